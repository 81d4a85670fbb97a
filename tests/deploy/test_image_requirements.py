"""The gateway image's dependency list (deploy/docker/requirements.py's GATEWAY) covers what the
gateway and the router import, and keeps torch, transformers and numpy out: checked here in the
test env, so a new import is caught before an image build fails on it (deploy/docker/check_imports.py
checks the built image itself)."""

from __future__ import annotations

import importlib.metadata as md
import json
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "deploy" / "docker"))
import requirements as image_requirements  # noqa: E402

# What the gateway image runs, as check_imports.py imports it.
MODULES = [
    "gateway.app",
    "gateway.service",
    "gateway.fast_tokenizer",
    "gateway.chat_template",
    "router_svc.service",
    "services.healthcheck",
    "llguidance",
    "tokenizers.decoders",
    "jinja2.ext",
    "uvicorn.protocols.http.httptools_impl",
    "uvicorn.lifespan.on",
]
# Imported here only because the test env has them; the image runs without them (its build checks).
OPTIONAL = {
    "grpc_tools",  # grpc._runtime_protos, when grpcio-tools is installed
    "sniffio",  # anyio, when installed
    "_distutils_hack",  # setuptools' .pth hook
}
OURS = {
    "llmesh",
    "services",
    "gateway",
    "scheduler_svc",
    "worker_svc",
    "kvstore_svc",
    "kernels",
    "router_svc",
}


def _imported_top_level() -> set[str]:
    code = (
        "import importlib, json, sys\n"
        f"for m in {MODULES!r}: importlib.import_module(m)\n"
        "from llmesh.cli import main\n"
        "try:\n    main(['gateway', '--help'])\nexcept SystemExit:\n    pass\n"
        "print(json.dumps(sorted({n.split('.')[0] for n in sys.modules})))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def _closure(names: tuple[str, ...], with_deps: bool) -> set[str]:
    seen: set[str] = set()
    todo = [n for n in names]
    while todo:
        name = todo.pop()
        key = md.metadata(name)["Name"].lower().replace("_", "-")
        if key in seen:
            continue
        seen.add(key)
        if not with_deps:
            continue
        for line in md.requires(name) or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


def test_the_gateway_image_list_covers_every_import_of_the_gateway_and_router() -> None:
    imported = _imported_top_level() - set(sys.stdlib_module_names) - OURS - OPTIONAL
    assert not imported & {"torch", "transformers", "numpy", "huggingface_hub"}, imported
    allowed = _closure(image_requirements.GATEWAY, True) | _closure(image_requirements.GATEWAY_NO_DEPS, False)
    dists = md.packages_distributions()
    missing = {
        module: dists[module]
        for module in imported
        if module in dists and not {d.lower().replace("_", "-") for d in dists[module]} & allowed
    }
    assert missing == {}, f"imported by the gateway but not in the gateway image: {missing}"


def test_the_gateway_list_is_in_pyproject() -> None:
    kept = image_requirements.requirements(
        str(ROOT / "pyproject.toml"), [], [], list(image_requirements.GATEWAY)
    )
    assert len(kept) == len(image_requirements.GATEWAY)


def test_the_torch_free_targets_are_python_alone_non_root_with_llmesh_healthchecks() -> None:
    from llmesh.cli import parse_command

    text = (ROOT / "deploy" / "docker" / "Dockerfile").read_text().replace("\\\n", " ")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    stages: dict[str, tuple[str, list[tuple[str, str]]]] = {}
    current = None
    for op, arg in (tuple(ln.split(None, 1)) for ln in lines):
        op = op.upper()
        if op == "FROM":
            current = arg.split()[-1]
            stages[current] = (arg.split()[0], [])
        elif current:
            stages[current][1].append((op, arg))
    for target in ("gateway", "light"):
        base, ops = stages[target]
        assert base == "scratch", target  # no shell, apt or perl: the root minroot.sh makes
        assert ("COPY", f"--from=root-{target} /rootfs /") in ops
        assert ("USER", "10001:10001") in ops
        assert [json.loads(arg) for op, arg in ops if op == "ENTRYPOINT"] == [["llmesh"]]
        assert any(op == "VOLUME" and "/models" in arg for op, arg in ops)
        health = [arg for op, arg in ops if op == "HEALTHCHECK"]
        assert len(health) == 1
        command = json.loads(health[0].split("CMD", 1)[1])
        assert command[0] == "llmesh"
        parse_command(command[1:])
        # Every RUN is exec form: there is no /bin/sh to run a shell form.
        assert all(arg.startswith("[") for op, arg in ops if op == "RUN"), target
