"""The office world's tables and its exact JSON export/restore.

Every table row is a pydantic model with extra keys forbidden, so a restored
state is checked field by field; ids are short strings (``E1``, ``M1``, ``T1``)
and new rows get max+1, so replaying the same calls always yields the same ids.
The clock is frozen (``now``) so dates in outputs and tables are reproducible.
"""

from __future__ import annotations

from datetime import date, datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

SCHEMA_VERSION = 1
DEFAULT_NOW = "2024-03-04 09:00"  # a Monday; the frozen clock of every world
DEFAULT_USER_EMAIL = "me@hq.co"
DATE_FMT = "%Y-%m-%d"
DATETIME_FMT = "%Y-%m-%d %H:%M"
TASK_STATUSES = ("todo", "doing", "done")
ID_PREFIX = {"events": "E", "emails": "M", "tasks": "T"}


class WorldStateError(ValueError):
    """A seed or exported state that does not describe a valid office world."""


def parse_date(value: str) -> date:
    return datetime.strptime(value, DATE_FMT).date()


def parse_datetime(value: str) -> datetime:
    return datetime.strptime(value, DATETIME_FMT)


class _Row(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class Person(_Row):
    name: str = Field(min_length=1)
    email: str = Field(pattern=r"^[^@\s]+@[^@\s]+$")
    team: str = Field(min_length=1)


class Event(_Row):
    event_id: str = Field(pattern=r"^E[1-9][0-9]*$")
    title: str = Field(min_length=1)
    start: str
    duration_minutes: int = Field(ge=1, le=24 * 60)
    attendee_email: str

    @field_validator("start")
    @classmethod
    def _start_format(cls, v: str) -> str:
        parse_datetime(v)
        return v


class Email(_Row):
    email_id: str = Field(pattern=r"^M[1-9][0-9]*$")
    folder: Literal["inbox", "sent"]
    sender: str
    to: str
    subject: str
    body: str
    sent_at: str

    @field_validator("sent_at")
    @classmethod
    def _sent_at_format(cls, v: str) -> str:
        parse_datetime(v)
        return v


class Task(_Row):
    task_id: str = Field(pattern=r"^T[1-9][0-9]*$")
    title: str = Field(min_length=1)
    assignee_email: str
    due_date: str
    status: Literal["todo", "doing", "done"] = "todo"

    @field_validator("due_date")
    @classmethod
    def _due_format(cls, v: str) -> str:
        parse_date(v)
        return v


class MutableTables(_Row):
    """The tables tools may change; ``verify`` compares exactly these."""

    events: list[Event] = Field(default_factory=list)
    emails: list[Email] = Field(default_factory=list)
    tasks: list[Task] = Field(default_factory=list)

    @model_validator(mode="after")
    def _unique_ids(self) -> "MutableTables":
        for table, key in (("events", "event_id"), ("emails", "email_id"), ("tasks", "task_id")):
            ids = [getattr(r, key) for r in getattr(self, table)]
            dup = sorted({i for i in ids if ids.count(i) > 1})
            if dup:
                raise ValueError(f"{table}: duplicate {key} {dup}")
        return self


class OfficeSeed(MutableTables):
    """A row's ``seed`` block: the directory plus the starting tables."""

    now: str = DEFAULT_NOW
    user_email: str = DEFAULT_USER_EMAIL
    people: list[Person] = Field(min_length=1)

    @field_validator("now")
    @classmethod
    def _now_format(cls, v: str) -> str:
        parse_datetime(v)
        return v

    @model_validator(mode="after")
    def _unique_people(self) -> "OfficeSeed":
        names = [p.name.lower() for p in self.people]
        emails = [p.email.lower() for p in self.people]
        if len(set(names)) != len(names) or len(set(emails)) != len(emails):
            raise ValueError("people: names and emails must be unique (case-insensitive)")
        return self


class OfficeState(OfficeSeed):
    """The full exported state; ``schema_version`` guards future changes."""

    schema_version: Literal[1] = SCHEMA_VERSION


def validate_model(model: type[BaseModel], data: Any, what: str) -> Any:
    if not isinstance(data, dict):
        raise WorldStateError(f"{what} must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise WorldStateError(f"invalid {what}: {exc}") from exc


class OfficeWorld:
    """One session's office: directory (read-only), calendar, email, task board."""

    def __init__(self, state: OfficeState):
        self.state = state

    # construction -------------------------------------------------------
    @classmethod
    def from_seed(cls, seed: Any) -> "OfficeWorld":
        parsed = validate_model(OfficeSeed, seed, "seed")
        return cls(OfficeState.model_validate(parsed.model_dump()))

    @classmethod
    def restore_state(cls, data: Any) -> "OfficeWorld":
        """Rebuild a world from :meth:`export_state` output, validating every field."""
        return cls(validate_model(OfficeState, data, "workplace state"))

    def export_state(self) -> dict:
        """Pure-JSON copy of the whole world (no shared references)."""
        return self.state.model_dump(mode="json")

    def mutable_tables(self) -> dict:
        return MutableTables(
            events=self.state.events, emails=self.state.emails, tasks=self.state.tasks
        ).model_dump(mode="json")

    # helpers used by the tools ----------------------------------------------
    @property
    def now(self) -> datetime:
        return parse_datetime(self.state.now)

    def person_by_email(self, email: str) -> Person | None:
        want = email.strip().lower()
        return next((p for p in self.state.people if p.email.lower() == want), None)

    def person_by_name(self, name: str) -> Person | None:
        want = name.strip().lower()
        return next((p for p in self.state.people if p.name.lower() == want), None)

    def next_id(self, table: str) -> str:
        prefix = ID_PREFIX[table]
        key = {"events": "event_id", "emails": "email_id", "tasks": "task_id"}[table]
        numbers = [int(getattr(r, key)[1:]) for r in getattr(self.state, table)]
        return f"{prefix}{max(numbers, default=0) + 1}"

    def call_tool(self, name: str, arguments: Any) -> str:
        """Run tool ``name``; see :mod:`.tools` for the error contract."""
        from .tools import call_tool

        return call_tool(self, name, arguments)


def seed_from_row(row: Any) -> OfficeWorld:
    """Build the world a dataset row asks for (its ``seed`` block)."""
    if not isinstance(row, dict) or "seed" not in row:
        raise WorldStateError("row has no 'seed' block")
    return OfficeWorld.from_seed(row["seed"])

