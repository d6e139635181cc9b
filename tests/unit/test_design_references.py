"""Every section a docstring or comment cites as ``docs/design.md §N[.M]`` (also each ``§`` listed right after
it: ``docs/design.md §5.3, §5.5``) is a section heading of ``docs/design.md``, is about what the citing text
talks about, and no old-style ``DESIGN §`` reference is left.

"About what the citing text talks about": a citation followed by a quoted name (``§5.8, "Hung Gym servers"``)
must quote the title of the section or of one of its subsections, or one of its bold run-in headings; and
the text around every citation (the citing line, the seven before it and the four after) must share at least
one topic word with the section: a word of its title or of its row in ``TOPICS``. A citation of §5.4 for
what §5.8 says fails when nothing around it speaks of snapshots."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROOTS = ("nemo_rl", "gym_patches", "testkit", "examples", "tests")
SELF = Path(__file__).resolve()
REFERENCE = re.compile(r"docs/design\.md\s+(§\d+(?:\.\d+)*(?:\s*(?:,|;|and)\s*§\d+(?:\.\d+)*)*)")
SECTION = re.compile(r"§(\d+(?:\.\d+)*)")
HEADING = re.compile(r"^#{2,}\s+(\d+(?:\.\d+)*)\.?\s+\S", re.MULTILINE)


def _sources() -> list[Path]:
    return sorted(p for root in ROOTS for p in (REPO / root).rglob("*.py") if p.resolve() != SELF)


def _sections() -> set[str]:
    return set(HEADING.findall((REPO / "docs" / "design.md").read_text()))


def test_every_design_section_cited_exists():
    sections = _sections()
    cited, missing = 0, []
    for path in _sources():
        text = path.read_text()
        for match in REFERENCE.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            for number in SECTION.findall(match.group(1)):
                cited += 1
                if number not in sections:
                    missing.append(f"{path.relative_to(REPO)}:{line} cites docs/design.md §{number}")
    assert missing == [], (f"sections docs/design.md does not have (it has {sorted(sections)}):\n"
                           + "\n".join(missing))
    assert cited > 30  # the scan finds the references it checks


def test_no_old_style_design_reference_is_left():
    old = [f"{p.relative_to(REPO)}:{n}" for p in _sources()
           for n, line in enumerate(p.read_text().splitlines(), 1) if "DESIGN §" in line]
    assert old == [], "cite docs/design.md §N instead of DESIGN §N:\n" + "\n".join(old)


def test_the_headings_are_read():
    sections = _sections()
    assert {"1", "4.4", "4.5", "5.10", "5.11"} <= sections and "3.4" not in sections


# Section -> the words a text citing it must use at least one of (besides the words of the section's title).
# A subsection (5.4.2) also takes its parent's row. Matched case-insensitively at the start of a word.
TOPICS: dict[str, tuple[str, ...]] = {
    "1": ("restart-only", "stall", "block", "problem"),
    "2": ("restart-only", "best_effort", "best effort", "allow_restart_only", "unsaved", "fix"),
    "3": ("layout", "imports", "client surface", "map"),
    "3.1": ("map", "path", "newcomer"),
    "4.1": ("episode", "capture key", "capture_key", "attempt", "rollout_id", "identity"),
    "4.2": ("server", "kind", "launch", "head server", "deployment"),
    "4.3": ("responses", "model server", "openai", "reply", "route"),
    "4.4": ("route", "control", "409", "422", "phase", "lease", "task scope", "owner"),
    "4.5": ("participant", "agent", "resources", "model server", "boundary", "boundaries", "pac",
            "session", "admission", "admit", "seed", "collect", "activity"),
    "4.6": ("coordination", "prepare", "resume", "retire", "fan", "probe", "typed request"),
    "4.7": ("store", "storage", "writer", "reader", "records", "manifest"),
    "5.1": ("config", "yaml", "override", "setting", "cli", "--help", "--check", "logger", "inspect"),
    "5.2": ("setup", "restart-only", "spinup", "check", "discover"),
    "5.3": ("ledger", "attempt", "sibling", "group", "position"),
    "5.4": ("snapshot", "pause", "capture", "stage", "planner", "persist", "publish", "drain",
            "ownership", "checkpoint", "gate", "run store", "runstore", "writer"),
    "5.5": ("restore", "restart", "relaunch"),
    "5.6": ("train", "warm start", "warm_start", "demonstration", "grpo", "validation", "tokenizer", "refit",
            "generation worker", "hugging face"),
    "5.7": ("replica", "shard", "instance", "elastic", "reshard"),
    "5.8": ("hung", "hang", "timeout", "time out", "stall", "probe", "left out", "leave", "answer",
            "watchdog", "reopen", "busy", "dead"),
    "4.8": ("replay", "replayed", "replayable", "record", "divergen", "restart-only", "restart_only"),
    "5.9": ("async", "lookahead", "anchor", "overtak", "admission", "coverage", "crash point", "refit",
            "in flight", "stream"),
    "5.10": ("prefix", "generation cut", "cut", "continu", "pin"),
    "5.11": ("signal", "sigterm", "sigint", "sigusr1", "stop", "ctrl-c", "slurm", "preempt"),
    "5.12": ("recover", "lost", "loss", "in-run", "in_run", "watch", "replace", "restart", "dead", "died",
             "given up", "give up", "supervis", "generation worker", "worker", "resend", "sent again", "wedge",
             "weights"),
    "5.13": ("deterministic", "parity", "seed", "draw", "canonical", "trained", "harness"),
    "6": ("test", "testkit", "hook", "harness", "fake"),
}
CHAPTERS = {"4", "5"}  # "Gym side (`gym_patches`)", "RL side (`nemo_rl`)": their sections carry the topics
STOP_WORDS = {"the", "and", "its", "with", "from", "side", "what", "where", "that", "this", "one"}
QUOTED_NAME = re.compile(r'\s*[,:(]?\s*"([^"\n]{3,80})"')
TITLE = re.compile(r"^(#{2,})\s+(\d+(?:\.\d+)*)\.?\s+(.+?)\s*$", re.MULTILINE)
BOLD = re.compile(r"\*\*([^*]+?)\.?\*\*")


def _design_sections(text: str) -> dict[str, tuple[str, str]]:
    """Section number -> (title, its text up to the next heading of the same or a higher level)."""
    found = list(TITLE.finditer(text))
    out = {}
    for i, m in enumerate(found):
        level = len(m.group(1))
        end = next((n.start() for n in found[i + 1:] if len(n.group(1)) <= level), len(text))
        out[m.group(2)] = (m.group(3), text[m.start():end])
    return out


def _words(title: str) -> set[str]:
    """The title's words worth matching: letters, four or more, not a stop word; backticks dropped."""
    return {w for w in re.findall(r"[a-z][a-z_-]{3,}", title.lower().replace("`", "")) if w not in STOP_WORDS}


