"""The build's check of a torch-free image: its services import, and what must stay out is absent.

    python deploy/docker/check_imports.py gateway|light

Run as root in the build stage, it also byte-compiles what it imports (pip installs with
--no-compile): the modules the services load get their .pyc, the rest of the venv none.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import sys

# What each image's services load, at start or on their first requests (uvicorn picks its
# protocol modules by name; the tokenizer and grammar engines load lazily).
IMPORTS = {
    "gateway": [
        "gateway.app", "gateway.service", "gateway.fast_tokenizer", "gateway.chat_template",
        "services.healthcheck", "llmesh.cli", "tokenizers", "tokenizers.decoders", "llguidance",
        "uvicorn.protocols.http.httptools_impl", "uvicorn.protocols.http.h11_impl",
        "uvicorn.lifespan.on", "uvicorn.loops.asyncio", "fastapi", "orjson",
        "grpc.aio", "grpc_health.v1.health_pb2_grpc", "grpc_reflection.v1alpha.reflection",
    ],
    "light": [
        "gateway.app", "gateway.service", "scheduler_svc.service", "kvstore_svc.service",
        "services.healthcheck", "services.model_files", "llmesh.cli", "uvicorn", "fastapi", "redis",
    ],
}
# The router joins the gateway's image where this tree has it.
OPTIONAL = {"gateway": ["router_svc.service"], "light": ["router_svc.service"]}
SERVICES = {"gateway": ["gateway", "health"], "light": ["scheduler", "kvstore", "gateway", "health"]}
ABSENT = {"gateway": ["torch", "numpy", "transformers", "huggingface_hub"], "light": ["torch"]}


def main() -> int:
    image = sys.argv[1]
    for name in IMPORTS[image]:
        importlib.import_module(name)
    for name in OPTIONAL[image]:
        try:
            importlib.import_module(name)
        except ImportError as e:
            print(f"{name} not in this image: {e}")
    if image == "light":  # the scheduler loads its tokenizer with transformers' classes
        import transformers

        for cls in ("PreTrainedTokenizerFast", "GPT2Tokenizer", "LlamaTokenizer", "Qwen2Tokenizer"):
            getattr(transformers, cls)
    # `llmesh SERVICE` (the images' entry point) parses its flags with only that service imported.
    from llmesh.cli import main as cli

    for service in SERVICES[image]:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
            cli([service, "--help"])
    present = [n for n in ABSENT[image] if n in sys.modules or importlib.util.find_spec(n) is not None]
    if present:
        print(f"{', '.join(present)} must not be in the {image} image", file=sys.stderr)
        return 1
    print(f"{image}: every service imports; none of {', '.join(ABSENT[image])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
