"""The agent loop behind ``/run``: seed -> model -> tools -> ... -> verify.

One implementation serves both agents: the session agent passes an
``activation`` (its checkpoint participant's per-session handle) and the loop
reports every boundary to it; the restart-only agent passes none. The loop
mutates its ``SimpleAgentLoopState`` only between boundaries, so a parked or
model-waiting session's state object *is* its boundary state.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
from typing import Any, AsyncIterator, Awaitable, Callable, Protocol

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gym_patches.activity import ActivityBoard, RunTrack
from gym_patches.checkpoint.errors import CheckpointError, StaleAttemptError
from gym_patches.checkpoint.identity import EpisodeId
from gym_patches.responses_api_agents.admission import StartGate
from gym_patches.server_configs import LoopAgentConfig
from gym_patches.server_utils import GymServer, ServerCallError, ServerClient
from gym_patches.wire_models import (
    ACTIVITY_ROUTE,
    ROLLOUT_ID_FIELD,
    ROLLOUT_PREFIX,
    RUN_ERROR_UPSTREAM,
    RUN_ERROR_UPSTREAM_TIMEOUT,
    SESSION_COOKIE,
    Boundary,
    Item,
    ResponsesReply,
    ResponsesRequest,
    ResponseUsage,
    RunError,
    RunErrorBody,
    RunPhase,
    RunReply,
    SeedSessionReply,
    TaskRow,
    TerminationReason,
    ToolReply,
    VerifyReply,
    message_item,
)

logger = logging.getLogger(__name__)

# Token information the model server attaches to the last output item (and its ``replay`` note); kept
# in the rollout's output for training, not sent back to the model as input.
TOKEN_INFO_KEYS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs", "weight_version",
                   "prefix_continuation", "replay")
_TOOL_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,127}$")
# Routes every resources server has that a model must never reach as a "tool".
_RESERVED_ROUTES = frozenset({"seed_session", "verify", "close_session", "health"})


class SimpleAgentLoopState(BaseModel):
    """Everything needed to continue an episode from a boundary (JSON-able)."""

    model_config = ConfigDict(extra="forbid")

    step: int = Field(default=0, ge=0)  # finished model turns (max_steps counts these)
    pending_tools: bool = False  # the last reply's function calls have not run yet
    new_outputs: list[Item] = Field(default_factory=list)  # every new item, in order
    usage: ResponseUsage = Field(default_factory=ResponseUsage)
    last_model_response: dict[str, Any] | None = None
    model_calls: int = Field(default=0, ge=0)  # model replies this episode consumed
    resources_cookies: dict[str, str] = Field(default_factory=dict)
    seed_row: dict[str, Any]

    def pending_calls(self) -> list[Item]:
        """Function calls of the last reply (the tools a P1 boundary still owes)."""
        return function_calls(self.last_model_response)


class LoopError(RuntimeError):
    """Another Gym server failed or answered nonsense; names the server and route.

    ``server`` is that server's name, so ``/run`` can say which one failed."""

    def __init__(self, message: str, *, server: str | None = None):
        super().__init__(message)
        self.server = server


class UpstreamTimeout(LoopError):
    """A Gym server did not answer a call within the agent's timeout for it (hung, stopped,
    deadlocked): without one the rollout would wait forever and nothing would say on what."""

    def __init__(self, server: str, route: str, timeout_s: float, setting: str):
        super().__init__(
            f"Gym server {server!r} did not answer POST {route} within {timeout_s:g}s ({setting})", server=server
        )
        self.route, self.timeout_s = route, timeout_s


class ModelRequestRejected(LoopError):
    """The model server answered 4xx: this request can never succeed (e.g. over the context length).

    Not an infrastructure failure: retrying the rollout would only meet it again, so the episode
    ends with ``termination_reason="model_rejected"`` and is verified as it stands."""


class Activation(Protocol):
    """What the loop reports to a checkpointing agent (see checkpoint/agent.py)."""

    async def boundary(self, name: Boundary, state: SimpleAgentLoopState) -> None: ...

    def awaiting_model(self) -> contextlib.AbstractAsyncContextManager[None]: ...

    def seeding(self) -> contextlib.AbstractAsyncContextManager[None]: ...


