"""Policy model server: Responses API in front of a chat-completions backend.

Upstream counterpart: ``responses_api_models/vllm_model``. Agents call
``/ng-rollout/<capture_key>/v1/responses`` so every generation belongs to an
episode; the checkpoint gate (``gym_patches.checkpoint.model``) holds replies
while a checkpoint is being taken. Plain ``/v1/responses`` is not tracked by
checkpoints but still waits while admission is closed. An episode restored for
replay is answered from its recorded calls while its requests match
(``gym_patches.checkpoint.replay``; counts at ``GET /ng-replay/v1/stats``).

Errors use the OpenAI shape ``{"error": {"message", "type", "param", "code"}}``
so the ``openai`` client raises its usual exceptions:

- 400 ``invalid_request`` (``param`` names the field): a request we cannot map.
- 413 ``payload_too_large``: a body over the server's size cap.
- the backend's own 4xx status, message, type, param and code, passed through
  (e.g. ``top_p`` it does not support, a prompt over its context length);
  except 401/403/404/407, which mean this server's backend settings (key, URL,
  model name) are wrong: those are a 502 ``backend_error`` naming the backend.
- 409 ``stale_attempt`` / ``admission_closed`` from the checkpoint gate.
- 502 ``backend_error``: the backend failed, is unreachable (after sending the
  call again for ``policy_unreachable_retry_s``, when set), timed out or sent an
  unusable reply; 503 ``backend_not_configured``.

4xx replies carry ``x-should-retry: false`` (except 408 and 429, which a
client may retry) so the ``openai`` client does not resend a request that can
never succeed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import uuid
from typing import Any

import aiohttp
from aiohttp import web
from pydantic import ValidationError

from gym_patches.checkpoint.cuts import (
    CALL_ID_HEADER,
    CALL_INDEX_HEADER,
    CUT_FETCH_ROUTE,
    CUT_ROUTE,
    PREFIX_FIELD,
    RESEND_HEADER,
    CutReply,
    CutRequest,
    FetchRequest,
    GenerationCut,
    PinReply,
)
from gym_patches.checkpoint.errors import CheckpointError
from gym_patches.checkpoint.identity import EpisodeId
from gym_patches.checkpoint.model import ModelTicket, PolicyModelParticipant
from gym_patches.checkpoint.replay import REPLAY_STATS_ROUTE, annotated
from gym_patches.config import GymGlobalConfig, ServerInstanceConfig
from gym_patches.responses_api_models.vllm_model.converter import (
    BackendReplyError,
    ConversionError,
    chat_to_responses,
    responses_to_chat,
)
from gym_patches.server_configs import VLLMModelConfig
from gym_patches.server_utils import MAX_REQUEST_BODY_BYTES, GymServer, new_client_session
from gym_patches.wire_models import ROLLOUT_PREFIX, ResponsesRequest

logger = logging.getLogger(__name__)
MAX_ERROR_BODY_CHARS = 500
MAX_PASSED_MESSAGE_CHARS = 4000
# Backend 4xx that describe this server's settings, not the caller's request.
BACKEND_SETTINGS_STATUSES = frozenset({401, 403, 404, 407})
RETRYABLE_4XX = frozenset({408, 429})
RESEND_FIRST_WAIT_S, RESEND_MAX_WAIT_S = 0.1, 1.0  # the waits before sending a call again double up to the cap
_ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 409: "conflict_error",
                413: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error"}


class BackendError(RuntimeError):
    """The backend failed; the message names its URL."""


class BackendRejected(RuntimeError):
    """The backend refused the request with a 4xx; passed through to the caller."""

    def __init__(self, status: int, message: str, type_: str | None, param: str | None, code: str | None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


class RequestError(Exception):
    """A request this server refuses before calling the backend."""

    def __init__(self, status: int, code: str, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.param = status, code, message, param


def openai_error(
    status: int, message: str, *, code: str | None, param: str | None = None, type_: str | None = None
) -> web.Response:
    """An error in the OpenAI shape; 4xx that cannot succeed on a resend say so."""
    if type_ is None:
        type_ = _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    headers = {}
    if 400 <= status < 500 and status not in RETRYABLE_4XX:
        headers["x-should-retry"] = "false"
    return web.json_response(body, status=status, headers=headers)


# pydantic puts the member type of a union into the error location (``input.str``)
_UNION_TAG = re.compile(r"^(str|int|float|bool|none|list\[.*\]|dict\[.*\])$")


def _param(loc: tuple[Any, ...]) -> str:
    """A pydantic error location as an OpenAI ``param``: ``input[0].role``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not _UNION_TAG.match(str(part)):
            out += f".{part}" if out else str(part)
    return out


