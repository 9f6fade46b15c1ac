"""Client mistakes: `APIError` (a 4xx) and OpenAI's error body `{"error": {"message", "type", "param", "code"}}`.

pydantic's and FastAPI's validation errors map to the same body, `param` naming the offending field. Nothing here
imports Ray or torch.
"""

from __future__ import annotations

from typing import Any

from cluster.serving.fields import UNKNOWN, UNSUPPORTED


class APIError(Exception):
    """A request the server refuses; rendered as an OpenAI error body with HTTP `status`."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(message: str, *, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    """The 400 for pydantic/FastAPI validation errors: the first error's field becomes `param`.

    FastAPI locations start with "body" (or "query", "header"); that prefix is dropped, and list indices are
    kept (`messages.0.content`). A body that is not valid JSON maps to param None, code "invalid_json".
    """
    if not errors:
        return APIError("invalid request", code="invalid_request")
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part not in ("body", "query", "header")]
    if first.get("type") == "json_invalid":
        return APIError(f"request body is not valid JSON: {first.get('msg', '')}", code="invalid_json")
    # pydantic reports union members as extra location parts ("str", "list[str]"); keep the field path only.
    loc = [part for part in loc if not _is_type_name(part)]
    param = ".".join(loc) or None
    message = first.get("msg", "invalid value")
    if param:
        message = f"{param}: {message}"
    extra = len(errors) - 1
    if extra:
        message += f" (and {extra} more error{'s' if extra > 1 else ''})"
    kind = first.get("type")
    if kind == "extra_forbidden":
        message = f"{param}: unknown parameter (neither in OpenAI's schema nor a specserve extension)"
    code = {"missing": "missing_required_parameter", "extra_forbidden": UNKNOWN, UNSUPPORTED: UNSUPPORTED}.get(
        kind, "invalid_value")
    return APIError(message, param=param, code=code)


def _is_type_name(part: str) -> bool:
    return part in ("str", "int", "float", "bool", "list[str]", "list[int]", "none") or part.startswith(
        ("list[", "function-", "constrained-")
    )
