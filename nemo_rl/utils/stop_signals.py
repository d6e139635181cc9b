"""How a run is told to stop or to snapshot: SIGTERM, SIGINT (Ctrl-C) and SIGUSR1 (docs/design.md §5.11).

Schedulers stop a job with SIGTERM, to the launcher alone or (Slurm's
preemption and time limit) to every process of the job at once. A run must
then take one last snapshot while its Gym servers, generation worker and Ray
are still alive. So ``StopSignals``, entered before anything is started:

- blocks the three signals in this thread; every thread and child process
  started afterwards inherits the block (Ray's GCS and raylet, its workers, the
  Gym servers they start, the generation worker), so a signal sent to every
  process of the run stays pending in them and they keep serving;
- starts one listener thread that takes the signals with ``sigwait``: they
  reach the driver only there. The first SIGTERM or SIGINT is a stop: it goes
  to the controller's event loop (``attach``) or, before or after the loop,
  interrupts the main thread (SIGUSR2 to that thread alone, whose handler
  raises ``KeyboardInterrupt``, which the runner turns into its one line; a
  real signal also wakes a blocking call such as a sleep). A second one, or the grace running out, exits the process at
  once with ``os._exit``: publishing is an atomic rename, so nothing torn is
  left, and the run's reaper (parent-death signal) then takes every child
  down, as after a SIGKILL. A stop signal within ``DUPLICATE_WINDOW_S`` of the
  first is the same stop delivered twice, not a second one: Slurm signals
  every process of the job while a batch script forwards the same signal to
  the run, and a shell's kill of the process group reaches the driver too.
  SIGUSR1 asks for a snapshot now.

Children that must not be shielded unblock the signals themselves
(``unblock_in_child``, a ``preexec_fn``). The process exits with
``128 + signal number`` (143 for SIGTERM, 130 for SIGINT) after a stop.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

HANDLED = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGUSR1})
STOPS = frozenset({signal.SIGTERM, signal.SIGINT})
# A stop signal this soon after the first is one stop delivered twice (see the module docstring).
DUPLICATE_WINDOW_S = 2.0


def _interrupt(signum, frame) -> None:
    """SIGUSR2 from the listener: a stop outside the controller's loop, as a Ctrl-C would be."""
    raise KeyboardInterrupt


def exit_status(signum: int) -> int:
    """The documented exit status of a run stopped by ``signum`` (the shell's convention)."""
    return 128 + int(signum)


