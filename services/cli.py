"""The `llmesh` command: one sub-command per service, plus the local launcher and offline tools."""

from __future__ import annotations

import argparse
import os
import sys


def _cmd_convert(args: argparse.Namespace) -> int:
    from worker_svc.model_files import resolve_model

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

    p = sub.add_parser("up", help="start the whole local mesh (scheduler, workers, gateway) on loopback")
    _add_model_flags(p)
    p.add_argument("--workers", type=int, default=1, help="number of worker processes")
    p.add_argument("--host", default="127.0.0.1", help="address every service binds (loopback by default)")
    p.add_argument("--port", type=int, default=int(os.environ.get("LLMESH_PORT", 8000)), help="gateway port")
    p.add_argument("--scheduler-port", type=int, default=50051)
    p.add_argument(
        "--worker-arg", action="append", default=[], help="extra flag for every worker (repeatable)"
    )
    p.set_defaults(func=_cmd_up)

    # One service each; their flags come from their config dataclasses (`llmesh worker --help`).
    for name, helptext in (
        ("scheduler", "run the scheduler service"),
        ("worker", "run one worker service"),
        ("gateway", "run the OpenAI-compatible gateway"),
    ):
        p = sub.add_parser(name, help=helptext, add_help=False)
        p.set_defaults(func=_service_main(name))
    return parser


def _service_main(name: str):
    def run(args: argparse.Namespace) -> int:
        import importlib

        module = {
            "scheduler": "scheduler_svc.service",
            "worker": "worker_svc.service",
            "gateway": "gateway.service",
        }
        return importlib.import_module(module[name]).main(args.rest)

    return run


def _cmd_up(args: argparse.Namespace) -> int:
    from services.launcher import run_up

    worker_args = list(args.worker_arg) + (["--cache-dir", args.cache_dir] if args.cache_dir else [])
    return run_up(args.workers, args.model, args.host, args.port, args.scheduler_port, worker_args)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    if argv and argv[0] in ("scheduler", "worker", "gateway"):
        args = argparse.Namespace(rest=argv[1:], func=_service_main(argv[0]))
    else:
        args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
