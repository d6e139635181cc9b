"""The HTTP side of the control routes: bearer auth, the body cap, strict parsing, the deadline
check and the mapping of errors to replies (the status-code rule, ``checkpoint.errors``).

Handlers get a validated request model and return a reply body; they never see aiohttp.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from typing import Any, Awaitable, Callable, Mapping

from aiohttp import web
from pydantic import BaseModel, ValidationError

from gym_patches.checkpoint.control.scope import JobFailed
from gym_patches.checkpoint.errors import CheckpointError
from gym_patches.checkpoint.wire import CHECKPOINT_ROUTE_PREFIX, CheckpointRequest

logger = logging.getLogger(__name__)

# Above the largest valid request (MAX_EPISODES_PER_REQUEST ids of the longest form, ~25 MB),
# below the server's 64 MiB aiohttp cap.
MAX_CONTROL_BODY_BYTES = 32 * 1024 * 1024
_BODY_CHUNK = 256 * 1024
_INTERNAL_ERROR = "internal_error"  # 500: a participant raised something that is not a CheckpointError
_DEADLINE_EXEMPT = frozenset({"resume"})  # reopening is always safe, also after a missed deadline

Handler = Callable[[Any], Awaitable[dict[str, Any]]]
Routes = Mapping[str, tuple[type[CheckpointRequest], Handler]]
Route = Callable[[web.Request], Awaitable[web.Response]]


def _internal_error(detail: str) -> web.Response:
    return web.json_response({"error": {"code": _INTERNAL_ERROR, "detail": detail}}, status=500)


def _error(exc: CheckpointError) -> web.Response:
    return web.json_response(exc.to_body(), status=exc.status)


class ControlHttp:
    """Serves ``GET status`` and one ``POST`` per operation under ``CHECKPOINT_ROUTE_PREFIX``."""

    def __init__(self, *, instance: str, auth_token: str, max_body_bytes: int, clock: Callable[[], float]):
        if not isinstance(auth_token, str) or not auth_token:
            raise ValueError(f"checkpoint control of {instance!r} needs a non-empty auth_token")
        if isinstance(max_body_bytes, bool) or not isinstance(max_body_bytes, int) or max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be a positive integer, got {max_body_bytes!r}")
        self._instance = instance
        self._token = auth_token.encode("utf-8")
        self._max_body = max_body_bytes
        self._clock = clock

    def install(self, app: web.Application, status: Callable[[], dict[str, Any]], routes: Routes) -> None:
        app.router.add_get(f"{CHECKPOINT_ROUTE_PREFIX}/status", self._status_route(status))
        for op, (model, handler) in routes.items():
            app.router.add_post(f"{CHECKPOINT_ROUTE_PREFIX}/{op}", self._route(op, model, handler))

    # -- routes ------------------------------------------------------------
    def _status_route(self, status: Callable[[], dict[str, Any]]) -> Route:
        async def route(request: web.Request) -> web.Response:
            if not self._authorized(request):
                return self._unauthorized(request)
            try:
                return web.json_response(status())
            except Exception as exc:
                logger.exception("checkpoint control %s: status failed", self._instance)
                return _internal_error(f"status failed: {type(exc).__name__}: {exc}")

        route.__name__ = "checkpoint_status"
        return route

    def _route(self, op: str, model: type[CheckpointRequest], handler: Handler) -> Route:
        async def route(request: web.Request) -> web.Response:
            if not self._authorized(request):
                return self._unauthorized(request)
            try:
                req = await self._parse(request, op, model)
                if op not in _DEADLINE_EXEMPT:
                    self._check_deadline(op, req.deadline_ts)
                return web.json_response(await handler(req))
            except CheckpointError as exc:
                return _error(exc)
            except JobFailed as exc:  # logged once by its scope, when it happened
                return _internal_error(f"{op} failed: {type(exc.cause).__name__}: {exc.cause}")
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a participant bug: report it, keep serving
                logger.exception("checkpoint control %s: %s failed", self._instance, op)
                return _internal_error(f"{op} failed: {type(exc).__name__}: {exc}")

        route.__name__ = f"checkpoint_{op}"
        return route

    # -- auth --------------------------------------------------------------
    def _authorized(self, request: web.Request) -> bool:
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            return False
        try:
            given = token.strip().encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:
            return False
        return hmac.compare_digest(given, self._token)

    def _unauthorized(self, request: web.Request) -> web.Response:
        logger.warning("checkpoint control %s: rejected %s %s (bad or missing bearer token)",
                       self._instance, request.method, request.path)
        return _error(CheckpointError("missing or invalid bearer token", code="unauthorized"))

    # -- the request -------------------------------------------------------
    def _check_deadline(self, op: str, deadline_ts: float) -> None:
        """A deadline already past would open a lease that has expired: refuse it."""
        late = self._clock() - deadline_ts
        if late >= 0:
            raise CheckpointError(
                f"{op}: invalid request: deadline_ts: must be in the future "
                f"(it passed {late:.3f}s ago by this server's clock)",
                code="invalid_request",
            )

    async def _read_body(self, request: web.Request, op: str) -> bytes:
        """The body, or 413 past ``max_body_bytes`` (read in chunks, never whole)."""
        cap = self._max_body
        too_large = CheckpointError(f"{op}: request body is over the {cap}-byte limit", code="payload_too_large")
        if request.content_length is not None and request.content_length > cap:
            raise too_large  # aiohttp discards the unread rest before closing
        chunks: list[bytes] = []
        size = 0
        while True:
            chunk = await request.content.read(_BODY_CHUNK)
            if not chunk:
                return b"".join(chunks)
            size += len(chunk)
            if size > cap:
                raise too_large
            chunks.append(chunk)

    async def _parse(self, request: web.Request, op: str, model: type[BaseModel]) -> Any:
        raw = await self._read_body(request, op)
        try:
            data = json.loads(raw) if raw else None
        except (ValueError, UnicodeDecodeError):
            raise CheckpointError(f"{op}: request body is not valid JSON", code="invalid_request") from None
        if not isinstance(data, dict):
            raise CheckpointError(f"{op}: request body must be a JSON object", code="invalid_request")
        try:
            # strict: a deadline of "12" or true is a caller bug, not a number.
            return model.model_validate(data, strict=True)
        except ValidationError as exc:
            # loc + msg only: never echo input values back.
            fields = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or '<body>'}: {e['msg']}" for e in exc.errors()
            )
            raise CheckpointError(f"{op}: invalid request: {fields}", code="invalid_request") from None
