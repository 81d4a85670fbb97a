"""`llmesh up` flags: parsed into run_up's arguments without starting a process."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from llmesh import cli


def up(*argv: str) -> dict:
    return cli.up_kwargs(cli.build_parser().parse_args(["up", *argv]))


def test_up_help_lists_the_gateway_flags_and_the_passthroughs(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["up", "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for flag in (
        "--api-key",
        "--served-model-name",
        "--max-body-bytes",
        "--request-timeout-s",
        "--scheduler-args",
        "--worker-args",
        "--gateway-args",
        "--worker-arg",
        "--no-kvstore",
        "--redis-url",
        "--kvstore-args",
    ):
        assert flag in text


def test_defaults_pass_nothing_extra():
    kw = up()
    assert kw["num_workers"] == 1 and kw["model"] is None and kw["host"] == "127.0.0.1"
    assert kw["scheduler_port"] == 50051
    assert kw["worker_args"] == kw["scheduler_args"] == kw["gateway_args"] == []
    assert kw["env"] == {}
    assert kw["kvstore"] is True and kw["kvstore_port"] == 0 and kw["kvstore_args"] == []


def test_gateway_flags_reach_the_gateway():
    kw = up("--max-body-bytes", "1024", "--request-timeout-s", "2.5", "--served-model-name", "a, b")
    assert kw["gateway_args"] == [
        "--served-model-name",
        "a,b",
        "--max-body-bytes",
        "1024",
        "--request-timeout-s",
        "2.5",
    ]
    assert kw["scheduler_args"] == ["--served-model-name", "a"]  # the gRPC API has one model id
    assert kw["worker_args"] == []


def test_stream_interval_reaches_the_scheduler():
    assert up("--stream-interval", "4")["scheduler_args"] == ["--stream-interval", "4"]


def test_api_key_travels_in_the_gateways_environment_not_its_argv():
    kw = up("--api-key", "sekret")
    # The scheduler's public gRPC API takes the same key as the gateway's HTTP API.
    assert kw["env"] == {"LLMESH_GATEWAY_API_KEY": "sekret", "LLMESH_SCHEDULER_API_KEY": "sekret"}
    assert "sekret" not in kw["gateway_args"] + kw["scheduler_args"]


def test_internal_key_and_tls_files_reach_every_service_in_the_environment(tmp_path):
    kw = up("--internal-key", "k", "--tls-cert", "c.pem", "--tls-key", "k.pem", "--tls-ca", "/ca.pem")
    kw2 = up("--tls-client-auth", "--tls-server-name", "llmesh-mesh")
    import os

    assert kw["env"] == {
        "LLMESH_INTERNAL_KEY": "k",
        "LLMESH_TLS_CERT": os.path.abspath("c.pem"),
        "LLMESH_TLS_KEY": os.path.abspath("k.pem"),
        "LLMESH_TLS_CA": "/ca.pem",
    }
    assert kw2["env"] == {"LLMESH_TLS_CLIENT_AUTH": "1", "LLMESH_TLS_SERVER_NAME": "llmesh-mesh"}


def test_passthrough_strings_are_split_like_a_shell_and_repeatable():
    kw = up(
        "--workers",
        "2",
        "--worker-args",
        "--kv-cache-memory 268435456",
        "--worker-args=--enforce-eager",
        "--worker-arg=--seed=3",
        "--scheduler-args",
        "--max-num-seqs 8 --served-model-name 'my model'",
        "--gateway-args=--log-format=text",
        "--cache-dir",
        "/tmp/c",
    )
    assert kw["num_workers"] == 2
    assert kw["worker_args"] == [
        "--cache-dir",
        "/tmp/c",
        "--seed=3",
        "--kv-cache-memory",
        "268435456",
        "--enforce-eager",
    ]
    assert kw["scheduler_args"] == [
        "--cache-dir",
        "/tmp/c",
        "--max-num-seqs",
        "8",
        "--served-model-name",
        "my model",
    ]
    assert kw["gateway_args"] == ["--cache-dir", "/tmp/c", "--log-format=text"]


def test_passthrough_comes_after_the_named_flags_so_it_wins():
    kw = up("--max-body-bytes", "10", "--gateway-args", "--max-body-bytes 20")
    assert kw["gateway_args"] == ["--max-body-bytes", "10", "--max-body-bytes", "20"]


@pytest.mark.parametrize(
    "argv",
    [
        ["--max-body-bytes", "0"],
        ["--request-timeout-s", "-1"],
        ["--request-timeout-s", "soon"],
        ["--worker-args", "--model 'unclosed"],
        ["--no-such-flag"],
    ],
)
def test_bad_up_flags_are_refused_before_anything_starts(argv, capsys):
    with pytest.raises(SystemExit) as e:
        cli.build_parser().parse_args(["up", *argv])
    assert e.value.code == 2


def test_cmd_up_hands_the_parsed_flags_to_run_up(monkeypatch):
    import services.launcher

    seen: dict = {}
    monkeypatch.setattr(services.launcher, "run_up", lambda **kw: seen.update(kw) or 0)
    assert cli.main(["up", "--workers", "3", "--api-key", "k", "--port", "9000"]) == 0
    assert seen["num_workers"] == 3 and seen["port"] == 9000
    assert seen["env"] == {"LLMESH_GATEWAY_API_KEY": "k", "LLMESH_SCHEDULER_API_KEY": "k"}


def test_kvstore_flags():
    assert up("--no-kvstore")["kvstore"] is False
    url = "redis://:pw@r:6379/0"
    kw = up("--redis-url", url, "--kvstore-port", "7000", "--kvstore-args", "--memory-bytes 1GiB")
    # The URL may hold a password: it travels in the KV store's environment, not on a command line.
    assert kw["env"] == {"LLMESH_KVSTORE_REDIS_URL": url}
    assert kw["kvstore_port"] == 7000 and kw["kvstore_args"] == ["--memory-bytes", "1GiB"]
    for name in ("worker_args", "scheduler_args", "gateway_args", "kvstore_args"):
        assert "pw" not in " ".join(kw[name])


def test_llmesh_kvstore_runs_the_kvstore_service(monkeypatch):
    import kvstore_svc.service

    seen: list = []
    monkeypatch.setattr(kvstore_svc.service, "main", lambda argv: seen.append(argv) or 0)
    assert cli.main(["kvstore", "--memory-bytes", "1GiB"]) == 0
    assert seen == [["--memory-bytes", "1GiB"]]


def test_tensor_parallel_size_reaches_every_worker():
    assert up("--tensor-parallel-size", "2")["worker_args"] == ["--tensor-parallel-size", "2"]
    with pytest.raises(SystemExit):
        up("--tensor-parallel-size", "0")


def test_speculative_config_reaches_every_worker_and_parses_there():
    spec = '{"method": "ngram", "num_speculative_tokens": 4}'
    args = up("--speculative-config", spec)["worker_args"]
    assert args == ["--speculative-config", spec]
    from services.config import load_config
    from worker_svc.service import WorkerServiceConfig
    from worker_svc.spec_decode.config import SpeculativeConfig

    config = load_config(WorkerServiceConfig, args, service="worker")
    parsed = SpeculativeConfig.parse(config.speculative_config)
    assert parsed is not None and parsed.num_speculative_tokens == 4


# -- the services' own flags, generated under --SERVICE. ------------------------------


def test_dotted_flags_reach_their_service_as_its_own_flags():
    kw = up(
        "--worker.kv-cache-memory",
        "64MiB",
        "--worker.enforce-eager",
        "--scheduler.max-num-seqs",
        "8",
        "--scheduler.no-async-scheduling",
        "--scheduler.no-tokenizer",
        "--gateway.log-format",
        "text",
        "--kvstore.memory-bytes",
        "1GiB",
        "--kvstore.no-memory-arena",
    )
    assert kw["worker_args"] == ["--kv-cache-memory", str(64 << 20), "--enforce-eager"]
    assert kw["scheduler_args"] == ["--max-num-seqs", "8", "--no-async-scheduling", "--no-tokenizer"]
    assert kw["gateway_args"] == ["--log-format", "text"]
    assert kw["kvstore_args"] == ["--memory-bytes", str(1 << 30), "--no-memory-arena"]
    assert kw["env"] == {}
    assert up("--scheduler.tokenizer")["scheduler_args"] == ["--tokenizer"]


def test_the_short_flags_are_the_same_knobs():
    assert up("--stream-interval", "4") == up("--scheduler.stream-interval", "4")
    assert up("--tensor-parallel-size", "2") == up("--worker.tensor-parallel-size", "2")
    assert up("--max-body-bytes", "9") == up("--gateway.max-body-bytes", "9")


def test_secret_knobs_travel_in_their_services_environment():
    kw = up(
        "--gateway.api-key",
        "g",
        "--scheduler.worker-step-token",
        "t",
        "--kvstore.redis-url",
        "redis://:p@r/0",
    )
    assert kw["env"] == {
        "LLMESH_GATEWAY_API_KEY": "g",
        "LLMESH_SCHEDULER_WORKER_STEP_TOKEN": "t",
        "LLMESH_KVSTORE_REDIS_URL": "redis://:p@r/0",
    }
    words = " ".join(kw["gateway_args"] + kw["scheduler_args"] + kw["kvstore_args"])
    assert "g" not in words.split() and "t" not in words.split() and "redis" not in words


@pytest.mark.parametrize(
    "argv",
    [
        ["--worker.port", "1"],  # the launcher sets where each child listens, and its peers
        ["--scheduler.host", "0.0.0.0"],
        ["--gateway.scheduler", "x:1"],
        ["--worker.cache-dir", "/c"],  # mesh-wide: --cache-dir
        ["--gateway.internal-key", "k"],  # mesh-wide: --internal-key
        ["--scheduler.stream-interval", "0"],  # the field's own bound (option(ge=1))
        ["--worker.kv-cache-memory", "lots"],
        ["--worker.kv-store-shared-memory", "maybe"],
    ],
)
def test_dotted_flags_are_checked_before_anything_starts(argv):
    with pytest.raises(SystemExit) as e:
        cli.build_parser().parse_args(["up", *argv])
    assert e.value.code == 2


def test_every_offered_knob_is_one_its_service_accepts():
    """Each group is generated from its service's config: given its default, each knob comes out as
    words the service's own parser takes (the worker's through WorkerServiceConfig)."""
    from services.config import is_secret, value_text

    for service, found in cli._up_groups().items():
        argv = []
        for leaf in found:
            flag = f"--{service}.{leaf.name.replace('_', '-')}"
            default = leaf.field.default
            if default is dataclasses.MISSING:
                default = leaf.field.default_factory()
            argv += [flag] if leaf.type is bool else [flag, value_text(default)]
        kw = up(*argv)
        words = kw[f"{service}_args"]
        assert len(words) >= len([leaf for leaf in found if not is_secret(leaf.field)])
        cli.parse_command([service, *words])  # exits 2 on a flag or value it does not take


def test_up_builds_its_flags_without_torch():
    code = (
        "import sys\n"
        "from llmesh import cli\n"
        "cli.up_kwargs(cli.build_parser().parse_args(['up', '--worker.seed', '3']))\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_a_secret_typed_on_the_command_line_warns(capsys):
    cli._warn_secrets_in_argv(["up", "--gateway.api-key=k", "--redis-url", "redis://x"])
    err = capsys.readouterr().err
    assert "--gateway.api-key on the command line" in err and "$LLMESH_GATEWAY_API_KEY" in err
    assert "--redis-url on the command line" in err


def test_serve_is_up_with_the_model_as_its_argument():
    """`llmesh serve MODEL` (vLLM's `vllm serve MODEL`): up's flags, the model positional."""

    def serve(*argv: str) -> dict:
        return cli.up_kwargs(cli.build_parser().parse_args(["serve", *argv]))

    flags = ["--port", "9000", "--api-key", "k", "--served-model-name", "smol", "--tensor-parallel-size", "2"]
    assert serve("models/smol", *flags) == up("--model", "models/smol", *flags)
    assert serve(*flags, "models/smol")["model"] == "models/smol"
    assert serve() == up()  # the embedded model
    kw = serve("m.gguf", "--max-model-len", "2048", "--dtype", "bfloat16", "--host", "0.0.0.0")
    assert kw["worker_args"] == ["--dtype", "bfloat16", "--max-model-len", "2048"] and kw["host"] == "0.0.0.0"
    with pytest.raises(SystemExit, match="not both"):
        serve("a", "--model", "b")
