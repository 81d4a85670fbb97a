"""Dataclass configs from CLI flags and env: precedence, types, help, errors."""

from __future__ import annotations

import argparse
import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

from services.config import (
    ByteSize,
    add_flag_group,
    build_parser,
    check_bounds,
    env_names,
    forward,
    from_flat,
    load_config,
    option,
    select,
)
from services.grpc_server import ServerConfig


class Mode(enum.Enum):
    FAST = "fast"
    SAFE = "safe"


@dataclass
class DemoConfig(ServerConfig):
    """Demo service."""

    model: str | None = None  # model folder or .gguf; none = the embedded one
    max_num_seqs: int = option(64, help="most sequences in one step (100% busy)")
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False  # no CUDA graphs
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    mode: Mode = Mode.FAST
    cache_dir: Path = Path("/tmp/cache")
    stop_token_ids: list[int] = field(default_factory=list)
    workers: list[str] = option(default_factory=lambda: ["127.0.0.1:50051"], help="worker addresses")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")


def test_defaults() -> None:
    assert load_config(DemoConfig, [], {}) == DemoConfig()


def test_flags_and_types() -> None:
    cfg = load_config(
        DemoConfig,
        [
            "--port",
            "50052",
            "--max-num-seqs",
            "8",
            "--gpu-memory-utilization",
            "0.5",
            "--enforce-eager",
            "--dtype",
            "bfloat16",
            "--mode",
            "safe",
            "--cache-dir",
            "/x",
            "--stop-token-ids",
            "1,2, 3",
            "--workers",
            "a:1,b:2",
            "--model",
            "m.gguf",
        ],
        {},
    )
    assert cfg.port == 50052 and cfg.max_num_seqs == 8 and cfg.gpu_memory_utilization == 0.5
    assert cfg.enforce_eager is True and cfg.dtype == "bfloat16" and cfg.mode is Mode.SAFE
    assert cfg.cache_dir == Path("/x") and cfg.stop_token_ids == [1, 2, 3] and cfg.workers == ["a:1", "b:2"]
    assert cfg.model == "m.gguf"
    assert load_config(DemoConfig, ["--no-enforce-eager", "--model", "none"], {}).model is None


def test_env_then_flag_precedence() -> None:
    env = {
        "LLMESH_PORT": "1",
        "LLMESH_DEMO_PORT": "2",
        "LLMESH_ENFORCE_EAGER": "yes",
        "LLMESH_WORKERS": "w:1",
    }
    assert load_config(DemoConfig, [], env, service="demo").port == 2  # service-scoped wins
    assert load_config(DemoConfig, [], env).port == 1  # without a service name only LLMESH_X is read
    cfg = load_config(DemoConfig, ["--port", "3", "--no-enforce-eager"], env, service="demo")
    assert cfg.port == 3 and cfg.enforce_eager is False and cfg.workers == ["w:1"]
    assert env_names("max_num_seqs", "kv-store") == ["LLMESH_KV_STORE_MAX_NUM_SEQS", "LLMESH_MAX_NUM_SEQS"]


