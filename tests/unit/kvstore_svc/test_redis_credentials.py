"""Redis with credentials: the store refuses an anonymous URL unless told, reads a password file,
works as an ACL user and over TLS, and treats refused credentials as Redis being down."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from kvstore_svc.config import KVStoreConfig, kvstore_environ
from kvstore_svc.tiers.base import EntryKey
from kvstore_svc.tiers.redis_tier import RedisTier, redis_key
from kvstore_svc.tiers.redis_url import has_credentials, redact_url, with_password
from services.config import load_config
from tests.helpers.certs import make_certs
from tests.helpers.redis_server import RedisServer

SECRET = "s3cret-p@ss/word"


def load(argv: list[str], env: dict[str, str] | None = None) -> KVStoreConfig:
    return load_config(KVStoreConfig, argv, kvstore_environ(env or {}), service="kvstore")


def usage_error(argv: list[str], capsys, env: dict[str, str] | None = None) -> str:
    with pytest.raises(SystemExit) as e:
        load(argv, env)
    assert e.value.code == 2
    return capsys.readouterr().err


def k(i: int) -> EntryKey:
    return EntryKey(b"\x01\x02", bytes([i]) * 4)


@pytest.fixture
def password_file(tmp_path):
    path = tmp_path / "redis-password"
    path.write_text(f"  {SECRET}\n")  # as a Secret or `echo` leaves it: whitespace is stripped
    return str(path)


# -- the config ---------------------------------------------------------------------------------


@pytest.mark.parametrize("url", ["redis://r:6379/0", "redis://llmesh@r:6379/0", "rediss://r/0", "unix:///s"])
def test_a_url_without_credentials_is_refused_with_how_to_fix_it(url, capsys):
    err = usage_error(["--redis-url", url], capsys)
    assert "without credentials" in err
    for fix in ("redis://USER:PASSWORD@", "--redis-password-file", "--redis-allow-anonymous"):
        assert fix in err
    assert "refusing" in usage_error([], capsys, {"REDIS_URL": url})  # the environment too


def test_allow_anonymous_accepts_it_by_flag_or_environment():
    assert (
        load(["--redis-url", "redis://r:6379/0", "--redis-allow-anonymous"]).redis_url == "redis://r:6379/0"
    )
    env = {"REDIS_URL": "redis://r/0", "LLMESH_KVSTORE_REDIS_ALLOW_ANONYMOUS": "1"}
    assert load([], env).redis_allow_anonymous


@pytest.mark.parametrize(
    "url", ["redis://:pw@r/0", "redis://u:pw@r/0", "rediss://u:pw@r/0", "unix:///s?password=pw"]
)
def test_a_password_or_an_acl_user_with_one_is_credentials(url):
    assert load(["--redis-url", url]).redis_url == url


def test_the_password_file_joins_the_url_and_keeps_the_acl_user(password_file):
    cfg = load(["--redis-url", "redis://llmesh@r:6379/0", "--redis-password-file", password_file])
    assert cfg.redis_url == with_password("redis://llmesh@r:6379/0", SECRET)
    assert redact_url(cfg.redis_url) == "redis://llmesh:***@r:6379/0"
    env = {"REDIS_URL": "redis://r/0", "LLMESH_KVSTORE_REDIS_PASSWORD_FILE": password_file}
    assert has_credentials(load([], env).redis_url)
    assert dataclasses.replace(cfg).redis_url == cfg.redis_url  # rebuilding the config changes nothing


def test_bad_password_files_are_usage_errors_that_never_show_a_password(tmp_path, password_file, capsys):
    def err(url: str, path: str) -> str:
        return usage_error(["--redis-url", url, "--redis-password-file", path], capsys)

    empty = tmp_path / "empty"
    empty.write_text("\n")
    assert "is empty" in err("redis://r/0", str(empty))
    assert str(tmp_path / "missing") in err("redis://r/0", str(tmp_path / "missing"))
    conflict = err("redis://:other-pw@r/0", password_file)
    assert "keep one" in conflict and "other-pw" not in conflict and SECRET not in conflict
    assert "need --redis-url" in usage_error(["--redis-password-file", password_file], capsys)


def test_tls_files_need_rediss_and_exist(tmp_path, capsys):
    def err(url: str, *tls: str) -> str:
        return usage_error(["--redis-url", url, *tls], capsys)

    certs = make_certs(tmp_path)
    cfg = load(["--redis-url", "rediss://:pw@r:6380/0", "--redis-tls-ca", certs.ca])
    assert cfg.redis_url.startswith("rediss://:pw@r:6380/0?ssl_ca_certs=")
    assert "rediss://" in err("redis://:pw@r/0", "--redis-tls-ca", certs.ca)
    assert "no such file" in err("rediss://:pw@r/0", "--redis-tls-ca", str(tmp_path / "nope.pem"))
    assert "go together" in err("rediss://:pw@r/0", "--redis-tls-cert", certs.cert)


def test_passwords_in_a_query_are_masked_too():
    assert redact_url("unix:///run/redis.sock?db=0&password=pw") == "unix:///run/redis.sock?db=0&password=***"
    assert redact_url("redis://u:p%40ss@h:1/0") == "redis://u:***@h:1/0"


# -- a real redis-server ------------------------------------------------------------------------


def test_a_wrong_password_is_redis_down_a_miss_never_an_error(redis_server, caplog):
    redis_server.client().set(redis_key(k(1)), b"x")
    tier = RedisTier(with_password(redis_server.anonymous_url, "wrong"), timeout_s=0.2, retry_after_s=30)
    with caplog.at_level(logging.WARNING):
        assert tier.get(k(1)) is None
        assert not tier.put(k(2), b"y") and tier.contains_many([k(1)]) == [False]
    assert tier.breaker.is_open and tier.stats().errors == 1 and tier.stats().misses == 1
    assert "refused the credentials" in caplog.text and "wrong" not in caplog.text
    tier.close()
    anonymous = RedisTier(redis_server.anonymous_url, timeout_s=0.2)  # NOAUTH: the same
    assert anonymous.get(k(1)) is None and anonymous.stats().errors == 1
    anonymous.close()


def test_an_acl_user_reads_and_writes_its_own_keys_only(tmp_path):
    with RedisServer(tmp_path, user="llmesh") as server:
        assert server.url.startswith("redis://llmesh:")
        tier = RedisTier(server.url, timeout_s=0.5, ttl_s=60)
        assert tier.put(k(1), b"blob") and tier.get(k(1)) == b"blob"
        assert tier.contains_many([k(1), k(2)]) == [True, False] and tier.delete(k(1))
        assert tier.stats().errors == 0
        import redis

        as_user = redis.Redis.from_url(server.url)
        with pytest.raises(redis.exceptions.NoPermissionError):
            as_user.get("not-llmesh")  # the ACL confines it to llmesh:* keys
        as_user.close()
        tier.close()


def _tls_server(tmp_path) -> tuple[RedisServer, object]:
    certs = make_certs(tmp_path)
    return RedisServer(tmp_path / "redis", tls=certs), certs


def test_rediss_with_the_mesh_ca_works_and_a_wrong_ca_is_a_miss(tmp_path):
    server, certs = _tls_server(tmp_path)
    with server:
        cfg = load(["--redis-url", server.url, "--redis-tls-ca", certs.ca, "--memory-bytes", "0"])
        tier = RedisTier(cfg.redis_url, timeout_s=1.0)
        assert tier.put(k(1), b"over tls") and tier.get(k(1)) == b"over tls"
        tier.close()
        wrong = load(["--redis-url", server.url, "--redis-tls-ca", certs.other_cert]).redis_url
        untrusted = RedisTier(wrong, timeout_s=1.0)
        assert untrusted.get(k(1)) is None and untrusted.stats().errors == 1
        untrusted.close()
