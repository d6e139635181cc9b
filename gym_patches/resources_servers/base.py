"""``SimpleResourcesServer``: the HTTP side shared by every resources server.

Routes: ``POST /seed_session`` (binds a new session to the episode named by
``_ng_rollout_id`` and sets the ``ng_session`` cookie), ``POST /<tool>``,
``POST /verify`` and ``POST /close_session`` (both end the session).
Subclasses only supply the session-state hooks; the session table and the
checkpoint rules live in :class:`ResourcesParticipant`.

``checkpoint_mode`` defaults to ``restart_only`` so a server that says
nothing never claims to save what it cannot; ``replayable: true`` in its config
declares its tools replayable (a restart-only one then runs as ``replayed``).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import uuid
from typing import Any, Awaitable, Callable, ClassVar

from aiohttp import web
from pydantic import ValidationError

from gym_patches.checkpoint.errors import CheckpointError
from gym_patches.checkpoint.identity import EpisodeId
from gym_patches.checkpoint.resources import ResourcesParticipant, SessionStateHooks, UnknownSessionError
from gym_patches.checkpoint.wire import ResourcesCheckpointMode
from gym_patches.config import GymConfigError, GymGlobalConfig, ServerInstanceConfig
from gym_patches.resources_servers import ToolError
from gym_patches.server_configs import ResourcesServerConfig, ServerConfigBase
from gym_patches.server_utils import GymServer, json_error
from gym_patches.wire_models import (
    ROLLOUT_ID_FIELD,
    SESSION_COOKIE,
    SeedSessionReply,
    SeedSessionRequest,
    VerifyReply,
    VerifyRequest,
)

logger = logging.getLogger(__name__)

RESERVED_ROUTES = frozenset({"seed_session", "verify", "close_session", "health"})
MODE_LABELS: dict[str, str] = {"exported": "saves", "stateless": "stateless", "restart_only": "restart-only",
                               "replayed": "replayed"}

Handler = Callable[[web.Request], Awaitable[web.Response]]


def _field_errors(exc: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '<body>'}: {e['msg']}" for e in exc.errors())


class _BadRequest(Exception):
    """Turned into a 4xx JSON error by ``_guarded``."""

    def __init__(self, status: int, code: str, detail: str):
        super().__init__(detail)
        self.status, self.code, self.detail = status, code, detail


class SimpleResourcesServer(GymServer, SessionStateHooks):
    """Base of resources servers: one state object per live session."""

    server_type: ClassVar[str] = "resources_servers"
    config_model: ClassVar[type[ServerConfigBase]] = ResourcesServerConfig
    checkpoint_mode: ClassVar[ResourcesCheckpointMode] = "restart_only"
    # False for a server whose exported session states name what only its process has (a local
    # path, a handle): its sessions then never move to another replica (docs/design.md §5.7).
    records_portable: ClassVar[bool] = True
    tool_schemas: ClassVar[list[dict[str, Any]]] = []

    def __init__(self, instance: ServerInstanceConfig, global_config: GymGlobalConfig):
        super().__init__(instance, global_config)
        self.tool_names = frozenset(t["name"] for t in self.tool_schemas)
        clash = sorted(self.tool_names & RESERVED_ROUTES)
        if clash:
            raise GymConfigError(f"{self.name}: tool name(s) {clash} clash with the session routes")
        unknown = sorted(set(self.config.tool_delay_s) - self.tool_names)
        if unknown:
            raise GymConfigError(
                f"{self.name}.tool_delay_s names unknown tool(s) {unknown}; tools: {sorted(self.tool_names)}"
            )
        if self.checkpoint_mode == "exported" and (
            type(self).export_session_state is SimpleResourcesServer.export_session_state
            or type(self).restore_session_state is SimpleResourcesServer.restore_session_state
        ):
            raise GymConfigError(
                f"{type(self).__name__} declares checkpoint_mode 'exported' but does not implement "
                "export_session_state and restore_session_state"
            )
        # The session table exists with or without checkpointing; the control plane
        # is wired to it only when checkpoint.enabled.
        self.sessions = ResourcesParticipant(self.checkpoint_mode, self, instance=self.name,
                                             replayable=self.config.replayable)

    # -- hooks for subclasses ------------------------------------------------
    async def seed_state(self, row: dict[str, Any]) -> Any:
        """Build a session's state from a task row; raise ValueError for a bad row."""
        raise NotImplementedError

    async def call_tool(self, state: Any, name: str, arguments: dict[str, Any]) -> str:
        """Run one tool; domain errors are outputs, malformed calls raise ToolError."""
        raise NotImplementedError

    async def verify_state(self, state: Any, row: dict[str, Any], response: dict[str, Any]) -> float:
        """The reward of the finished session; raise ValueError for a bad row."""
        raise NotImplementedError

    async def close_state(self, state: Any) -> None:
        """Free the state's resources; default: nothing to free."""

    def export_session_state(self, state: Any) -> dict[str, Any]:
        raise NotImplementedError(f"{type(self).__name__} cannot export session state")

    def restore_session_state(self, data: dict[str, Any]) -> Any:
        raise NotImplementedError(f"{type(self).__name__} cannot restore session state")

    # -- GymServer -------------------------------------------------------------
    @classmethod
    def checkpoint_mode_label(cls) -> str:
        return MODE_LABELS[cls.checkpoint_mode]

    def make_participant(self) -> ResourcesParticipant:
        return self.sessions

    async def on_cleanup(self) -> None:
        await self.sessions.shutdown()

    def setup_routes(self, app: web.Application) -> None:
        app.router.add_post("/seed_session", self._guarded(self._seed_session))
        app.router.add_post("/verify", self._guarded(self._verify))
        app.router.add_post("/close_session", self._guarded(self._close_session))
        app.router.add_post("/{tool_name}", self._guarded(self._tool))

    # -- routes ------------------------------------------------------------------
    def _guarded(self, handler: Handler) -> Handler:
        """Map the errors a session route can raise to the shared JSON error shape."""

        @functools.wraps(handler)
        async def route(request: web.Request) -> web.Response:
            try:
                return await handler(request)
            except _BadRequest as exc:
                return json_error(exc.status, exc.code, exc.detail)
            except UnknownSessionError as exc:
                return json_error(400, "unknown_session", str(exc))
            except CheckpointError as exc:
                return json_error(exc.status, exc.code, exc.detail)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                logger.exception("%s %s failed", self.name, request.path)
                return json_error(500, "internal_error", f"{self.name} {request.path}: {type(exc).__name__}: {exc}")

        return route

    async def _json_body(self, request: web.Request, *, code: str, empty: Any = ...) -> Any:
        raw = await request.read()
        if not raw.strip() and empty is not ...:
            return empty
        try:
            return json.loads(raw) if raw else None
        except (ValueError, UnicodeDecodeError):
            raise _BadRequest(422, code, f"{self.name} {request.path}: body is not valid JSON") from None

    async def _seed_session(self, request: web.Request) -> web.Response:
        data = await self._json_body(request, code="invalid_request")
        if not isinstance(data, dict):
            raise _BadRequest(422, "invalid_request", f"{self.name} /seed_session: body must be a JSON object")
        if not data.get(ROLLOUT_ID_FIELD):
            raise _BadRequest(
                400, "rollout_id_required", f"{self.name} /seed_session: {ROLLOUT_ID_FIELD} is required"
            )
        try:
            body = SeedSessionRequest.model_validate(data)
        except ValidationError as exc:
            raise _BadRequest(422, "invalid_request", f"{self.name} /seed_session: {_field_errors(exc)}") from None
        try:
            episode = EpisodeId.from_capture_key(body.ng_rollout_id)
        except ValidationError as exc:
            raise _BadRequest(
                422, "invalid_request", f"{self.name} /seed_session: {ROLLOUT_ID_FIELD}: {_field_errors(exc)}"
            ) from None
        async with self.sessions.seeding(episode):
            try:
                state = await self.seed_state(body.row)
            except ValueError as exc:
                raise _BadRequest(422, "invalid_request", f"{self.name} /seed_session: row: {exc}") from None
            session_id = uuid.uuid4().hex
            try:
                self.sessions.add_session(session_id, episode, state)
            except BaseException:
                await self.close_state(state)
                raise
        reply = web.json_response(SeedSessionReply(session_id=session_id).model_dump())
        reply.set_cookie(SESSION_COOKIE, session_id, path="/", httponly=True, samesite="Lax")
        return reply

    async def _tool(self, request: web.Request) -> web.Response:
        name = request.match_info["tool_name"]
        if name not in self.tool_names:
            raise _BadRequest(
                404, "unknown_tool", f"{self.name} has no tool {name!r}; tools: {', '.join(sorted(self.tool_names))}"
            )
        arguments = await self._json_body(request, code="invalid_arguments", empty={})
        if not isinstance(arguments, dict):
            raise _BadRequest(
                422, "invalid_arguments", f"{self.name} /{name}: arguments must be a JSON object"
            )
        async with self.sessions.session_call(request.cookies.get(SESSION_COOKIE)) as session:
            delay = self.config.tool_delay_s.get(name, 0.0)
            if delay:
                await asyncio.sleep(delay)
            try:
                output = await self.call_tool(session.state, name, arguments)
            except ToolError as exc:
                raise _BadRequest(422, "invalid_arguments", f"{self.name} /{name}: {exc}") from None
        return web.json_response({"output": output})

    async def _verify(self, request: web.Request) -> web.Response:
        data = await self._json_body(request, code="invalid_request")
        try:
            body = VerifyRequest.model_validate(data)
        except ValidationError as exc:
            raise _BadRequest(422, "invalid_request", f"{self.name} /verify: {_field_errors(exc)}") from None
        async with self.sessions.session_call(request.cookies.get(SESSION_COOKIE)) as session:
            try:
                reward = float(await self.verify_state(session.state, body.row, body.response))
            except ValueError as exc:
                raise _BadRequest(422, "invalid_request", f"{self.name} /verify: row: {exc}") from None
            await self.sessions.end_session(session)
        return web.json_response(VerifyReply(reward=reward).model_dump())

    async def _close_session(self, request: web.Request) -> web.Response:
        async with self.sessions.session_call(request.cookies.get(SESSION_COOKIE)) as session:
            await self.sessions.end_session(session)
        return web.json_response({"session_id": session.session_id, "closed": True})
