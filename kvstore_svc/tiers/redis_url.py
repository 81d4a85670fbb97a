"""Redis URLs: which carry credentials, how a password file and TLS files join one, and how to log one.

Redis is untrusted shared storage reached over the network, so the store
insists on credentials (`redis://USER:PASSWORD@host:port/db`, or a password
alone for `requirepass`). A password may come from a file (a mounted
Kubernetes Secret) instead of the URL, so that it never needs to be on a
command line; TLS files (`rediss://`) travel as the query parameters redis-py
reads itself (`ssl_ca_certs`, `ssl_certfile`, `ssl_keyfile`). Everything that
logs or reports a URL goes through `redact_url`: the password never leaves.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import SplitResult, parse_qsl, quote, unquote, urlencode, urlsplit

SCHEMES = ("redis://", "rediss://", "unix://")
MASK = "***"


def _join(parts: SplitResult) -> str:
    """urlunsplit that keeps `//` before an empty netloc (`unix:///path`, which urlunsplit drops)."""
    query = f"?{parts.query}" if parts.query else ""
    fragment = f"#{parts.fragment}" if parts.fragment else ""
    return f"{parts.scheme}://{parts.netloc}{parts.path}{query}{fragment}"


def _userinfo(url: str) -> tuple[str | None, str | None, str]:
    """(user, password, host part) of the URL's netloc, user and password still %-quoted."""
    netloc = urlsplit(url).netloc
    if "@" not in netloc:
        return None, None, netloc
    userinfo, _, hostport = netloc.rpartition("@")
    user, sep, password = userinfo.partition(":")
    return user, (password if sep else None), hostport


def password_of(url: str) -> str | None:
    """The URL's password (from the netloc or a `password=` query parameter), None when it has none."""
    _, password, _ = _userinfo(url)
    if password:
        return unquote(password)
    query = dict(parse_qsl(urlsplit(url).query))
    return query.get("password") or None


def has_credentials(url: str) -> bool:
    """Whether this URL authenticates (Redis AUTH needs a password; a user name alone is none)."""
    return password_of(url) is not None


def with_password(url: str, password: str) -> str:
    """The URL with `password` in its netloc, its user (an ACL user) kept."""
    user, _, hostport = _userinfo(url)
    netloc = f"{user or ''}:{quote(password, safe='')}@{hostport}"
    return _join(urlsplit(url)._replace(netloc=netloc))


def with_query(url: str, params: dict[str, str]) -> str:
    """The URL with these query parameters set (replacing ones of the same name)."""
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query)) | params
    return _join(parts._replace(query=urlencode(query)))


def redact_url(url: str) -> str:
    """The URL with its password masked, for logs and error messages."""
    parts = urlsplit(url)
    user, password, hostport = _userinfo(url)
    if password is not None:
        parts = parts._replace(netloc=f"{user or ''}:{MASK}@{hostport}")
    query = parse_qsl(parts.query)
    if any(name == "password" for name, _ in query):
        masked = [(n, MASK if n == "password" else v) for n, v in query]
        parts = parts._replace(query=urlencode(masked, safe="*"))
    return _join(parts)


def read_password_file(path: str) -> str:
    """The password a file holds (a mounted Secret), surrounding whitespace stripped; never echoed."""
    try:
        password = Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--redis-password-file {path}: {getattr(e, 'strerror', None) or e}") from None
    if not password:
        raise ValueError(f"--redis-password-file {path} is empty")
    return password
