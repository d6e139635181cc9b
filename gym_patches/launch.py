"""Start a Gym deployment from YAML: a head server plus one process per server.

``python -m gym_patches.launch --config <gym yaml>`` prints each server's name,
kind, URL and checkpoint mode and stops every process on Ctrl-C. Tests and RL
use ``GymDeployment`` directly; ``stop()`` (or the context manager) always
reaps every process it started.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gym_patches.config import (
    CONFIG_DICT_ENV,
    CONFIG_PATH_ENV,
    LISTEN_FD_ENV,
    SERVER_KIND,
    GymConfigError,
    GymGlobalConfig,
    load_gym_config,
    parse_gym_config,
)
from gym_patches.utils.processes import die_with_parent, listening_socket, signals_blocked


class GymStartupError(RuntimeError):
    """A server did not come up; names it and shows the end of its log."""


@dataclass(frozen=True)
class LaunchedServer:
    name: str
    server_type: str
    implementation: str
    url: str
    checkpoint_mode: str
    log_path: Path

    @property
    def kind(self) -> str:
        return SERVER_KIND[self.server_type]


class GymDeployment:
    """A running deployment. Owns its processes; ``stop()`` is idempotent."""

    def __init__(self, config: GymGlobalConfig, log_dir: Path):
        self.config = config
        self.log_dir = log_dir
        self.head_url = f"http://{config.head_server.host}:{config.head_server.port}"
        self._procs: dict[str, subprocess.Popen] = {}
        self._logs: list[Any] = []
        self._sockets: dict[str, socket.socket] = {}  # listening, handed to each server as it starts
        self.servers: list[LaunchedServer] = []

    # -- start -------------------------------------------------------------
    @classmethod
    def start(
        cls,
        config: GymGlobalConfig | dict[str, Any] | str | Path | list[str | Path],
        *,
        log_dir: str | Path | None = None,
        startup_timeout_s: float = 60.0,
    ) -> "GymDeployment":
        if isinstance(config, (str, Path, list)):
            config = load_gym_config(config)
        elif isinstance(config, dict):
            config = parse_gym_config(config)
        from gym_patches.server_main import server_class

        classes = {name: server_class(i.server_type, i.implementation) for name, i in config.instances.items()}
        for name, server_cls in classes.items():
            server_cls.validate_instance_config(config.instances[name])  # a bad key fails here, not in a child
        modes = {name: server_cls.checkpoint_mode_label() for name, server_cls in classes.items()}
        config, sockets = _assign_ports(config)
        logs = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="gym-logs-"))
        logs.mkdir(parents=True, exist_ok=True)
        dep = cls(config, logs)
        dep._sockets = sockets
        try:
            dep._spawn("head_server", head=True)
            for name, inst in config.instances.items():
                dep._spawn(name)
                dep.servers.append(
                    LaunchedServer(name, inst.server_type, inst.implementation, inst.url, modes[name], logs / f"{name}.log")
                )
            dep._wait_healthy(startup_timeout_s)
        except BaseException:
            dep.stop()
            raise
        finally:
            dep._close_sockets()
        return dep

    def _spawn(self, name: str, head: bool = False) -> None:
        env = dict(os.environ)
        env[CONFIG_DICT_ENV] = self.config.to_yaml()
        env[CONFIG_PATH_ENV] = name
        env.setdefault("PYTHONUNBUFFERED", "1")
        repo_root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (repo_root, env.get("PYTHONPATH", "")) if p)
        log = open(self.log_dir / f"{name}.log", "ab")
        self._logs.append(log)
        cmd = [sys.executable, "-m", "gym_patches.server_main"] + (["--head"] if head else [])
        sock = self._sockets.pop(name, None)
        if sock is not None:
            env[LISTEN_FD_ENV] = str(sock.fileno())
        try:
            self._procs[name] = subprocess.Popen(
                cmd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                preexec_fn=die_with_parent, pass_fds=() if sock is None else (sock.fileno(),),
            )
        finally:
            if sock is not None:
                sock.close()  # the child holds it now

    def _close_sockets(self) -> None:
        for sock in self._sockets.values():
            sock.close()
        self._sockets.clear()

    def _url(self, name: str) -> str:
        return self.head_url if name == "head_server" else self.config.instances[name].url

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        pending = set(self._procs)
        while pending:
            for name in sorted(pending):
                proc = self._procs[name]
                if proc.poll() is not None:
                    raise GymStartupError(
                        f"Gym server {name!r} exited with code {proc.returncode} during startup:\n{self.log_tail(name)}"
                    )
                try:
                    with urllib.request.urlopen(self._url(name) + "/health", timeout=1.0) as resp:
                        if resp.status == 200:
                            pending.discard(name)
                except (urllib.error.URLError, OSError):
                    pass
            if pending and time.monotonic() > deadline:
                names = ", ".join(sorted(pending))
                raise GymStartupError(f"Gym servers not up after {timeout_s:.0f}s: {names}")
            if pending:
                time.sleep(0.05)

    # -- use ---------------------------------------------------------------
    def server(self, name: str) -> LaunchedServer:
        for s in self.servers:
            if s.name == name:
                return s
        raise GymConfigError(f"unknown Gym server {name!r}")

    def url(self, name: str) -> str:
        return self._url(name)

    def pid(self, name: str) -> int:
        return self._procs[name].pid

    def log_tail(self, name: str, lines: int = 30) -> str:
        try:
            text = (self.log_dir / f"{name}.log").read_text(errors="replace")
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def kill_server(self, name: str) -> None:
        """SIGKILL one server (fault tests)."""
        proc = self._procs[name]
        proc.kill()
        proc.wait(timeout=10)

    def alive(self) -> dict[str, bool]:
        return {name: p.poll() is None for name, p in self._procs.items()}

    # -- stop ----------------------------------------------------------------
    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout_s``. Servers started while SIGTERM was blocked (a run
        that keeps them alive through a scheduler's stop signal, docs/design.md §5.11) never see it,
        so they get SIGKILL at once: they hold nothing to flush by the time their run tears down."""
        if signals_blocked():
            timeout_s = 0.0
        for proc in self._procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM if timeout_s > 0 else signal.SIGKILL)
        deadline = time.monotonic() + timeout_s
        for proc in self._procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for log in self._logs:
            log.close()
        self._logs.clear()

    def __enter__(self) -> "GymDeployment":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def describe(self) -> str:
        rows = [("name", "kind", "url", "checkpoint mode")]
        rows += [(s.name, s.kind, s.url, s.checkpoint_mode) for s in self.servers]
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows)


