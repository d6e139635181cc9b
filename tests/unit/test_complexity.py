"""No product function grows past cyclomatic complexity 20 (radon), with a ratchet for those that do.

Product code is every module under ``nemo_rl/`` and ``gym_patches/`` (not tests, testkit or
examples). ``KNOWN`` lists the functions above the limit today with their complexity: one may not
grow, a new one may not join, and one brought to 20 or below must leave the list, so it only shrinks
(lower a value when a listed function gets simpler).
Each function is measured on its own: a nested function (closure) is a function of its own, and
does not count towards the one around it (radon's rule).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

radon_visitors = pytest.importorskip("radon.visitors", reason="radon is in the test extra")

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("nemo_rl", "gym_patches")
LIMIT = 20

# "<path>::<qualified name>" -> its complexity today. Only ever remove entries, or lower them.
KNOWN: dict[str, int] = {}


def _functions(tree: ast.AST, prefix: str = ""):
    """(qualified name, node) of every function in ``tree``, nested ones included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = f"{prefix}{node.name}"
            if not isinstance(node, ast.ClassDef):
                yield name, node
            yield from _functions(node, name + ".")
        else:
            yield from _functions(node, prefix)


def _complexity(node: ast.AST) -> int:
    """radon's cyclomatic complexity of one function, without the functions nested in it."""
    visitor = radon_visitors.ComplexityVisitor.from_ast(ast.Module(body=[node], type_ignores=[]))
    return visitor.functions[0].complexity


def measure() -> dict[str, int]:
    """Every product function -> its complexity."""
    out: dict[str, int] = {}
    for package in PRODUCT:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            tree = ast.parse(path.read_text(), filename=rel)
            for name, node in _functions(tree):
                out[f"{rel}::{name}"] = _complexity(node)
    return out


def test_the_measure_sees_nested_functions_and_methods_apart():
    src = ("class A:\n    def m(self, x):\n        def inner(y):\n            return 1 if y else 2\n"
           "        return inner(x) if x else 0\n")
    found = {name: _complexity(node) for name, node in _functions(ast.parse(src))}
    assert found == {"A.m": 2, "A.m.inner": 2}


def test_the_measure_reads_every_product_package_and_sees_a_function_past_the_limit():
    # With KNOWN empty the two tests below pass on any measure that finds nothing: check it finds.
    assert {name.split("/")[0] for name in measure()} == set(PRODUCT)
    src = "def f(x):\n" + "".join(f"    if x == {i}:\n        return {i}\n" for i in range(LIMIT)) + "    return 0\n"
    [(name, node)] = list(_functions(ast.parse(src)))
    assert _complexity(node) == LIMIT + 1


def test_no_product_function_exceeds_the_limit_unless_known_and_none_grows():
    measured = measure()
    too_complex = {name: cc for name, cc in measured.items() if cc > LIMIT and name not in KNOWN}
    assert not too_complex, (
        f"functions above cyclomatic complexity {LIMIT} (split them, or if it truly cannot be, list it in KNOWN): {too_complex}")
    grown = {name: (KNOWN[name], measured[name]) for name in KNOWN
             if name in measured and measured[name] > KNOWN[name]}
    assert not grown, f"known complex functions grew (listed -> now): {grown}"


def test_the_known_list_only_names_functions_still_above_the_limit():
    measured = measure()
    gone = sorted(name for name in KNOWN if name not in measured)
    assert not gone, f"KNOWN names functions that no longer exist (remove them): {gone}"
    fixed = {name: measured[name] for name in KNOWN if measured[name] <= LIMIT}
    assert not fixed, f"these are at or below {LIMIT} now: remove them from KNOWN: {fixed}"
