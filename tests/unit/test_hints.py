"""Every fix an error message suggests is an override that works when pasted after the failing ones."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from megascale_data_ext.config import compose_config, conf_dir, load_config
from megascale_data_ext.errors import ConfigError, SourceError
from megascale_data_ext.sources.registry import open_source

OVERRIDE = re.compile(r"^\+{0,2}data\.[\w.\-]+=\S+$")


def overrides_in(message: str) -> list[list[str]]:
    """The backticked hints that are overrides (one hint may set two keys, space-separated)."""
    hints = [h.split() for h in re.findall(r"`([^`]+)`", message)]
    return [h for h in hints if h and all(OVERRIDE.match(o) for o in h)]


@pytest.fixture
def config_dir(tmp_path: Path) -> Path:
    (tmp_path / "code.jsonl").write_text("".join(json.dumps({"text": "def f(): pass"}) + "\n" for _ in range(4)))
    rows = [{"text": "short"}, {"text": "x" * 100}, {"text": "y" * 90}, {"text": "ok"}]
    (tmp_path / "web.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "run.yaml").write_text(f"""
defaults:
  - data: megascale
  - ray: local
  - _self_
data:
  data_root: {tmp_path}
  seq_length: 64
  samples_per_step: 4
  sources:
    - {{name: code, format: jsonl, path: code.jsonl}}
    - {{name: web, format: jsonl, path: web.jsonl}}
""")
    return tmp_path


def start_sources(config_dir: Path, overrides: list[str]) -> None:
    """Compose, validate and open every source as the service does before any actor starts."""
    cfg = compose_config(overrides, "run", config_dir=config_dir, search_path=[conf_dir()])
    for spec in load_config(cfg.data).to_service_config().sources:
        open_source(spec).metadata()


def test_source_addressed_by_name_is_its_index() -> None:
    cfg = compose_config(["data.sources.megatron-text.weight=3", "+data.sources.text-1.max_bad_fraction=0.5"])
    assert [s.weight for s in cfg.data.sources] == [1.0, 1.0, 1.0, 3]
    assert cfg.data.sources[1].max_bad_fraction == 0.5
    with pytest.raises(ConfigError, match="no source named 'text-9' in data.sources; did you mean"):
        compose_config(["data.sources.text-9.truncate=true"])


def test_too_long_sample_hints_each_pass_when_pasted(config_dir: Path) -> None:
    with pytest.raises(SourceError) as err:
        start_sources(config_dir, [])
    hints = overrides_in(str(err.value))
    assert ["data.sources.web.truncate=true"] in hints and len(hints) == 3, str(err.value)
    for hint in hints:
        start_sources(config_dir, hint)  # raises if the hint does not get the run past this point


def test_config_check_hints_each_pass_when_pasted(config_dir: Path) -> None:
    failing = ["+data.sources.web.max_tokens=100", "data.sources.web.truncate=true"]
    with pytest.raises(ConfigError) as err:
        start_sources(config_dir, failing)
    hints = overrides_in(str(err.value))
    assert len(hints) == 2, str(err.value)
    for hint in hints:
        start_sources(config_dir, failing + hint)


def test_bad_jsonl_rows_hints_each_pass_when_pasted(config_dir: Path) -> None:
    with (config_dir / "code.jsonl").open("a") as f:
        f.write("not json\n[1, 2]\n")
    with pytest.raises(SourceError) as err:
        start_sources(config_dir, ["data.sources.web.truncate=true"])
    hints = overrides_in(str(err.value))
    assert ["data.sources.code.on_bad_rows=skip"] in hints, str(err.value)
    for hint in hints[1:]:  # the first names the current budget (max_bad_fraction=0), not a fix
        start_sources(config_dir, ["data.sources.web.truncate=true", *hint])


def test_a_schedule_missing_its_weights_hints_an_override_that_passes_when_pasted(config_dir: Path) -> None:
    """`data.mixing.type=feedback` alone said "missing key `base_weights`" with nothing to paste."""
    failing = ["data.mixing.type=feedback", "data.sources.web.truncate=true"]
    with pytest.raises(ConfigError, match=r"needs base_weights: set `data.mixing.params.base_weights=\[1,1\]` \(a "
                                          r"weight per source, in the order \['code', 'web'\]\)") as err:
        start_sources(config_dir, failing)
    (hint,) = overrides_in(str(err.value))
    start_sources(config_dir, failing + hint)


def test_keys_inside_free_form_nodes_are_set_without_a_plus() -> None:
    """`data.strategy.args` and `data.mixing.params` take the strategy's and the schedule's own keys,
    checked by the schema: the README's overrides work as written (Hydra's struct mode refused them)."""
    cfg = compose_config(["data.strategy.args.broadcast=[tp,cp]", "data.mixing.type=feedback",
                          "data.mixing.params={base_weights:[1,1,1,1],delay:2}"])
    assert list(cfg.data.strategy.args.broadcast) == ["tp", "cp"] and cfg.data.mixing.params.delay == 2
    assert compose_config(["data.mixing.params.lr=0.5"]).data.mixing.params.lr == 0.5
    for typo in ("data.seq_lenght=512", "data.fault_tolrance.client_prefetch=2"):  # elsewhere: Hydra's struct error,
        with pytest.raises(ConfigError, match="the config has no key") as err:  # with the override respelled
            compose_config([typo])
        (hint,) = overrides_in(str(err.value))
        compose_config(hint)


def test_a_misspelled_config_name_lists_the_configs_there() -> None:
    with pytest.raises(ConfigError, match=r"config 'train_gtp' not found in .*; the configs there are train_gpt, "
                                          r"train_vlm \(did you mean --config-name train_gpt\?\)"):
        compose_config([], "train_gtp")
