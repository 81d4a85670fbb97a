"""The mesh secret: the key every internal RPC carries, on by default, never on a command line.

Where a service finds it, first match wins:

1. `LLMESH_INTERNAL_KEY` (or the service-scoped `LLMESH_<SERVICE>_INTERNAL_KEY`; `--internal-key`
   still works but shows in `ps`): what `llmesh up` sets in each child's environment, a fresh
   random key per mesh;
2. `LLMESH_INTERNAL_KEY_FILE` / `--internal-key-file`: a file holding it (a Kubernetes Secret or a
   compose secret mounted into the container), surrounding whitespace stripped;
3. mutual TLS (`--tls-client-auth`) and nothing above: no key, the certificates authenticate
   (the mesh's CA is then what admits a peer);
4. a service bound to loopback with none of these: this user's local key,
   `$LLMESH_CACHE/internal.key` (made on first use, mode 0600), so that services one user starts
   by hand on one host find each other, and no other user of the host can call them;
5. anything else (a wildcard or routable address, no key, no mTLS) is refused at start, with a
   message that says how to set one: a protection that needs a flag protects nothing.

Clients that are given no security (`open_channel(address)`) carry keys 1, 2 or 4 too, so a
tool or test on the host reaches the services started the same way. The key never appears in
argv, logs or error messages.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import time
from collections.abc import Mapping
from pathlib import Path

ENV_KEY = "LLMESH_INTERNAL_KEY"
ENV_KEY_FILE = "LLMESH_INTERNAL_KEY_FILE"
LOCAL_KEY_NAME = "internal.key"
MIN_KEY_CHARS = 16  # shorter keys are guessable; refuse them rather than pretend


class MissingSecret(ValueError):
    """A service off loopback with no mesh secret and no mutual TLS."""


def new_key() -> str:
    """A fresh mesh secret (256 random bits, URL-safe text: it travels in gRPC metadata)."""
    return secrets.token_urlsafe(32)


def is_loopback(host: str) -> bool:
    """Whether binding or dialling `host` stays on this machine."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: it may resolve anywhere


def _checked(key: str, where: str) -> str:
    key = key.strip()
    if len(key) < MIN_KEY_CHARS:
        raise ValueError(f"the mesh secret from {where} is shorter than {MIN_KEY_CHARS} characters")
    return key


def read_key_file(path: str) -> str:
    """The key a file holds (a mounted Secret), whitespace stripped."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ValueError(f"--internal-key-file {path}: {e.strerror or e}") from None
    return _checked(text, f"--internal-key-file {path}")


def local_key_path(environ: Mapping[str, str] | None = None) -> Path:
    environ = os.environ if environ is None else environ
    cache = environ.get("LLMESH_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "llmesh")
    return Path(cache) / LOCAL_KEY_NAME


def local_key(environ: Mapping[str, str] | None = None) -> str:
    """This user's key for services on loopback: made once (0600, never replaced), then read."""
    path = local_key_path(environ)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        pass  # made by an earlier service (or one starting beside us: O_EXCL lets one win)
    else:
        with os.fdopen(fd, "w") as f:
            f.write(new_key() + "\n")
    mode = path.stat().st_mode
    if mode & 0o077:
        raise ValueError(f"{path} is readable by other users (mode {mode & 0o777:o}); chmod 600 it")
    for _ in range(50):  # a service racing us may not have written it yet
        text = path.read_text()
        if text.strip():
            return _checked(text, str(path))
        time.sleep(0.01)
    raise ValueError(f"{path} is empty; delete it and start again")


def resolve_internal_key(
    key: str | None,
    key_file: str | None,
    *,
    host: str,
    mutual_tls: bool = False,
    environ: Mapping[str, str] | None = None,
) -> str | None:
    """The key a service serves and dials with (None: mutual TLS authenticates); see the module doc.

    A config built in code with neither `key` nor `key_file` reads the environment as a client
    would (`client_key`), so that a server and a client told nothing agree."""
    environ = os.environ if environ is None else environ
    if key:
        return _checked(key, "--internal-key / $LLMESH_INTERNAL_KEY")
    if key_file:
        return read_key_file(key_file)
    if environ.get(ENV_KEY) or environ.get(ENV_KEY_FILE):
        return client_key(environ)
    if mutual_tls:
        return None
    if is_loopback(host):
        return local_key()
    raise MissingSecret(
        f"refusing to serve internal RPCs on {host} without a mesh secret: set {ENV_KEY} (or "
        f"{ENV_KEY_FILE}, a file holding it) to the same random key in every service of the mesh "
        "(`python -c 'import secrets; print(secrets.token_urlsafe(32))'`), or use mutual TLS "
        "(--tls-cert/--tls-key/--tls-ca/--tls-client-auth); `llmesh up` and deploy/ make one for you"
    )


def client_key(environ: Mapping[str, str] | None = None) -> str:
    """The key a client that was told nothing carries: the environment's, else this user's local key."""
    environ = os.environ if environ is None else environ
    if environ.get(ENV_KEY):
        return _checked(environ[ENV_KEY], f"${ENV_KEY}")
    if environ.get(ENV_KEY_FILE):
        return read_key_file(environ[ENV_KEY_FILE])
    return local_key(environ)


def with_mesh_secret(env: dict[str, str]) -> tuple[dict[str, str], str | None]:
    """`env` for the children of one mesh (`llmesh up`), with a fresh secret unless it brings its
    own (a key, a key file) or mutual TLS; and the key the mesh's clients must carry."""
    if env.get(ENV_KEY) or env.get(ENV_KEY_FILE):
        return env, client_key(env)
    if env.get("LLMESH_TLS_CLIENT_AUTH", "").lower() in ("1", "true", "yes", "on"):
        return env, None
    key = new_key()
    return {**env, ENV_KEY: key}, key
