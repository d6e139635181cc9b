"""The OpenAI-style HTTP front both generation backends serve (chat completions, models, health)."""

from __future__ import annotations

from typing import Awaitable, Callable

from aiohttp import web

from gym_patches.checkpoint.cuts import CUT_FETCH_ROUTE, CUT_ROUTE

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
MAX_BODY_BYTES = 64 * 1024 * 1024


async def serve_openai_routes(host: str, port: int, *, chat: Handler, models: Handler, health: Handler,
                              cuts: tuple[Handler, Handler] | None = None,
                              reuse_port: bool = False) -> tuple[web.AppRunner, str]:
    """Serve the routes on ``host:port`` (0: any free port); returns the runner (its owner
    cleans it up) and the base URL ending in ``/v1``. ``cuts`` (pin, fetch) serves generation
    cuts (``gym_patches.checkpoint.cuts``) on ``/v1/ng-cuts`` and ``/v1/ng-cuts/fetch``. ``reuse_port``:
    the port is kept for this server by the driver's ``PortHold`` (``gym_patches.utils.processes``)."""
    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app.router.add_post("/v1/chat/completions", chat)
    if cuts is not None:
        app.router.add_post("/v1" + CUT_ROUTE, cuts[0])
        app.router.add_post("/v1" + CUT_FETCH_ROUTE, cuts[1])
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port, reuse_port=reuse_port or None).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner, f"http://{host}:{runner.addresses[0][1]}/v1"
