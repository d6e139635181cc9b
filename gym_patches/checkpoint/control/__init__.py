"""Checkpoint control routes of one Gym server (docs/design.md §4.4): ``ParticipantControlPlane``.

Status codes follow one rule (``gym_patches.checkpoint.errors``): 409 when the
request is well formed but the checkpoint state refuses it; 422
``invalid_request`` when the request itself is wrong (bad body or field, or a
``deadline_ts`` that is not in the future on any route but ``resume``); 413
``payload_too_large`` for a body over ``max_body_bytes``; 401 without the
token; 500 when a participant fails unexpectedly. A 4xx never changes state.
"""

from gym_patches.checkpoint.control.http import MAX_CONTROL_BODY_BYTES
from gym_patches.checkpoint.control.phases import RESUMED_IDS_KEPT, STORED_RESULTS_KEPT
from gym_patches.checkpoint.control.plane import ParticipantControlPlane

__all__ = ["MAX_CONTROL_BODY_BYTES", "RESUMED_IDS_KEPT", "STORED_RESULTS_KEPT", "ParticipantControlPlane"]
