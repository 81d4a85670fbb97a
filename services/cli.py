"""The `llmesh` command: one sub-command per service, plus the local launcher and offline tools."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path
from typing import Any


def _cmd_convert(args: argparse.Namespace) -> int:
    from services.model_files import resolve_model

    print(resolve_model(args.model, args.cache_dir))
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
    p.set_defaults(func=_cmd_convert)

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
        "(same flags, same port) with backoff; Ctrl-C / SIGTERM stops everything.",
    )
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
    ):
        p = sub.add_parser(name, help=helptext, add_help=False)
        p.set_defaults(func=_service_main(name))
    return parser


SERVICES = ("scheduler", "worker", "gateway", "kvstore")
PASSTHROUGH = (*SERVICES, "health")  # commands whose flags their own parser reads


SERVICE_CONFIGS = {  # module, config class: what `llmesh <service>` parses its flags into
    "scheduler": ("scheduler_svc.service", "SchedulerServiceConfig"),
    "worker": ("worker_svc.service", "WorkerServiceConfig"),
    "gateway": ("gateway.config", "GatewayConfig"),
    "kvstore": ("kvstore_svc.config", "KVStoreConfig"),
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
        }
        return importlib.import_module(module[name]).main(args.rest)

    return run


def _shell_words(text: str) -> list[str]:
    try:
        return shlex.split(text)
    except ValueError as e:  # an unbalanced quote
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None


def _positive(kind: type[int] | type[float]):
    def parse(text: str) -> int | float:
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its error message
    return parse


def _add_up_flags(p: argparse.ArgumentParser) -> None:
    _add_model_flags(p)
    p.add_argument("--workers", type=int, default=1, help="number of worker processes")
    p.add_argument(
        "--tensor-parallel-size",
        type=_positive(int),
        default=None,
        help="ranks (GPUs) each worker splits the model over (`llmesh worker --tensor-parallel-size`)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address every service binds (loopback by default)")
    p.add_argument("--port", type=int, default=int(os.environ.get("LLMESH_PORT", 8000)), help="gateway port")
    p.add_argument("--scheduler-port", type=int, default=50051, help="scheduler gRPC port")
    p.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help="speculative decoding on every worker, as vLLM's JSON: "
        '\'{"method": "ngram", "num_speculative_tokens": 4}\'',
    )
    p.add_argument(
        "--stream-interval",
        type=_positive(int),
        default=None,
        help="stream tokens once this many are pending after the first (vLLM's --stream-interval; "
        "`llmesh scheduler --stream-interval`)",
    )

    g = p.add_argument_group("gateway", "the flags of `llmesh gateway` that matter most (default: its own)")
    g.add_argument(
        "--api-key",
        default=None,
        help="clients must send `Authorization: Bearer KEY` (default $LLMESH_API_KEY); "
        "handed to the gateway in its environment, not on its command line",
    )
    g.add_argument(
        "--api-key-file",
        default=None,
        help="file of client keys, one a line (the gateway's --api-key-file); the first also opens "
        "the scheduler's public gRPC API",
    )
    g.add_argument(
        "--served-model-name",
        default=None,
        metavar="NAMES",
        help="model ids clients use, comma-separated; the first also names the model on the gRPC API",
    )
    g.add_argument(
        "--max-body-bytes", type=_positive(int), default=None, help="largest request body (413 beyond)"
    )
    g.add_argument(
        "--request-timeout-s", type=_positive(float), default=None, help="deadline of one generation, seconds"
    )
    g.add_argument(
        "--api-server-count",
        type=_positive(int),
        default=None,
        help="gateway processes sharing the HTTP port (SO_REUSEPORT), each with its own scheduler channel",
    )

    s = p.add_argument_group(
        "security",
        "keys and TLS for every service (`docs/deploy.md`); certificate paths reach each service in its "
        "environment (LLMESH_TLS_*), keys too (never on a command line)",
    )
    s.add_argument(
        "--internal-key",
        default=None,
        help="mesh secret every internal RPC must carry (default $LLMESH_INTERNAL_KEY, else a fresh "
        "random one per mesh); prefer the environment or --internal-key-file: argv shows in `ps`",
    )
    s.add_argument("--internal-key-file", default=None, help="file holding the mesh secret")
    s.add_argument("--tls-cert", default=None, help="PEM certificate every service presents")
    s.add_argument("--tls-key", default=None, help="its PEM private key")
    s.add_argument("--tls-ca", default=None, help="PEM CA bundle that signs the services' certificates")
    s.add_argument(
        "--tls-client-auth", action="store_true", help="mutual TLS between the services (needs all three)"
    )
    s.add_argument("--tls-server-name", default=None, help="name checked in certificates (default: the host)")

    k = p.add_argument_group("kvstore", "the KV store (memory tier by default; `llmesh kvstore --help`)")
    k.add_argument("--no-kvstore", action="store_true", help="do not start the KV store")
    k.add_argument("--kvstore-port", type=int, default=0, help="KV store gRPC port (default: any free port)")
    k.add_argument(
        "--kv-store-shared-memory",
        choices=("auto", "on", "off"),
        default=None,
        help="workers move KV payloads to and from the store through shared memory (/dev/shm) instead of "
        "gRPC (default auto: the store is on this host, so on)",
    )
    k.add_argument(
        "--redis-url",
        default=None,
        help="redis://[:password@]host:port/db: Redis as the KV store's shared tier (default $REDIS_URL); "
        "handed to the KV store in its environment, not on its command line",
    )

    pt = p.add_argument_group(
        "passthrough",
        "any other flag of a service (`llmesh scheduler|worker|gateway|kvstore --help`), as one shell-quoted "
        'string, repeatable, applied last: --worker-args "--kv-cache-memory 268435456". '
        "A lone flag needs `=`: --scheduler-args=--no-tokenizer",
    )
    for name, whom in (
        ("scheduler", "the scheduler"),
        ("worker", "every worker"),
        ("gateway", "the gateway"),
        ("kvstore", "the KV store"),
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


def up_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """`run_up`'s arguments from parsed `llmesh up` flags (no process is started)."""
    common = ["--cache-dir", args.cache_dir] if args.cache_dir else []
    scheduler, gateway = list(common), list(common)
    if args.served_model_name:
        names = [n.strip() for n in args.served_model_name.split(",") if n.strip()]
        scheduler += ["--served-model-name", names[0]]  # the scheduler takes one name
        gateway += ["--served-model-name", ",".join(names)]
    if args.max_body_bytes is not None:
        gateway += ["--max-body-bytes", str(args.max_body_bytes)]
    if args.request_timeout_s is not None:
        gateway += ["--request-timeout-s", str(args.request_timeout_s)]
    if args.api_server_count is not None:
        gateway += ["--api-server-count", str(args.api_server_count)]
    if args.stream_interval is not None:
        scheduler += ["--stream-interval", str(args.stream_interval)]
    worker = list(common)
    if args.tensor_parallel_size is not None:
        worker += ["--tensor-parallel-size", str(args.tensor_parallel_size)]
    if args.kv_store_shared_memory is not None:
        worker += ["--kv-store-shared-memory", args.kv_store_shared_memory]
    spec = ["--speculative-config", args.speculative_config] if args.speculative_config else []
    env = {}
    if args.api_key:  # the gateway's clients and the scheduler's public API take the same key
        env |= {"LLMESH_GATEWAY_API_KEY": args.api_key, "LLMESH_SCHEDULER_API_KEY": args.api_key}
    if args.api_key_file:
        keys = [k.strip() for k in Path(args.api_key_file).read_text().splitlines()]
        keys = [k for k in keys if k and not k.startswith("#")]
        if not keys:
            raise SystemExit(f"--api-key-file {args.api_key_file}: no key in it")
        env["LLMESH_GATEWAY_API_KEY_FILE"] = os.path.abspath(args.api_key_file)
        env.setdefault("LLMESH_SCHEDULER_API_KEY", keys[0])
    env |= security_env(args)
    if args.redis_url:  # service-scoped and in the environment: a password stays out of `ps` output
        env["LLMESH_KVSTORE_REDIS_URL"] = args.redis_url
    return {
        "num_workers": args.workers,
        "model": args.model,
        "host": args.host,
        "port": args.port,
        "scheduler_port": args.scheduler_port,
        "worker_args": [*worker, *spec, *args.worker_arg, *_flatten(args.worker_args)],
        "scheduler_args": [*scheduler, *_flatten(args.scheduler_args)],
        "gateway_args": [*gateway, *_flatten(args.gateway_args)],
        "kvstore": not args.no_kvstore,
        "kvstore_port": args.kvstore_port,
        "kvstore_args": _flatten(args.kvstore_args),
        # Service-scoped variables reach one service only, and keep secrets out of `ps` output.
        "env": env,
    }


