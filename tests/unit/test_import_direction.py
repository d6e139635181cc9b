"""Which way the product's imports point, read from the source with ``ast`` (nothing is imported):

* the model layer and the utilities (``nemo_rl/models/``, ``nemo_rl/utils/``) never import the algorithms
  (``nemo_rl.algorithms``), not even inside a function or for type checking;
* no import cycle among the product's modules (``nemo_rl``, ``gym_patches``), counting what a module
  imports as it loads (its top level, ``if TYPE_CHECKING:`` blocks and class bodies included); an import
  inside a function is allowed, and the ones that would close a cycle are listed in the output;
* RL reaches Gym through its client surface (docs/design.md §3): no module under ``nemo_rl/`` imports a
  Gym server implementation, except the few named in ``SERVER_IMPORTS_ALLOWED`` with why; a call to
  ``importlib.import_module`` / ``__import__`` counts as an import of the name it is given, and a name
  computed at run time is refused under ``nemo_rl/`` (it could name anything);
* and, since a static read cannot see every path, a subprocess imports the driver's modules and runs its
  Gym config checks (``check_gym_configs``, ``--check``'s rows) on every example config, then finds no
  Gym server module loaded.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("nemo_rl", "gym_patches")
SERVER_PACKAGES = ("gym_patches.resources_servers", "gym_patches.responses_api_agents",
                   "gym_patches.responses_api_models", "gym_patches.fakes")
# (importing module, Gym server it imports: package or module) -> why it may, for now.
SERVER_IMPORTS_ALLOWED = {
    ("nemo_rl.algorithms.single_controller_utils.components", "gym_patches.fakes.scripted_backend"):
        "the named fake backend a test config (policy.model_name: scripted-test-backend) starts in place of "
        "a model",
}


@dataclass(frozen=True)
class Import:
    importer: str
    target: str
    line: int
    at_load: bool  # run as the module loads (not inside a function)
    dynamic: bool = False  # importlib.import_module / __import__ (target: the name, or COMPUTED)


COMPUTED = "<a name computed at run time>"
_DYNAMIC_IMPORTERS = {"import_module", "__import__"}


def _dynamic_import(call: ast.Call) -> bool:
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    return name in _DYNAMIC_IMPORTERS


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            out[_module_name(path)] = path
    return out


MODULES = _modules()


def _resolve(importer: str, is_package: bool, module: str | None, level: int) -> str:
    if not level:
        return module or ""
    base = importer.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, module] if module else base)


def _imports(name: str, path: Path) -> list[Import]:
    return _imports_of(name, path.read_text(), path.name == "__init__.py", str(path))


def _imports_of(name: str, source: str, is_package: bool, filename: str = "<source>") -> list[Import]:
    tree = ast.parse(source, filename=filename)
    out: list[Import] = []

    def visit(node: ast.AST, at_load: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                out.extend(Import(name, a.name, child.lineno, at_load) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                source = _resolve(name, is_package, child.module, child.level)
                for alias in child.names:
                    sub = f"{source}.{alias.name}"
                    out.append(Import(name, sub if sub in MODULES else source, child.lineno, at_load))
            elif isinstance(child, ast.Call) and _dynamic_import(child):
                arg = child.args[0] if child.args else None
                target = arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else COMPUTED
                out.append(Import(name, target, child.lineno, at_load, dynamic=True))
            visit(child, at_load and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, True)
    return out


IMPORTS = [imp for name, path in MODULES.items() for imp in _imports(name, path)]


def _product(target: str) -> str | None:
    """The product module ``target`` names (itself, or the module it names a member of), if any."""
    while target:
        if target in MODULES:
            return target
        target = target.rpartition(".")[0]
    return None


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_models_and_utils_never_import_the_algorithms():
    upward = sorted({f"{i.importer}:{i.line} imports {i.target}" for i in IMPORTS
              if (_within(i.importer, "nemo_rl.models") or _within(i.importer, "nemo_rl.utils"))
              and _within(i.target, "nemo_rl.algorithms")})
    assert upward == [], "nemo_rl/models and nemo_rl/utils must not import nemo_rl.algorithms:\n" + "\n".join(upward)


def _graph(at_load_only: bool) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in MODULES}
    for imp in IMPORTS:
        target = _product(imp.target)
        if target is not None and target != imp.importer and (imp.at_load or not at_load_only):
            graph[imp.importer].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return out


def test_no_import_cycle_among_product_modules():
    cycles = _cycles(_graph(at_load_only=True))
    assert cycles == [], "import cycles (module-level imports):\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_imports_inside_functions_that_would_close_a_cycle_are_listed():
    """Allowed (they run once the modules have loaded), but listed: each one is a dependency that points
    back."""
    at_load = _graph(at_load_only=True)
    deferred = []
    for component in _cycles(_graph(at_load_only=False)):
        members = set(component)
        for imp in IMPORTS:
            target = _product(imp.target)
            if not imp.at_load and imp.importer in members and target in members and target not in at_load[imp.importer]:
                deferred.append(f"{imp.importer}:{imp.line} imports {imp.target} inside a function")
    print("\n".join(["imports inside functions that close a cycle:", *sorted(set(deferred))] if deferred
                    else ["no import inside a function closes a cycle"]))
    assert _cycles(at_load) == []


def test_rl_never_imports_a_gym_server_implementation_but_the_listed_few():
    unlisted, used = [], set()
    for imp in IMPORTS:
        if not _within(imp.importer, "nemo_rl") or not any(_within(imp.target, p) for p in SERVER_PACKAGES):
            continue
        allowed = [key for key in SERVER_IMPORTS_ALLOWED if key[0] == imp.importer and _within(imp.target, key[1])]
        used.update(allowed)
        if not allowed:
            unlisted.append(f"{imp.importer}:{imp.line} imports {imp.target}")
    assert unlisted == [], ("RL reaches Gym through its client surface (docs/design.md §3); these import a Gym "
                            "server implementation:\n" + "\n".join(unlisted))
    stale = sorted(set(SERVER_IMPORTS_ALLOWED) - used)
    assert stale == [], f"allowed but no longer imported (drop them from SERVER_IMPORTS_ALLOWED): {stale}"


def test_rl_imports_no_module_by_a_name_computed_at_run_time():
    computed = [f"{i.importer}:{i.line}" for i in IMPORTS if _within(i.importer, "nemo_rl") and i.target == COMPUTED]
    assert computed == [], ("a module under nemo_rl/ imports a module whose name is computed at run time (it could "
                            "be a Gym server implementation):\n" + "\n".join(computed))


# Run in a fresh interpreter: import what the driver imports, run every Gym config check it makes.
_DRIVER_CHECKS = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from types import SimpleNamespace
    import nemo_rl.cli.run_grpo, nemo_rl.cli.check, nemo_rl.cli.inspect
    from nemo_rl.algorithms.single_controller_utils.config import load_config
    from nemo_rl.algorithms.single_controller_utils.setup import check_gym_configs
    from nemo_rl.cli.check import server_rows
    checked = []
    for path in sorted(Path("examples/configs").glob("*.yaml")):
        config = load_config(path, [])
        check_gym_configs(config)
        rows = server_rows(config, SimpleNamespace(agent_servers={}, restart_only_servers={}, replay_models={}), [])
        checked.append((path.name, sorted({row.checkpoint for row in rows})))
    print(json.dumps({"checked": checked, "modules": sorted(sys.modules)}))
""")


