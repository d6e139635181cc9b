"""Start a Gym deployment from YAML: a head server plus one process per server.

``python -m gym_patches.launch --config <gym yaml>`` prints each server's name,
kind, URL and checkpoint mode and stops every process on Ctrl-C or SIGTERM.
Given a NeMo-RL training config instead (``--config <rl yaml> [key=value ...]``),
it starts the deployments that run would start, read from its ``env.nemo_gym``
section by ``gym_patches.rl_config`` (docs/design.md §4.2). Tests and RL use
``GymDeployment`` directly; ``stop()`` (or the context manager) always reaps
every process it started.
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
from gym_patches.rl_config import GYM_SECTION, looks_like_rl_config, read_rl_gym
from gym_patches.server_catalog import check_servers
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
        modes = check_servers(config)  # a bad key fails here, not in a child (and no server is imported here)
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

    def exit_code(self, name: str) -> int | None:
        """The server's exit code once it has exited (reaped here), else None."""
        return self._procs[name].poll()

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


def _no_servers(paths: list[str]) -> str:
    """Why a Gym config without a single server cannot start."""
    return (f"{', '.join(paths)} configures no Gym server: a Gym config maps each server's name to "
            "{<server type>: {<implementation>: {...}}} (see examples/gym_configs/); a NeMo-RL training "
            "config is read from its env.nemo_gym section")


class _Stopped(Exception):
    """SIGTERM or SIGINT: stop every server and exit."""

    def __init__(self, name: str):
        super().__init__(name)
        self.name = name


def _raise_stop(signum: int, _frame: Any) -> None:
    raise _Stopped(signal.Signals(signum).name)


Deployment = tuple[str | None, Any, Path | None]  # instance id (RL config) or None, Gym config, log dir


def _plan(configs: list[str], overrides: list[str], log_dir: str | None) -> tuple[list[Deployment], float, str | None]:
    """What to start: ``(instance id or None, Gym config, log dir)`` per deployment, the startup timeout
    and, for an RL config, the line that says where the servers come from."""
    if looks_like_rl_config(configs):
        rl = read_rl_gym(configs, overrides)
        if not rl.instances or not any(_servers(i.config) for i in rl.instances):
            raise GymConfigError(f"{rl.source}: its Gym section ({GYM_SECTION}) configures no Gym server "
                                 f"(set {GYM_SECTION}.config_paths or {GYM_SECTION}.config)")
        root = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="gym-logs-"))
        token = _write_token(root, rl.control_token)
        head = (f"RL config {rl.source}: its {GYM_SECTION} section, rollout_recovery.target_level={rl.target_level} "
                f"(Gym checkpoints {'enabled' if rl.checkpointing else 'disabled'}); "
                f"{len(rl.instances)} Gym instance(s), as the training run starts them\n"
                f"checkpoint control token (Authorization: Bearer <it>): {token}")
        return [(i.instance_id, i.config, root / i.instance_id) for i in rl.instances], rl.spinup_timeout_s, head
    if overrides:
        raise GymConfigError(f"overrides {' '.join(overrides)}: only an RL config takes key=value overrides; "
                             "edit the Gym YAML instead")
    config = load_gym_config(configs)
    if not config.instances:
        raise GymConfigError(_no_servers(configs))
    return [(None, config, Path(log_dir) if log_dir else None)], 60.0, None


def _write_token(root: Path, token: str) -> Path:
    """The control token, readable by this user only: what a hand-made call to a control route needs."""
    root.mkdir(parents=True, exist_ok=True)
    path = root / "control_token"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return path


def _servers(config: dict[str, Any]) -> bool:
    """Whether a Gym config names at least one server (``{name: {server type: {...}}}``)."""
    return bool(parse_gym_config(config).instances)


def _serve(deployments: list[tuple[str | None, "GymDeployment"]], head: str | None) -> int:
    """Print what runs and wait until a server exits (1) or a stop arrives (0; at any point, mid-print too)."""
    try:
        if head:
            print(head)
        for instance, dep in deployments:
            where = f"{instance}   " if instance else ""
            print(f"{where}head server: {dep.head_url}   logs: {dep.log_dir}")
            print(dep.describe(), flush=True)
        while all(ok for _, dep in deployments for ok in dep.alive().values()):
            time.sleep(0.5)
        dead = [f"{instance}/{n}" if instance else n for instance, dep in deployments
                for n, ok in dep.alive().items() if not ok]
        print(f"error: Gym server(s) exited: {', '.join(dead)}", file=sys.stderr)
        return 1
    except _Stopped as stop:
        print(f"stopping Gym servers ({stop.name})...", flush=True)
        return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Start a Gym deployment and keep it running until Ctrl-C or SIGTERM.",
        epilog="With a NeMo-RL training config (e.g. examples/configs/grpo_workplace_turn.yaml) it starts the "
               "Gym servers a training run with that config would start: every replica of every shard of "
               f"{GYM_SECTION}, with the run's checkpoint setting; key=value overrides apply as run_grpo.py "
               "takes them. The restart-only setup check: python examples/run_grpo.py --config <yaml> --check.")
    parser.add_argument("--config", required=True, nargs="+",
                        help="Gym YAML file(s), or one NeMo-RL training config")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="overrides of an RL config")
    parser.add_argument("--log-dir", default=None)
    args = parser.parse_args(argv)
    configs = [c for c in args.config if "=" not in c]  # `--config rl.yaml a.b=1`: nargs took the override
    overrides = [c for c in args.config if "=" in c] + args.overrides
    # SIGINT stops the deployment even when this process was started with it ignored (a background
    # job of a non-interactive shell inherits SIG_IGN, and Python then installs no handler); SIGTERM
    # stops it the same way, so the servers get their own SIGTERM rather than only their parent-death one.
    signal.signal(signal.SIGINT, _raise_stop)
    signal.signal(signal.SIGTERM, _raise_stop)
    deployments: list[tuple[str | None, GymDeployment]] = []
    try:
        try:
            plan, timeout_s, head = _plan(configs, overrides, args.log_dir)
            for instance, config, logs in plan:
                deployments.append((instance, GymDeployment.start(config, log_dir=logs, startup_timeout_s=timeout_s)))
        except (GymConfigError, GymStartupError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        except _Stopped as stop:  # while starting: start() has stopped what it was starting
            print(f"stopped while starting ({stop.name})", file=sys.stderr)
            return 130 if stop.name == "SIGINT" else 143
        return _serve(deployments, head)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second signal must not cut the teardown short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for _, dep in deployments:
            dep.stop()


if __name__ == "__main__":
    sys.exit(main())
