"""Structured logs: one JSON object per line with the core fields and the caller's extras."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.logging_setup import parse_level, setup_logging


@pytest.fixture
def restore_root() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    logging.captureWarnings(False)


def test_json_lines_have_core_fields_and_extras(restore_root) -> None:
    out = io.StringIO()
    setup_logging("scheduler", "debug", stream=out)
    log = logging.getLogger("scheduler_svc.servicer")
    log.info("request %s finished", "r1", extra={"request_id": "r1", "tokens": 17, "path": Path("/x")})
    log.debug("details", extra={"service": "spoofed"})
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        log.exception("failed")
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert len(lines) == 3
    first = lines[0]
    assert first["level"] == "INFO" and first["service"] == "scheduler"
    assert first["logger"] == "scheduler_svc.servicer" and first["msg"] == "request r1 finished"
    assert first["request_id"] == "r1" and first["tokens"] == 17 and first["path"] == "/x"
    assert first["ts"].endswith("Z") and "T" in first["ts"]
    assert lines[1]["service"] == "scheduler" and lines[1]["extra_service"] == "spoofed"
    assert lines[2]["level"] == "ERROR" and "RuntimeError: boom" in lines[2]["exc"]


def test_level_filters_and_setup_is_idempotent(restore_root) -> None:
    first, second = io.StringIO(), io.StringIO()
    setup_logging("worker", "info", stream=first)
    setup_logging("worker", "WARNING", stream=second)  # replaces the first handler
    logging.getLogger("x").info("dropped")
    logging.getLogger("x").warning("kept")
    assert first.getvalue() == ""
    assert [json.loads(line)["msg"] for line in second.getvalue().splitlines()] == ["kept"]


def test_text_format(restore_root) -> None:
    out = io.StringIO()
    setup_logging("gateway", "info", fmt="text", stream=out)
    logging.getLogger("gw").info("hello", extra={"port": 8000})
    line = out.getvalue().strip()
    assert "INFO" in line and "gateway gw: hello" in line and line.endswith("port=8000")


def test_bad_level_and_format() -> None:
    assert parse_level("warning") == logging.WARNING
    with pytest.raises(ValueError):
        parse_level("loud")
    with pytest.raises(ValueError):
        setup_logging("x", "info", fmt="xml")  # type: ignore[arg-type]
