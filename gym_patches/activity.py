"""What each agent's ``/run`` calls are waiting on, so a hung Gym server gets a name.

Agent side: ``ActivityBoard`` holds one ``RunTrack`` per running ``/run``, updated
in O(1) as each call to another Gym server starts and ends, and answers
``GET /ng-activity/v1/runs``. Client side: ``fetch_activity`` asks agents for
it with a bound on the wait (a stopped agent is itself the answer), and
``group_runs`` / ``summary_lines`` turn the replies into lines a person reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Mapping

from pydantic import ValidationError

from gym_patches.config import GymConfigError
from gym_patches.server_utils import ServerCallError, ServerClient
from gym_patches.wire_models import ACTIVITY_ROUTE, AgentActivity, RunActivity, RunPhase

# -- agent side --------------------------------------------------------------


class RunTrack:
    """The live activity of one ``/run``; its loop's calls move it between phases."""

    __slots__ = ("capture_key", "phase", "server", "tool", "since", "_clock")

    def __init__(self, capture_key: str, clock: Callable[[], float]):
        self.capture_key = capture_key
        self._clock = clock
        self.phase: RunPhase = "between_calls"
        self.server: str | None = None
        self.tool: str | None = None
        self.since = clock()

    def enter(self, phase: RunPhase, server: str, tool: str | None = None) -> None:
        self.phase, self.server, self.tool, self.since = phase, server, tool, self._clock()

    def leave(self) -> None:
        self.phase, self.server, self.tool, self.since = "between_calls", None, None, self._clock()

    def view(self, now: float) -> RunActivity:
        return RunActivity(capture_key=self.capture_key, phase=self.phase, server=self.server, tool=self.tool,
                           since_s=max(0.0, now - self.since))


class ActivityBoard:
    """Every running ``/run`` of one agent. Keyed by the track itself, not the capture key,
    so two runs that share a key (a caller's bug) cannot hide or remove each other."""

    def __init__(self, agent: str, clock: Callable[[], float] = time.monotonic):
        self.agent = agent
        self._clock = clock
        self._runs: dict[RunTrack, None] = {}  # insertion-ordered set

    @contextlib.contextmanager
    def track(self, capture_key: str) -> Iterator[RunTrack]:
        run = RunTrack(capture_key, self._clock)
        self._runs[run] = None
        try:
            yield run
        finally:
            self._runs.pop(run, None)

    def __len__(self) -> int:
        return len(self._runs)

    def snapshot(self) -> AgentActivity:
        """The runs, longest in their current phase first."""
        now = self._clock()
        runs = sorted(self._runs, key=lambda r: r.since)
        return AgentActivity(agent=self.agent, runs=[r.view(now) for r in runs])


# -- client side -------------------------------------------------------------


async def _fetch_one(client: ServerClient, agent: str, timeout_s: float) -> AgentActivity | str:
    try:
        async with asyncio.timeout(timeout_s):  # also bounds what aiohttp's own timer does not cover
            resp = await client.get(agent, ACTIVITY_ROUTE, timeout_s=timeout_s)
    except TimeoutError:
        return f"no reply within {timeout_s:g}s"
    except ServerCallError as exc:  # aiohttp's own words ("Cannot connect to host ...") over its repr
        return f"unreachable: {exc.__cause__ or exc.body}"
    except GymConfigError as exc:
        return f"not a configured Gym server: {exc}"
    if resp.status != 200:
        return f"answered {resp.status}: {resp.text[:200]}"
    try:
        return AgentActivity.model_validate(resp.body)
    except ValidationError as exc:
        return f"bad activity reply: {exc.error_count()} error(s), first: {exc.errors()[0]['msg']}"


async def fetch_activity(client: ServerClient, agents: list[str], timeout_s: float) -> dict[str, AgentActivity | str]:
    """Each agent's activity, or a one-line reason it gave none; asked all at once,
    so the whole call takes about ``timeout_s`` at most however many agents hang."""
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    replies = await asyncio.gather(*(_fetch_one(client, a, timeout_s) for a in agents))
    return dict(zip(agents, replies))


_DOING = {
    "seeding": "seeding a session on {server}",
    "model_call": "in a model call to {server}",
    "tool_call": "in a tool call to {server}",
    "verify": "in verify on {server}",
    "between_calls": "between calls in agent {server}",
}


@dataclass
class RunGroup:
    """Runs in the same phase waiting on the same server (for ``between_calls``: the agent)."""

    phase: RunPhase
    server: str
    oldest_s: float = 0.0
    capture_keys: list[str] = field(default_factory=list)  # longest waiting first
    agents: list[str] = field(default_factory=list)
    tools: list[str] = field(default_factory=list)

    @property
    def count(self) -> int:
        return len(self.capture_keys)

    def line(self, max_keys: int = 0) -> str:
        noun = "rollout" if self.count == 1 else "rollouts"
        text = f"{self.count} {noun} {_DOING[self.phase].format(server=repr(self.server))}"
        oldest = f"{self.oldest_s:.0f}" if self.oldest_s >= 10 else f"{self.oldest_s:.1f}"
        tools = f", tools: {', '.join(self.tools)}" if self.tools else ""
        text += f" (oldest {oldest} s{tools})"
        if max_keys > 0:
            shown = self.capture_keys[:max_keys]
            more = self.count - len(shown)
            text += ": " + ", ".join(shown) + (f" and {more} more" if more else "")
        return text


def group_runs(activities: Mapping[str, AgentActivity | str], *, older_than_s: float = 0.0) -> list[RunGroup]:
    """Runs of every agent that answered, grouped by (phase, server), the longest-waiting
    group first. ``older_than_s`` leaves out runs that entered their phase more recently."""
    groups: dict[tuple[str, str], tuple[RunGroup, list[tuple[float, str]]]] = {}
    for agent, activity in activities.items():
        if isinstance(activity, str):
            continue
        for run in activity.runs:
            if run.since_s < older_than_s:
                continue
            server = run.server if run.server is not None else agent
            g, waits = groups.setdefault((run.phase, server), (RunGroup(run.phase, server), []))
            waits.append((run.since_s, run.capture_key))
            if agent not in g.agents:
                g.agents.append(agent)
            if run.tool is not None and run.tool not in g.tools:
                g.tools.append(run.tool)
    for g, waits in groups.values():
        waits.sort(key=lambda w: -w[0])
        g.capture_keys = [key for _, key in waits]
        g.oldest_s = waits[0][0]
    return sorted((g for g, _ in groups.values()), key=lambda g: (-g.oldest_s, g.phase, g.server))


def summary_lines(activities: Mapping[str, AgentActivity | str], *, older_than_s: float = 0.0,
                  max_keys: int = 0) -> list[str]:
    """One line per agent that did not answer, then one per group of runs (see ``group_runs``);
    ``max_keys`` > 0 lists that many capture keys on each group's line."""
    lines = [f"agent {agent!r} did not answer: {a}" for agent, a in activities.items() if isinstance(a, str)]
    lines += [g.line(max_keys) for g in group_runs(activities, older_than_s=older_than_s)]
    return lines
