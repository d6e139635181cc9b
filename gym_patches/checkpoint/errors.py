"""Checkpoint error codes; every control-route error is ``{"error": {code, detail}}``.

The status-code rule (docs/design.md, "Control routes"):

- 409: the request is well formed, but the server's checkpoint state refuses it
  now (another checkpoint is active, wrong phase, an id already resumed, ...).
- 422 ``invalid_request``: the request itself is wrong and can never succeed as
  sent: the body is not a JSON object, a field is missing, extra, of the wrong
  type or out of range, or ``deadline_ts`` is not in the future (every route
  but ``resume``). The detail names the field.
- 422 ``invalid_checkpoint_state``: the checkpoint files the request names are
  missing, torn, or cannot be installed.
- 400 ``rollout_id_required``, 401 ``unauthorized``, 413 ``payload_too_large``
  (body over the cap), 500 ``internal_error`` (a participant bug; the server
  keeps serving).

No 4xx changes the phase or any record.
"""

from __future__ import annotations

from typing import ClassVar

# code -> HTTP status: 409 for state conflicts, the others as listed above.
ERROR_STATUS: dict[str, int] = {
    "unauthorized": 401,
    "payload_too_large": 413,
    "invalid_request": 422,
    "rollout_id_required": 400,
    "stale_checkpoint": 409,
    "checkpoint_conflict": 409,
    "invalid_phase": 409,
    "deadline_exceeded": 409,
    "stale_attempt": 409,
    "admission_closed": 409,
    "restart_in_scope": 409,
    "activation_out_of_order": 409,
    "invalid_checkpoint_state": 422,
    "internal_error": 500,
}


class CheckpointError(Exception):
    """An error a participant reports to its caller with a stable code."""

    code: ClassVar[str] = "invalid_checkpoint_state"

    def __init__(self, detail: str, *, code: str | None = None):
        super().__init__(detail)
        self.detail = detail
        if code is not None:
            if code not in ERROR_STATUS:
                raise ValueError(f"unknown checkpoint error code {code!r}")
            self.code = code  # type: ignore[misc]

    @property
    def status(self) -> int:
        return ERROR_STATUS[self.code]

    def to_body(self) -> dict:
        return {"error": {"code": self.code, "detail": self.detail}}


class AdmissionClosedError(CheckpointError):
    """New work refused while a checkpoint holds the server closed."""

    code = "admission_closed"


class StaleAttemptError(CheckpointError):
    """A call for an attempt that was retired (or superseded by a restore)."""

    code = "stale_attempt"


class CheckpointStoreError(CheckpointError):
    """A checkpoint file is missing, torn or does not match its manifest."""

    code = "invalid_checkpoint_state"