@pytest.mark.parametrize(
    ("argv", "env", "needle"),
    [
        (["--port", "x"], {}, "--port"),
        ([], {"LLMESH_PORT": "x"}, "LLMESH_PORT"),
        ([], {"LLMESH_ENFORCE_EAGER": "maybe"}, "LLMESH_ENFORCE_EAGER"),
        (["--dtype", "float64"], {}, "dtype"),
        (["--max-num-seqs", "0"], {}, "max_num_seqs must be >= 1"),  # the dataclass's own check
        (["--port", "70000"], {}, "port must be in"),
    ],
)
def test_bad_values_are_usage_errors(argv, env, needle, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        load_config(DemoConfig, argv, env)
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


def test_required_field() -> None:
    @dataclass
    class Needs:
        scheduler: str = option(help="scheduler address")

    assert load_config(Needs, [], {"LLMESH_SCHEDULER": "h:1"}).scheduler == "h:1"
    with pytest.raises(SystemExit):
        load_config(Needs, [], {})


def test_help_lists_every_flag_with_help_env_and_default() -> None:
    text = build_parser(DemoConfig, prog="demo", service="demo").format_help()
    for flag in (
        "--host",
        "--port",
        "--shutdown-grace-s",
        "--max-message-bytes",
        "--max-concurrent-rpcs",
        "--model",
        "--max-num-seqs",
        "--gpu-memory-utilization",
        "--enforce-eager",
        "--dtype",
        "--mode",
        "--cache-dir",
        "--stop-token-ids",
        "--workers",
    ):
        assert flag in text, flag
    flat = " ".join(text.split())
    assert "most sequences in one step (100% busy)" in flat  # metadata help, '%' survives
    assert "no CUDA graphs" in flat  # help from the field's trailing comment
    assert "LLMESH_DEMO_MAX_NUM_SEQS" in flat and "default 64" in flat
    assert "{auto,float32,bfloat16}" in flat
    assert "Demo service." in text


@pytest.mark.parametrize(
    "text,value",
    [
        ("4096", 4096),
        ("2GiB", 2 << 30),
        ("512MiB", 512 << 20),
        ("1k", 1000),
        ("1Ki", 1024),
        ("0.5 GiB", 1 << 29),
    ],
)
def test_byte_size(text, value):
    assert ByteSize(text) == value


@pytest.mark.parametrize("text", ["", "GiB", "-1", "1 XB", "1.2.3"])
def test_byte_size_refuses_nonsense(text):
    with pytest.raises(ValueError):
        ByteSize(text)


def test_byte_size_fields_take_units_from_flags_and_env():
    @dataclass
    class Sized:
        budget: ByteSize = option(ByteSize("1GiB"), help="a budget")

    assert load_config(Sized, [], {}).budget == 1 << 30
    assert load_config(Sized, ["--budget", "3MiB"], {}).budget == 3 << 20
    assert load_config(Sized, [], {"LLMESH_BUDGET": "2k"}).budget == 2000


# -- composition: nested configs, bounds, a service's flags in a launcher -----------------


@dataclass
class Core:
    max_num_seqs: int = option(0, ge=0, help="the core's batch")


@dataclass
class Service:
    core: Core = field(default_factory=Core)
    interval: int = option(1, ge=1, help="an interval")
    api_key: str = ""


def test_a_nested_dataclass_is_flattened_into_flags_and_env():
    config = load_config(Service, ["--max-num-seqs", "8"], {"LLMESH_SVC_INTERVAL": "3"}, service="svc")
    assert config == Service(core=Core(max_num_seqs=8), interval=3)
    assert load_config(Service, [], {}).core == Core()


def test_from_flat_routes_each_name_to_its_config():
    assert from_flat(Service, {"max_num_seqs": 4, "interval": 2}) == Service(Core(4), 2)
    with pytest.raises(TypeError, match="unknown settings: nope"):
        from_flat(Service, {"nope": 1})


def test_bounds_are_checked_where_flags_and_env_are_parsed_and_by_check_bounds():
    for argv, env in ((["--interval", "0"], {}), ([], {"LLMESH_INTERVAL": "0"})):
        with pytest.raises(SystemExit):
            load_config(Service, argv, env)
    with pytest.raises(ValueError, match="interval must be >= 1, got 0"):
        check_bounds(Service(interval=0))


def test_a_name_declared_twice_is_refused_as_a_flag():
    @dataclass
    class Twice:
        core: Core = field(default_factory=Core)
        max_num_seqs: int = 1

    with pytest.raises(TypeError, match="declared twice"):
        build_parser(Twice)
    assert from_flat(Twice, {"max_num_seqs": 5}) == Twice(Core(5), 5)  # from_flat: both get it


def test_a_group_of_prefixed_flags_forwards_values_and_secrets():
    parser = argparse.ArgumentParser()
    found = select(Service, exclude={"max_num_seqs"})
    add_flag_group(parser, found, "svc", title="svc", service="svc", aliases={"interval": "--interval"})
    args = parser.parse_args(["--interval", "5", "--svc.api-key", "k"])
    assert forward(args, found, "svc", "svc") == (["--interval", "5"], {"LLMESH_SVC_API_KEY": "k"})
    assert forward(parser.parse_args([]), found, "svc", "svc") == ([], {})
    with pytest.raises(SystemExit):
        parser.parse_args(["--svc.max-num-seqs", "1"])
