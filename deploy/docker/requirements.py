"""Print llmesh's runtime requirements from pyproject.toml, one a line (the images' dependency layer).

    python deploy/docker/requirements.py pyproject.toml [--extra gpu] [--drop torch ...] [--keep fastapi ...]
    python deploy/docker/requirements.py pyproject.toml --keep-gateway [--no-deps-part]

The images install dependencies before the sources, so that a source change rebuilds only the last
layer; this reads them from the one place they are declared instead of a copied list. `--drop`
leaves a distribution out (the light image: torch); `--keep` prints only the named ones (the
gateway image: what the gateway and the router import, with their version bounds from here;
`--keep-gateway` names that list, `GATEWAY`, and `--no-deps-part` the part pip installs without its
dependencies, `GATEWAY_NO_DEPS`).
"""

from __future__ import annotations

import argparse
import re
import tomllib

# What the gateway and the router import (tests/deploy/test_image_requirements.py keeps it so):
# the gateway image installs these and nothing else. llguidance: structured outputs are checked at
# the gateway. No uvloop (optional), transformers, numpy, redis, safetensors or gguf.
GATEWAY = (
    "grpcio", "grpcio-health-checking", "grpcio-reflection", "protobuf", "fastapi", "uvicorn",
    "httptools", "orjson", "prometheus_client", "jinja2", "llguidance",
)
# Installed without dependencies: tokenizers' huggingface_hub (with hf_xet, fsspec, pyyaml, ...)
# serves only Tokenizer.from_pretrained, which the gateway never calls.
GATEWAY_NO_DEPS = ("tokenizers",)


def requirement_name(requirement: str) -> str:
    """The normalised distribution name of a PEP 508 line ("torch>=2.4" -> "torch")."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if match is None:
        raise ValueError(f"not a requirement: {requirement!r}")
    return re.sub(r"[-_.]+", "-", match.group(1)).lower()


def requirements(
    pyproject: str, extras: list[str], drop: list[str], keep: list[str] | None = None
) -> list[str]:
    with open(pyproject, "rb") as f:
        project = tomllib.load(f)["project"]
    lines = list(project.get("dependencies", []))
    for extra in extras:
        lines += project.get("optional-dependencies", {})[extra]
    dropped = {requirement_name(d) for d in drop}
    lines = [line for line in lines if requirement_name(line) not in dropped]
    if keep:
        kept = {requirement_name(k) for k in keep}
        missing = kept - {requirement_name(line) for line in lines}
        if missing:
            raise SystemExit(f"not a dependency in {pyproject}: {', '.join(sorted(missing))}")
        lines = [line for line in lines if requirement_name(line) in kept]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pyproject")
    parser.add_argument("--extra", action="append", default=[], help="add an optional-dependencies group")
    parser.add_argument("--drop", action="append", default=[], help="leave out this distribution")
    parser.add_argument("--keep", action="append", default=[], help="print only these distributions")
    parser.add_argument("--keep-gateway", action="store_true", help="--keep the gateway image's list")
    parser.add_argument("--no-deps-part", action="store_true", help="with --keep-gateway: its no-deps part")
    args = parser.parse_args()
    keep = args.keep
    if args.keep_gateway:
        keep = list(GATEWAY_NO_DEPS if args.no_deps_part else GATEWAY)
    print("\n".join(requirements(args.pyproject, args.extra, args.drop, keep)))


if __name__ == "__main__":
    main()
