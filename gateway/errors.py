"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with the right status.

Everything the gateway rejects or fails at becomes an `APIError`; the handlers
installed by `install_error_handlers` turn it (and FastAPI's validation errors,
Starlette's 404/405, gRPC failures) into that body, so a client never sees a
bare 500 or FastAPI's `{"detail": ...}` for bad input.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
}


# Anthropic's Messages routes answer in Anthropic's shape: {"type": "error", "error": {"type", "message"}}.
_ANTHROPIC_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}


def anthropic_route(path: str) -> bool:
    """Whether a path is one of Anthropic's API (its errors take Anthropic's shape)."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


class APIError(Exception):
    """A failure to answer in OpenAI's error shape."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type: str = "",
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.retry_after_s = retry_after_s  # a 429's Retry-After header (whole seconds)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict[str, Any]:
        default = "api_error" if self.status >= 500 else "invalid_request_error"
        kind = _ANTHROPIC_TYPES.get(self.status, default)
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def body_for(self, path: str) -> dict[str, Any]:
        """The body in the shape of the API `path` belongs to."""
        return self.anthropic_body() if anthropic_route(path) else self.body()

    def response(self, path: str = "") -> Response:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else {}
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(self.retry_after_s)
        # ASCII JSON: a message quoting client input stays encodable whatever that input was.
        return Response(
            json.dumps(self.body_for(path)),
            status_code=self.status,
            headers=headers,
            media_type="application/json",
        )

    def renamed(self, rename: Callable[[str], str]) -> APIError:
        """The same error naming another API's parameters (`rename` maps the chat route's
        name of one to that API's), in `param` and in the message's prefix."""
        if self.param is None or (param := rename(self.param)) == self.param:
            return self
        message = self.message
        if message.startswith(self.param + ":"):
            message = param + message[len(self.param) :]
        err = APIError(self.status, message, param=param, code=self.code, type=self.type)
        err.retry_after_s = self.retry_after_s
        return err


def renamer(*rules: tuple[str, str]) -> Callable[[str], str]:
    """A `rename` for APIError.renamed: the first (regex, replacement) rule that matches applies."""
    compiled = [(re.compile(pattern), repl) for pattern, repl in rules]

    def rename(param: str) -> str:
        for pattern, repl in compiled:
            new, n = pattern.subn(repl, param, count=1)
            if n:
                return new
        return param

    return rename


def bad_request(param: str | None, message: str, code: str | None = None) -> APIError:
    """400 naming the parameter; messages start with it, as the scheduler's do."""
    text = f"{param}: {message}" if param else message
    return APIError(400, text, param=param, code=code or "invalid_value")


def model_not_found(model: str) -> APIError:
    return APIError(
        404,
        f"The model `{model}` does not exist or is not served here.",
        param="model",
        code="model_not_found",
    )


# -- gRPC -> HTTP ---------------------------------------------------------------------

_GRPC_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_value"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_value"),
    grpc.StatusCode.NOT_FOUND: (404, "model_not_found"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "conflict"),
    # The scheduler is full and refused the request before it started (OpenAI's code for its 429s).
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_exceeded"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
    grpc.StatusCode.UNIMPLEMENTED: (501, "not_implemented"),
}
_PARAM_PREFIX = re.compile(r"^([a-z_][a-z0-9_.\[\]]*): ")
RETRY_AFTER_KEY = "retry-after"  # the scheduler's trailing metadata with RESOURCE_EXHAUSTED


def from_grpc(err: grpc.RpcError, scheduler: str) -> APIError:
    """Map a failed scheduler call to an APIError; INVALID_ARGUMENT messages start with the param."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = (err.details() if hasattr(err, "details") else None) or str(code)
    status, err_code = _GRPC_STATUS.get(code, (500, "internal_error"))
    if status == 503:
        return APIError(503, f"The scheduler at {scheduler} is unavailable: {details}", code=err_code)
    if status == 504:
        return APIError(504, f"The request timed out on the scheduler: {details}", code=err_code)
    if status == 500:
        log.error("scheduler call failed", extra={"grpc_code": code.name, "details": details})
        return APIError(500, f"The scheduler failed: {details}", code=err_code)
    if status == 429:
        return APIError(429, details, code=err_code, retry_after_s=retry_after_of(err))
    m = _PARAM_PREFIX.match(details)
    param = m.group(1) if m else None
    if param in ("prompt_token_ids", "prompt"):
        param = "prompt"  # the gateway's callers name the prompt, whatever its form
    return APIError(status, details, param=param, code=err_code)


def retry_after_of(err: grpc.RpcError) -> int | None:
    """The whole seconds of a RESOURCE_EXHAUSTED's `retry-after` trailing metadata (None: absent)."""
    try:
        trailers = err.trailing_metadata() or ()  # type: ignore[attr-defined]
    except Exception:  # not a call's error (a test double, a channel failure)
        return None
    for key, value in trailers:
        if key == RETRY_AFTER_KEY:
            try:
                return max(0, int(value))
            except ValueError:
                return None
    return None


# -- handlers -------------------------------------------------------------------------


# Union members show up in error locations as type tags ("str", "list[int]", "function-after[...]",
# "ChatMessage"); our field names are all snake_case, so anything else is a tag.
_UNION_TAG = re.compile(r"^(str|int|float|bool|none|[a-z-]+\[.*\]|[A-Z]\w*)$")


def _loc_to_param(loc: tuple[Any, ...]) -> str | None:
    out = ""
    for p in loc:
        if p == "body" and not out:
            continue
        if isinstance(p, int):
            out += f"[{p}]"
        elif not _UNION_TAG.match(str(p)):
            out += f".{p}" if out else str(p)
    return out or None


def validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if not errors:
        return APIError(400, "Invalid request body.", code="invalid_request")
    first = errors[0]
    kind = first.get("type", "")
    if kind == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "malformed JSON")
        return APIError(400, f"The request body is not valid JSON: {detail}.", code="invalid_json")
    loc = tuple(first.get("loc", ()))
    param = _loc_to_param(loc)
    msg = str(first.get("msg", "invalid value"))
    if param is None:
        if kind == "missing":
            return APIError(400, "The request needs a JSON object body.", code="invalid_request")
        if kind in ("model_type", "model_attributes_type", "dict_type"):
            return APIError(400, "The request body must be a JSON object.", code="invalid_request")
        return APIError(400, f"Invalid request body: {msg}", code="invalid_request")
    if kind == "missing":
        return APIError(400, f"{param}: this field is required", param=param, code="missing_required")
    if len(errors) > 1:
        msg += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return APIError(400, f"{param}: {msg}", param=param, code="invalid_value")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> Response:
        return exc.response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> Response:
        return validation_error(exc).response(request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 404:
            err = APIError(404, f"No route {request.method} {request.url.path}.", code="not_found")
        elif exc.status_code == 405:
            err = APIError(405, f"Method {request.method} is not allowed on {request.url.path}.")
        else:
            err = APIError(exc.status_code, str(exc.detail))
        return err.response(request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        # A bug, not bad input: log it with its traceback and answer in shape.
        log.exception("unhandled error", extra={"path": request.url.path})
        return APIError(500, "Internal server error.", code="internal_error").response(request.url.path)
