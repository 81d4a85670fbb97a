"""Print llmesh's runtime requirements from pyproject.toml, one a line (the images' dependency layer).

    python deploy/docker/requirements.py pyproject.toml [--extra gpu] [--drop torch ...] [--keep fastapi ...]

The images install dependencies before the sources, so that a source change rebuilds only the last
layer; this reads them from the one place they are declared instead of a copied list. `--drop`
leaves a distribution out (the light image: torch); `--keep` prints only the named ones (the
gateway image: what the gateway and the router import, with their version bounds from here).
"""

from __future__ import annotations

import argparse
import re
import tomllib


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
    args = parser.parse_args()
    print("\n".join(requirements(args.pyproject, args.extra, args.drop, args.keep)))


if __name__ == "__main__":
    main()
