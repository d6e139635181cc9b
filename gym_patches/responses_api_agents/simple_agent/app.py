"""simple_agent server: ``POST /run`` with session checkpointing (docs/design.md §4.5).

Each run is hosted by ``AgentSessionParticipant``, which parks it at a loop
boundary when a checkpoint is prepared and can continue it after a restore.
"""

from __future__ import annotations

from typing import Any

from gym_patches.checkpoint.agent import AgentSessionParticipant
from gym_patches.checkpoint.identity import EpisodeId
from gym_patches.responses_api_agents.loop import LoopAgentServer
from gym_patches.wire_models import RunReply


class SimpleAgent(LoopAgentServer):
    checkpoint_sessions_supported = True

    def make_participant(self) -> AgentSessionParticipant:
        return AgentSessionParticipant(self)

    @classmethod
    def checkpoint_mode_label(cls) -> str:
        return "saves"

    def needs_row(self, episode: EpisodeId) -> bool:
        participant = self.participant
        return not (isinstance(participant, AgentSessionParticipant) and participant.is_restored(episode.capture_key))

    async def run_rollout(self, episode: EpisodeId, row: dict[str, Any]) -> RunReply:
        runner = self.episode_runner(episode, row)
        if isinstance(self.participant, AgentSessionParticipant):
            return await self.participant.run_session(episode, runner)
        return await runner()


SERVER = SimpleAgent
