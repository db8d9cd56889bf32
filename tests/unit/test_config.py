"""The `data` Hydra config group: compose with overrides, eager validation, ServiceConfig round trip."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from omegaconf import OmegaConf
from omegaconf.errors import ValidationError

from megascale_data_ext.config import (
    BatchConfig,
    MegascaleDataConfig,
    RayConfig,
    SourceConfig,
    compose_config,
    conf_dir,
    load_config,
    source_config_class,
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
    assert (service.seq_length, service.strategy, service.ray.address) == (2048, "vlm_balance", "auto")
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
    want = {"address": "local", "namespace": "megascale", "include_dashboard": False, "num_cpus": 2,
            "resources": {"loader": 1.0}, "_system_config": {"max_direct_call_object_size": 1 << 20, "prestart_worker_first_driver": False}}
    assert local.ray.init_kwargs() == local.to_service_config().ray.init_kwargs() == want
    cluster = load_config(compose_config(["ray=cluster", "data.ray.num_cpus=2"]), check_paths=False)
    assert cluster.ray.init_kwargs() == {"address": "auto", "namespace": "megascale"}  # cluster owns its CPUs
    assert cluster.to_service_config().ray == cluster.ray


def test_ray_init_kwargs_embedded_or_cluster() -> None:
    # embedded = a new local instance, never a `ray start` cluster someone left running on the machine
    base = {"address": "local", "namespace": "megascale", "include_dashboard": False,
            "_system_config": {"max_direct_call_object_size": 1 << 20, "prestart_worker_first_driver": False}}
    assert RayConfig(num_cpus=2).init_kwargs() == {**base, "num_cpus": 2}
    assert RayConfig().init_kwargs() == base
    joined = RayConfig(address="ray://head:10001", namespace="exp", num_cpus=2, resources={"gpu_host": 1.0})
    assert joined.init_kwargs() == {"address": "ray://head:10001", "namespace": "exp"}


def test_dashboard_and_metrics_port_are_honoured_embedded_and_refused_for_a_cluster() -> None:
    ports = RayConfig(dashboard=True, dashboard_port=8300, metrics_export_port=9400)
    assert ports.problems() == []
    assert ports.init_kwargs() == {"address": "local", "namespace": "megascale", "include_dashboard": True,
                                   "dashboard_port": 8300, "_metrics_export_port": 9400,
                                   "_system_config": {"max_direct_call_object_size": 1 << 20, "prestart_worker_first_driver": False}}
    with pytest.raises(ConfigError, match=r"data.ray.dashboard_port.*applies to an embedded Ray only .*ray start "
                                          r"--head --dashboard-port"):
        load_config(compose_config(["ray=cluster", "data.ray.dashboard_port=8300"]), check_paths=False)
    with pytest.raises(ConfigError, match=r"data.ray.metrics_export_port.*must be a port in 1\.\.65535"):
        load_config(compose_config(["data.ray.metrics_export_port=70000"]), check_paths=False)


def test_inline_object_bytes_is_honoured_embedded_and_refused_for_a_cluster() -> None:
    cfg = load_config(compose_config(["data.ray.inline_object_bytes=262144"]), check_paths=False)
    assert cfg.ray.init_kwargs()["_system_config"] == {"max_direct_call_object_size": 262144,
                                                       "prestart_worker_first_driver": False}
    with pytest.raises(ConfigError, match=r"data.ray.inline_object_bytes.*embedded Ray only.*--system-config"):
        load_config(compose_config(["ray=cluster", "data.ray.inline_object_bytes=262144"]), check_paths=False)
    with pytest.raises(ConfigError, match=r"data.ray.inline_object_bytes.*integer >= 0"):
        load_config(compose_config(["data.ray.inline_object_bytes=-1"]), check_paths=False)


def test_prestart_workers_is_honoured_embedded_and_refused_for_a_cluster() -> None:
    cfg = load_config(compose_config(["data.ray.prestart_workers=true"]), check_paths=False)
    assert cfg.ray.init_kwargs()["_system_config"]["prestart_worker_first_driver"] is True
    with pytest.raises(ConfigError, match=r"data.ray.prestart_workers.*embedded Ray only.*"
                                          r"RAY_prestart_worker_first_driver=0 ray start"):
        load_config(compose_config(["ray=cluster", "data.ray.prestart_workers=true"]), check_paths=False)


@pytest.mark.parametrize(
    ("overrides", "line"),
    [(["strategy=nope"], "strategy=nope: config group 'strategy' has no option 'nope'; pick one of hybrid_cp, "
                         "llm_balance, vanilla, vlm_balance (e.g. strategy=hybrid_cp)"),
     (["strategy=llm_balanc"], "(e.g. strategy=llm_balance)"),
     (["data.seq_lenght=2048"], "data.seq_lenght=2048: the config has no key `data.seq_lenght`; did you mean "
                                "`data.seq_length=2048`? check its spelling; the keys under `data` are "),
     (["nope.x=1"], "the keys at the top are data, model, parallel, train"),
     (["data.seq_length=[1"], "cannot compose 'train_gpt'")],
)
def test_compose_errors_are_one_line_config_errors_that_name_the_fix(overrides: list[str], line: str) -> None:
    with pytest.raises(ConfigError) as info:
        compose_config(overrides)
    assert line in str(info.value) and "\n" not in str(info.value)
    if "e.g. " in line:  # the suggested override composes
        compose_config([line.split("e.g. ")[1].rstrip(")")])


def test_a_command_line_item_that_is_neither_an_override_nor_a_dataset_says_which(tmp_path: Path) -> None:
    import argparse

    from megascale_data_ext.commands._config_args import compose_from_args

    (tmp_path / "empty").mkdir()
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "a.jsonl").write_text('{"text": "x"}\n')
    (tmp_path / "mixed" / "b.parquet").write_bytes(b"")
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "half.bin").write_bytes(b"x")
    cases = {str(tmp_path / "half.bin"): "is half of a Megatron prefix", str(tmp_path / "half"): "is half of a Megatron",
             str(tmp_path / "gone"): "does not exist: check the path", str(tmp_path / "empty"): "holds no .parquet",
             str(tmp_path / "mixed"): "mixes .jsonl, .parquet files", str(tmp_path / "notes.txt"): "is not a dataset file"}
    for item, fragment in cases.items():
        args = argparse.Namespace(config=["sources=demo_text", item], config_dir=None, config_name=None)
        with pytest.raises(ConfigError, match=re.escape(f"{item!r} {fragment}")):
            compose_from_args(args)


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
    assert len(problems) == 5
    assert problems[0].startswith("`data.sources[0].paths[0]`") and str(tmp_path / "text-0") in problems[0]
    assert problems[3].startswith("`data.sources[3].paths[0]`")
    assert str(tmp_path / "megatron-text" / "text_document.bin") in problems[3] and ".idx" in problems[3]
    assert problems[4].startswith("`data.validation.sources[0].paths[0]`") and "valid-text" in problems[4]


# --------------------------------------------------------------------------- validation


def test_validation_sources_become_a_service_of_their_own(demo_root: tuple[Path, list[SourceSpec]]) -> None:
    root, _ = demo_root
    cfg = compose_config(["sources=demo_text", f"data.data_root={root}", "data.ray.namespace=job7",
                          "data.validation.sources.valid-text.weight=2", "data.fault_tolerance.inject=planner@3"])
    data = load_config(cfg)
    train, valid = data.to_service_config(), data.validation_service_config()
    assert [s.name for s in valid.sources] == ["valid-text"] and valid.sources[0].weight == 2
    assert valid.sources[0].paths == [str(root / "valid-text")]
    assert "valid-text" not in [s.name for s in train.sources]
    assert valid.ray.namespace == "job7-valid" and train.ray.namespace == "job7"
    assert valid.fault_tolerance.inject == "" and train.fault_tolerance.inject == "planner@3"
    assert (valid.seq_length, valid.num_microbatches, valid.samples_per_step, valid.strategy) == (
        train.seq_length, train.num_microbatches, train.samples_per_step, train.strategy)
    assert load_config(compose_config(["sources=demo_text", f"data.data_root={root}",
                                       "data.validation.sources=[]"])).validation_service_config() is None


def test_validation_data_must_be_held_out(base: dict[str, Any]) -> None:
    base["validation"] = {"sources": [{"name": "va", "format": "parquet", "paths": ["a"]}]}
    _one(base, "data.validation.sources[0]", "'a' is also read by training source 'a'", "held out")
    base["validation"] = {"sources": [{"name": "va", "format": "parquet", "paths": ["nowhere"]}]}
    _one(base, "data.validation.sources[0].paths[0]", "does not exist")


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
        with_attention_mask=False, pad_to_multiple_of=16, ray=RayConfig(address="ray://head:10001", namespace="exp1"),
    )
    assert got == want and got.digest() == want.digest()


def test_token_budget_keys_reach_the_service(base: dict[str, Any]) -> None:
    base.update(tokens_per_step=4096, split_documents=True)
    got = load_config(OmegaConf.create({"data": base})).to_service_config()
    assert got.tokens_per_step == 4096 and got.split_documents
    assert all(s.max_tokens is None for s in got.sources)  # split documents are not truncated to seq_length
    assert got.fingerprint()["tokens_per_step"] == 4096  # a resume under another budget is refused


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


def test_source_config_has_every_source_spec_field() -> None:
    shorthand = {"path"}
    spec_fields = {f.name for f in dataclasses.fields(SourceSpec)}
    assert {f.name for f in dataclasses.fields(SourceConfig)} - shorthand == spec_fields
    spec_defaults = {f.name: f.default for f in dataclasses.fields(SourceSpec)}
    cfg_defaults = {f.name: f.default for f in dataclasses.fields(SourceConfig)}
    assert {k: cfg_defaults[k] for k in spec_defaults if k not in ("name", "format", "paths")} == {
        k: v for k, v in spec_defaults.items() if k not in ("name", "format", "paths")}
    assert (cfg_defaults["name"], cfg_defaults["format"], SourceConfig().paths) == (None, "parquet", [])


def test_a_field_added_to_source_spec_is_a_yaml_key() -> None:
    from typing import Literal

    grown = dataclasses.make_dataclass(
        "GrownSpec", [("colour", Literal["red", "blue"] | None, dataclasses.field(default="red")),
                      ("tags", list[str], dataclasses.field(default_factory=list))],
        bases=(SourceSpec,), kw_only=True, slots=True)
    cfg = source_config_class(grown, "GrownSourceConfig")
    assert {f.name for f in dataclasses.fields(cfg)} - {"path"} == {f.name for f in dataclasses.fields(grown)}
    node = OmegaConf.structured(cfg)  # Literal -> str, so OmegaConf takes it
    assert (node.colour, node.tags, node.format) == ("red", [], "parquet")
    node.colour = "blue"
    with pytest.raises(ValidationError, match="colour"):
        node.colour = [1]


def test_batch_fields_defined_once_and_passed_through() -> None:
    batch = [f.name for f in dataclasses.fields(BatchConfig)]
    assert issubclass(MegascaleDataConfig, BatchConfig) and issubclass(ServiceConfig, BatchConfig)
    assert "namespace" not in batch and not hasattr(ServiceConfig, "ray_address")
    assert not hasattr(MegascaleDataConfig(), "__dict__")  # slots through the inheritance
    data = MegascaleDataConfig(sources=[SourceConfig(name="a", paths=["x"])], seed=9, overflow="error",
                               middle_stage_masks=False, ray=RayConfig(namespace="n"))
    service = data.to_service_config()
    assert {k: getattr(service, k) for k in batch} == {k: getattr(data, k) for k in batch}
    assert service.ray == data.ray and service.ray is not data.ray
    defaults = ServiceConfig(sources=service.sources)
    assert not hasattr(defaults, "__dict__") and not set(ServiceConfig.__slots__) & set(batch)
    assert {k: getattr(defaults, k) for k in batch} == {k: getattr(MegascaleDataConfig(), k) for k in batch}
    assert MegascaleDataConfig().strategy.name == defaults.strategy
    assert MegascaleDataConfig().mixing.mode == defaults.mix_mode


def test_structured_schema_builds_with_omegaconf() -> None:
    from hydra.core.config_store import ConfigStore

    node = OmegaConf.structured(MegascaleDataConfig)
    node.sources.append(OmegaConf.structured(SourceConfig(path="x.parquet")))
    node.ray.num_cpus = 2
    built = OmegaConf.to_object(node)
    assert isinstance(built, MegascaleDataConfig) and isinstance(built.ray, RayConfig)
    assert built.sources == [SourceConfig(path="x.parquet")]
    assert "checkpoint" not in node
    stored = ConfigStore.instance().load("data/megascale_schema.yaml")
    assert OmegaConf.get_type(stored.node) is MegascaleDataConfig


@pytest.mark.parametrize(("key", "value"), [("samples_per_step", 0), ("seed", -1), ("overflow", "never"),
                                            ("pad_to_multiple_of", 0), ("tokens_per_step", 0),
                                            ("split_documents", True)])
def test_service_config_and_data_config_share_one_check(base: dict[str, Any], key: str, value: Any) -> None:
    base[key] = value
    problem = _one(base, f"data.{key}")
    with pytest.raises(ConfigError) as info:
        ServiceConfig(sources=[SourceSpec(name="a", format="parquet", paths=["x"])], **{key: value})
    assert str(info.value).splitlines()[1:] == [problem.replace(f"`data.{key}`", f"  - `{key}`")]


def test_mix_mode_and_ray_checks_shared(base: dict[str, Any]) -> None:
    base["mixing"] = {"mode": "shuffled"}
    base["ray"] = {"num_cpus": 0, "resources": {"loader": -1.0}}
    problems = _problems(base)
    spec = SourceSpec(name="a", format="parquet", paths=["x"])
    with pytest.raises(ConfigError) as info:
        ServiceConfig(sources=[spec], mix_mode="shuffled", ray=RayConfig(num_cpus=0, resources={"loader": -1.0}))
    service = [line.removeprefix("  - ") for line in str(info.value).splitlines()[1:]]
    assert [p.replace("`data.", "`") for p in problems] == [
        service[1], service[2], service[0].replace("`mix_mode`", "`mixing.mode`")]


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
        "data.bogus", "data.prefetch", "data.sources[0].wieght", "data.strategy.name", "data.samples_per_step",
        "data.seq_length", "data.ray.num_cpus", "data.sources[0].name", "data.sources[0].format",
        "data.sources[0].weight", "data.sources[1].path", "data.sources[2].name", "data.sources[2].decode_images",
        "data.sources[2].paths[0]", "data.mixing.params",
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


def test_removed_checkpoint_key_is_unknown(base: dict[str, Any]) -> None:
    base["checkpoint"] = {"dir": "ckpt", "save_with_megatron": True}
    _one(base, "data.checkpoint", "unknown key")
    with pytest.raises(ConfigError, match="checkpoint"):
        compose_config(["data.checkpoint.dir=ckpt"])


def test_name_derived_from_path_and_duplicates(base: dict[str, Any]) -> None:
    assert load_config(base).to_service_config().source_names == ["a", "b"]
    base["sources"][0]["name"] = "b"
    problems = _problems(base)
    assert [p.split("`")[1] for p in problems] == ["data.sources[0].name", "data.sources[1].name"]
    assert "[0, 1]" in problems[0]


def test_strategy_model_accepts_every_registered_cost_model_name() -> None:
    """`model` is checked against the cost-model registry the strategies resolve through."""
    base = {"sources": [{"name": "a", "format": "jsonl", "paths": ["a.jsonl"]}]}
    for model in ("tokens", "gpt-tiny", "vit:vit-1b"):
        cfg = load_config({**base, "strategy": {"name": "llm_balance", "args": {"model": model}}}, check_paths=False)
        assert cfg.strategy.args["model"] == model
    with pytest.raises(ConfigError, match=r"data.strategy.args.model`: got 'no-such'.*allowed: \[.*'tokens'"):
        load_config({**base, "strategy": {"name": "llm_balance", "args": {"model": "no-such"}}}, check_paths=False)


def test_a_calibrated_cost_model_is_accepted_by_path_and_a_missing_file_is_named(tmp_path: Path,
                                                                                 base: dict[str, Any]) -> None:
    from megascale_data_ext.dataplane.calibration import fit_calibration

    lens = [[64], [32, 32], [16] * 4, [128], [8] * 16, [100, 28]]
    seconds = [0.01 + 1e-4 * sum(d) + 1e-6 * sum(x * x for x in d) for d in lens]
    path = tmp_path / "calibration.json"
    model, _report = fit_calibration([[d] for d in lens], seconds)  # one microbatch per observation
    model.save(path)
    cfg = base
    cfg["strategy"]["args"]["model"] = f"calibrated:{path}"
    load_config(cfg)
    cfg["strategy"]["args"]["model"] = f"calibrated:{tmp_path / 'nope.json'}"
    assert "nope.json" in _one(cfg, "data.strategy.args", "cannot build strategy")


def test_fault_tolerance_node_reaches_the_service_config_and_bad_values_are_named(base: dict[str, Any]) -> None:
    cfg = {**base, "fault_tolerance": {"shadow_loaders": True, "client_prefetch": 6, "inject": "planner@every15"}}
    ft = load_config(cfg).to_service_config().fault_tolerance
    assert (ft.shadow_loaders, ft.client_prefetch, ft.inject, ft.restart) == (True, 6, "planner@every15", True)
    problems = _problems({**base, "fault_tolerance": {"client_prefetch": -1, "shadows": True}})
    assert any(p.startswith("`data.fault_tolerance.shadows`: unknown key") for p in problems), problems
    assert any("client_prefetch" in p and "must be an integer >= 0" in p for p in problems), problems
    assert "router" in _one({**base, "fault_tolerance": {"inject": "router@3"}}, "data.fault_tolerance.inject")


# --------------------------------------------------------------------------- one place for the model's shape
def test_the_cost_model_comes_from_model_unless_the_strategy_names_one() -> None:
    from megascale_data_ext.dataplane.costs import TransformerConfig, TransformerCost, get_cost_model

    derived = load_config(compose_config(["data.strategy.args.model=null", "model.num_layers=6", "model.hidden_size=256",
                                          "model.num_attention_heads=8"]), check_paths=False).to_service_config()
    assert derived.strategy_args["model"] == "transformer:layers=6,hidden=256,heads=8"
    lengths = np.asarray([10, 300, 2000])
    want = TransformerCost(TransformerConfig(layers=6, hidden=256, heads=8))(lengths)
    np.testing.assert_allclose(make_strategy(derived).cost_model(lengths), want)
    np.testing.assert_allclose(get_cost_model("transformer:layers=6,hidden=256,heads=8")(lengths), want)
    named = load_config(compose_config(["model.num_layers=6"]), check_paths=False).to_service_config()
    assert named.strategy_args["model"] == "gpt-tiny"  # train_gpt.yaml names its cost model: it wins
    data_only = load_config(compose_config(["data.strategy.args.model=null"]).data, check_paths=False)
    assert "model" not in data_only.strategy.args  # no model node: the strategy's default (llama-12b)
    assert make_strategy(data_only.to_service_config()).model == "llama-12b"


@pytest.mark.parametrize(("name", "fragment"), [
    ("transformer:layers=2,hidden=64", "lacks ['heads']"),
    ("transformer:layers=2,hidden=64,heads=4,depth=3", "'depth=3' is not <field>=<integer>"),
])
def test_a_bad_shape_name_is_one_line_with_an_example(name: str, fragment: str) -> None:
    from megascale_data_ext.dataplane.costs import get_cost_model

    with pytest.raises(ConfigError, match=re.escape(fragment)):
        get_cost_model(name)


def test_a_user_strategy_without_a_cost_model_gets_none_from_model(base: dict[str, Any]) -> None:
    """The shape of `model.*` goes only to strategies that take a `model` argument."""
    strategy = {"name": None, "_target_": f"{__name__}.CustomStrategy", "args": {"level": "x"}}
    whole = {"data": {**base, "strategy": strategy},
             "model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4}}
    loaded = load_config(whole)
    assert "model" not in loaded.strategy.args
    assert make_strategy(loaded.to_service_config()) == CustomStrategy(num_microbatches=2, cap=512, level="x")


def test_a_source_override_by_name_applies_to_a_dataset_named_on_the_command_line(tmp_path: Path) -> None:
    """The hints of a dataset given as a path print `data.sources.<its name>.<key>=...`: pasted, they apply to it."""
    import argparse

    from megascale_data_ext.commands._config_args import compose_from_args

    (tmp_path / "web").mkdir()
    pq.write_table(pa.table({"content": ["a b"] * 4}), tmp_path / "web" / "x.parquet")
    args = argparse.Namespace(config=[str(tmp_path / "web"), "data.sources.web.text_column=content",
                                      "data.seq_length=512"], config_dir=None, config_name=None)
    cfg = compose_from_args(args)
    assert [s["name"] for s in cfg.data.sources] == ["web"]
    assert cfg.data.sources[0].text_column == "content" and cfg.data.seq_length == 512