class NoActivation:
    """The activation of an agent that saves nothing: every hook is a no-op, but a seed still
    takes a slot of the agent's ``StartGate`` when it has one (``admission``)."""

    def __init__(self, start_gate: StartGate | None = None):
        self._gate = start_gate

    async def boundary(self, name: Boundary, state: SimpleAgentLoopState) -> None:
        return None

    @contextlib.asynccontextmanager
    async def awaiting_model(self) -> AsyncIterator[None]:
        yield

    @contextlib.asynccontextmanager
    async def seeding(self) -> AsyncIterator[None]:
        if self._gate is None:
            yield
            return
        async with self._gate.slot():
            yield


class LoopIO(Protocol):
    """The four calls the loop makes to other servers."""

    async def seed(self, row: dict[str, Any], capture_key: str) -> dict[str, str]: ...

    async def call_model(self, capture_key: str, body: dict[str, Any]) -> dict[str, Any]: ...

    async def call_tool(self, name: str, arguments: dict[str, Any], cookies: dict[str, str]) -> str: ...

    async def verify(self, row: dict[str, Any], output: list[Item], cookies: dict[str, str]) -> float: ...


# -- the loop -------------------------------------------------------------


def function_calls(reply: dict[str, Any] | None) -> list[Item]:
    if not reply:
        return []
    return [item for item in reply.get("output") or [] if isinstance(item, dict) and item.get("type") == "function_call"]


def model_request(state: SimpleAgentLoopState) -> dict[str, Any]:
    """The row's ``responses_create_params`` with every new item appended to ``input``."""
    params = dict(state.seed_row["responses_create_params"])
    base = params.get("input")
    items = [message_item("user", base)] if isinstance(base, str) else list(base or [])
    items += [{k: v for k, v in item.items() if k not in TOKEN_INFO_KEYS} for item in state.new_outputs]
    params["input"] = items
    return params


def _add_usage(total: ResponseUsage, reply: ResponsesReply) -> ResponseUsage:
    return ResponseUsage(
        input_tokens=total.input_tokens + reply.usage.input_tokens,
        output_tokens=total.output_tokens + reply.usage.output_tokens,
        total_tokens=total.total_tokens + reply.usage.total_tokens,
    )


async def run_tools(io: LoopIO, state: SimpleAgentLoopState) -> None:
    """Run the pending calls in order, appending one output per call."""
    for call in state.pending_calls():
        output = await _tool_output(io, call, state.resources_cookies)
        state.new_outputs.append({"type": "function_call_output", "call_id": call.get("call_id"), "output": output})
    state.pending_tools = False


async def _tool_output(io: LoopIO, call: Item, cookies: dict[str, str]) -> str:
    name = call.get("name")
    if not isinstance(name, str) or not _TOOL_NAME.match(name) or name in _RESERVED_ROUTES:
        return f"Error: unknown tool {name!r}"
    raw = call.get("arguments") or "{}"
    try:
        arguments = json.loads(raw) if isinstance(raw, str) else raw
    except ValueError as exc:
        return f"Error: arguments of {name} are not valid JSON ({exc})"
    if not isinstance(arguments, dict):
        return f"Error: arguments of {name} must be a JSON object"
    return await io.call_tool(name, arguments, cookies)


