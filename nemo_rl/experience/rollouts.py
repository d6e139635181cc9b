"""Turn an agent's ``/run`` reply into the sample training consumes."""

from __future__ import annotations

from typing import Any

from nemo_rl.experience.sample import ModelCall, RolloutSample

_TOKEN_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")


def sample_from_run_reply(
    reply: dict[str, Any], *, rollout_id: str, group_id: str, generation_index: int, prompt_id: str,
    gym_instance_id: str | None = None,
) -> RolloutSample:
    """One ``ModelCall`` per output item that carries token information."""
    calls = []
    for item in (reply.get("response") or {}).get("output", []):
        if isinstance(item, dict) and all(f in item for f in _TOKEN_FIELDS):
            calls.append(
                ModelCall(
                    prompt_token_ids=item["prompt_token_ids"],
                    generation_token_ids=item["generation_token_ids"],
                    generation_log_probs=item["generation_log_probs"],
                    weight_version=int(item.get("weight_version", 0)),
                    prefix=item.get("prefix_continuation"),
                    replay=item.get("replay"),
                )
            )
    return RolloutSample(
        rollout_id=rollout_id,
        group_id=group_id,
        generation_index=generation_index,
        reward=float(reply["reward"]),
        calls=calls,
        prompt_id=prompt_id,
        gym_instance_id=gym_instance_id,
        restored_from=reply.get("restored_from"),
    )
