"""Policy model server: Responses API in front of a chat-completions backend.

Upstream counterpart: ``responses_api_models/vllm_model``. Agents call
``/ng-rollout/<capture_key>/v1/responses`` so every generation belongs to an
episode; the checkpoint gate (``gym_patches.checkpoint.model``) holds replies
while a checkpoint is being taken. Plain ``/v1/responses`` is not tracked by
checkpoints but still waits while admission is closed.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp
from aiohttp import web
from pydantic import Field, ValidationError

from gym_patches.checkpoint.errors import CheckpointError
from gym_patches.checkpoint.identity import EpisodeId
from gym_patches.checkpoint.model import ModelTicket, PolicyModelParticipant
from gym_patches.config import GymGlobalConfig, ServerInstanceConfig
from gym_patches.responses_api_models.vllm_model.converter import (
    BackendReplyError,
    ConversionError,
    chat_to_responses,
    responses_to_chat,
)
from gym_patches.server_utils import GymServer, ServerConfigBase, json_error, read_json_model
from gym_patches.wire_models import ROLLOUT_PREFIX, ResponsesRequest

logger = logging.getLogger(__name__)
MAX_ERROR_BODY_CHARS = 500


class VLLMModelConfig(ServerConfigBase):
    return_token_id_information: bool = True  # ask for and pass through token ids + logprobs
    request_timeout_s: float = Field(default=600.0, gt=0)  # per backend call


class BackendError(RuntimeError):
    """The backend failed; the message names its URL."""


class VLLMModelServer(GymServer):
    server_type = "responses_api_models"
    config_model = VLLMModelConfig
    config: VLLMModelConfig

    def __init__(self, instance: ServerInstanceConfig, global_config: GymGlobalConfig):
        super().__init__(instance, global_config)
        # The gate always runs; with checkpointing off nobody ever closes it.
        self.gate = PolicyModelParticipant()
        self._session: aiohttp.ClientSession | None = None

    def make_participant(self) -> PolicyModelParticipant:
        return self.gate

    @classmethod
    def checkpoint_mode_label(cls) -> str:
        return "saves"

    def setup_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/responses", self._responses)
        app.router.add_post(f"{ROLLOUT_PREFIX}/{{capture_key}}/v1/responses", self._responses)

    async def on_startup(self) -> None:
        self._session = aiohttp.ClientSession()

    async def on_cleanup(self) -> None:
        if self._session is not None:
            await self._session.close()

    @property
    def backend_url(self) -> str | None:
        base = self.global_config.policy_base_url
        return None if base is None else f"{base.rstrip('/')}/chat/completions"

    # -- route ---------------------------------------------------------------
    async def _responses(self, request: web.Request) -> web.StreamResponse:
        key = request.match_info.get("capture_key")
        if key is not None:
            try:
                EpisodeId.from_capture_key(key)
            except ValidationError as exc:
                reason = "; ".join(e["msg"] for e in exc.errors())
                return json_error(422, "invalid_request", f"capture key {key!r} in the path is invalid: {reason}")
        body = await read_json_model(request, ResponsesRequest)
        try:
            chat_body = responses_to_chat(
                body,
                model=self.global_config.policy_model_name,
                return_token_ids=self.config.return_token_id_information,
            )
        except ConversionError as exc:
            return json_error(422, "invalid_request", exc.detail)
        if self.backend_url is None:
            return json_error(
                503, "backend_not_configured", f"model server {self.name!r}: policy_base_url is not set in the Gym config"
            )
        try:
            async with self.gate.call(key) as ticket:
                resp = await self._generate(ticket, chat_body)
                await self.gate.release_response(ticket)  # held here while a checkpoint is open
                await resp.prepare(request)
                await resp.write_eof()
                if resp.status == 200:
                    self.gate.delivered(ticket)
                return resp
        except CheckpointError as exc:
            return web.json_response(exc.to_body(), status=exc.status)

    async def _generate(self, ticket: ModelTicket, chat_body: dict[str, Any]) -> web.Response:
        """The reply to write: the mapped completion, or a 502 naming the backend.
        Errors are held like replies, so no agent moves on while prepared."""
        try:
            reply = await self.gate.run(ticket, self._post_backend(chat_body))
            out = chat_to_responses(
                reply,
                model=self.global_config.policy_model_name,
                keep_token_ids=self.config.return_token_id_information,
            )
        except BackendError as exc:
            logger.warning("model server %s: %s", self.name, exc)
            return json_error(502, "backend_error", str(exc))
        except BackendReplyError as exc:
            return json_error(502, "backend_error", f"policy backend {self.backend_url} sent an unusable reply: {exc}")
        return web.json_response(out)

    async def _post_backend(self, chat_body: dict[str, Any]) -> Any:
        url = self.backend_url
        assert url is not None and self._session is not None
        headers = {"Authorization": f"Bearer {self.global_config.policy_api_key}"}
        timeout = aiohttp.ClientTimeout(total=self.config.request_timeout_s)
        try:
            async with self._session.post(url, json=chat_body, headers=headers, timeout=timeout) as resp:
                text = await resp.text()
                if resp.status != 200:
                    raise BackendError(f"policy backend {url} returned {resp.status}: {text[:MAX_ERROR_BODY_CHARS]}")
                try:
                    return await resp.json(content_type=None)
                except ValueError:
                    raise BackendError(f"policy backend {url} returned a body that is not JSON") from None
        except asyncio.TimeoutError:
            raise BackendError(
                f"policy backend {url} did not answer within {self.config.request_timeout_s:g}s"
            ) from None
        except aiohttp.ClientError as exc:
            raise BackendError(f"policy backend {url} is unreachable: {exc}") from None


SERVER = VLLMModelServer