def parse_responses_request(raw: bytes) -> ResponsesRequest:
    return parse_request_body(raw)[1]


def parse_request_body(raw: bytes) -> tuple[dict[str, Any], ResponsesRequest]:
    """The body as the agent sent it (what a replay's digest is taken of) and as this server reads it."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise RequestError(400, "invalid_request", "request body is not valid JSON") from None
    if not isinstance(data, dict):
        raise RequestError(400, "invalid_request", "request body must be a JSON object")
    try:
        return data, ResponsesRequest.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors()
        message = "; ".join(f"{_param(e['loc']) or '<body>'}: {e['msg']}" for e in errors)
        raise RequestError(400, "invalid_request", message, _param(errors[0]["loc"]) or None) from None


def backend_rejection(status: int, text: str) -> BackendRejected:
    """The message (and type/param/code, when given) of a backend's 4xx body, in
    the OpenAI, vLLM, FastAPI or Gym shape, or its text."""
    try:
        data: Any = json.loads(text)
    except ValueError:
        data = None
    err: Any = data.get("error", data) if isinstance(data, dict) else None
    if isinstance(err, str):
        err = {"message": err}
    message = type_ = param = code = None
    if isinstance(err, dict):
        raw = err.get("message", err.get("detail"))
        if raw is not None:
            message = raw if isinstance(raw, str) else json.dumps(raw)
        type_ = err.get("type") if isinstance(err.get("type"), str) else None
        param = err.get("param") if isinstance(err.get("param"), str) else None
        code = err.get("code") if isinstance(err.get("code"), str) else None
    if not message:
        message = text.strip() or f"the policy backend refused the request with status {status}"
    return BackendRejected(status, message[:MAX_PASSED_MESSAGE_CHARS], type_, param, code)


class BackendCuts:
    """The policy backend's generation cuts, as the model participant asks for them: pin the calls in the
    pause (counts only), fetch their tokens after resume. Any failure raises (a 404 says the backend has no
    cut support); the participant reports it and never blocks on it."""

    def __init__(self, server: "VLLMModelServer"):
        self.server = server
        self.owner = f"{server.name}-{uuid.uuid4().hex[:12]}"  # this process: one pin kept per owner

    async def _post(self, route: str, body: str) -> bytes:
        server = self.server
        base = server.global_config.policy_base_url
        if base is None or server._session is None:
            raise BackendError("no policy backend is configured")
        url = f"{base.rstrip('/')}{route}"
        headers = {"Authorization": f"Bearer {server.global_config.policy_api_key}",
                   "Content-Type": "application/json"}
        async with server._session.post(url, data=body, headers=headers) as resp:
            raw = await resp.read()
            if resp.status == 404:
                raise BackendError(f"policy backend {url} does not support generation cuts (404)")
            if resp.status != 200:
                raise BackendError(f"policy backend {url} returned {resp.status} to a cut: "
                                   f"{raw[:MAX_ERROR_BODY_CHARS].decode(errors='replace')}")
        return raw

    async def pin(self, pin: str, call_ids: list[str]) -> dict[str, int]:
        raw = await self._post(CUT_ROUTE, CutRequest(owner=self.owner, pin=pin, call_ids=call_ids).model_dump_json())
        try:
            return PinReply.model_validate_json(raw).counts
        except ValidationError as exc:
            raise BackendError(f"policy backend sent an unusable pin reply: {exc.errors()[0]['msg']}") from None

    async def fetch(self, pin: str) -> dict[str, GenerationCut]:
        raw = await self._post(CUT_FETCH_ROUTE, FetchRequest(owner=self.owner, pin=pin).model_dump_json())
        try:
            return CutReply.model_validate_json(raw).cuts
        except ValidationError as exc:
            raise BackendError(f"policy backend sent an unusable cut: {exc.errors()[0]['msg']}") from None


class VLLMModelServer(GymServer):
    server_type = "responses_api_models"
    config_model = VLLMModelConfig
    config: VLLMModelConfig

    def __init__(self, instance: ServerInstanceConfig, global_config: GymGlobalConfig):
        super().__init__(instance, global_config)
        # The gate always runs; with checkpointing off nobody ever closes it.
        self.gate = PolicyModelParticipant()
        self.gate.cut_source = BackendCuts(self)
        self.gate.record_calls = self.config.record_calls  # each episode's finished calls, for a replay
        self._session: aiohttp.ClientSession | None = None

    def make_participant(self) -> PolicyModelParticipant:
        return self.gate

    @classmethod
    def checkpoint_mode_label(cls) -> str:
        return "saves"

    def setup_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/responses", self._responses)
        app.router.add_post(f"{ROLLOUT_PREFIX}/{{capture_key}}/v1/responses", self._responses)
        app.router.add_get(REPLAY_STATS_ROUTE, self._replay_stats)

    async def on_startup(self) -> None:
        # No cap on open connections (aiohttp's default is 100): every rollout in flight may hold a
        # backend call at once, and a cap of 100 made thousands of them queue here, invisibly.
        self._session = new_client_session()

    async def on_cleanup(self) -> None:
        if self._session is not None:
            await self._session.close()

    @property
    def backend_url(self) -> str | None:
        base = self.global_config.policy_base_url
        return None if base is None else f"{base.rstrip('/')}/chat/completions"

    # -- route ---------------------------------------------------------------
    async def _responses(self, request: web.Request) -> web.StreamResponse:
        try:
            return await self._serve(request)
        except RequestError as exc:
            return openai_error(exc.status, exc.message, code=exc.code, param=exc.param)

    async def _serve(self, request: web.Request) -> web.StreamResponse:
        key = request.match_info.get("capture_key")
        if key is not None:
            try:
                EpisodeId.from_capture_key(key)
            except ValidationError as exc:
                reason = "; ".join(e["msg"] for e in exc.errors())
                raise RequestError(400, "invalid_request", f"capture key {key!r} in the path is invalid: {reason}")
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise RequestError(
                413, "payload_too_large", f"request body is over the {MAX_REQUEST_BODY_BYTES}-byte limit"
            ) from None
        data, body = parse_request_body(raw)
        try:
            chat_body = responses_to_chat(
                body,
                model=self.global_config.policy_model_name,
                return_token_ids=self.config.return_token_id_information,
            )
        except ConversionError as exc:
            raise RequestError(400, "invalid_request", exc.detail, exc.field) from None
        if self.backend_url is None:
            return openai_error(
                503, f"model server {self.name!r}: policy_base_url is not set in the Gym config",
                code="backend_not_configured",
            )
        try:
            async with self.gate.call(key) as ticket:
                plan = self.gate.plan_call(ticket, data)  # answered from the episode's record, or live
                if plan.recorded is not None:
                    resp = web.json_response(plan.reply_for_agent())
                    recorded = None  # its call is in the record already
                else:
                    resp = await self._generate(ticket, chat_body, body)
                    recorded = resp.body if resp.status == 200 else None
                    note = plan.live_note()
                    if note is not None and recorded is not None:
                        resp = web.json_response(annotated(json.loads(recorded), note))  # the record keeps it bare
                await self.gate.release_response(ticket)  # held here while a checkpoint is open
                await resp.prepare(request)
                await resp.write_eof()
                if resp.status == 200:
                    self.gate.delivered(ticket, recorded)
                return resp
        except CheckpointError as exc:
            return openai_error(exc.status, exc.detail, code=exc.code)

    async def _replay_stats(self, _: web.Request) -> web.Response:
        """Read only and unauthenticated, like ``/health``: what replays did here (``ReplayReport``)."""
        return web.json_response(self.gate.calls.report().model_dump(mode="json"))

    async def _generate(self, ticket: ModelTicket, chat_body: dict[str, Any], request: ResponsesRequest) -> web.Response:
        """The reply to write: the mapped completion, the backend's 4xx, or a 502
        naming the backend. Errors are held like replies, so no agent moves on
        while prepared. A tracked call is named to the backend (``X-NG-Call-Id``) so a
        snapshot can cut it, with its index in its episode (``X-NG-Call-Index``); a restored episode's call
        carries its saved cut, once."""
        call_index = None
        if ticket.episode is not None:
            ticket.call_id = f"{ticket.episode.capture_key}.{uuid.uuid4().hex[:12]}"
            if ticket.plan is not None and ticket.plan.index >= 0:  # its delivered count when planned
                call_index = ticket.plan.index
            cut = self.gate.take_restored_cut(ticket.episode)
            if cut is not None:
                chat_body = {**chat_body, PREFIX_FIELD: cut.model_dump()}
        try:
            reply = await self.gate.run(ticket, self._post_backend(chat_body, ticket.call_id, call_index))
            out = chat_to_responses(
                reply,
                model=self.global_config.policy_model_name,
                keep_token_ids=self.config.return_token_id_information,
                request=request,
            )
        except BackendRejected as exc:
            return openai_error(exc.status, exc.message, code=exc.code, param=exc.param, type_=exc.type)
        except BackendError as exc:
            logger.warning("model server %s: %s", self.name, exc)
            return openai_error(502, str(exc), code="backend_error")
        except BackendReplyError as exc:
            return openai_error(
                502, f"policy backend {self.backend_url} sent an unusable reply: {exc}", code="backend_error"
            )
        return web.json_response(out)

    async def _post_backend(self, chat_body: dict[str, Any], call_id: str | None = None,
                            call_index: int | None = None) -> Any:
        """The backend's reply. A backend that cannot be reached (refused, reset, closed under the call: a
        generation worker lost and being restarted) is sent the call again, with growing waits, for up to
        ``policy_unreachable_retry_s``: same call id, ``X-NG-Resend``, and the newest cut of the call the gate
        fetched as its prefix, so only the rest is decoded again (``gym_patches.checkpoint.cuts``)."""
        retry_s = self.global_config.policy_unreachable_retry_s
        loop = asyncio.get_running_loop()
        resends, first_failed = 0, None
        while True:
            try:
                return await self._post_once(chat_body, call_id, resends, call_index)
            except _Unreachable as exc:
                first_failed = loop.time() if first_failed is None else first_failed
                if loop.time() - first_failed >= retry_s:
                    why = f"; still so after {retry_s:g}s of sending it again (policy_unreachable_retry_s)" \
                        if retry_s > 0 else ""
                    raise BackendError(f"{exc}{why}") from None
                await asyncio.sleep(min(RESEND_MAX_WAIT_S, RESEND_FIRST_WAIT_S * 2 ** resends))
                resends += 1
                cut = self.gate.newest_cut(call_id)
                if cut is not None:
                    chat_body = {**chat_body, PREFIX_FIELD: cut.model_dump()}

    async def _post_once(self, chat_body: dict[str, Any], call_id: str | None, resends: int,
                         call_index: int | None = None) -> Any:
        url = self.backend_url
        assert url is not None and self._session is not None
        headers = {"Authorization": f"Bearer {self.global_config.policy_api_key}"}
        if call_id is not None:
            headers[CALL_ID_HEADER] = call_id
        if call_index is not None:
            headers[CALL_INDEX_HEADER] = str(call_index)
        if resends:
            headers[RESEND_HEADER] = str(resends)
        timeout = aiohttp.ClientTimeout(total=self.config.request_timeout_s)
        try:
            async with self._session.post(url, json=chat_body, headers=headers, timeout=timeout) as resp:
                await resp.read()
                await self.pacer.turn()  # the reply's decoding and mapping take their share of a turn
                text = await resp.text()
                if 400 <= resp.status < 500 and resp.status not in BACKEND_SETTINGS_STATUSES:
                    raise backend_rejection(resp.status, text)
                if resp.status != 200:
                    raise BackendError(f"policy backend {url} returned {resp.status}: {text[:MAX_ERROR_BODY_CHARS]}")
                try:
                    return json.loads(text)
                except ValueError:
                    raise BackendError(f"policy backend {url} returned a body that is not JSON") from None
        except asyncio.TimeoutError:
            raise BackendError(
                f"policy backend {url} did not answer within {self.config.request_timeout_s:g}s"
            ) from None
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
            raise _Unreachable(f"policy backend {url} is unreachable: {exc or type(exc).__name__}") from None
        except aiohttp.ClientError as exc:
            raise BackendError(f"policy backend {url} is unreachable: {exc}") from None


class _Unreachable(Exception):
    """The backend could not be reached, or closed the connection under the call: it may be sent again."""


SERVER = VLLMModelServer
