"""Checkpoint error codes; every control-route error is ``{"error": {code, detail}}``."""

from __future__ import annotations

from typing import ClassVar

# code -> HTTP status (409 unless noted, DESIGN §3.3)
ERROR_STATUS: dict[str, int] = {
    "unauthorized": 401,
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
