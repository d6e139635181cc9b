"""Write the example Gym datasets (workplace, python sandbox, arithmetic, mixed) as JSONL.

Rows are tiny and regular on purpose: a character-level policy trained for a
few minutes on two CPU cores has to learn them. Every task needs two tool
turns where the second call copies something only the first call's *output*
reveals (an email, a task id, a hidden value), then a final "Done.".

Expected results are written down from the task's meaning, not by running the
tools, so replaying ``ground_truth`` in a fresh world is a real check of the
tools. Output is deterministic: the same arguments give byte-identical files.

    python examples/data/make_gym_data.py [--out-dir examples/data]
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

_REPO_ROOT = Path(__file__).resolve().parents[2]
if str(_REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(_REPO_ROOT))

from gym_patches.resources_servers.arithmetic_verifier import TOOL_SCHEMAS as ARITHMETIC_TOOLS  # noqa: E402
from gym_patches.resources_servers.arithmetic_verifier import evaluate as evaluate_arithmetic  # noqa: E402
from gym_patches.resources_servers.python_sandbox import TOOL_SCHEMAS as SANDBOX_TOOLS  # noqa: E402
from gym_patches.resources_servers.workplace import (  # noqa: E402
    DEFAULT_NOW,
    DEFAULT_USER_EMAIL,
    TOOL_SCHEMAS as WORKPLACE_TOOLS,
)

DEFAULT_SEED = 1234
WORKPLACE_AGENT = "workplace_simple_agent"
RESTART_ONLY_AGENT = "workplace_restart_only_agent"
SANDBOX_AGENT = "sandbox_simple_agent"
ARITHMETIC_AGENT = "arithmetic_simple_agent"
FINAL_ANSWER = "Done."
WORKPLACE_SYSTEM = "Use the tools to do the task, then say Done."
SANDBOX_SYSTEM = "Use python_exec to do the task, then say Done."
ARITHMETIC_SYSTEM = "Use calculate, then answer with the number only."

NAMES = ["Ana", "Bo", "Cy", "Dee", "Eli", "Fay", "Gus", "Ivy"]
TEAMS = ["ops", "dev", "ads", "hr"]
EVENT_TITLES = ["Sync", "Demo", "Lunch", "Review", "Retro"]
TASK_TITLES = ["Fix bug", "Write doc", "Ship app", "Test UI", "Plan trip"]
SUBJECTS = ["Hi", "Update", "Notes", "Plan"]
BODIES = ["See you soon.", "Thanks!", "Call me.", "All good."]
DAYS = ["2024-03-05", "2024-03-06", "2024-03-07", "2024-03-08"]
HOURS = ["09:00", "10:00", "11:00", "14:00", "15:00", "16:00"]
DURATIONS = [30, 60]
PEOPLE_PER_WORLD = 5
SANDBOX_VARS = ["x", "y", "n", "k"]
SANDBOX_LISTS = ["xs", "ys", "vals"]
SANDBOX_OPS = {"plus": "+", "times": "*", "minus": "-"}


def _call(tool: str, /, **arguments) -> dict:
    return {"name": tool, "arguments": arguments}


def _next_id(rows: list[dict], key: str, prefix: str) -> str:
    return f"{prefix}{max((int(r[key][1:]) for r in rows), default=0) + 1}"


# workplace -------------------------------------------------------------------
def _office_seed(rng: random.Random) -> dict:
    names = rng.sample(NAMES, PEOPLE_PER_WORLD)
    people = []
    for name in names:
        team = rng.choice(TEAMS)
        people.append({"name": name, "email": f"{name.lower()}@{team}.co", "team": team})
    emails = [p["email"] for p in people]
    events = [
        {"event_id": f"E{i + 1}", "title": rng.choice(EVENT_TITLES),
         "start": f"{rng.choice(DAYS)} {rng.choice(HOURS)}",
         "duration_minutes": rng.choice(DURATIONS), "attendee_email": rng.choice(emails)}
        for i in range(rng.randint(1, 2))
    ]
    inbox = [
        {"email_id": f"M{i + 1}", "folder": "inbox", "sender": rng.choice(emails),
         "to": DEFAULT_USER_EMAIL, "subject": rng.choice(SUBJECTS), "body": rng.choice(BODIES),
         "sent_at": f"2024-03-0{1 + i} 08:00"}
        for i in range(rng.randint(1, 2))
    ]
    tasks = [
        {"task_id": f"T{i + 1}", "title": title, "assignee_email": rng.choice(emails),
         "due_date": rng.choice(DAYS), "status": rng.choice(["todo", "doing"])}
        for i, title in enumerate(rng.sample(TASK_TITLES, 3))
    ]
    return {"now": DEFAULT_NOW, "user_email": DEFAULT_USER_EMAIL, "people": people,
            "events": events, "emails": inbox, "tasks": tasks}


def _tables(seed: dict) -> dict:
    return {t: copy.deepcopy(seed[t]) for t in ("events", "emails", "tasks")}


# Each template returns (user prompt, ground-truth calls, expected tables).
def _wp_book(rng: random.Random, seed: dict) -> tuple[str, list, dict]:
    person = rng.choice(seed["people"])
    title, day, hour, dur = (rng.choice(EVENT_TITLES), rng.choice(DAYS), rng.choice(HOURS),
                             rng.choice(DURATIONS))
    start = f"{day} {hour}"
    expected = _tables(seed)
    expected["events"].append({
        "event_id": _next_id(expected["events"], "event_id", "E"), "title": title,
        "start": start, "duration_minutes": dur, "attendee_email": person["email"]})
    calls = [_call("directory_find_email", name=person["name"]),
             _call("calendar_create_event", title=title, start=start, duration_minutes=dur,
                   attendee_email=person["email"])]
    return f"Book {title} with {person['name']} on {start} for {dur} min.", calls, expected


def _email_entry(expected: dict, to: str, subject: str, body: str) -> dict:
    return {"email_id": _next_id(expected["emails"], "email_id", "M"), "folder": "sent",
            "sender": DEFAULT_USER_EMAIL, "to": to, "subject": subject, "body": body,
            "sent_at": DEFAULT_NOW}


def _wp_mail(rng: random.Random, seed: dict) -> tuple[str, list, dict]:
    person = rng.choice(seed["people"])
    subject, body = rng.choice(SUBJECTS), rng.choice(BODIES)
    expected = _tables(seed)
    expected["emails"].append(_email_entry(expected, person["email"], subject, body))
    calls = [_call("directory_find_email", name=person["name"]),
             _call("email_send", to=person["email"], subject=subject, body=body)]
    return f"Email {person['name']} subject {subject} body {body}", calls, expected


def _wp_assign(rng: random.Random, seed: dict) -> tuple[str, list, dict]:
    person = rng.choice(seed["people"])
    taken = {t["title"] for t in seed["tasks"]}
    title = rng.choice([t for t in TASK_TITLES if t not in taken])
    due = rng.choice(DAYS)
    expected = _tables(seed)
    expected["tasks"].append({
        "task_id": _next_id(expected["tasks"], "task_id", "T"), "title": title,
        "assignee_email": person["email"], "due_date": due, "status": "todo"})
    calls = [_call("directory_find_email", name=person["name"]),
             _call("tasks_create", title=title, assignee_email=person["email"], due_date=due)]
    return f"Assign {title} to {person['name']} due {due}.", calls, expected


def _wp_update(rng: random.Random, seed: dict) -> tuple[str, list, dict]:
    expected = _tables(seed)
    task = rng.choice(expected["tasks"])
    if rng.random() < 0.5:
        field = "status"
        value = rng.choice([s for s in ("doing", "done") if s != task["status"]])
        prompt = f"Mark task {task['title']} as {value}."
    else:
        field = "due_date"
        value = rng.choice([d for d in DAYS if d != task["due_date"]])
        prompt = f"Move task {task['title']} to {value}."
    calls = [_call("tasks_search", query=task["title"]),
             _call("tasks_update", task_id=task["task_id"], field=field, value=value)]
    task[field] = value
    return prompt, calls, expected


def _wp_owner_mail(rng: random.Random, seed: dict) -> tuple[str, list, dict]:
    task = rng.choice(seed["tasks"])
    subject, body = rng.choice(SUBJECTS), rng.choice(BODIES)
    expected = _tables(seed)
    expected["emails"].append(_email_entry(expected, task["assignee_email"], subject, body))
    calls = [_call("tasks_search", query=task["title"]),
             _call("email_send", to=task["assignee_email"], subject=subject, body=body)]
    return f"Email the owner of {task['title']} subject {subject} body {body}", calls, expected


WORKPLACE_TEMPLATES: list[Callable[[random.Random, dict], tuple[str, list, dict]]] = [
    _wp_book, _wp_mail, _wp_assign, _wp_update, _wp_owner_mail,
]


def _row(row_id: str, source: str, agent: str, system: str, user: str, tools: list,
         max_output_tokens: int) -> dict:
    return {
        "id": row_id,
        "task_source": source,
        "agent_ref": {"name": agent},
        "responses_create_params": {
            "input": [{"role": "system", "content": system}, {"role": "user", "content": user}],
            "tools": copy.deepcopy(tools),
            "temperature": 1.0,
            "max_output_tokens": max_output_tokens,
        },
    }


def workplace_rows(n: int, split: str, *, agent: str = WORKPLACE_AGENT, seed: int = DEFAULT_SEED,
                   max_output_tokens: int = 96) -> list[dict]:
    """``n`` workplace rows; templates cycle so each appears about equally often."""
    rng = random.Random(f"{seed}:workplace:{split}")
    rows = []
    for i in range(n):
        office = _office_seed(rng)
        prompt, calls, expected = WORKPLACE_TEMPLATES[i % len(WORKPLACE_TEMPLATES)](rng, office)
        row = _row(f"workplace-{split}-{i:04d}", "workplace", agent, WORKPLACE_SYSTEM, prompt,
                   WORKPLACE_TOOLS, max_output_tokens)
        row.update(seed=office, expected_state=expected, ground_truth=calls,
                   final_answer=FINAL_ANSWER)
        rows.append(row)
    return rows


# python sandbox ----------------------------------------------------------------
def sandbox_rows(n: int, split: str, *, agent: str = SANDBOX_AGENT, seed: int = DEFAULT_SEED,
                 max_output_tokens: int = 96) -> list[dict]:
    """``n`` sandbox rows: print a hidden value, then compute ``answer`` from it."""
    rng = random.Random(f"{seed}:sandbox:{split}")
    rows = []
    for i in range(n):
        word = rng.choice(sorted(SANDBOX_OPS))
        op = SANDBOX_OPS[word]
        if i % 2 == 0:
            name, value = rng.choice(SANDBOX_VARS), rng.randint(2, 9)
            setup, shown = f"{name} = {value}", name
        else:
            name = rng.choice(SANDBOX_LISTS)
            items = [rng.randint(1, 9) for _ in range(rng.randint(2, 6))]
            value, setup, shown = len(items), f"{name} = {items!r}", f"len({name})"
        const = rng.choice([c for c in range(1, 10) if c != value])
        prompt = f"Print {shown}, then set answer to that {word} {const}."
        answer = {"+": value + const, "*": value * const, "-": value - const}[op]
        row = _row(f"sandbox-{split}-{i:04d}", "python_sandbox", agent, SANDBOX_SYSTEM, prompt,
                   SANDBOX_TOOLS, max_output_tokens)
        row.update(
            seed={"setup": setup},
            expected_answer=repr(answer),
            ground_truth=[_call("python_exec", code=f"print({shown})"),
                          _call("python_exec", code=f"answer = {value} {op} {const}")],
            final_answer=FINAL_ANSWER,
        )
        rows.append(row)
    return rows


# arithmetic (stateless verifier) ------------------------------------------------
def arithmetic_rows(n: int, split: str, *, agent: str = ARITHMETIC_AGENT, seed: int = DEFAULT_SEED,
                    max_output_tokens: int = 96) -> list[dict]:
    """``n`` rows: compute an expression with ``calculate``, answer with the number (reward: exact match)."""
    rng = random.Random(f"{seed}:arithmetic:{split}")
    words = {"+": "plus", "-": "minus", "*": "times"}
    rows = []
    for i in range(n):
        a, b, c = rng.randint(2, 19), rng.randint(2, 9), rng.randint(2, 9)
        op1, op2 = rng.choice(sorted(words)), rng.choice(sorted(words))
        expression = f"({a} {op1} {b}) {op2} {c}"
        prompt = f"What is {a} {words[op1]} {b}, then {words[op2]} {c}?"
        row = _row(f"arithmetic-{split}-{i:04d}", "arithmetic", agent, ARITHMETIC_SYSTEM, prompt,
                   ARITHMETIC_TOOLS, max_output_tokens)
        answer = str(evaluate_arithmetic(expression))
        row.update(expected_answer=answer, ground_truth=[_call("calculate", expression=expression)],
                   final_answer=answer)
        rows.append(row)
    return rows


def interleave(*sources: Sequence[dict]) -> list[dict]:
    """Round-robin over ``sources`` until every row is placed (a step sees every kind of row)."""
    out: list[dict] = []
    for i in range(max((len(s) for s in sources), default=0)):
        out.extend(copy.deepcopy(s[i]) for s in sources if i < len(s))
    return out


# mixed ------------------------------------------------------------------------
def mixed_rows(workplace: Sequence[dict], sandbox: Sequence[dict], *,
               workplace_agents: Sequence[str] = (WORKPLACE_AGENT, RESTART_ONLY_AGENT),
               sandbox_agent: str = SANDBOX_AGENT) -> list[dict]:
    """Workplace rows alternate over ``workplace_agents``; sandbox rows are spread evenly."""
    if not workplace_agents:
        raise ValueError("workplace_agents must name at least one agent")
    wp = [copy.deepcopy(r) for r in workplace]
    for i, row in enumerate(wp):
        row["agent_ref"] = {"name": workplace_agents[i % len(workplace_agents)]}
    sb = [copy.deepcopy(r) for r in sandbox]
    for row in sb:
        row["agent_ref"] = {"name": sandbox_agent}
    out: list[dict] = []
    total = len(wp) + len(sb)
    wi = si = 0
    for k in range(total):  # place sandbox row j at about position (j + 1) * total / (len(sb) + 1)
        want_sb = si < len(sb) and (wi >= len(wp) or (k + 1) * (len(sb) + 1) >= (si + 1) * total)
        if want_sb:
            out.append(sb[si])
            si += 1
        else:
            out.append(wp[wi])
            wi += 1
    return out


def write_jsonl(path: Path, rows: Sequence[dict]) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=True) + "\n")


SIZES = {"workplace_train": 256, "workplace_val": 32, "sandbox_train": 64, "sandbox_val": 16,
         "arithmetic_train": 64, "arithmetic_val": 16}


def generate(out_dir: Path, *, seed: int = DEFAULT_SEED, workplace_agent: str = WORKPLACE_AGENT,
             restart_only_agent: str = RESTART_ONLY_AGENT, sandbox_agent: str = SANDBOX_AGENT,
             max_output_tokens: int = 96, sizes: dict[str, int] | None = None) -> list[Path]:
    """Write every dataset file into ``out_dir``; returns their paths."""
    sizes = {**SIZES, **(sizes or {})}
    unknown = sorted(set(sizes) - set(SIZES))
    if unknown:
        raise ValueError(f"unknown size key(s) {unknown}; known: {sorted(SIZES)}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    kw = {"seed": seed, "max_output_tokens": max_output_tokens}
    files: dict[str, list[dict]] = {}
    for split in ("train", "val"):
        wp = workplace_rows(sizes[f"workplace_{split}"], split, agent=workplace_agent, **kw)
        sb = sandbox_rows(sizes[f"sandbox_{split}"], split, agent=sandbox_agent, **kw)
        files[f"workplace_{split}"] = wp
        files[f"sandbox_{split}"] = sb
        files[f"mixed_{split}"] = mixed_rows(
            wp, sb, workplace_agents=(workplace_agent, restart_only_agent), sandbox_agent=sandbox_agent)
        ar = arithmetic_rows(sizes[f"arithmetic_{split}"], split, **kw)
        files[f"arithmetic_{split}"] = ar
        # two shards: 'saving' (workplace + arithmetic) and 'mixed' (restart-only agent + sandbox)
        files[f"mixed_shards_{split}"] = interleave(files[f"mixed_{split}"], ar)
    paths = []
    for name, rows in files.items():
        path = out_dir / f"{name}.jsonl"
        write_jsonl(path, rows)
        paths.append(path)
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent)
    p.add_argument("--seed", type=int, default=DEFAULT_SEED)
    p.add_argument("--workplace-agent", default=WORKPLACE_AGENT)
    p.add_argument("--restart-only-agent", default=RESTART_ONLY_AGENT,
                   help="second agent that half the mixed workplace rows use")
    p.add_argument("--sandbox-agent", default=SANDBOX_AGENT)
    p.add_argument("--max-output-tokens", type=int, default=96)
    for key, n in SIZES.items():
        p.add_argument(f"--n-{key.replace('_', '-')}", type=int, default=n, dest=f"n_{key}")
    args = p.parse_args(argv)
    for key in SIZES:
        if getattr(args, f"n_{key}") < 0:
            p.error(f"--n-{key.replace('_', '-')} must be >= 0")
    if args.max_output_tokens < 1:
        p.error("--max-output-tokens must be >= 1")
    paths = generate(
        args.out_dir, seed=args.seed, workplace_agent=args.workplace_agent,
        restart_only_agent=args.restart_only_agent, sandbox_agent=args.sandbox_agent,
        max_output_tokens=args.max_output_tokens,
        sizes={key: getattr(args, f"n_{key}") for key in SIZES})
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
