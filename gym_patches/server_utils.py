"""What every Gym server process shares: the base server class and ``ServerClient``.

A server is an aiohttp app in its own process. ``GymServer.build_app`` adds the
server's routes, ``/health``, and, when checkpointing is on and the server has a
participant, the checkpoint control routes. Its data-plane work is paced: at most a
turn's share of requests, outgoing sends and replies run per turn of its event loop
(``gym_patches.utils.pacing``), so the control routes, which are not paced, are served
between them (docs/design.md §4.5, "Paced turns").
"""

from __future__ import annotations

import asyncio
import json as jsonlib
from dataclasses import dataclass
from typing import Any, ClassVar

import aiohttp
import yaml
from aiohttp import web

from gym_patches.checkpoint.participant import CheckpointParticipant
from gym_patches.config import SERVER_KIND, GymConfigError, GymGlobalConfig, ServerInstanceConfig, parse_gym_config
from gym_patches.checkpoint.wire import CHECKPOINT_ROUTE_PREFIX
from gym_patches.utils.collector import (
    FullCollections,
    freeze_startup_objects,
    restore_collections,
    young_collections_only,
)
from gym_patches.server_configs import ServerConfigBase, parse_instance_config
from gym_patches.utils.pacing import TurnPacer
from gym_patches.wire_models import ACTIVITY_ROUTE, REPLAY_STATS_ROUTE


# Largest request body any Gym server reads (aiohttp's client_max_size).
MAX_REQUEST_BODY_BYTES = 64 * 1024 * 1024
# Routes served at once, however busy the server: checkpoint control, liveness, the activity and replay reports.
UNPACED_ROUTE_PREFIXES = (CHECKPOINT_ROUTE_PREFIX, "/health", ACTIVITY_ROUTE, REPLAY_STATS_ROUTE)


@dataclass(frozen=True)
class ServerInstance:
    name: str
    server_type: str
    implementation: str
    url: str

    @property
    def kind(self) -> str:
        return SERVER_KIND[self.server_type]


@dataclass(frozen=True)
class ServerResponse:
    status: int
    body: Any  # parsed JSON, or None
    text: str
    cookies: dict[str, str]
    headers: dict[str, str]


class ServerCallError(RuntimeError):
    """A call to another Gym server failed; names the server and route."""

    def __init__(self, server: str, path: str, status: int, body: Any):
        super().__init__(f"Gym server {server!r} {path} returned {status}: {body}")
        self.server, self.path, self.status, self.body = server, path, status, body


