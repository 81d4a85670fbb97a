"""The `llmesh` command: one sub-command per service, plus the local launcher and offline tools."""

from __future__ import annotations

import argparse
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

    p = sub.add_parser("up", help="start the local mesh (until the mesh lands: an offline chat)")
    _add_model_flags(p)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.set_defaults(func=_cmd_chat)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
