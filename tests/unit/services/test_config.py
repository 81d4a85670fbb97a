"""Dataclass configs from CLI flags and env: precedence, types, help, errors."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

from services.config import ByteSize, build_parser, env_names, load_config, option
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
