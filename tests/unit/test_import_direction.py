"""Which way the product's imports point, read from the source with ``ast`` (nothing is imported):

* the model layer and the utilities (``nemo_rl/models/``, ``nemo_rl/utils/``) never import the algorithms
  (``nemo_rl.algorithms``), not even inside a function or for type checking;
* no import cycle among the product's modules (``nemo_rl``, ``gym_patches``), counting what a module
  imports as it loads (its top level, ``if TYPE_CHECKING:`` blocks and class bodies included); an import
  inside a function is allowed, and the ones that would close a cycle are listed in the output;
* RL reaches Gym through its client surface (docs/design.md §3): no module under ``nemo_rl/`` imports a
  Gym server implementation, except the few named in ``SERVER_IMPORTS_ALLOWED`` with why.
"""

from __future__ import annotations

import ast
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
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
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


def test_the_checks_see_what_they_check():
    """The parse finds the imports it judges (a broken walk would pass every check above)."""
    assert len(MODULES) > 100 and "nemo_rl.models.generation.worker" in MODULES
    assert any(i.importer == "nemo_rl.experience.rollout_recovery.ledger"
               and i.target == "nemo_rl.experience.rollout_recovery.restart" and i.at_load for i in IMPORTS)
    assert any(i.importer == "nemo_rl.algorithms.single_controller_utils.components" and not i.at_load
               and i.target == "gym_patches.fakes.scripted_backend" for i in IMPORTS)
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