def new_client_session() -> aiohttp.ClientSession:
    """A client session with no total timeout and no cap on open connections."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None))


class ServerClient:
    """Resolves Gym server names to URLs and calls them over HTTP.

    With a ``pacer`` (a Gym server's own calls) a call waits for its share of a turn before it
    encodes and sends and again before it decodes the reply, so a burst of calls cannot fill one
    turn of the caller's event loop."""

    def __init__(self, global_config: GymGlobalConfig, session: aiohttp.ClientSession | None = None,
                 pacer: TurnPacer | None = None):
        self.global_config = global_config
        self._session = session
        self._owns_session = session is None
        self.pacer = pacer

    @classmethod
    async def load_from_global_config(cls, head_url: str, *, timeout_s: float = 30.0) -> "ServerClient":
        """Read the resolved config from a deployment's head server."""
        session = new_client_session()
        try:
            async with session.get(
                f"{head_url.rstrip('/')}/global_config_dict_yaml",
                timeout=aiohttp.ClientTimeout(total=timeout_s),
            ) as resp:
                if resp.status != 200:
                    raise GymConfigError(f"head server {head_url} returned {resp.status}")
                data = yaml.safe_load(await resp.text())
        except BaseException:
            await session.close()
            raise
        client = cls(parse_gym_config(data), session=session)
        client._owns_session = True
        return client

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # No total timeout by default: model calls may be held across a checkpoint. No connection
            # limit either (aiohttp's default is 100): rollouts parked for a checkpoint keep their
            # connections open, and the checkpoint's own control calls must still get through.
            self._session = new_client_session()
            self._owns_session = True
        return self._session

    def instances(self) -> list[ServerInstance]:
        return [
            ServerInstance(i.name, i.server_type, i.implementation, i.url)
            for i in self.global_config.instances.values()
        ]

    def url_for(self, server_name: str) -> str:
        return self.global_config.instance(server_name).url

    async def request(
        self,
        method: str,
        server_name: str,
        path: str,
        *,
        json: Any = None,
        cookies: dict[str, str] | None = None,
        headers: dict[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> ServerResponse:
        url = self.url_for(server_name) + path
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        pacer = self.pacer
        try:
            if pacer is not None:
                await pacer.turn()
            async with self.session.request(
                method, url, json=json, cookies=cookies, headers=headers, timeout=timeout
            ) as resp:
                raw = await resp.read()
                if pacer is not None:
                    await pacer.turn()
                text = raw.decode(resp.get_encoding(), errors="replace")
                try:
                    body = jsonlib.loads(text) if text else None
                except ValueError:
                    body = None
                return ServerResponse(
                    status=resp.status,
                    body=body,
                    text=text,
                    cookies={k: v.value for k, v in resp.cookies.items()},
                    headers=dict(resp.headers),
                )
        except aiohttp.ClientError as exc:
            raise ServerCallError(server_name, path, 0, f"connection failed: {exc!r}") from exc

    async def post(self, server_name: str, path: str, json: Any = None, **kw: Any) -> ServerResponse:
        return await self.request("POST", server_name, path, json=json, **kw)

    async def get(self, server_name: str, path: str, **kw: Any) -> ServerResponse:
        return await self.request("GET", server_name, path, **kw)

    async def close(self) -> None:
        if self._session is not None and self._owns_session and not self._session.closed:
            await self._session.close()


def json_error(status: int, code: str, detail: str) -> web.Response:
    """The one error body shape every Gym route uses."""
    return web.json_response({"error": {"code": code, "detail": detail}}, status=status)


class GymServer:
    """Base class of every Gym server. Subclasses set ``config_model`` and add routes."""

    server_type: ClassVar[str]
    config_model: ClassVar[type[ServerConfigBase]] = ServerConfigBase

    def __init__(self, instance: ServerInstanceConfig, global_config: GymGlobalConfig):
        self.instance = instance
        self.name = instance.name
        self.global_config = global_config
        self.config = self.validate_instance_config(instance)
        # the data-plane steps one turn of this server's event loop runs (requests, calls, replies)
        self.pacer = TurnPacer()
        self.full_collections = FullCollections()  # the only full gc walks (``utils.collector``)
        self._young_only = False  # this server holds the process's young-only collection
        self.client = ServerClient(global_config, pacer=self.pacer)
        self.participant: CheckpointParticipant | None = None

    @classmethod
    def validate_instance_config(cls, instance: ServerInstanceConfig) -> ServerConfigBase:
        """Parse an instance's implementation config; errors name the full key."""
        return parse_instance_config(cls.config_model, instance)

    # -- for subclasses ----------------------------------------------------
    def setup_routes(self, app: web.Application) -> None:
        raise NotImplementedError(f"{type(self).__name__} must add its routes")

    def middlewares(self) -> list[Any]:
        return []

    def make_participant(self) -> CheckpointParticipant | None:
        """The checkpoint participant of this server, or None if it takes no part."""
        return None

    @classmethod
    def checkpoint_mode_label(cls) -> str:
        """``saves`` / ``restart-only`` / ``stateless`` for the launcher's table."""
        return "saves"

    async def on_startup(self) -> None:
        pass

    async def on_cleanup(self) -> None:
        pass

    # -- app -------------------------------------------------------------
    def build_app(self) -> web.Application:
        if self.global_config.checkpoint.enabled:
            self.participant = self.make_participant()
        app = web.Application(middlewares=[self._paced, *self.middlewares()], client_max_size=MAX_REQUEST_BODY_BYTES)
        app.router.add_get("/health", self._health)
        self.setup_routes(app)
        if self.participant is not None:
            from gym_patches.checkpoint.control import ParticipantControlPlane
            from gym_patches.checkpoint.storage import build_writer

            settings = self.global_config.checkpoint
            ParticipantControlPlane(
                self.participant,
                instance=self.name,
                auth_token=settings.control_auth_token or "",
                writer=build_writer(settings.storage_writer),  # this server's own instance
                lease_grace_seconds=settings.lease_grace_seconds,
                pacer=self.pacer,
            ).install(app)

        async def _startup(_: web.Application) -> None:
            await self.on_startup()
            freeze_startup_objects()  # imports and config stay out of every later full collection
            young_collections_only()
            self._young_only = True
            self.full_collections.start()

        async def _cleanup(_: web.Application) -> None:
            try:
                await self.full_collections.stop()
                if self._young_only:  # a startup that failed before it took no hold to give back
                    self._young_only = False
                    restore_collections()
                await self.on_cleanup()
            finally:
                await self.client.close()

        app.on_startup.append(_startup)
        app.on_cleanup.append(_cleanup)
        return app

    @web.middleware
    async def _paced(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """A data-plane request's handler starts in its share of a turn, its body read first (a body
        too large or of unknown length is left to the handler, which reports it in its own shape).
        Control routes and ``/health`` are never paced: they are what the pacing keeps prompt."""
        if request.path.startswith(UNPACED_ROUTE_PREFIXES):
            return await handler(request)
        length = request.content_length
        if request.body_exists and length is not None and length <= MAX_REQUEST_BODY_BYTES:
            await request.read()  # kept by aiohttp for the handler's own read
        await self.pacer.turn()
        return await handler(request)

    async def _health(self, _: web.Request) -> web.Response:
        return web.json_response({"name": self.name, "server_type": self.server_type, "ok": True})


async def cancel_and_wait(tasks: "set[asyncio.Task[Any]] | list[asyncio.Task[Any]]") -> None:
    """Cancel tasks this server owns and wait until they are gone."""
    tasks = [t for t in tasks if not t.done()]
    for t in tasks:
        t.cancel()
    if tasks:
        await asyncio.gather(*tasks, return_exceptions=True)