async def run_turns(
    io: LoopIO,
    state: SimpleAgentLoopState,
    *,
    capture_key: str,
    max_steps: int,
    activation: Activation | None = None,
) -> TerminationReason:
    """Model and tool turns until a final answer, an incomplete reply or ``max_steps``.

    Starts wherever ``state`` stands: pending tools run first (a P1 restore),
    otherwise the next model call is issued. Boundaries: B0 before each model
    call, P1 after a reply that asks for tools, P2 after those tools return.
    """
    act = activation or NoActivation()
    if state.pending_tools:
        await run_tools(io, state)
        if state.step >= max_steps:
            return "max_steps"
        await act.boundary("P2", state)
    while True:
        await act.boundary("B0", state)
        try:
            async with act.awaiting_model():
                body = await io.call_model(capture_key, model_request(state))
        except ModelRequestRejected as exc:
            logger.warning("%s: %s; the episode ends here", capture_key, exc)
            return "model_rejected"
        try:
            reply = ResponsesReply.model_validate(body)
        except ValidationError as exc:
            raise LoopError(f"model reply for {capture_key} is not a Responses API object: {exc}",
                            server=getattr(io, "model_server", None)) from None
        state.step += 1
        state.model_calls += 1
        state.usage = _add_usage(state.usage, reply)
        state.last_model_response = body
        state.new_outputs.extend(reply.output)
        if reply.incomplete_details is not None:
            return "incomplete"
        if not function_calls(body):
            return "final_answer"
        state.pending_tools = True
        await act.boundary("P1", state)
        await run_tools(io, state)
        if state.step >= max_steps:
            return "max_steps"
        await act.boundary("P2", state)


async def run_episode(
    io: LoopIO,
    row: dict[str, Any] | None,
    *,
    capture_key: str,
    max_steps: int,
    activation: Activation | None = None,
    restored_from: Boundary | None = None,
    restored_state: SimpleAgentLoopState | None = None,
) -> RunReply:
    """A whole ``/run``: seed (unless continuing a restored state), loop, verify."""
    act = activation or NoActivation()
    if restored_state is not None:
        state = restored_state
    else:
        if row is None:
            raise ValueError("run_episode needs a row when not continuing a restored state")
        state = SimpleAgentLoopState(seed_row=row)
        async with act.seeding():
            state.resources_cookies = await io.seed(row, capture_key)
    reason = await run_turns(io, state, capture_key=capture_key, max_steps=max_steps, activation=act)
    reward = await io.verify(state.seed_row, state.new_outputs, state.resources_cookies)
    return RunReply(
        rollout_id=capture_key,
        reward=reward,
        response={"output": state.new_outputs},
        num_model_calls=state.model_calls,
        termination_reason=reason,
        restored_from=restored_from,
    )


# -- the real calls -------------------------------------------------------


