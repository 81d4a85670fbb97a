"""Structured logging for every service: one JSON object per line on stderr.

    setup_logging("scheduler", "info")
    log = logging.getLogger(__name__)
    log.info("request finished", extra={"request_id": rid, "tokens": 17})

gives

    {"ts": "2025-01-01T12:00:00.123Z", "level": "INFO", "service": "scheduler",
     "logger": "scheduler_svc.servicer", "msg": "request finished",
     "request_id": "r1", "tokens": 17}

JSON lines because the services run under Kubernetes / docker where logs are
collected and queried by field; `fmt="text"` gives one readable line per
record for local runs.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import IO, Any, Literal

# Attributes every LogRecord has; anything else on a record came from `extra`.
_RECORD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}
_CORE_KEYS = ("ts", "level", "service", "logger", "msg")
# Marks the handler setup_logging installs, so that a second call replaces it.
_HANDLER_FLAG = "_llmesh_handler"


def _extras(record: logging.LogRecord) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in record.__dict__.items():
        if key in _RECORD_ATTRS or key.startswith("_"):
            continue
        # An extra named like a core field must not overwrite it.
        out[f"extra_{key}" if key in _CORE_KEYS else key] = value
    return out


def _timestamp(record: logging.LogRecord) -> str:
    ts = datetime.fromtimestamp(record.created, tz=UTC).isoformat(timespec="milliseconds")
    return ts.replace("+00:00", "Z")


class JsonFormatter(logging.Formatter):
    """Formats a record as one JSON object: ts, level, service, logger, msg, extras, exc."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": _timestamp(record),
            "level": record.levelname,
            "service": self.service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update(_extras(record))
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        # default=str: an extra that JSON cannot encode (a Path, an enum) is logged as text, never raises.
        return json.dumps(out, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """One human-readable line: ts LEVEL service logger: msg key=value ..."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        extras = " ".join(f"{k}={v}" for k, v in _extras(record).items())
        line = (
            f"{_timestamp(record)} {record.levelname:<7} {self.service} {record.name}: {record.getMessage()}"
        )
        if extras:
            line = f"{line} {extras}"
        if record.exc_info:
            line = f"{line}\n{self.formatException(record.exc_info)}"
        return line


def parse_level(level: str | int) -> int:
    if isinstance(level, int):
        return level
    value = logging.getLevelName(level.strip().upper())
    if not isinstance(value, int):
        raise ValueError(f"unknown log level {level!r}")
    return value


def setup_logging(
    service: str,
    level: str | int = "INFO",
    *,
    fmt: Literal["json", "text"] = "json",
    stream: IO[str] | None = None,
) -> logging.Handler:
    """Route all logging (root logger, warnings) through one structured handler.

    Idempotent: calling it again replaces the handler it installed before
    (and leaves handlers others added, e.g. pytest's capture, alone).
    """
    if fmt not in ("json", "text"):
        raise ValueError(f"log format must be json or text, got {fmt!r}")
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter(service) if fmt == "json" else TextFormatter(service))
    setattr(handler, _HANDLER_FLAG, True)
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, _HANDLER_FLAG, False)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(parse_level(level))
    logging.captureWarnings(True)
    return handler
