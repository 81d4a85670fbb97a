"""Free ports are picked below the ephemeral range (where outgoing connections cannot take
them between the pick and the bind), are free, and are not handed out twice."""

from __future__ import annotations

import socket

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


def test_an_unreadable_range_falls_back_to_linux_defaults(tmp_path) -> None:
    assert ports.ephemeral_range(str(tmp_path / "missing")) == (32768, 60999)
    odd = tmp_path / "range"
    odd.write_text("not numbers\n")
    assert ports.ephemeral_range(str(odd)) == (32768, 60999)
