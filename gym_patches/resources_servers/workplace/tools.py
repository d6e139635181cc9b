"""The office tools: one registry drives both dispatch and ``TOOL_SCHEMAS``.

Each tool takes only string/integer arguments and returns a short string, since
a tiny policy has to read and copy these outputs. Value mistakes (unknown
person, bad date, unknown task) return ``"Error: ..."``; a malformed call
(unknown tool, unknown/missing argument) raises :class:`ToolError`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .. import ToolError, check_arguments, function_tool
from .world import (
    DATE_FMT,
    DATETIME_FMT,
    TASK_STATUSES,
    Email,
    Event,
    OfficeWorld,
    Task,
    parse_date,
    parse_datetime,
)

MAX_RESULTS = 5
WORKDAY_START_HOUR = 9
WORKDAY_END_HOUR = 18
TASK_FIELDS = ("title", "assignee_email", "due_date", "status")


class _ValueProblem(Exception):
    """Raised inside a tool; turned into an ``Error:`` output for the model."""


@dataclass(frozen=True)
class _Tool:
    name: str
    description: str
    params: dict[str, tuple[str, str]]
    fn: Callable[..., str]


def _text(args: dict, key: str) -> str:
    value = args[key]
    if not isinstance(value, str) or not value.strip():
        raise _ValueProblem(f"{key} must be a non-empty string")
    return value.strip()


def _int(args: dict, key: str) -> int:
    value = args[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise _ValueProblem(f"{key} must be an integer")
    return value


def _known_email(world: OfficeWorld, args: dict, key: str) -> str:
    person = world.person_by_email(_text(args, key))
    if person is None:
        raise _ValueProblem(f"{key} {args[key]!r} is not in the directory")
    return person.email


def _future_date(world: OfficeWorld, value: str, key: str) -> str:
    try:
        day = parse_date(value)
    except ValueError:
        raise _ValueProblem(f"{key} must look like YYYY-MM-DD, got {value!r}") from None
    if day < world.now.date():
        raise _ValueProblem(f"{key} {value} is in the past")
    return day.strftime(DATE_FMT)


def _match(query: str, *fields: str) -> bool:
    q = query.lower()
    return any(q in f.lower() for f in fields)


def _listing(lines: list[str], what: str) -> str:
    if not lines:
        return f"No {what} found."
    shown = lines[:MAX_RESULTS]
    extra = len(lines) - len(shown)
    return "\n".join(shown + ([f"({extra} more)"] if extra else []))


# directory -----------------------------------------------------------------
def directory_find_email(world: OfficeWorld, args: dict) -> str:
    name = _text(args, "name")
    person = world.person_by_name(name)
    if person is None:
        raise _ValueProblem(f"no person named {name!r}")
    return person.email


# calendar ------------------------------------------------------------------
def _event_line(e: Event) -> str:
    return f"{e.event_id}: {e.title}, {e.start}, {e.duration_minutes} min, {e.attendee_email}"


def calendar_create_event(world: OfficeWorld, args: dict) -> str:
    title = _text(args, "title")
    raw_start = _text(args, "start")
    try:
        start = parse_datetime(raw_start)
    except ValueError:
        raise _ValueProblem(f"start must look like YYYY-MM-DD HH:MM, got {raw_start!r}") from None
    duration = _int(args, "duration_minutes")
    if not 5 <= duration <= 480:
        raise _ValueProblem("duration_minutes must be between 5 and 480")
    attendee = _known_email(world, args, "attendee_email")
    if start <= world.now:
        raise _ValueProblem(f"start {raw_start} is in the past")
    end_minutes = start.hour * 60 + start.minute + duration
    if start.hour < WORKDAY_START_HOUR or end_minutes > WORKDAY_END_HOUR * 60:
        raise _ValueProblem("events must fall between 09:00 and 18:00")
    event = Event(
        event_id=world.next_id("events"),
        title=title,
        start=start.strftime(DATETIME_FMT),
        duration_minutes=duration,
        attendee_email=attendee,
    )
    world.state.events.append(event)
    return f"Created event {event.event_id}."


def calendar_search_events(world: OfficeWorld, args: dict) -> str:
    query = _text(args, "query")
    hits = [e for e in world.state.events if _match(query, e.title, e.start, e.attendee_email)]
    return _listing([_event_line(e) for e in hits], "events")


# email ---------------------------------------------------------------------
def _email_line(m: Email) -> str:
    return f"{m.email_id}: {m.folder}, from {m.sender} to {m.to}, {m.subject}: {m.body}"


def email_send(world: OfficeWorld, args: dict) -> str:
    to = _known_email(world, args, "to")
    email = Email(
        email_id=world.next_id("emails"),
        folder="sent",
        sender=world.state.user_email,
        to=to,
        subject=_text(args, "subject"),
        body=_text(args, "body"),
        sent_at=world.state.now,
    )
    world.state.emails.append(email)
    return f"Sent email {email.email_id}."


def email_search(world: OfficeWorld, args: dict) -> str:
    query = _text(args, "query")
    hits = [m for m in world.state.emails if _match(query, m.subject, m.body, m.sender, m.to)]
    return _listing([_email_line(m) for m in hits], "emails")


# tasks ---------------------------------------------------------------------
def _task_line(t: Task) -> str:
    return f"{t.task_id}: {t.title}, {t.assignee_email}, due {t.due_date}, {t.status}"


def tasks_create(world: OfficeWorld, args: dict) -> str:
    title = _text(args, "title")
    assignee = _known_email(world, args, "assignee_email")
    due = _future_date(world, _text(args, "due_date"), "due_date")
    task = Task(task_id=world.next_id("tasks"), title=title, assignee_email=assignee, due_date=due)
    world.state.tasks.append(task)
    return f"Created task {task.task_id}."


def tasks_update(world: OfficeWorld, args: dict) -> str:
    task_id = _text(args, "task_id").upper()
    task = next((t for t in world.state.tasks if t.task_id == task_id), None)
    if task is None:
        raise _ValueProblem(f"no task with id {args['task_id']!r}")
    field = _text(args, "field").lower()
    if field not in TASK_FIELDS:
        raise _ValueProblem(f"field must be one of {', '.join(TASK_FIELDS)}, got {args['field']!r}")
    if field == "assignee_email":
        value = _known_email(world, args, "value")
    elif field == "due_date":
        value = _future_date(world, _text(args, "value"), "value")
    elif field == "status":
        value = _text(args, "value").lower()
        if value not in TASK_STATUSES:
            raise _ValueProblem(f"status must be one of {', '.join(TASK_STATUSES)}")
    else:
        value = _text(args, "value")
    setattr(task, field, value)
    return f"Updated task {task.task_id}."


def tasks_search(world: OfficeWorld, args: dict) -> str:
    query = _text(args, "query")
    hits = [t for t in world.state.tasks if _match(query, t.title, t.assignee_email, t.status)]
    return _listing([_task_line(t) for t in hits], "tasks")


_S = "string"
_TOOLS: tuple[_Tool, ...] = (
    _Tool("directory_find_email", "Find a person's email by name.",
          {"name": (_S, "Person name, e.g. Ana.")}, directory_find_email),
    _Tool("calendar_create_event", "Create a calendar event with one attendee.",
          {"title": (_S, "Event title."),
           "start": (_S, "Start as YYYY-MM-DD HH:MM."),
           "duration_minutes": ("integer", "Length in minutes."),
           "attendee_email": (_S, "Attendee email.")}, calendar_create_event),
    _Tool("calendar_search_events", "Search events by title, start or attendee.",
          {"query": (_S, "Text to look for.")}, calendar_search_events),
    _Tool("email_send", "Send an email.",
          {"to": (_S, "Recipient email."), "subject": (_S, "Subject."), "body": (_S, "Body.")},
          email_send),
    _Tool("email_search", "Search emails by subject, body or address.",
          {"query": (_S, "Text to look for.")}, email_search),
    _Tool("tasks_create", "Create a task on the board.",
          {"title": (_S, "Task title."),
           "assignee_email": (_S, "Assignee email."),
           "due_date": (_S, "Due date as YYYY-MM-DD.")}, tasks_create),
    _Tool("tasks_update", "Change one field of a task.",
          {"task_id": (_S, "Task id, e.g. T2."),
           "field": (_S, "One of title, assignee_email, due_date, status."),
           "value": (_S, "New value; status is todo, doing or done.")}, tasks_update),
    _Tool("tasks_search", "Search tasks by title, assignee or status.",
          {"query": (_S, "Text to look for.")}, tasks_search),
)
TOOLS: dict[str, _Tool] = {t.name: t for t in _TOOLS}
TOOL_SCHEMAS: list[dict] = [function_tool(t.name, t.description, t.params) for t in _TOOLS]
READ_ONLY_TOOLS = frozenset({"directory_find_email", "calendar_search_events", "email_search", "tasks_search"})


def call_tool(world: OfficeWorld, name: str, arguments: Any) -> str:
    """Dispatch one call; a failed call leaves the world unchanged."""
    tool = TOOLS.get(name)
    if tool is None:
        raise ToolError(f"unknown tool {name!r}")
    args = check_arguments(name, arguments, tool.params)
    try:
        return tool.fn(world, args)
    except _ValueProblem as exc:
        return f"Error: {exc}"


__all__ = ["TOOL_SCHEMAS", "TOOLS", "READ_ONLY_TOOLS", "call_tool", "ToolError"]
