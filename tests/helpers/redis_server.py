"""A real redis-server process on a free loopback port, for tests of the KV store's Redis tier.

    with RedisServer(tmp_path) as r:      # started, answering PING
        r.url                            # redis://:PASSWORD@127.0.0.1:PORT/0
        r.kill(); r.start()              # SIGKILL, then the same port again (empty: no persistence)

Secure like the deploy stack: a random password by default (`requirepass`);
`user="llmesh"` makes it an ACL user limited to `llmesh:*` keys (the default
user then holds `admin_password`, which `client()` uses); `password=None` is
an anonymous Redis; `tls=MeshCerts` serves TLS only (`rediss://`);
`acl_file=` loads the users from a file (deploy/'s, with `user` and
`password` its user's, which `client()` then uses). The passwords go into a
config file (mode 0600), not argv.

No persistence (`--save "" --appendonly no`): each start is an empty Redis,
as after a crash of a cache-only Redis. `pytest.skip`s when redis-server is
not installed (`make system-deps` installs it).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from services.ports import free_port
from tests.helpers.certs import MeshCerts

# What deploy/ grants the store's ACL user: its own keys, no admin or dangerous commands.
ACL_RULES = "~llmesh:* resetchannels +@all -@dangerous"
_DEFAULT = object()


def redis_server_binary() -> str:
    path = shutil.which("redis-server")
    if path is None:
        pytest.skip("redis-server is not installed (`make system-deps` installs it, with apt-get)")
    return path


class RedisServer:
    def __init__(
        self,
        workdir: Path,
        port: int | None = None,
        *,
        password: str | None | object = _DEFAULT,
        user: str | None = None,
        tls: MeshCerts | None = None,
        acl_file: Path | None = None,
    ) -> None:
        self.binary = redis_server_binary()
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.password: str | None = secrets.token_hex(16) if password is _DEFAULT else password  # type: ignore[assignment]
        self.user = user
        self.admin_password = secrets.token_hex(16) if user else self.password
        self.acl_file = acl_file
        self.tls = tls
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """The URL the store connects with: scheme, credentials (if any), loopback address, db 0."""
        auth = f"{self.user or ''}:{self.password}@" if self.password else ""
        return f"{self.scheme}://{auth}127.0.0.1:{self.port}/0"

    @property
    def anonymous_url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}/0"

    @property
    def scheme(self) -> str:
        return "rediss" if self.tls else "redis"

    def client(self):
        """An administrator's client (all keys, all commands), for tests to look inside."""
        import redis

        tls = {"ssl": True, "ssl_ca_certs": self.tls.ca} if self.tls else {}
        auth = (
            {"username": self.user, "password": self.password}
            if self.acl_file
            else {"password": self.admin_password}
        )
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2, **auth, **tls)

    def _config_file(self) -> Path:
        """redis.conf with the secrets and the listener (0600: the passwords stay out of argv)."""
        lines = ["bind 127.0.0.1", f"port {0 if self.tls else self.port}"]
        if self.tls:
            lines += [
                f"tls-port {self.port}",
                f"tls-cert-file {self.tls.cert}",
                f"tls-key-file {self.tls.key}",
                f"tls-ca-cert-file {self.tls.ca}",
                "tls-auth-clients optional",
            ]
        if self.acl_file:
            lines.append(f"aclfile {self.acl_file}")
        elif self.user:
            lines += [
                f"user default on >{self.admin_password} ~* &* +@all",
                f"user {self.user} on >{self.password} {ACL_RULES}",
            ]
        elif self.password:
            lines.append(f"requirepass {self.password}")
        path = self.workdir / f"redis-{self.port}.conf"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(lines) + "\n")
        return path

    def start(self, timeout: float = 10.0) -> RedisServer:
        cmd = [
            self.binary,
            str(self._config_file()),
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
                self._skip_without_tls()
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}; see {self.workdir}")
            try:
                if self.client().ping():
                    return self
            except Exception:  # not listening yet
                time.sleep(0.02)
        raise TimeoutError(f"redis-server on port {self.port} did not answer within {timeout} s")

    def _skip_without_tls(self) -> None:
        """A redis-server built without TLS refuses the tls-* directives: skip, it is not a failure."""
        log = (self.workdir / f"redis-{self.port}.log").read_text(errors="replace")
        if self.tls and "tls" in log.lower() and "bad directive" in log.lower():
            pytest.skip("this redis-server has no TLS support")

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
