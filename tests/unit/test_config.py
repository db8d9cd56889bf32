"""The `data` Hydra config group: compose with overrides, eager validation, ServiceConfig round trip."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from omegaconf import OmegaConf

from megascale_data_ext.config import (
    _SHARED_FIELDS as _SHARED,
    MegascaleDataConfig,
    SourceConfig,
    compose_config,
    conf_dir,
    load_config,
)
from megascale_data_ext.dataplane.strategies import STRATEGIES, LLMBalance, VLMBalance
from megascale_data_ext.errors import ConfigError
from megascale_data_ext.runtime.config import ServiceConfig
from megascale_data_ext.runtime.planner import make_strategy
from megascale_data_ext.sources.base import SourceSpec


@dataclasses.dataclass(slots=True, kw_only=True)
class CustomStrategy:
    """A user strategy reached only through `_target_` (never registered by name)."""

    num_microbatches: int
    cap: int | None = None
    level: str = "mine"

    def __call__(self, g: Any) -> Any:
        return g


NOT_CALLABLE = 3


def _parquet(path: Path, rows: int = 4) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"text": [f"doc {i}" for i in range(rows)]}), path)
    return path


@pytest.fixture()
def base(tmp_path: Path) -> dict[str, Any]:
    """A valid `data` mapping over two real Parquet files under data_root."""
    _parquet(tmp_path / "a" / "part-0.parquet")
    _parquet(tmp_path / "b.parquet")
    return {
        "data_root": str(tmp_path),
        "sources": [{"name": "a", "format": "parquet", "paths": ["a"], "weight": 3.0},
                    {"path": "b.parquet", "weight": 1.0}],
        "strategy": {"name": "llm_balance", "args": {"model": "gpt-tiny"}},
        "seq_length": 512,
    }


def _problems(cfg: Any, **kwargs: Any) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(cfg, **kwargs)
    lines = str(info.value).splitlines()
    assert re.match(r"invalid data config \(\d+ problems?\):", lines[0])
    assert int(re.search(r"\((\d+) problem", lines[0]).group(1)) == len(lines) - 1
    return [line.removeprefix("  - ") for line in lines[1:]]


def _one(cfg: Any, path: str, *fragments: str, **kwargs: Any) -> str:
    """The single problem reported, which must name `path` and contain every fragment."""
    problems = _problems(cfg, **kwargs)
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"`{path}`: "), problems
    for frag in fragments:
        assert frag in problems[0], (frag, problems[0])
    return problems[0]


# --------------------------------------------------------------------------- compose


def test_compose_with_command_line_overrides() -> None:
    cfg = compose_config(["data.seq_length=2048", "strategy=vlm_balance", "data.ray.address=auto"])
    assert cfg.data.seq_length == 2048 and cfg.data.ray.address == "auto"
    assert cfg.data.strategy.name == "vlm_balance" and cfg.data.strategy._target_ is None
    assert cfg.data.strategy.args.model == "gpt-tiny"  # train_gpt.yaml's _self_ wins over the group
    assert cfg.parallel.tensor_model_parallel_size == 2  # the rest of the training config is untouched
    data = load_config(cfg, check_paths=False)
    service = data.to_service_config()
    assert (service.seq_length, service.strategy, service.ray_address) == (2048, "vlm_balance", "auto")
    assert isinstance(make_strategy(service), VLMBalance)


def test_default_train_gpt_maps_target_back_to_registered_name() -> None:
    cfg = compose_config([])
    assert cfg.data.strategy._target_ == "megascale_data_ext.dataplane.strategies.LLMBalance"
    data = load_config(cfg.data, check_paths=False)
    service = data.to_service_config()
    assert service.strategy == "llm_balance"
    assert service.source_names == ["text-0", "text-1", "text-2", "megatron-text"]
    built = make_strategy(service)
    assert isinstance(built, LLMBalance) and (built.num_microbatches, built.cap, built.model) == (4, 1024, "gpt-tiny")


def test_ray_cluster_group_and_init_kwargs() -> None:
    local = load_config(compose_config(["data.ray.num_cpus=2", "+data.ray.resources.loader=1"]), check_paths=False)
    assert local.ray_init_kwargs() == {"address": None, "namespace": "megascale", "num_cpus": 2,
                                       "resources": {"loader": 1.0}}
    cluster = load_config(compose_config(["ray=cluster", "data.ray.num_cpus=2"]), check_paths=False)
    assert cluster.ray_init_kwargs() == {"address": "auto", "namespace": "megascale"}  # cluster owns its CPUs


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [(["strategy=nope"], "llm_balance"), (["data.seq_lenght=2048"], "seq_lenght"), (["data.seq_length=[1"], "[1")],
)
def test_compose_errors_are_config_errors(overrides: list[str], fragment: str) -> None:
    with pytest.raises(ConfigError, match="cannot compose 'train_gpt'") as info:
        compose_config(overrides)
    assert fragment in str(info.value)


def test_structured_schema_registered_and_typed_at_compose() -> None:
    cfg = compose_config(["data=megascale_schema"])
    assert OmegaConf.get_type(cfg.data) is MegascaleDataConfig
    assert OmegaConf.get_type(cfg.data.sources[0]) is SourceConfig
    assert load_config(cfg, check_paths=False).to_service_config().strategy == "llm_balance"
    with pytest.raises(ConfigError, match="seq_length"):
        compose_config(["data=megascale_schema", "data.seq_length=long"])


def test_conf_dir_env_override(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert (conf_dir() / "train_gpt.yaml").is_file()
    monkeypatch.setenv("MEGASCALE_CONF_DIR", str(tmp_path))
    with pytest.raises(ConfigError, match="MEGASCALE_CONF_DIR"):
        conf_dir()


# --------------------------------------------------------------------------- demo sources


@pytest.fixture(scope="module")
def demo_root(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[SourceSpec]]:
    from megascale_data_ext.sources.demo_data import make_demo_data

    root = tmp_path_factory.mktemp("demo")
    return root, make_demo_data(root, rows=12, image_rows=2, max_image_patches=256)


@pytest.mark.parametrize(("group", "names"), [
    ("demo_text", ["text-0", "text-1", "text-2", "megatron-text"]),
    ("demo_vlm", ["text-0", "coyo-0", "coyo-1"]),
])
def test_demo_sources_yaml_resolves_to_the_demo_specs(demo_root: tuple[Path, list[SourceSpec]], group: str,
                                                      names: list[str]) -> None:
    root, specs = demo_root
    cfg = compose_config([f"sources={group}", f"data.data_root={root}"])
    service = load_config(cfg).to_service_config()  # every path checked on disk
    by_name = {s.name: replace(s, truncate=True) for s in specs}
    weights = {"coyo-0": 2.0}
    expected = [replace(by_name[n], weight=weights.get(n, 1.0)) for n in names]
    assert service.sources == ServiceConfig(sources=expected, seq_length=1024).sources


def test_demo_sources_missing_data_named(tmp_path: Path) -> None:
    problems = _problems(compose_config(["sources=demo_text", f"data.data_root={tmp_path}"]))
    assert len(problems) == 4
    assert problems[0].startswith("`data.sources[0].paths[0]`") and str(tmp_path / "text-0") in problems[0]
    assert problems[3].startswith("`data.sources[3].paths[0]`")
    assert str(tmp_path / "megatron-text" / "text_document.bin") in problems[3] and ".idx" in problems[3]


# --------------------------------------------------------------------------- round trip


def test_round_trip_equals_hand_built_service_config(base: dict[str, Any], tmp_path: Path) -> None:
    base.update(
        mixing={"type": "ramp", "mode": "random", "params": {"start": {"a": 1.0, "b": 0.0}, "end": [1, 1],
                                                            "warmup_steps": 100}},
        samples_per_step=64, num_microbatches=4, seed=7, prefetch=3, buffer_size=256, constructor_group=2,
        shuffle=False, with_attention_mask=False, pad_to_multiple_of=16,
        ray={"address": "ray://head:10001", "namespace": "exp1"},
    )
    base["sources"][1]["tokenizer"] = None
    got = load_config(OmegaConf.create({"data": base})).to_service_config()
    want = ServiceConfig(
        sources=[SourceSpec(name="a", format="parquet", paths=[str(tmp_path / "a")], weight=3.0),
                 SourceSpec(name="b", format="parquet", paths=[str(tmp_path / "b.parquet")], weight=1.0)],
        seed=7, samples_per_step=64, num_microbatches=4, seq_length=512, strategy="llm_balance",
        strategy_args={"model": "gpt-tiny"},
        mixing={"type": "ramp", "start": {"a": 1.0, "b": 0.0}, "end": [1, 1], "warmup_steps": 100},
        mix_mode="random", shuffle=False, buffer_size=256, prefetch=3, constructor_group=2,
        with_attention_mask=False, pad_to_multiple_of=16, namespace="exp1", ray_address="ray://head:10001",
    )
    assert got == want and got.digest() == want.digest()


def test_constant_mixing_without_params_uses_source_weights(base: dict[str, Any]) -> None:
    service = load_config(base).to_service_config()
    assert service.mixing is None and service.mixing_config() == {"type": "constant", "weights": [3.0, 1.0]}


def test_target_strategy_registered_under_its_path(base: dict[str, Any]) -> None:
    target = f"{__name__}.CustomStrategy"
    base["strategy"] = {"name": None, "_target_": target, "args": {"level": "x"}}
    try:
        service = load_config(base).to_service_config()
        assert service.strategy == target and STRATEGIES[target] is CustomStrategy
        assert make_strategy(service) == CustomStrategy(num_microbatches=2, cap=512, level="x")
    finally:
        STRATEGIES.pop(target, None)  # keep the global registry as other tests expect it


def test_defaults_mirror_runtime_dataclasses() -> None:
    spec_fields = {f.name: f.default for f in dataclasses.fields(SourceSpec)}
    cfg_fields = {f.name: f.default for f in dataclasses.fields(SourceConfig)}
    assert set(cfg_fields) == set(spec_fields) | {"path"}
    assert {k: cfg_fields[k] for k in spec_fields if k not in ("name", "format", "paths")} == {
        k: v for k, v in spec_fields.items() if k not in ("name", "format", "paths")}
    service = dataclasses.fields(ServiceConfig)
    data = {f.name: (f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default)
            for f in dataclasses.fields(MegascaleDataConfig)}
    shared = [f for f in service if f.name in data and f.name not in ("sources", "strategy", "mixing")]
    assert len(shared) == len(_SHARED) and all(data[f.name] == f.default for f in shared)
    assert data["strategy"].name == ServiceConfig.__dataclass_fields__["strategy"].default


def test_whole_composed_config_or_data_node_or_plain_mapping_all_accepted(base: dict[str, Any]) -> None:
    a = load_config(base)
    assert load_config({"data": base}) == a == load_config(OmegaConf.create(base)) == load_config(a)


# --------------------------------------------------------------------------- validation


def test_every_problem_reported_at_once(base: dict[str, Any], tmp_path: Path) -> None:
    base.update(samples_per_step=0, seq_length=1000, bogus=1, prefetch="2")
    base["sources"][0].update(weight=-1.0, format="csv", wieght=2)
    base["sources"][1]["path"] = "nope/*.parquet"
    base["sources"].append({"name": "a", "paths": ["missing.parquet"], "decode_images": "gpu"})
    base["strategy"] = {"name": "llm_balanse", "args": {}}
    base["mixing"] = {"type": "feedback", "params": {}}
    base["ray"] = {"address": None, "num_cpus": 0}
    problems = _problems(base)
    paths = [p.split("`")[1] for p in problems]
    assert paths == [
        "data.bogus", "data.sources[0].wieght", "data.sources[0].format", "data.sources[2].decode_images",
        "data.strategy.name", "data.prefetch", "data.samples_per_step", "data.seq_length",
        "data.ray.num_cpus", "data.sources[0].name", "data.sources[0].weight", "data.sources[1].path",
        "data.sources[2].name", "data.sources[2].paths[0]", "data.mixing.params",
    ], problems
    text = "\n".join(problems)
    assert "did you mean 'weight'?" in text and "did you mean 'llm_balance'?" in text
    assert "'csv'" in text and "'parquet'" in text and "'megatron'" in text  # bad value and the choices
    assert "got 'gpu'" in text and "'constructor'" in text
    assert str(tmp_path / "missing.parquet") in text and "glob" in text and "matches nothing" in text


@pytest.mark.parametrize(("key", "value"), [("samples_per_step", 0), ("num_microbatches", -2), ("prefetch", 0),
                                            ("buffer_size", 0), ("constructor_group", 0), ("pad_to_multiple_of", 0)])
def test_non_positive_sizes(base: dict[str, Any], key: str, value: int) -> None:
    base[key] = value
    _one(base, f"data.{key}", "positive integer", f"got {value}")


@pytest.mark.parametrize(("key", "value", "what"), [("seq_length", "2k", "an integer"), ("shuffle", "yes", "a boolean"),
                                                    ("sources", {"a": 1}, "a list"), ("mixing", 3, "a mapping")])
def test_wrong_types(base: dict[str, Any], key: str, value: Any, what: str) -> None:
    base[key] = value
    _one(base, f"data.{key}", f"must be {what}", repr(value))


def test_seq_length_must_divide_by_pad_multiple_and_cp(base: dict[str, Any]) -> None:
    base["seq_length"] = 520
    _one(base, "data.seq_length", "520", "= 16", "use e.g. 528")
    base["seq_length"] = 528
    assert load_config(base).seq_length == 528
    _one(base, "data.seq_length", "context_parallel_size (2) = 32", "use e.g. 544", context_parallel_size=2)


def test_weights_negative_or_all_zero(base: dict[str, Any]) -> None:
    base["sources"][1]["weight"] = -0.5
    _one(base, "data.sources[1].weight", ">= 0", "-0.5")
    for s in base["sources"]:
        s["weight"] = 0.0
    _one(base, "data.sources[*].weight", "sum to > 0", "[0.0, 0.0]", "['a', 'b']")
    base["mixing"] = {"type": "constant", "params": {"weights": {"a": 1.0}}}  # explicit weights win
    assert load_config(base).to_service_config().mixing == {"type": "constant", "weights": {"a": 1.0}}


def test_mixing_errors(base: dict[str, Any]) -> None:
    base["mixing"] = {"type": "cosine"}
    _one(base, "data.mixing.type", "'cosine'", "'piecewise'", "'ramp'")
    base["mixing"] = {"mode": "shuffled"}
    _one(base, "data.mixing.mode", "'deterministic'", "'random'")
    base["mixing"] = {"type": "constant", "params": {"weights": {"a": 1, "zzz": 2}}}
    _one(base, "data.mixing.params", "unknown sources ['zzz']")
    base["mixing"] = {"type": "ramp", "params": {"type": "ramp"}}
    _one(base, "data.mixing.params.type", "data.mixing.type")


def test_strategy_errors(base: dict[str, Any]) -> None:
    base["strategy"] = {"name": "llm_balance", "_target_": "x.Y"}
    _one(base, "data.strategy", "exactly one of")
    base["strategy"] = {"name": None, "_target_": "no_such_module_xyz.Strategy"}
    _one(base, "data.strategy._target_", "no_such_module_xyz")
    base["strategy"] = {"name": None, "_target_": f"{__name__}.NOT_CALLABLE"}
    _one(base, "data.strategy._target_", "int, not a strategy class")
    base["strategy"] = {"name": "llm_balance", "args": {"method": "kkk", "model": "gpt-huge", "axis": "tp"}}
    problems = _problems(base)
    assert [p.split("`")[1] for p in problems] == ["data.strategy.args.method", "data.strategy.args.model",
                                                  "data.strategy.args.axis"]
    assert "'greedy'" in problems[0] and "'llama-12b'" in problems[1] and "'WORLD'" in problems[2]
    base["strategy"] = {"name": "vanilla", "args": {"methd": "kk"}}
    _one(base, "data.strategy.args.methd", "'vanilla' takes no argument", "allowed:")
    base["strategy"] = {"name": "vlm_balance", "args": {"encoder_modl": "vit-2b"}}  # **kwargs: built to find out
    _one(base, "data.strategy.args", "encoder_modl")
    base["strategy"] = {"name": "llm_balance", "method": "kk"}
    _one(base, "data.strategy.method", "unknown key", "under `args`")


def test_source_errors(base: dict[str, Any], tmp_path: Path) -> None:
    base["sources"][0]["path"] = "a"
    _one(base, "data.sources[0].path", "not both")
    del base["sources"][0]["path"]
    base["sources"][0].update(paths=[], max_bad_fraction=2.0, row_group_cache=0)
    problems = _problems(base)
    assert [p.split("`")[1] for p in problems] == ["data.sources[0].paths", "data.sources[0].max_bad_fraction",
                                                  "data.sources[0].row_group_cache"]
    base["sources"][0].update(paths=["a"], max_bad_fraction=0.0, row_group_cache=4, max_tokens=1024)
    _one(base, "data.sources[0].max_tokens", "<= data.seq_length (512)", "1024")
    base["sources"][0].update(max_tokens=None, tokenizer="tok/tokenizer.json")
    _one(base, "data.sources[0].tokenizer", str(tmp_path / "tok" / "tokenizer.json"))
    base["sources"] = []
    _one(base, "data.sources", "is empty", "sources=demo_text")


def test_megatron_source_needs_bin_and_idx(base: dict[str, Any], tmp_path: Path) -> None:
    (tmp_path / "m.bin").write_bytes(b"")
    base["sources"][1] = {"name": "m", "format": "megatron", "paths": ["m"]}
    msg = _one(base, "data.sources[1].paths[0]", str(tmp_path / "m.idx"))
    assert "m.bin" not in msg.split("(configured")[0]
    assert load_config(base, check_paths=False).source_specs()[1].paths == [str(tmp_path / "m")]


def test_interpolation_and_missing_values_named(base: dict[str, Any]) -> None:
    base["seed"] = "${oc.env:MEGASCALE_TEST_UNSET_VAR_XYZ}"
    base["seq_length"] = "???"
    base["data_root"] = base["data_root"]
    problems = _problems(OmegaConf.create({"data": base}))
    assert [p.split("`")[1] for p in problems] == ["data.seed", "data.seq_length"]
    assert "MEGASCALE_TEST_UNSET_VAR_XYZ" in problems[0] and "missing (???)" in problems[1]


def test_checkpoint_dir_that_is_a_file(base: dict[str, Any], tmp_path: Path) -> None:
    base["checkpoint"] = {"dir": "b.parquet", "save_with_megatron": False}
    _one(base, "data.checkpoint.dir", "is a file")
    base["checkpoint"]["dir"] = "ckpt"
    assert load_config(base).checkpoint.dir == "ckpt"


def test_name_derived_from_path_and_duplicates(base: dict[str, Any]) -> None:
    assert load_config(base).to_service_config().source_names == ["a", "b"]
    base["sources"][0]["name"] = "b"
    problems = _problems(base)
    assert [p.split("`")[1] for p in problems] == ["data.sources[0].name", "data.sources[1].name"]
    assert "[0, 1]" in problems[0]
