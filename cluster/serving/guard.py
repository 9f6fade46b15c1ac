"""The ingress's gate: API keys and the request body limit, checked before a route reads the body.

The keys are `serving.api_keys` plus those in the file `SPECSERVE_API_KEYS_FILE` names; with none the service is
open. With keys, a request needs `Authorization: Bearer KEY` or gets a 401 with OpenAI's error body and
`WWW-Authenticate: Bearer`; `/healthz` and the OpenAPI documents stay open, `/metrics` needs a key only with
`serving.protect_metrics`, `/v1/specserve/export` unless `serving.protect_export` is off. Keys are compared by
SHA-256 digest in constant time and never logged or echoed. A body over `serving.max_body_bytes` gets a 413
before it is parsed. `RequestGuard` is a plain ASGI middleware (a `BaseHTTPMiddleware` would get in the way of
streaming and client disconnects) that reads its `GuardPolicy` from `app.state.guard`, set when the ingress's
replica starts, and lets everything through until then. Details: docs/reliability.md.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from cluster.serving.errors import error_body

logger = logging.getLogger(__name__)

API_KEYS_FILE_ENV = "SPECSERVE_API_KEYS_FILE"
OPEN_PATHS = frozenset({"/healthz", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})
METRICS_PATH = "/metrics"
EXPORT_PATH = "/v1/specserve/export"


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


def read_key_file(path: str | Path) -> list[str]:
    """Keys in a file, one per line; blank lines and lines starting with '#' are skipped."""
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise ValueError(f"{API_KEYS_FILE_ENV}: cannot read the key file {str(path)!r}: {err.strerror}") from None
    keys = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    if not keys:
        raise ValueError(f"{API_KEYS_FILE_ENV}: the key file {str(path)!r} holds no key")
    return keys


def configured_keys(config_keys: Iterable[str], environ: Mapping[str, str] = os.environ) -> list[str]:
    """`serving.api_keys` plus the keys of the file `SPECSERVE_API_KEYS_FILE` names (if it is set)."""
    keys = list(config_keys)
    path = environ.get(API_KEYS_FILE_ENV)
    if path:
        keys += read_key_file(path)
    return keys


@dataclass(frozen=True)
class GuardPolicy:
    """What the gate enforces. `digests`: SHA-256 of every accepted key (empty: no authentication)."""

    digests: tuple[bytes, ...] = field(default=(), repr=False)
    protect_metrics: bool = False
    protect_export: bool = True
    max_body_bytes: int | None = None

    @classmethod
    def from_settings(cls, serving, environ: Mapping[str, str] = os.environ) -> GuardPolicy:
        """From `SpecServeConfig.serving` and the environment (the key file)."""
        keys = configured_keys(serving.api_keys, environ)
        return cls(tuple(_digest(k.encode()) for k in dict.fromkeys(keys)), serving.protect_metrics,
                   serving.protect_export, serving.max_body_bytes)

    @property
    def auth(self) -> bool:
        return bool(self.digests)

    def needs_key(self, path: str) -> bool:
        if not self.auth or path in OPEN_PATHS:
            return False
        if path == METRICS_PATH:
            return self.protect_metrics
        if path == EXPORT_PATH:
            return self.protect_export
        return True

    def accepts(self, authorization: bytes | None) -> bool:
        """Whether an `Authorization` header value carries an accepted key; constant time in the key."""
        if not authorization:
            return False
        scheme, _, key = authorization.strip().partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        given = _digest(key.strip())
        ok = False
        for digest in self.digests:  # no early exit: every accepted key is compared
            ok |= hmac.compare_digest(given, digest)
        return ok


class BodyTooLarge(Exception):
    """The streamed body passed the limit."""


class RequestGuard:
    """ASGI middleware: 401 without an accepted key where one is needed, 413 past the body limit."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        policy = getattr(getattr(scope.get("app"), "state", None), "guard", None)
        if scope["type"] != "http" or policy is None:
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or ())
        path, root = scope.get("path", ""), scope.get("root_path", "")
        path = path[len(root):] if root and path.startswith(root) else path  # the route's own path (a prefix)
        if policy.needs_key(path) and not policy.accepts(headers.get(b"authorization")):
            logger.warning("%s %s: refused, %s API key", scope.get("method"), path,
                           "wrong" if b"authorization" in headers else "no")
            return await _reply(send, 401, "Incorrect or missing API key: send `Authorization: Bearer <key>`.",
                                "invalid_api_key", {"www-authenticate": "Bearer"})
        limit = policy.max_body_bytes
        if limit is None:
            return await self.app(scope, receive, send)
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return await _too_large(send, limit)
        started, seen = False, 0

        async def counted_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge()
            return message

        async def tracked_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except BodyTooLarge:
            if started:
                raise
            await _too_large(send, limit)


async def _too_large(send, limit: int) -> None:
    await _reply(send, 413, f"request body is larger than the limit of {limit} bytes", "request_too_large")


async def _reply(send, status: int, message: str, code: str, headers: dict[str, str] | None = None) -> None:
    body = json.dumps(error_body(message, type="invalid_request_error", code=code)).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})
