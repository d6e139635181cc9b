"""The office world: tools, error contract, exact export/restore, reward."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gym_patches.resources_servers import ToolError
from gym_patches.resources_servers.workplace import (
    DEFAULT_NOW,
    READ_ONLY_TOOLS,
    TOOL_SCHEMAS,
    OfficeWorld,
    WorldStateError,
    seed_from_row,
    verify,
)
from gym_patches.resources_servers.workplace.tools import TOOLS

PEOPLE = [
    {"name": "Ana", "email": "ana@ops.co", "team": "ops"},
    {"name": "Bo", "email": "bo@dev.co", "team": "dev"},
    {"name": "Cy", "email": "cy@hr.co", "team": "hr"},
]


def make_seed(**over) -> dict:
    seed = {
        "people": PEOPLE,
        "events": [{"event_id": "E1", "title": "Sync", "start": "2024-03-05 10:00",
                    "duration_minutes": 30, "attendee_email": "bo@dev.co"}],
        "emails": [{"email_id": "M1", "folder": "inbox", "sender": "bo@dev.co", "to": "me@hq.co",
                    "subject": "Hi", "body": "Thanks!", "sent_at": "2024-03-01 08:00"}],
        "tasks": [
            {"task_id": "T2", "title": "Fix bug", "assignee_email": "ana@ops.co",
             "due_date": "2024-03-08", "status": "todo"},
            {"task_id": "T5", "title": "Write doc", "assignee_email": "cy@hr.co",
             "due_date": "2024-03-06", "status": "doing"},
        ],
    }
    seed.update(over)
    return seed


@pytest.fixture
def world() -> OfficeWorld:
    return OfficeWorld.from_seed(make_seed())


# seeding ---------------------------------------------------------------------
def test_seed_is_deterministic_and_defaults_the_clock():
    a, b = seed_from_row({"seed": make_seed()}), seed_from_row({"seed": make_seed()})
    assert a.export_state() == b.export_state()
    assert a.export_state()["now"] == DEFAULT_NOW


@pytest.mark.parametrize(
    "row, needle",
    [
        ({}, "'seed'"),
        ({"seed": []}, "seed must be a JSON object"),
        ({"seed": make_seed(people=[])}, "people"),
        ({"seed": make_seed(colour="red")}, "colour"),
        ({"seed": make_seed(now="tomorrow")}, "now"),
        ({"seed": make_seed(people=[{**PEOPLE[0], "email": "no-at-sign"}])}, "people.0.email"),
        ({"seed": make_seed(people=PEOPLE + [{**PEOPLE[0], "team": "x"}])}, "unique"),
        ({"seed": make_seed(tasks=[{**make_seed()["tasks"][0], "due_date": "08/03/2024"}])},
         "tasks.0.due_date"),
        ({"seed": make_seed(events=[{**make_seed()["events"][0], "event_id": "X1"}])},
         "events.0.event_id"),
    ],
)
def test_bad_seed_names_the_problem(row, needle):
    with pytest.raises(WorldStateError, match=needle):
        seed_from_row(row)


# tools -----------------------------------------------------------------------
def test_directory_lookup_is_case_insensitive(world):
    assert world.call_tool("directory_find_email", {"name": "bo"}) == "bo@dev.co"
    assert world.call_tool("directory_find_email", {"name": " ANA "}) == "ana@ops.co"
    assert world.call_tool("directory_find_email", {"name": "Zed"}).startswith("Error: no person")


def test_create_event_appends_with_next_id(world):
    out = world.call_tool("calendar_create_event", {
        "title": "Demo", "start": "2024-03-06 14:00", "duration_minutes": 60,
        "attendee_email": "ANA@ops.co"})
    assert out == "Created event E2."
    assert world.export_state()["events"][-1] == {
        "event_id": "E2", "title": "Demo", "start": "2024-03-06 14:00",
        "duration_minutes": 60, "attendee_email": "ana@ops.co"}
    assert world.call_tool("calendar_search_events", {"query": "demo"}) == (
        "E2: Demo, 2024-03-06 14:00, 60 min, ana@ops.co")


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"start": "2024-03-06"}, "start must look like"),
        ({"start": "2024-03-01 10:00"}, "in the past"),
        ({"start": "2024-03-06 07:00"}, "between 09:00 and 18:00"),
        ({"start": "2024-03-06 17:30"}, "between 09:00 and 18:00"),
        ({"duration_minutes": "30"}, "duration_minutes must be an integer"),
        ({"duration_minutes": True}, "duration_minutes must be an integer"),
        ({"duration_minutes": 2}, "between 5 and 480"),
        ({"attendee_email": "zed@x.co"}, "not in the directory"),
        ({"title": "  "}, "title must be a non-empty string"),
    ],
)
def test_create_event_value_errors_leave_world_unchanged(world, change, needle):
    before = world.export_state()
    args = {"title": "Demo", "start": "2024-03-06 14:00", "duration_minutes": 60,
            "attendee_email": "ana@ops.co", **change}
    out = world.call_tool("calendar_create_event", args)
    assert out.startswith("Error:") and needle in out
    assert world.export_state() == before


def test_email_send_and_search(world):
    assert world.call_tool("email_send", {"to": "cy@hr.co", "subject": "Plan", "body": "Call me."}) \
        == "Sent email M2."
    sent = world.export_state()["emails"][-1]
    assert sent == {"email_id": "M2", "folder": "sent", "sender": "me@hq.co", "to": "cy@hr.co",
                    "subject": "Plan", "body": "Call me.", "sent_at": DEFAULT_NOW}
    assert world.call_tool("email_search", {"query": "bo@dev"}) == (
        "M1: inbox, from bo@dev.co to me@hq.co, Hi: Thanks!")
    assert world.call_tool("email_send", {"to": "zed@x.co", "subject": "a", "body": "b"}) \
        .startswith("Error:")


def test_task_ids_continue_after_the_highest(world):
    out = world.call_tool("tasks_create", {"title": "Ship app", "assignee_email": "bo@dev.co",
                                           "due_date": "2024-03-07"})
    assert out == "Created task T6."
    assert world.call_tool("tasks_search", {"query": "ship"}) == (
        "T6: Ship app, bo@dev.co, due 2024-03-07, todo")
    assert world.call_tool("tasks_create", {"title": "X", "assignee_email": "bo@dev.co",
                                            "due_date": "2024-03-01"}) == \
        "Error: due_date 2024-03-01 is in the past"


@pytest.mark.parametrize(
    "field, value, stored",
    [("status", "DONE", "done"), ("due_date", "2024-03-07", "2024-03-07"),
     ("assignee_email", "Cy@hr.co", "cy@hr.co"), ("title", "Fix bugs", "Fix bugs")],
)
def test_tasks_update_each_field(world, field, value, stored):
    assert world.call_tool("tasks_update", {"task_id": "t2", "field": field, "value": value}) \
        == "Updated task T2."
    task = world.export_state()["tasks"][0]
    assert task[field] == stored


@pytest.mark.parametrize(
    "args, needle",
    [
        ({"task_id": "T9", "field": "status", "value": "done"}, "no task with id 'T9'"),
        ({"task_id": "T2", "field": "colour", "value": "red"}, "field must be one of"),
        ({"task_id": "T2", "field": "status", "value": "later"}, "status must be one of"),
        ({"task_id": "T2", "field": "due_date", "value": "soon"}, "value must look like"),
        ({"task_id": "T2", "field": "assignee_email", "value": "zed@x.co"}, "not in the directory"),
    ],
)
def test_tasks_update_value_errors(world, args, needle):
    before = world.export_state()
    out = world.call_tool("tasks_update", args)
    assert out.startswith("Error:") and needle in out
    assert world.export_state() == before


def test_search_caps_results_and_reports_none(world):
    for i in range(7):
        world.call_tool("tasks_create", {"title": f"Job {i}", "assignee_email": "bo@dev.co",
                                         "due_date": "2024-03-07"})
    out = world.call_tool("tasks_search", {"query": "job"}).splitlines()
    assert len(out) == 6 and out[-1] == "(2 more)"
    assert world.call_tool("tasks_search", {"query": "nothing"}) == "No tasks found."
    assert world.call_tool("calendar_search_events", {"query": "zzz"}) == "No events found."


@pytest.mark.parametrize(
    "name, args, needle",
    [
        ("tasks_delete", {}, "unknown tool 'tasks_delete'"),
        ("email_send", {"to": "bo@dev.co", "subject": "a"}, "missing argument(s) 'body'"),
        ("tasks_search", {"query": "x", "page": 2}, "unknown argument(s) 'page'"),
        ("tasks_search", ["x"], "arguments must be a JSON object"),
    ],
)
def test_malformed_calls_raise_tool_error(world, name, args, needle):
    with pytest.raises(ToolError) as info:
        world.call_tool(name, args)
    assert needle in str(info.value)


def test_tool_schemas_match_the_dispatch_table():
    assert [s["name"] for s in TOOL_SCHEMAS] == list(TOOLS)
    assert len(TOOL_SCHEMAS) >= 6 and READ_ONLY_TOOLS < set(TOOLS)
    for schema in TOOL_SCHEMAS:
        assert schema["type"] == "function" and schema["strict"] is False
        assert schema["description"]
        params = schema["parameters"]
        assert params["type"] == "object" and params["additionalProperties"] is False
        assert params["required"] == list(params["properties"]) == list(TOOLS[schema["name"]].params)
        for prop in params["properties"].values():
            assert prop["type"] in ("string", "integer")
    json.dumps(TOOL_SCHEMAS)


# export / restore --------------------------------------------------------------
def test_export_is_json_and_independent(world):
    state = world.export_state()
    assert json.loads(json.dumps(state)) == state
    state["tasks"][0]["status"] = "done"
    assert world.export_state()["tasks"][0]["status"] == "todo"


def test_restore_round_trip_is_exact(world):
    world.call_tool("email_send", {"to": "cy@hr.co", "subject": "Plan", "body": "Call me."})
    state = world.export_state()
    again = OfficeWorld.restore_state(json.loads(json.dumps(state)))
    assert again.export_state() == state
    assert OfficeWorld.restore_state(again.export_state()).export_state() == state


@pytest.mark.parametrize(
    "mutate, needle",
    [
        (lambda s: s.update(schema_version=2), "schema_version"),
        (lambda s: s.update(extra=1), "extra"),
        (lambda s: s.pop("people"), "people"),
        (lambda s: s["events"][0].update(duration_minutes="30"), "events.0.duration_minutes"),
        (lambda s: s["tasks"][1].update(task_id="T2"), "duplicate task_id"),
        (lambda s: s["tasks"][0].update(status="blocked"), "tasks.0.status"),
        (lambda s: s["emails"][0].update(folder="spam"), "emails.0.folder"),
        (lambda s: s["emails"][0].pop("body"), "emails.0.body"),
    ],
)
def test_restore_rejects_bad_state(world, mutate, needle):
    state = world.export_state()
    mutate(state)
    with pytest.raises(WorldStateError, match=needle):
        OfficeWorld.restore_state(state)


def test_restore_rejects_non_object():
    with pytest.raises(WorldStateError, match="must be a JSON object"):
        OfficeWorld.restore_state("{}")


_names = st.sampled_from(["Ana", "bo", "Zed"])
_emails = st.sampled_from(["ana@ops.co", "BO@dev.co", "zed@x.co"])
_days = st.sampled_from(["2024-03-05", "2024-03-01", "bad"])
_calls = st.one_of(
    st.tuples(st.just("directory_find_email"), st.fixed_dictionaries({"name": _names})),
    st.tuples(st.just("calendar_create_event"), st.fixed_dictionaries({
        "title": st.sampled_from(["Sync", "Demo"]),
        "start": st.sampled_from(["2024-03-05 10:00", "2024-03-05 20:00", "x"]),
        "duration_minutes": st.sampled_from([30, 0, "30"]), "attendee_email": _emails})),
    st.tuples(st.just("email_send"), st.fixed_dictionaries({
        "to": _emails, "subject": st.sampled_from(["Hi", ""]), "body": st.just("Ok.")})),
    st.tuples(st.just("tasks_create"), st.fixed_dictionaries({
        "title": st.sampled_from(["A", "B"]), "assignee_email": _emails, "due_date": _days})),
    st.tuples(st.just("tasks_update"), st.fixed_dictionaries({
        "task_id": st.sampled_from(["T2", "T5", "T6", "T9"]),
        "field": st.sampled_from(["status", "due_date", "assignee_email", "title", "nope"]),
        "value": st.sampled_from(["done", "2024-03-07", "cy@hr.co", "New"])})),
    st.tuples(st.sampled_from(["tasks_search", "email_search", "calendar_search_events"]),
              st.fixed_dictionaries({"query": st.sampled_from(["a", "T", "zzz"])})),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(before=st.lists(_calls, max_size=6), after=st.lists(_calls, max_size=6))
def test_restore_mid_episode_continues_identically(before, after):
    """A world restored from an export behaves exactly like the one that kept going."""
    live = OfficeWorld.from_seed(make_seed())
    for name, args in before:
        live.call_tool(name, args)
    snap = live.export_state()
    restored = OfficeWorld.restore_state(json.loads(json.dumps(snap)))
    assert restored.export_state() == snap
    for name, args in after:
        assert restored.call_tool(name, args) == live.call_tool(name, args)
    assert restored.export_state() == live.export_state()


# verify ----------------------------------------------------------------------
def _expected_after(calls) -> dict:
    w = OfficeWorld.from_seed(make_seed())
    for name, args in calls:
        w.call_tool(name, args)
    return w.mutable_tables()


def test_verify_rewards_only_the_expected_state(world):
    mail = ("email_send", {"to": "cy@hr.co", "subject": "Plan", "body": "Call me."})
    row = {"expected_state": _expected_after([mail])}
    assert verify(world, row) == 0.0
    world.call_tool("directory_find_email", {"name": "Cy"})  # read-only calls are free
    world.call_tool("tasks_search", {"query": "fix"})
    world.call_tool(*mail)
    assert verify(world, row) == 1.0
    world.call_tool("tasks_update", {"task_id": "T2", "field": "status", "value": "done"})
    assert verify(world, row) == 0.0


def test_verify_is_case_insensitive_and_order_free(world):
    world.call_tool("email_send", {"to": "cy@hr.co", "subject": "Plan", "body": "Call me."})
    expected = world.mutable_tables()
    expected["emails"][-1]["subject"] = " PLAN "
    expected["tasks"].reverse()
    assert verify(world, {"expected_state": expected}) == 1.0
    expected["emails"][-1]["body"] = "Call you."
    assert verify(world, {"expected_state": expected}) == 0.0


def test_verify_rejects_bad_expected_state(world):
    with pytest.raises(WorldStateError, match="expected_state"):
        verify(world, {})
    with pytest.raises(WorldStateError, match="people"):
        verify(world, {"expected_state": {**world.mutable_tables(), "people": []}})