class ServerLoopIO:
    """``LoopIO`` over HTTP to the agent's model and resources servers.

    Every call has a timeout (a hung server must fail the run, not hold it forever).
    ``for_run`` gives a run its own view that also reports each call to its ``RunTrack``."""

    def __init__(self, client: ServerClient, model_server: str, resources_server: str, *,
                 model_call_timeout_s: float = 1800.0, resources_call_timeout_s: float = 300.0,
                 run: RunTrack | None = None):
        self.client = client
        self.model_server = model_server
        self.resources_server = resources_server
        self.model_call_timeout_s = model_call_timeout_s
        self.resources_call_timeout_s = resources_call_timeout_s
        self.run = run

    def for_run(self, run: RunTrack) -> "ServerLoopIO":
        return ServerLoopIO(self.client, self.model_server, self.resources_server,
                            model_call_timeout_s=self.model_call_timeout_s,
                            resources_call_timeout_s=self.resources_call_timeout_s, run=run)

    async def _post(self, server: str, path: str, phase: RunPhase, tool: str | None = None, **kw: Any):
        if phase == "model_call":
            timeout_s, setting = self.model_call_timeout_s, "model_call_timeout_s"
        else:
            timeout_s, setting = self.resources_call_timeout_s, "resources_call_timeout_s"
        run = self.run
        if run is not None:
            run.enter(phase, server, tool)
        try:
            return await self.client.post(server, path, timeout_s=timeout_s, **kw)
        except TimeoutError:
            raise UpstreamTimeout(server, path, timeout_s, setting) from None
        except ServerCallError as exc:
            raise LoopError(str(exc), server=server) from None
        finally:
            if run is not None:
                run.leave()

    def _fail(self, server: str, path: str, resp: Any) -> Exception:
        shown = resp.body if resp.body is not None else resp.text[:500]
        detail = f"Gym server {server!r} {path} returned {resp.status}: {shown}"
        error = resp.body.get("error") if isinstance(resp.body, dict) else None
        if isinstance(error, dict) and error.get("code") == "stale_attempt":
            return StaleAttemptError(detail)  # the episode was retired there: so is this run
        return LoopError(detail, server=server)

    async def seed(self, row: dict[str, Any], capture_key: str) -> dict[str, str]:
        path = "/seed_session"
        resp = await self._post(self.resources_server, path, "seeding",
                                json={"row": row, ROLLOUT_ID_FIELD: capture_key})
        if resp.status != 200:
            raise self._fail(self.resources_server, path, resp)
        if SESSION_COOKIE in resp.cookies:
            return {SESSION_COOKIE: resp.cookies[SESSION_COOKIE]}
        try:
            return {SESSION_COOKIE: SeedSessionReply.model_validate(resp.body).session_id}
        except ValidationError:
            raise self._fail(self.resources_server, path, resp) from None

    async def call_model(self, capture_key: str, body: dict[str, Any]) -> dict[str, Any]:
        path = f"{ROLLOUT_PREFIX}/{capture_key}/v1/responses"
        resp = await self._post(self.model_server, path, "model_call", json=body)
        if resp.status != 200 or not isinstance(resp.body, dict):
            error = self._fail(self.model_server, path, resp)
            if 400 <= resp.status < 500 and resp.status not in (408, 409, 429) and type(error) is LoopError:
                raise ModelRequestRejected(str(error), server=self.model_server)
            raise error
        return resp.body

    async def call_tool(self, name: str, arguments: dict[str, Any], cookies: dict[str, str]) -> str:
        path = f"/{name}"
        resp = await self._post(self.resources_server, path, "tool_call", name, json=arguments, cookies=cookies)
        if resp.status == 200:
            try:
                return ToolReply.model_validate(resp.body).output
            except ValidationError:
                raise self._fail(self.resources_server, path, resp) from None
        if resp.status in (404, 422):  # the model's mistake (unknown tool, bad arguments): show it to the model
            return resp.text
        raise self._fail(self.resources_server, path, resp)

    async def verify(self, row: dict[str, Any], output: list[Item], cookies: dict[str, str]) -> float:
        path = "/verify"
        resp = await self._post(
            self.resources_server, path, "verify", json={"row": row, "response": {"output": output}}, cookies=cookies
        )
        if resp.status != 200:
            raise self._fail(self.resources_server, path, resp)
        try:
            return VerifyReply.model_validate(resp.body).reward
        except ValidationError:
            raise self._fail(self.resources_server, path, resp) from None


# -- the server both agents share -------------------------------------------


class RunRequestError(ValueError):
    """A ``/run`` body that cannot start an episode."""

    def __init__(self, status: int, code: str, detail: str):
        super().__init__(detail)
        self.status, self.code, self.detail = status, code, detail


def parse_run_body(body: Any) -> tuple[EpisodeId, dict[str, Any]]:
    """Split a ``/run`` body into the episode (from ``_ng_rollout_id``) and the row."""
    if not isinstance(body, dict):
        raise RunRequestError(422, "invalid_request", "POST /run body must be a JSON object (a task row)")
    key = body.get(ROLLOUT_ID_FIELD)
    if not isinstance(key, str) or not key:
        raise RunRequestError(400, "rollout_id_required", f"POST /run needs {ROLLOUT_ID_FIELD} (the capture key)")
    try:
        episode = EpisodeId.from_capture_key(key)
    except ValidationError as exc:
        msg = "; ".join(e["msg"] for e in exc.errors())
        raise RunRequestError(400, "rollout_id_required", f"{ROLLOUT_ID_FIELD} {key!r} is not valid: {msg}") from None
    return episode, {k: v for k, v in body.items() if k != ROLLOUT_ID_FIELD}


def check_row(row: dict[str, Any]) -> None:
    """A fresh episode needs ``responses_create_params`` with an ``input``."""
    try:
        TaskRow.model_validate(row)
        ResponsesRequest.model_validate(row["responses_create_params"])
    except ValidationError as exc:
        detail = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '<row>'}: {e['msg']}" for e in exc.errors()
        )
        raise RunRequestError(422, "invalid_request", f"task row: {detail}") from None
    except KeyError:
        raise RunRequestError(422, "invalid_request", "task row: responses_create_params is required") from None