def test_the_driver_loads_no_gym_server_module_while_it_checks_every_example_config():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", _DRIVER_CHECKS], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(report["checked"]) >= 5 and all(modes for _, modes in report["checked"]), report["checked"]
    loaded = [m for m in report["modules"] if any(_within(m, p) for p in SERVER_PACKAGES)]
    assert loaded == [], f"the driver loaded Gym server modules: {loaded}"


def test_the_checks_see_what_they_check():
    """The parse finds the imports it judges (a broken walk would pass every check above)."""
    assert len(MODULES) > 100 and "nemo_rl.models.generation.worker" in MODULES
    assert any(i.importer == "nemo_rl.experience.rollout_recovery.ledger"
               and i.target == "nemo_rl.experience.rollout_recovery.restart" and i.at_load for i in IMPORTS)
    assert any(i.importer == "nemo_rl.algorithms.single_controller_utils.components" and not i.at_load
               and i.target == "gym_patches.fakes.scripted_backend" for i in IMPORTS)
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    dynamic = _imports_of("nemo_rl.x", textwrap.dedent("""
        import importlib
        from importlib import import_module
        def f(kind):
            importlib.import_module("gym_patches.resources_servers.workplace_assistant.app")
            __import__("gym_patches.responses_api_agents.simple_agent.app")
            import_module(f"gym_patches.{kind}.vllm_model.app")
    """), is_package=False)
    assert [(i.target, i.dynamic) for i in dynamic if i.dynamic] == [
        ("gym_patches.resources_servers.workplace_assistant.app", True),
        ("gym_patches.responses_api_agents.simple_agent.app", True), (COMPUTED, True)]
