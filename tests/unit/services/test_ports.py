"""Free ports are picked below the ephemeral range (where outgoing connections cannot take
them between the pick and the bind), are free, and are not handed out twice."""

from __future__ import annotations

import os
import socket

import pytest

from services import ports


def test_ports_are_free_distinct_and_below_the_ephemeral_range() -> None:
    first, _ = ports.ephemeral_range()
    picked = [ports.free_port() for _ in range(200)]
    assert len(set(picked)) == len(picked)
    if first - ports._LOWEST >= 1000:
        assert all(ports._LOWEST <= p < first for p in picked)
    with socket.socket() as s:
        s.bind(("127.0.0.1", picked[-1]))  # still free


def test_a_bound_port_is_never_picked(monkeypatch) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        busy = taken.getsockname()[1]
        monkeypatch.setattr(ports, "ephemeral_range", lambda: (busy + 2000, busy + 4000))
        monkeypatch.setattr(ports, "_LOWEST", busy)
        monkeypatch.setattr(ports.random, "randint", lambda a, b: busy)
        # Every try lands on the bound port: the kernel's pick is the fallback.
        assert ports.free_port() != busy


def test_the_environment_gives_a_range_of_its_own(monkeypatch) -> None:
    monkeypatch.setenv(ports.ENV_RANGE, "21000-21099")
    picked = [ports.free_port() for _ in range(20)]
    assert all(21000 <= p <= 21099 for p in picked) and len(set(picked)) == len(picked)
    assert ports.pick_range({ports.ENV_RANGE: "25000-25000"}) == (25000, 25000)
    for bad in ("21000", "a-b", "2100-2000", "0-10", "1-70000", "-5-10"):
        with pytest.raises(ValueError, match="LLMESH_PORT_RANGE"):
            ports.pick_range({ports.ENV_RANGE: bad})


def test_an_unreadable_range_falls_back_to_linux_defaults(tmp_path) -> None:
    assert ports.ephemeral_range(str(tmp_path / "missing")) == (32768, 60999)
    odd = tmp_path / "range"
    odd.write_text("not numbers\n")
    assert ports.ephemeral_range(str(odd)) == (32768, 60999)


def test_each_xdist_worker_picks_from_a_slice_of_its_own() -> None:
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not worker or count == "1":
        pytest.skip("not under pytest-xdist with several workers (tests/conftest.py sets the slice)")
    lo, hi = ports.pick_range()
    first, _ = ports.ephemeral_range()
    assert ports._LOWEST <= lo <= hi < first
    assert hi - lo + 1 >= 1000  # every worker has room: a few hundred meshes in a run