def security_env(args: argparse.Namespace) -> dict[str, str]:
    """The environment that gives every service of `llmesh up` the same internal key and TLS files.

    No key given: `start_mesh` makes a fresh one for this mesh (services/mesh_secret.py)."""
    env = {"LLMESH_INTERNAL_KEY": args.internal_key} if args.internal_key else {}
    if getattr(args, "internal_key_file", None):
        env["LLMESH_INTERNAL_KEY_FILE"] = os.path.abspath(args.internal_key_file)
    for name in ("tls_cert", "tls_key", "tls_ca", "tls_server_name"):
        if getattr(args, name):
            # Absolute: a service resolves them from its own working directory.
            value = getattr(args, name)
            env[f"LLMESH_{name.upper()}"] = value if name == "tls_server_name" else os.path.abspath(value)
    if args.tls_client_auth:
        env["LLMESH_TLS_CLIENT_AUTH"] = "1"
    return env


def _flatten(groups: list[list[str]]) -> list[str]:
    return [word for group in groups for word in group]


def _warn_secrets_in_argv(args: argparse.Namespace, argv: list[str]) -> None:
    """A key typed on the command line is readable by every user of the host (`ps`)."""
    for flag in ("--api-key", "--internal-key"):
        if any(a == flag or a.startswith(flag + "=") for a in argv):
            env = "LLMESH_API_KEY" if flag == "--api-key" else "LLMESH_INTERNAL_KEY"
            print(
                f"warning: {flag} on the command line is visible to every user of this host (ps); "
                f"set ${env} or use {flag}-file instead",
                file=sys.stderr,
            )


def _cmd_up(args: argparse.Namespace) -> int:
    from services.launcher import run_up

    _warn_secrets_in_argv(args, sys.argv[1:])
    return run_up(**up_kwargs(args))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    if argv and argv[0] in SERVICES:
        args = argparse.Namespace(rest=argv[1:], func=_service_main(argv[0]))
    elif argv and argv[0] == "health":
        args = argparse.Namespace(rest=argv[1:], func=_cmd_health)
    else:
        args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