def _topics(number: str, sections: dict[str, tuple[str, str]]) -> set[str]:
    words: set[str] = set()
    parts = number.split(".")
    for depth in range(len(parts), 0, -1):
        key = ".".join(parts[:depth])
        if key in CHAPTERS:
            continue
        words |= set(TOPICS.get(key, ()))
        if key in sections:
            words |= _words(sections[key][0])
    return words


def _names_in(section_text: str) -> set[str]:
    """What a quoted name may be: the section's and its subsections' titles, and its bold run-in headings."""
    names = {m.group(3) for m in TITLE.finditer(section_text)} | set(BOLD.findall(section_text))
    return {re.sub(r"\s*\(.*?\)\s*$", "", n).strip("` .").lower() for n in names}


def topic_problems(source: str, name: str, design: str) -> list[str]:
    """Citations in ``source`` whose section is not about what the text around them names."""
    sections = _design_sections(design)
    lines = source.splitlines()
    found = []
    for match in REFERENCE.finditer(source):
        line = source.count("\n", 0, match.start()) + 1
        context = "\n".join(lines[max(0, line - 8):line + 4]).lower()
        quoted = QUOTED_NAME.match(source, match.end())
        for number in SECTION.findall(match.group(1)):
            if number not in sections:
                continue  # test_every_design_section_cited_exists reports it
            if quoted and quoted.group(1).strip(" .").lower() not in _names_in(sections[number][1]):
                found.append(f"{name}:{line}: quotes {quoted.group(1)!r}, which is not a title or a bold heading "
                             f"of docs/design.md §{number} {sections[number][0]!r}")
            words = _topics(number, sections)
            if not any(re.search(r"(?<![a-z])" + re.escape(w), context) for w in words):
                found.append(f"{name}:{line}: cites docs/design.md §{number} {sections[number][0]!r}, but nothing "
                             f"around it names its topic (any of {sorted(words)})")
    return found


def test_every_citation_is_about_its_section():
    design = (REPO / "docs" / "design.md").read_text()
    found, cited = [], 0
    for path in _sources():
        text = path.read_text()
        cited += len(REFERENCE.findall(text))
        found += topic_problems(text, str(path.relative_to(REPO)), design)
    assert found == [], "citations of the wrong section (or add the topic word to TOPICS):\n" + "\n".join(found)
    assert cited > 100


def test_every_section_has_topics():
    """The table names every section, and only sections that exist, so a new one cannot be cited unchecked."""
    numbered = {n for n in _design_sections((REPO / "docs" / "design.md").read_text()) if n.count(".") <= 1}
    numbered -= CHAPTERS
    assert set(TOPICS) == numbered


def test_a_wrong_citation_is_caught():
    design = (REPO / "docs" / "design.md").read_text()
    cite = "docs/" + "design.md"  # kept out of the scan of this file
    right = f'"""On SIGTERM the run takes a final snapshot and stops ({cite} §5.11)."""\n'
    wrong = f'"""On SIGTERM the run takes a final snapshot and stops ({cite} §4.1)."""\n'
    assert topic_problems(right, "x", design) == []
    assert topic_problems(wrong, "x", design)
    hung = f'"""A replica that cannot be parked leaves ({cite} §5.8, "Hung Gym servers")."""\n'
    misquoted = f'"""A replica that cannot be parked leaves ({cite} §5.4, "Stalled replicas")."""\n'
    assert topic_problems(hung, "x", design) == []
    assert topic_problems(misquoted, "x", design)
