"""Entry point of one Gym server process: ``python -m gym_patches.server_main``.

Reads the resolved deployment config from ``NEMO_GYM_CONFIG_DICT`` and the
instance name from ``NEMO_GYM_CONFIG_PATH`` (``--head`` runs the head server);
serves on the listening socket in ``NEMO_GYM_LISTEN_FD`` when the launcher
bound one for it, else binds the configured host and port itself.
"""

from __future__ import annotations

import argparse
import importlib
import os
import socket
import sys

import yaml
from aiohttp import web

from gym_patches.config import (
    CONFIG_DICT_ENV,
    CONFIG_PATH_ENV,
    LISTEN_FD_ENV,
    GymConfigError,
    GymGlobalConfig,
    parse_gym_config,
)
from gym_patches.server_utils import GymServer


def server_class(server_type: str, implementation: str) -> type[GymServer]:
    """Import ``gym_patches.<server_type>.<implementation>.app.SERVER``."""
    module_name = f"gym_patches.{server_type}.{implementation}.app"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            raise GymConfigError(
                f"no Gym server implementation {server_type}/{implementation} (module {module_name})"
            ) from None
        raise
    cls = getattr(module, "SERVER", None)
    if not (isinstance(cls, type) and issubclass(cls, GymServer)):
        raise GymConfigError(f"{module_name} does not define SERVER as a GymServer subclass")
    return cls


REDACTED = "<redacted>"

# Connections the kernel queues for a server before it accepts them (capped by net.core.somaxconn).
# aiohttp's default, 128, is far below the thousands of /run calls one agent replica gets at the
# start of a step: past it the kernel drops connection attempts, and each caller (a status probe
# on a new connection too) waits out a retransmit of 1, 3, 7, ... seconds before it is even queued.
# The cost: asyncio accepts up to this many queued connections in one turn of the loop.
LISTEN_BACKLOG = 4096


def build_head_app(config: GymGlobalConfig) -> web.Application:
    """The head server publishes the resolved config and the instance list.

    The control token is redacted: anyone on loopback can read this route, and
    servers get their config (token included) from their environment instead.
    """
    public = config.model_copy(deep=True)
    if public.checkpoint.control_auth_token:
        public.checkpoint.control_auth_token = REDACTED
    text = public.to_yaml()

    async def global_config(_: web.Request) -> web.Response:
        return web.Response(text=text, content_type="application/yaml")

    async def instances(_: web.Request) -> web.Response:
        return web.json_response(
            [
                {"name": i.name, "server_type": i.server_type, "implementation": i.implementation, "url": i.url}
                for i in config.instances.values()
            ]
        )

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"name": "head_server", "ok": True})

    app = web.Application()
    app.router.add_get("/global_config_dict_yaml", global_config)
    app.router.add_get("/server_instances", instances)
    app.router.add_get("/health", health)
    return app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--head", action="store_true", help="run the head server")
    args = parser.parse_args(argv)
    raw = os.environ.get(CONFIG_DICT_ENV)
    if not raw:
        print(f"{CONFIG_DICT_ENV} is not set", file=sys.stderr)
        return 2
    config = parse_gym_config(yaml.safe_load(raw))
    if args.head:
        app = build_head_app(config)
        host, port = config.head_server.host, config.head_server.port
    else:
        name = os.environ.get(CONFIG_PATH_ENV, "")
        inst = config.instance(name)
        server = server_class(inst.server_type, inst.implementation)(inst, config)
        app = server.build_app()
        host, port = inst.host, inst.port
    fd = os.environ.pop(LISTEN_FD_ENV, None)
    if fd is not None:  # the launcher bound the port and kept it until now: serve on that socket
        where: dict = {"sock": socket.socket(fileno=int(fd))}
    else:
        where = {"host": host, "port": port}
    web.run_app(app, **where, backlog=LISTEN_BACKLOG, print=None, handle_signals=True, shutdown_timeout=2.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