def unblock_in_child() -> None:
    """``preexec_fn`` for a child that must get these signals (the reaper's parent-death signal)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, HANDLED)


def shielded() -> bool:
    """Whether this process started with SIGTERM blocked (a child of a run that owns its signals)."""
    return signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, [])


class StopSignals:
    """Owns the run's signals from ``__enter__`` to ``__exit__`` (see the module docstring)."""

    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self.first: int | None = None  # the stop signal that arrived first
        self.stopped_at: float | None = None
        self._deadline: float | None = None
        self._lock = threading.Lock()
        self._on_stop: Callable[[str], None] | None = None
        self._on_snapshot: Callable[[str], None] | None = None
        self._loop = None
        self._closing = False
        self._old_mask: set[int] | None = None
        self._old_int = None
        self._old_usr2 = None
        self._main = 0
        self._thread: threading.Thread | None = None
        # False while the run tears down: a stop then only starts the grace (an interrupt would leave
        # half of the teardown undone).
        self.interruptible = True

    @property
    def name(self) -> str | None:
        return signal.Signals(self.first).name if self.first is not None else None

    def __enter__(self) -> "StopSignals":
        # A background job of a non-interactive shell starts with SIGINT ignored; the interrupt the
        # listener raises in the main thread needs Python's own handler.
        self._old_int = signal.signal(signal.SIGINT, signal.default_int_handler)
        self._old_usr2 = signal.signal(signal.SIGUSR2, _interrupt)
        self._main = threading.get_ident()
        self._old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, HANDLED)
        self._thread = threading.Thread(target=self._listen, name="stop-signals", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        with self._lock:
            self._closing = True
        if self._thread is not None and self._thread.is_alive():
            signal.pthread_kill(self._thread.ident, signal.SIGUSR1)  # wakes sigwait; closing: it returns
            self._thread.join(timeout=5)
        signal.pthread_sigmask(signal.SIG_SETMASK, self._old_mask or set())
        signal.signal(signal.SIGINT, self._old_int if self._old_int is not None else signal.default_int_handler)
        signal.signal(signal.SIGUSR2, self._old_usr2 if self._old_usr2 is not None else signal.SIG_DFL)

    # ------------------------------------------------------------ the event loop
    def attach(self, loop, on_stop: Callable[[str], None], on_snapshot: Callable[[str], None]) -> None:
        """While the controller runs, stops and snapshot requests go to its loop (thread-safe calls).
        A stop that came before is handed over at once."""
        with self._lock:
            self._loop, self._on_stop, self._on_snapshot = loop, on_stop, on_snapshot
            pending = self.name
        if pending is not None:
            loop.call_soon_threadsafe(on_stop, pending)

    def detach(self) -> None:
        with self._lock:
            self._loop = self._on_stop = self._on_snapshot = None

    def remaining_s(self) -> float:
        """Seconds left of the grace (the whole grace before a stop)."""
        if self._deadline is None:
            return self.grace_s
        return max(0.0, self._deadline - time.monotonic())

    # ------------------------------------------------------------ the listener
    def _listen(self) -> None:
        while True:
            timeout = None if self._deadline is None else self._deadline - time.monotonic()
            if timeout is None:
                signum = signal.sigwait(HANDLED)
            elif timeout <= 0:
                signum = None
            else:
                info = signal.sigtimedwait(HANDLED, timeout)
                signum = info.si_signo if info is not None else None
            with self._lock:
                if self._closing:
                    return
                if signum is None:
                    self._exit_now(f"the {self.grace_s:g} s grace "
                                   "(rollout_checkpointing.stop_grace_s) ran out")
                if signum == signal.SIGUSR1:
                    if self._loop is not None and self.first is None:
                        self._loop.call_soon_threadsafe(self._on_snapshot, "SIGUSR1")
                    continue
                if self.first is not None:
                    if time.monotonic() - self.stopped_at < DUPLICATE_WINDOW_S:
                        print(f"{signal.Signals(signum).name} again within {DUPLICATE_WINDOW_S:g} s of the first "
                              f"{self.name}: the same stop delivered twice; still taking the final snapshot "
                              "(send it again later to exit at once)", file=sys.stderr, flush=True)
                        continue
                    self._exit_now(f"a second {signal.Signals(signum).name}")
                self.first, self.stopped_at = signum, time.monotonic()
                self._deadline = self.stopped_at + self.grace_s
                if self._loop is not None:
                    self._loop.call_soon_threadsafe(self._on_stop, self.name)
                elif self.interruptible:  # starting up or wrapping up: the runner stops what it started
                    signal.pthread_kill(self._main, signal.SIGUSR2)

    def _exit_now(self, why: str) -> None:
        first = self.name or "a signal"
        sys.stdout.flush()
        print(f"stopped by {first}: {why}; exiting at once, nothing torn is published (the newest "
              "complete snapshot stays the one a relaunch uses); run the same command to continue",
              file=sys.stderr, flush=True)
        os._exit(exit_status(self.first or signal.SIGTERM))


class RunStopped(Exception):
    """The run stopped as a signal asked (docs/design.md §5.11): what the final snapshot saved, or why
    it could not. ``line()`` is what the runner prints."""

    def __init__(self, by: str, *, step: int, anchor_step: int, in_flight: int):
        super().__init__(f"stopped by {by}")
        self.by, self.step, self.anchor_step, self.in_flight = by, step, anchor_step, in_flight
        self.outcome = None  # the final snapshot's SnapshotOutcome (the last attempt's), if one was attempted
        self.attempts = 0  # final snapshot attempts that ended (a failed one is tried again within the grace)
        self.error: str | None = None

    def line(self) -> str:
        o = self.outcome
        if o is not None and o.committed:
            name = Path(o.path).name if o.path else o.checkpoint_id
            return (f"stopped by {self.by}: {name} (trainer step {o.anchor_step}) holds {o.saved} of the "
                    f"{self.in_flight} rollouts in flight at the signal at their last finished turn "
                    f"({o.unsaved} unsaved on restart-only servers; the rest finished meanwhile, had no "
                    f"finished turn or run at a coarser level); run the same command to continue")
        why = self.error or (o.error or o.reason if o is not None else "snapshots are off")
        if self.attempts > 1:
            why = f"{self.attempts} attempts; the last: {why}"
        return (f"stopped by {self.by}: no final snapshot ({why}); the relaunch continues from trainer step "
                f"{self.anchor_step} and the newest snapshot published before; run the same command to continue")


def _descendants(roots: list[int]) -> list[int]:
    """Every live descendant of ``roots`` (from /proc's parent links), roots included."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], list(roots)
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def shutdown_shielded_ray() -> None:
    """``ray.shutdown()`` for a run whose children block SIGTERM (``StopSignals``).

    Ray stops the processes ``ray.init`` started with SIGTERM and a second's
    wait each; blocked, that is seconds of nothing. Once the run has torn down
    they hold nothing to flush, so they and what they started (the raylet's
    agents and idle workers) get SIGKILL. A Ray this process did not start is
    only disconnected, as ``ray.shutdown()`` does.
    """
    import ray

    node = getattr(getattr(ray, "_private", None) and ray._private.worker, "_global_node", None)
    processes = getattr(node, "all_processes", None)
    if not shielded() or not isinstance(processes, dict):
        ray.shutdown()
        return
    family = _descendants([info.process.pid for infos in processes.values() for info in infos])
    graceful = node.kill_all_processes
    node.kill_all_processes = lambda **kw: graceful(**{**kw, "allow_graceful": False})
    try:
        ray.shutdown()
    finally:
        for pid in family:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
