"""Every script in benchmarks/ runs in its smoke mode: tiny shapes, a few requests, the CPU.

A benchmark nobody runs rots unseen (issue 29: the null worker failed every plan for weeks).
Each script here runs its real code path with `--smoke` (or the tiny options listed in
`SMOKE_ARGV`) and must exit 0; a script added to benchmarks/ without a smoke mode fails its
case (argparse rejects `--smoke`). Scripts run in this process (torch is imported once), through
their `main()` with `sys.argv` set, unless listed in `OWN_PROCESS` (they patch the model's code
or need a `__main__` of their own).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
# Modules of benchmarks/ that are not scripts (imported by the others, no main); each runs in
# the smoke runs of the scripts that import it (stack_sampler: sharegpt_profile's -stacks pass).
HELPERS: set[str] = {"stack_sampler"}
# Scripts whose smoke run here takes more than --smoke (to keep make test's time): kv_store's chat
# rows (12 engines) are left out; its document rows cover every store path.
# gpu_mesh's timed runs sample (top_p), so its sampling option runs too.
SMOKE_ARGV: dict[str, list[str]] = {
    "kv_store": ["--smoke", "--skip-chat"],
    "gpu_mesh": ["--smoke", "--sampling", "nucleus"],
}
# Scripts to run as a process of their own (one that patches shared modules or needs its own
# __main__): none today; the smoke runs of tp_arithmetic and the other GPU engines stop before.
OWN_PROCESS: set[str] = set()
SCRIPTS = sorted(p.stem for p in BENCH.glob("*.py") if p.stem not in HELPERS and p.stem != "__init__")


def _argv(name: str) -> list[str]:
    return SMOKE_ARGV.get(name, ["--smoke"])


def _run_in_process(name: str, argv: list[str]) -> object:
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [str(BENCH / f"{name}.py"), *argv]
    try:
        # By its package name: child processes (spawned clients) import it again by that name.
        module = importlib.import_module(f"benchmarks.{name}")
        assert hasattr(module, "main"), f"benchmarks/{name}.py has no main(): list it in HELPERS"
        try:
            return module.main()
        except SystemExit as e:
            return e.code
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path


@pytest.mark.parametrize("name", SCRIPTS)
def test_benchmark_smoke(name: str, capsys) -> None:
    argv = _argv(name)
    if name in OWN_PROCESS:
        done = subprocess.run(
            [sys.executable, str(BENCH / f"{name}.py"), *argv], capture_output=True, text=True, timeout=300
        )
        code, out = done.returncode, done.stdout + done.stderr
    else:
        code = _run_in_process(name, argv)
        captured = capsys.readouterr()
        out = captured.out + captured.err
    assert code in (0, None), f"benchmarks/{name}.py {' '.join(argv)} exited {code}:\n{out[-4000:]}"
    assert out.strip(), f"benchmarks/{name}.py {' '.join(argv)} printed nothing"