class LoopAgentServer(GymServer):
    """``POST /run`` over ``run_episode``; subclasses decide how a run is hosted."""

    server_type = "responses_api_agents"
    config_model = LoopAgentConfig
    checkpoint_sessions_supported: bool = False

    def __init__(self, *args: Any, **kw: Any):
        super().__init__(*args, **kw)
        cfg: LoopAgentConfig = self.config  # type: ignore[assignment]
        self.io: LoopIO = ServerLoopIO(
            self.client, cfg.model_server.name, cfg.resources_server.name,
            model_call_timeout_s=cfg.model_call_timeout_s, resources_call_timeout_s=cfg.resources_call_timeout_s,
        )
        self.activity = ActivityBoard(self.name)
        self.start_gate = StartGate()  # the runs starting at once (``admission``); the participant shares it

    @property
    def max_steps(self) -> int:
        return self.config.max_steps  # type: ignore[attr-defined]

    def setup_routes(self, app: web.Application) -> None:
        app.router.add_post("/run", self._run_route)
        app.router.add_get(ACTIVITY_ROUTE, self._activity_route)

    def needs_row(self, episode: EpisodeId) -> bool:
        """Whether this run starts from the row (False when it continues a restored session)."""
        return True

    async def run_rollout(self, episode: EpisodeId, row: dict[str, Any]) -> RunReply:
        raise NotImplementedError

    def episode_runner(
        self, episode: EpisodeId, row: dict[str, Any]
    ) -> Callable[..., Awaitable[RunReply]]:
        """``runner(activation=None, restored_from=None, restored_state=None)`` for one run."""

        async def runner(activation: Activation | None = None, restored_from: Boundary | None = None,
                         restored_state: SimpleAgentLoopState | None = None) -> RunReply:
            with self.activity.track(episode.capture_key) as run:
                io = self.io.for_run(run) if isinstance(self.io, ServerLoopIO) else self.io
                return await run_episode(
                    io,
                    row,
                    capture_key=episode.capture_key,
                    max_steps=self.max_steps,
                    activation=activation if activation is not None else NoActivation(self.start_gate),
                    restored_from=restored_from,
                    restored_state=restored_state,
                )

        return runner

    def run_error(self, status: int, code: str, detail: str, server: str | None = None) -> web.Response:
        """A ``/run`` error (``RunErrorBody``); ``server`` defaults to this agent (its own error)."""
        body = RunErrorBody(error=RunError(code=code, detail=detail, server=server or self.name))
        return web.json_response(body.model_dump(mode="json"), status=status)

    async def _run_route(self, request: web.Request) -> web.Response:
        try:
            body = json.loads(await request.text())  # read before its share of the turn (``GymServer._paced``)
        except ValueError:
            return self.run_error(422, "invalid_request", "POST /run body is not valid JSON")
        try:
            episode, row = parse_run_body(body)
            if self.needs_row(episode):
                check_row(row)
            reply = await self.run_rollout(episode, row)
        except RunRequestError as exc:
            return self.run_error(exc.status, exc.code, exc.detail)
        except CheckpointError as exc:
            return self.run_error(exc.status, exc.code, exc.detail)
        except UpstreamTimeout as exc:
            return self.run_error(504, RUN_ERROR_UPSTREAM_TIMEOUT, f"{self.name}: {exc}", exc.server)
        except LoopError as exc:
            return self.run_error(502, RUN_ERROR_UPSTREAM, f"{self.name}: {exc}", exc.server)
        except Exception as exc:  # a bug here must still answer in the one error shape
            logger.exception("agent %s: /run failed", self.name)
            return self.run_error(500, "internal_error", f"{self.name}: /run failed: {type(exc).__name__}: {exc}")
        return web.json_response(reply.model_dump(mode="json"))

    async def _activity_route(self, _: web.Request) -> web.Response:
        """Read only and unauthenticated, like ``/health``: what each running ``/run`` waits on."""
        return web.json_response(self.activity.snapshot().model_dump(mode="json"))
