"""The `llmesh` command: one sub-command per service, plus the local launcher and offline tools.

It sits on the top floor, beside the offline `LLM` it builds for `generate` and `chat`; a
service's own flags come from its config dataclass (services/config.py), so the command
declares only what is its own.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import shlex
import sys
from pathlib import Path
from typing import Any

from services.config import (
    Leaf,
    add_flag_group,
    env_names,
    flag_name,
    forward,
    given_values,
    is_secret,
    select,
    value_text,
)
from services.lora_config import parse_lora_modules


def _cmd_convert(args: argparse.Namespace) -> int:
    from services.model_files import resolve_model

    folder = resolve_model(args.model, args.cache_dir)
    if args.link:
        # A stable name for the folder (content-keyed otherwise), for services whose image carries
        # no GGUF (deploy's light image): they are given `--model LINK`.
        tmp = f"{args.link}.tmp-{os.getpid()}"
        os.symlink(folder, tmp)
        os.replace(tmp, args.link)
    print(folder)
    return 0


def _cmd_quantize(args: argparse.Namespace) -> int:
    import json

    from services.model_files import resolve_model
    from worker_svc.models.fp8_writer import RECIPES, quantize_checkpoint

    try:
        src = resolve_model(args.model, args.cache_dir)
        with open(os.path.join(src, "config.json"), encoding="utf-8") as f:
            layers = int(json.load(f).get("num_hidden_layers", 0))
        ignore = [*RECIPES[args.recipe](layers), *args.ignore]
        r = quantize_checkpoint(src, args.out, args.format, ignore)
    except (ValueError, OSError) as e:
        print(f"llmesh quantize: {e}", file=sys.stderr)
        return 1
    print(
        f"{args.out}: {r.quantized} linear weights in FP8 ({args.format}), {r.kept} kept in their dtype; "
        f"tensors {r.bytes_in / 1e6:.1f} MB -> {r.bytes_out / 1e6:.1f} MB"
    )
    return 0


def _make_llm(args: argparse.Namespace):
    from llmesh import LLM

    return LLM(model=args.model, cache_dir=args.cache_dir)


def _cmd_generate(args: argparse.Namespace) -> int:
    from llmesh import SamplingParams

    llm = _make_llm(args)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    for out in llm.generate(args.prompt, params, use_tqdm=False):
        print(out.outputs[0].text)
    return 0


def _cmd_chat(args: argparse.Namespace) -> int:
    from llmesh import SamplingParams

    llm = _make_llm(args)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    history: list[dict[str, str]] = []
    print("llmesh chat — empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            line = input("you> ").strip()
        except EOFError:
            break
        if not line:
            break
        history.append({"role": "user", "content": line})
        reply = llm.chat(history, params, use_tqdm=False)[0].outputs[0].text
        history.append({"role": "assistant", "content": reply})
        print(f"assistant> {reply}")
    return 0


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF folder or .gguf file (default: embedded SmolLM2-135M)")
    p.add_argument("--cache-dir", default=None, help="converted-model cache (default $LLMESH_CACHE)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmesh", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("convert", help="convert/cache the model (GGUF -> safetensors) and print its folder")
    _add_model_flags(p)
    p.add_argument("--link", default=None, help="also make this path a symlink to the converted folder")
    p.set_defaults(func=_cmd_convert)

    p = sub.add_parser(
        "quantize",
        help="write an FP8 checkpoint (W8A8 e4m3, per-channel weight scales) that llmesh and vLLM load",
        description="Quantize a bf16/fp16/fp32 checkpoint's decoder linear weights to float8_e4m3fn "
        "with one scale per output channel (as --quantization fp8 does on load) and save it with "
        "config.json's quantization_config and the tokenizer files (docs/configuration.md).",
    )
    _add_model_flags(p)
    p.add_argument("--out", required=True, help="folder to write (created; must be empty)")
    p.add_argument("--format", choices=("compressed-tensors", "fbgemm"), default="compressed-tensors")
    p.add_argument(
        "--ignore",
        action="append",
        default=[],
        metavar="MODULE",
        help="a module kept in its dtype (model.layers.0.mlp.down_proj, or re:PATTERN); repeatable",
    )
    p.add_argument(
        "--recipe",
        choices=("none", "edge-down", "edge-layers"),
        default="none",
        help="modules kept for quality: edge-down = the first and last layers' down_proj; "
        "edge-layers = the first and last layers whole (docs/benchmarks.md)",
    )
    p.set_defaults(func=_cmd_quantize)

    for name, func, helptext in (
        ("generate", _cmd_generate, "generate a completion for one prompt, offline"),
        ("chat", _cmd_chat, "chat with the model in the terminal, offline"),
    ):
        p = sub.add_parser(name, help=helptext)
        _add_model_flags(p)
        if name == "generate":
            p.add_argument("prompt")
        p.add_argument("--max-tokens", type=int, default=128)
        p.add_argument("--temperature", type=float, default=0.0)
        p.add_argument("--seed", type=int, default=None)
        p.set_defaults(func=func)

    p = sub.add_parser(
        "up",
        help="start the whole local mesh (scheduler, workers, gateway, KV store) on loopback, supervised",
        description="Start the local mesh and supervise it: a service that dies is restarted "
        "(same flags, same port) with backoff; Ctrl-C / SIGTERM stops everything. Each service's own "
        "flags are offered as --SERVICE.FLAG (--worker.kv-cache-memory 64MiB) and handed to it.",
        usage="llmesh up [-h] [--model MODEL] [--workers N] [...] [--SERVICE.FLAG VALUE ...] "
        '[--SERVICE-args "FLAGS" ...]',
    )
    _add_up_flags(p)
    p.set_defaults(func=_cmd_up)

    p = sub.add_parser(
        "serve",
        help="serve one model on this machine, vLLM's `vllm serve MODEL`: `llmesh up` with the model "
        "as its argument",
        description="Serve MODEL (an HF folder or a .gguf file; default: the embedded SmolLM2-135M) "
        "on this machine with the OpenAI-compatible API: `llmesh up --model MODEL`, the same flags "
        "(--port, --host, --api-key, --served-model-name, --tensor-parallel-size, --max-model-len, "
        "--SERVICE.FLAG ...), the same supervised mesh.",
        usage="llmesh serve [MODEL] [-h] [--port PORT] [--host HOST] [--api-key KEY] [...] "
        "[--SERVICE.FLAG VALUE ...]",
    )
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help="HF folder or .gguf file")
    _add_up_flags(p)
    p.set_defaults(func=_cmd_up)

    p = sub.add_parser(
        "health",
        help="exit 0 if a service is serving (grpc.health.v1 or the gateway's /health), 1 if not",
        add_help=False,
    )
    p.set_defaults(func=_cmd_health)

    # One service each; their flags come from their config dataclasses (`llmesh worker --help`).
    for name, helptext in (
        ("scheduler", "run the scheduler service"),
        ("worker", "run one worker service"),
        ("gateway", "run the OpenAI-compatible gateway"),
        ("kvstore", "run the tiered KV store service (memory -> disk -> Redis)"),
        ("router", "run the router in front of scheduler shards (KV-event prefix index + load)"),
    ):
        p = sub.add_parser(name, help=helptext, add_help=False)
        p.set_defaults(func=_service_main(name))
    return parser


SERVICES = ("scheduler", "worker", "gateway", "kvstore", "router")
PASSTHROUGH = (*SERVICES, "health")  # commands whose flags their own parser reads


SERVICE_CONFIGS = {  # module, config class: what `llmesh <service>` parses its flags into
    "scheduler": ("scheduler_svc.service", "SchedulerServiceConfig"),
    "worker": ("worker_svc.service", "WorkerServiceConfig"),
    "gateway": ("gateway.config", "GatewayConfig"),
    "kvstore": ("kvstore_svc.config", "KVStoreConfig"),
    "router": ("router_svc.config", "RouterConfig"),
    "health": ("services.healthcheck", "HealthCheckConfig"),
}


def parse_command(argv: list[str]) -> argparse.Namespace:
    """Parse an `llmesh ...` command line as the CLI would, starting nothing (deploy files' checks).

    Bad flags exit 2 with argparse's message. Values are parsed (types, choices), not checked
    against each other or the machine (files named by --tls-cert need not exist here).
    """
    import importlib

    from services.config import build_parser as config_parser

    if argv and argv[0] in SERVICE_CONFIGS:
        module, name = SERVICE_CONFIGS[argv[0]]
        rest = argv[1:]
        if argv[0] == "health" and rest and not rest[0].startswith("-"):
            rest = rest[1:]  # the address
        cls = getattr(importlib.import_module(module), name)
        return config_parser(cls, prog=f"llmesh {argv[0]}").parse_args(rest)
    return build_parser().parse_args(argv)


def _cmd_health(args: argparse.Namespace) -> int:
    from services.healthcheck import main as health_main

    return health_main(args.rest)


def _service_main(name: str):
    def run(args: argparse.Namespace) -> int:
        import importlib

        module = {
            "scheduler": "scheduler_svc.service",
            "worker": "worker_svc.service",
            "gateway": "gateway.service",
            "kvstore": "kvstore_svc.service",
            "router": "router_svc.service",
        }
        return importlib.import_module(module[name]).main(args.rest)

    return run


def _shell_words(text: str) -> list[str]:
    try:
        return shlex.split(text)
    except ValueError as e:  # an unbalanced quote
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None


# -- llmesh up ------------------------------------------------------------------------
#
# `llmesh up` declares only what belongs to the launcher (how many workers, which ports, the
# model, fan-outs to several services). Every other knob is a service's own, offered under the
# service's name (`--worker.kv-cache-memory 64MiB`, `--scheduler.stream-interval 4`,
# `--gateway.max-body-bytes 1MiB`, `--kvstore.memory-bytes 4GiB`): flags, help and checks are
# generated from that service's config dataclass (services.config.add_flag_group) and what is
# given is handed to that child as its own flag, or, for a secret, in its environment. Dotted
# rather than `--worker-...`: a prefix with a dash would collide with the launcher's own flags
# (--scheduler-port, --worker-args) and read as one word. The flags users already had
# (--tensor-parallel-size, --stream-interval, ...) are the same knobs' second spelling.

# The short spellings: service -> field -> flag.
UP_ALIASES = {
    "scheduler": {"stream_interval": "--stream-interval"},
    "worker": {
        "tensor_parallel_size": "--tensor-parallel-size",
        "speculative_config": "--speculative-config",
        "max_model_len": "--max-model-len",  # the worker's: the scheduler's is at most its workers'
        "dtype": "--dtype",
        "quantization": "--quantization",
        "kv_cache_dtype": "--kv-cache-dtype",
        "gpu_memory_utilization": "--gpu-memory-utilization",
        "enforce_eager": "--enforce-eager",
        "kv_store_shared_memory": "--kv-store-shared-memory",
        "kv_store_transfer": "--kv-store-transfer",
        "enable_lora": "--enable-lora",
        "max_loras": "--max-loras",
        "max_lora_rank": "--max-lora-rank",
    },
    "gateway": {
        "max_body_bytes": "--max-body-bytes",
        "request_timeout_s": "--request-timeout-s",
        "api_server_count": "--api-server-count",
        "allow_runtime_lora_updating": "--allow-runtime-lora-updating",
    },
    "kvstore": {"redis_url": "--redis-url"},
    "router": {},
}
# Knobs of the whole mesh: one flag for every service, handed to each in the unscoped
# environment variable (LLMESH_TLS_CERT) that every service reads (a key never goes on argv).
MESH_SECURITY = (
    "internal_key",
    "internal_key_file",
    "tls_cert",
    "tls_key",
    "tls_ca",
    "tls_client_auth",
    "tls_server_name",
)
_PATHS = {"internal_key_file", "tls_cert", "tls_key", "tls_ca"}  # made absolute for the children
_GROUP_HELP = {
    "scheduler": "the scheduler's own flags (`llmesh scheduler --help`)",
    "worker": "every worker's own flags (`llmesh worker --help`; its service-only flags, such as "
    "--rejoin-after-s, through --worker-args)",
    "gateway": "the gateway's own flags (`llmesh gateway --help`)",
    "kvstore": "the KV store's own flags (`llmesh kvstore --help`; memory tier by default)",
    "router": "the router's own flags, with --schedulers N > 1 (`llmesh router --help`)",
}


@functools.cache
def _up_configs() -> dict[str, type]:
    """The config each `--SERVICE.*` group is generated from: modules that load no torch.

    The worker's is `WorkerConfig` (worker_svc/config.py) with the gRPC server's settings, not
    `WorkerServiceConfig`, whose module loads the model runner and torch.
    """
    from gateway.config import GatewayConfig
    from kvstore_svc.config import KVStoreConfig
    from router_svc.config import RouterConfig
    from scheduler_svc.service import SchedulerServiceConfig
    from services.grpc_server import ServerConfig
    from worker_svc.config import WorkerConfig

    worker = dataclasses.make_dataclass("WorkerFlags", [], bases=(ServerConfig, WorkerConfig))
    return {
        "scheduler": SchedulerServiceConfig,
        "worker": worker,
        "gateway": GatewayConfig,
        "kvstore": KVStoreConfig,
        "router": RouterConfig,
    }


@functools.cache
def _up_groups() -> dict[str, list[Leaf]]:
    """The knobs `llmesh up` offers per service: all but what the launcher sets for it (address,
    peers, model: services.launcher.LAUNCHER_SETS) and the mesh-wide ones (--cache-dir, security)."""
    from services.launcher import LAUNCHER_SETS

    mesh_wide = {*MESH_SECURITY, "cache_dir"}
    return {
        name: select(cls, exclude={*LAUNCHER_SETS[name], *mesh_wide}) for name, cls in _up_configs().items()
    }


@functools.cache
def _security_knobs() -> list[Leaf]:
    from services.grpc_server import ServerConfig

    return select(ServerConfig, only=MESH_SECURITY)


def _add_up_flags(p: argparse.ArgumentParser) -> None:
    _add_model_flags(p)
    p.add_argument("--workers", type=int, default=1, help="number of worker processes")
    p.add_argument(
        "--prefill-workers",
        type=int,
        default=0,
        help="disaggregated prefill/decode: this many workers with --role prefill (long prompts' "
        "prefill and first token) and --decode-workers with --role decode, instead of --workers",
    )
    p.add_argument(
        "--decode-workers", type=int, default=0, help="workers with --role decode (with --prefill-workers)"
    )
    p.add_argument(
        "--worker-gpus",
        default="",
        help="GPUs of this host for the workers, comma-separated (0,1): worker i sees only GPU i mod "
        "their number (CUDA_VISIBLE_DEVICES), so --prefill-workers 1 --decode-workers 1 --worker-gpus "
        "0,1 puts each pool on its own GPU; default: every worker sees every GPU and takes the first",
    )
    p.add_argument(
        "--schedulers",
        type=int,
        default=1,
        help="scheduler shards; above 1 a router takes --scheduler-port in front of them (routing by "
        "the shards' KV events and load) and the workers are split among them",
    )
    p.add_argument("--host", default="127.0.0.1", help="address every service binds (loopback by default)")
    p.add_argument("--port", type=int, default=int(os.environ.get("LLMESH_PORT", 8000)), help="gateway port")
    p.add_argument("--scheduler-port", type=int, default=50051, help="scheduler gRPC port")
    p.add_argument("--no-kvstore", action="store_true", help="do not start the KV store")
    p.add_argument("--kvstore-port", type=int, default=0, help="KV store gRPC port (default: any free port)")
    p.add_argument(
        "--served-model-name",
        default=None,
        metavar="NAMES",
        help="model ids clients use, comma-separated (the gateway's); the first also names the model "
        "on the scheduler's gRPC API",
    )
    p.add_argument(
        "--lora-modules",
        nargs="+",
        action="extend",
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT folders) served as models, vLLM's: the gateway lists them and maps "
        "`model` to them, the workers load them at start (and enable LoRA)",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="clients must send `Authorization: Bearer KEY` (default $LLMESH_API_KEY): the gateway's key "
        "and the scheduler's public gRPC API's, handed to both in their environment, not on argv",
    )
    p.add_argument(
        "--api-key-file",
        default=None,
        help="file of client keys, one a line (the gateway's --api-key-file); the first also opens "
        "the scheduler's public gRPC API",
    )
    add_flag_group(
        p,
        _security_knobs(),
        "",
        title="security",
        description="keys and TLS for every service (`docs/deploy.md`), handed to each in its environment "
        "(LLMESH_INTERNAL_KEY, LLMESH_TLS_*; paths made absolute), never on a command line. No key: a "
        "fresh random one per mesh",
    )
    for name, found in _up_groups().items():
        help_text = f"{_GROUP_HELP[name]}; secrets reach it in its environment, never on its argv"
        add_flag_group(
            p, found, name, title=name, description=help_text, service=name, aliases=UP_ALIASES[name]
        )

    pt = p.add_argument_group(
        "passthrough",
        "any flag of a service (`llmesh scheduler|worker|gateway|kvstore --help`), as one shell-quoted "
        'string, repeatable, applied last: --worker-args "--rejoin-after-s 5". '
        "A lone flag needs `=`: --scheduler-args=--no-tokenizer",
    )
    for name, whom in (
        ("scheduler", "the scheduler"),
        ("worker", "every worker"),
        ("gateway", "the gateway"),
        ("kvstore", "the KV store"),
        ("router", "the router (--schedulers > 1)"),
    ):
        pt.add_argument(
            f"--{name}-args",
            type=_shell_words,
            action="append",
            default=[],
            metavar='"FLAGS"',
            help=f"for {whom}",
        )
    pt.add_argument(
        "--worker-arg",
        action="append",
        default=[],
        metavar="WORD",
        help="one word for every worker (older form)",
    )


def _model_of(args: argparse.Namespace) -> str | None:
    """`llmesh serve MODEL`'s MODEL, or --model (as vLLM, not both)."""
    tag = getattr(args, "model_tag", None)
    if tag is not None and args.model is not None:
        raise SystemExit("llmesh serve: give the model as MODEL or as --model, not both")
    return tag if tag is not None else args.model


def up_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """`run_up`'s arguments from parsed `llmesh up` (or `llmesh serve`) flags (no process is started)."""
    common = ["--cache-dir", args.cache_dir] if args.cache_dir else []
    own: dict[str, list[str]] = {"scheduler": list(common), "worker": list(common), "gateway": list(common)}
    own["kvstore"] = []
    own["router"] = []
    if args.served_model_name:
        names = [n.strip() for n in args.served_model_name.split(",") if n.strip()]
        own["scheduler"] += ["--served-model-name", names[0]]  # the scheduler takes one name
        own["gateway"] += ["--served-model-name", ",".join(names)]
    if args.lora_modules:
        mods = ",".join(f"{n}={os.path.abspath(p)}" for n, p in parse_lora_modules(args.lora_modules).items())
        own["gateway"] += ["--lora-modules", mods]
        own["worker"] += ["--lora-modules", mods]
    env: dict[str, str] = {}
    for name, found in _up_groups().items():
        words, secrets = forward(args, found, name, name)
        own[name] += words
        env |= secrets  # service-scoped: each reaches one service only, and stays out of `ps` output
    if args.api_key:  # the gateway's clients and the scheduler's public API take the same key
        env |= {"LLMESH_GATEWAY_API_KEY": args.api_key, "LLMESH_SCHEDULER_API_KEY": args.api_key}
    if args.api_key_file:
        keys = [k.strip() for k in Path(args.api_key_file).read_text().splitlines()]
        keys = [k for k in keys if k and not k.startswith("#")]
        if not keys:
            raise SystemExit(f"--api-key-file {args.api_key_file}: no key in it")
        env["LLMESH_GATEWAY_API_KEY_FILE"] = os.path.abspath(args.api_key_file)
        env.setdefault("LLMESH_SCHEDULER_API_KEY", keys[0])
    if args.schedulers > 1 and "LLMESH_SCHEDULER_API_KEY" in env:  # the router's public API: the same key
        env["LLMESH_ROUTER_API_KEY"] = env["LLMESH_SCHEDULER_API_KEY"]
    env |= security_env(args)
    roles = up_worker_roles(args)
    return {
        "num_workers": len(roles) if roles else args.workers,
        "worker_roles": roles,
        "per_worker_env": up_worker_env(args, len(roles) if roles else args.workers),
        "model": _model_of(args),
        "host": args.host,
        "port": args.port,
        "scheduler_port": args.scheduler_port,
        "worker_args": [*own["worker"], *args.worker_arg, *_flatten(args.worker_args)],
        "scheduler_args": [*own["scheduler"], *_flatten(args.scheduler_args)],
        "gateway_args": [*own["gateway"], *_flatten(args.gateway_args)],
        "kvstore": not args.no_kvstore,
        "kvstore_port": args.kvstore_port,
        "kvstore_args": [*own["kvstore"], *_flatten(args.kvstore_args)],
        "env": env,
        "num_schedulers": args.schedulers,
        "router_args": [*own["router"], *_flatten(args.router_args)],
    }


def up_worker_env(args: argparse.Namespace, num_workers: int) -> list[dict[str, str]] | None:
    """Worker i's CUDA_VISIBLE_DEVICES from --worker-gpus (None: not given)."""
    gpus = [g.strip() for g in args.worker_gpus.split(",") if g.strip()]
    if not gpus:
        return None
    if not all(g.isdigit() for g in gpus):
        raise SystemExit(f"--worker-gpus takes GPU indices (0,1), got {args.worker_gpus!r}")
    return [{"CUDA_VISIBLE_DEVICES": gpus[i % len(gpus)]} for i in range(num_workers)]


def up_worker_roles(args: argparse.Namespace) -> list[str] | None:
    """Each worker's --role for --prefill-workers P --decode-workers D (None: --workers, all both)."""
    if not (args.prefill_workers or args.decode_workers):
        return None
    if args.prefill_workers < 0 or args.decode_workers < 0:
        raise SystemExit("--prefill-workers and --decode-workers must not be negative")
    if not args.decode_workers:
        raise SystemExit("--prefill-workers needs --decode-workers: prefill workers decode nothing")
    return ["prefill"] * args.prefill_workers + ["decode"] * args.decode_workers


def security_env(args: argparse.Namespace) -> dict[str, str]:
    """The environment that gives every service of `llmesh up` the same internal key and TLS files.

    No key given: `start_mesh` makes a fresh one for this mesh (services/mesh_secret.py)."""
    env = {}
    for leaf, value in given_values(args, _security_knobs()):
        text = value_text(value)
        # Absolute: a service resolves them from its own working directory.
        env[env_names(leaf.name)[-1]] = os.path.abspath(text) if leaf.name in _PATHS and text else text
    return env


def _flatten(groups: list[list[str]]) -> list[str]:
    return [word for group in groups for word in group]


def _warn_secrets_in_argv(argv: list[str]) -> None:
    """A key typed on the command line is readable by every user of the host (`ps`)."""
    secrets = {"--api-key": "LLMESH_API_KEY", "--internal-key": "LLMESH_INTERNAL_KEY"}
    for name, found in _up_groups().items():
        for leaf in found:
            if is_secret(leaf.field):
                env = env_names(leaf.name, name)[0]
                secrets[f"--{name}.{flag_name(leaf.name)[2:]}"] = env
                if alias := UP_ALIASES[name].get(leaf.name):
                    secrets[alias] = env
    for flag, env in secrets.items():
        if any(a == flag or a.startswith(flag + "=") for a in argv):
            print(
                f"warning: {flag} on the command line is visible to every user of this host (ps); "
                f"set ${env} instead (or a key file)",
                file=sys.stderr,
            )


def _cmd_up(args: argparse.Namespace) -> int:
    from services.launcher import run_up

    _warn_secrets_in_argv(sys.argv[1:])
    return run_up(**up_kwargs(args))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # A service or `health` parses its own flags: the full parser (every service's config, for
    # `up`) is not built, so an image with one service's dependencies runs it (the gateway's has
    # no numpy, which the scheduler's config module pulls in).
    if argv and argv[0] in SERVICES:
        args = argparse.Namespace(rest=argv[1:], func=_service_main(argv[0]))
    elif argv and argv[0] == "health":
        args = argparse.Namespace(rest=argv[1:], func=_cmd_health)
    else:
        args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
