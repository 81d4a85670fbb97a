"""A real redis-server process on a free loopback port, for tests of the KV store's Redis tier.

    with RedisServer(tmp_path) as r:      # started, answering PING
        r.url                            # redis://127.0.0.1:PORT/0
        r.kill(); r.start()              # SIGKILL, then the same port again (empty: no persistence)

No persistence (`--save "" --appendonly no`): each start is an empty Redis,
as after a crash of a cache-only Redis. `pytest.skip`s when redis-server is
not installed (`make system-deps` installs it).
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from services.ports import free_port


def redis_server_binary() -> str:
    path = shutil.which("redis-server")
    if path is None:
        pytest.skip("redis-server is not installed (`make system-deps` installs it, with apt-get)")
    return path


class RedisServer:
    def __init__(self, workdir: Path, port: int | None = None) -> None:
        self.binary = redis_server_binary()
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2)

    def start(self, timeout: float = 10.0) -> RedisServer:
        cmd = [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.workdir),
            "--daemonize", "no",
            "--loglevel", "warning",
        ]  # fmt: skip
        log = open(self.workdir / f"redis-{self.port}.log", "ab")  # the child keeps its own copy
        try:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        finally:
            log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}; see {self.workdir}")
            try:
                if self.client().ping():
                    return self
            except Exception:  # not listening yet
                time.sleep(0.02)
        raise TimeoutError(f"redis-server on port {self.port} did not answer within {timeout} s")

    def kill(self) -> None:
        """SIGKILL: what a crash or an OOM kill looks like to clients."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def pause(self) -> None:
        """SIGSTOP: a Redis that accepts connections but never answers (a hung or overloaded host)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.resume()  # a stopped process ignores SIGTERM until continued
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.kill()

    def __enter__(self) -> RedisServer:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()
