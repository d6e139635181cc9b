"""plain_loop_agent server: the simple_agent loop with no session saving.

It stands for the many upstream agents that are restart-only: checkpointing
only tracks its running ``/run`` calls (``RestartOnlyTrackingMiddleware``) and
reports them as blockers or, in best-effort mode, as unsaved.
"""

from __future__ import annotations

from typing import Any

from gym_patches.checkpoint.agent import RestartOnlyAgentParticipant, RestartOnlyTrackingMiddleware
from gym_patches.checkpoint.identity import EpisodeId
from gym_patches.responses_api_agents.loop import LoopAgentServer
from gym_patches.wire_models import RunReply


class PlainLoopAgent(LoopAgentServer):
    checkpoint_sessions_supported = False

    def make_participant(self) -> RestartOnlyAgentParticipant:
        return RestartOnlyAgentParticipant(self)

    def middlewares(self) -> list[Any]:
        if isinstance(self.participant, RestartOnlyAgentParticipant):
            return [RestartOnlyTrackingMiddleware(self.participant)]
        return []

    @classmethod
    def checkpoint_mode_label(cls) -> str:
        return "restart-only"

    async def run_rollout(self, episode: EpisodeId, row: dict[str, Any]) -> RunReply:
        return await self.episode_runner(episode, row)()


SERVER = PlainLoopAgent