def _assign_ports(config: GymGlobalConfig) -> tuple[GymGlobalConfig, dict[str, socket.socket]]:
    """Every ``port: 0`` gets a listening socket held open until its server starts (its port goes
    in the config every server reads); a fixed port is bound by its server itself."""
    config = config.model_copy(deep=True)
    sockets: dict[str, socket.socket] = {}
    try:
        targets = [("head_server", config.head_server)] + list(config.instances.items())
        for name, server in targets:
            if server.port == 0:
                sockets[name] = listening_socket(server.host)
                server.port = sockets[name].getsockname()[1]
    except BaseException:
        for sock in sockets.values():
            sock.close()
        raise
    return config, sockets


# Top-level keys of a NeMo-RL training config: a file with them and no server is one given by mistake.
_RL_KEYS = ("grpo", "policy", "env", "rollout_recovery", "rollout_checkpointing", "checkpointing", "defaults")


def _no_servers(paths: list[str]) -> str:
    """Why a config without a single server cannot start, and what the user likely meant."""
    import yaml

    found = set()
    for path in paths:
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError):
            continue
        found |= {k for k in _RL_KEYS if isinstance(data, dict) and k in data}
    if found:
        return (f"{', '.join(paths)} is a NeMo-RL training config (it has {', '.join(sorted(found))}), not a Gym "
                "deployment: to start its Gym servers, list their checkpoint modes and run the restart-only "
                f"setup check, run: python examples/run_grpo.py --config {paths[0]} --check")
    return (f"{', '.join(paths)} configures no Gym server: a Gym config maps each server's name to "
            "{<server type>: {<implementation>: {...}}} (see examples/gym_configs/)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Start a Gym deployment and keep it running until Ctrl-C.")
    parser.add_argument("--config", required=True, nargs="+", help="Gym YAML file(s)")
    parser.add_argument("--log-dir", default=None)
    args = parser.parse_args(argv)
    # SIGINT stops the deployment even when this process was started with it ignored (a background
    # job of a non-interactive shell inherits SIG_IGN, and Python then installs no handler).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        config = load_gym_config(args.config)
        if not config.instances:
            raise GymConfigError(_no_servers(args.config))
        dep = GymDeployment.start(config, log_dir=args.log_dir)
    except (GymConfigError, GymStartupError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C while starting: start() has stopped what it started
        print("stopped while starting", file=sys.stderr)
        return 130
    try:  # from here a Ctrl-C at any point stops every server and exits 0 (also mid-print)
        print(f"head server: {dep.head_url}   logs: {dep.log_dir}")
        print(dep.describe(), flush=True)
        while all(dep.alive().values()):
            time.sleep(0.5)
        dead = [n for n, ok in dep.alive().items() if not ok]
        print(f"error: Gym server(s) exited: {', '.join(dead)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("stopping Gym servers...", flush=True)
        return 0
    finally:
        dep.stop()


if __name__ == "__main__":
    sys.exit(main())
