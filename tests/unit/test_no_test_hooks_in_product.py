"""No product module carries a test hook: tests inject them (``testkit``), the product never reaches for them.

Every module under ``nemo_rl/`` and ``gym_patches/`` (what the wheel ships) is
read as source and as an AST. It must not import ``testkit`` or a testing
module (a ``*.testing*`` package, pytest, hypothesis, unittest.mock), must not
contain ``TEST_ONLY``, and must not read an environment variable whose name
contains ``TEST`` (``os.environ[...]``, ``.get``/``.pop``/``.setdefault``,
``os.getenv``, ``in os.environ``; the name as a literal, an f-string or a
module-level constant). The checker is shown to fail on synthetic sources.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PRODUCT_PACKAGES = ("nemo_rl", "gym_patches")
TESTING_TOP_LEVEL = {"testkit", "pytest", "hypothesis", "_pytest"}
_ENV_READ_METHODS = {"get", "pop", "setdefault", "__getitem__", "__contains__"}


def _is_testing_module(name: str) -> bool:
    parts = name.split(".")
    return (parts[0] in TESTING_TOP_LEVEL or any(p.startswith("testing") for p in parts)
            or name == "unittest.mock" or name.startswith("unittest.mock."))


def _module_strings(tree: ast.Module) -> dict[str, str]:
    """Module-level ``NAME = "text"`` assignments: how a variable's name is usually spelled once."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    out[target.id] = node.value.value
        elif (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
              and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)):
            out[node.target.id] = node.value.value
    return out


def _text_of(node: ast.AST, constants: dict[str, str]) -> str | None:
    """The variable name an expression spells, as far as it can be known from the source."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name):
        return constants.get(node.id)
    if isinstance(node, ast.JoinedStr):
        return "".join(_text_of(v, constants) or "" for v in node.values)
    if isinstance(node, ast.FormattedValue):
        return _text_of(node.value, constants)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return (_text_of(node.left, constants) or "") + (_text_of(node.right, constants) or "")
    return None


def _is_environ(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
        isinstance(node, ast.Name) and node.id == "environ")


def _env_names_read(tree: ast.Module) -> list[tuple[int, str]]:
    constants = _module_strings(tree)
    out = []
    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in _ENV_READ_METHODS and _is_environ(func.value):
                key = node.args[0] if node.args else None
            elif (isinstance(func, ast.Attribute) and func.attr == "getenv") or (
                    isinstance(func, ast.Name) and func.id == "getenv"):
                key = node.args[0] if node.args else None
        elif isinstance(node, ast.Subscript) and _is_environ(node.value):
            key = node.slice
        elif isinstance(node, ast.Compare) and any(_is_environ(c) for c in node.comparators) and any(
                isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
            key = node.left
        if key is not None:
            name = _text_of(key, constants)
            if name is not None:
                out.append((node.lineno, name))
    return out


def hook_problems(source: str, where: str = "<source>") -> list[str]:
    """Every way ``source`` carries a test hook, each naming the line."""
    problems = []
    if "TEST_ONLY" in source:
        line = source[: source.index("TEST_ONLY")].count("\n") + 1
        problems.append(f"{where}:{line}: contains TEST_ONLY")
    tree = ast.parse(source, where)
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        elif (isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name))
              and getattr(node.func, "attr", getattr(node.func, "id", None)) in ("import_module", "__import__")
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            names = [node.args[0].value]
        for name in names:
            if _is_testing_module(name):
                problems.append(f"{where}:{node.lineno}: imports the testing module {name}")
                break
    for line, name in _env_names_read(tree):
        if "TEST" in name.upper():
            problems.append(f"{where}:{line}: reads the environment variable {name}")
    return problems


def _product_modules() -> list[Path]:
    return sorted(p for package in PRODUCT_PACKAGES for p in (REPO / package).rglob("*.py"))


def test_no_product_module_carries_a_test_hook():
    modules = _product_modules()
    assert len(modules) > 50  # the packages were found
    problems = [p for path in modules for p in hook_problems(path.read_text(), str(path.relative_to(REPO)))]
    assert problems == []


def test_the_wheel_ships_no_testkit():
    text = (REPO / "pyproject.toml").read_text()
    assert 'include = ["gym_patches*", "nemo_rl*"]' in text
    assert not (REPO / "gym_patches" / "testing").exists()


@pytest.mark.parametrize("source, found", [
    ("import testkit.crash_points\n", "imports the testing module testkit.crash_points"),
    ("from testkit import write_faults\n", "imports the testing module testkit"),
    ("from gym_patches.testing.write_faults import check_write\n", "imports the testing module gym_patches.testing"),
    ("import torch.testing\n", "imports the testing module torch.testing"),
    ("import pytest\n", "imports the testing module pytest"),
    ("from unittest import mock\n", "imports the testing module unittest.mock"),
    ("import importlib\nimportlib.import_module('testkit.write_faults')\n", "imports the testing module testkit"),
    ("CRASH = 'NEMO_RL_CRASH_AT'  # TEST_ONLY\n", "contains TEST_ONLY"),
    ("import os\nos.environ.get('NEMO_RL_TEST_RUN_ID')\n", "reads the environment variable NEMO_RL_TEST_RUN_ID"),
    ("import os\nV = 'MY_TEST_SWITCH'\nif os.environ.get(V) == '1': pass\n", "reads the environment variable MY_TEST"),
    ("import os\nos.getenv('A_TEST_DELAY', '0')\n", "reads the environment variable A_TEST_DELAY"),
    ("from os import environ\nx = environ['SKIP_TESTS']\n", "reads the environment variable SKIP_TESTS"),
    ("import os\nP = 'NEMO'\nos.environ.pop(f'{P}_TEST_X', None)\n", "reads the environment variable NEMO_TEST_X"),
    ("import os\nflag = 'X_TEST' in os.environ\n", "reads the environment variable X_TEST"),
])
def test_the_checker_finds_each_kind_of_hook(source, found):
    problems = hook_problems(source)
    assert any(found in p for p in problems), problems


def test_the_checker_passes_clean_code():
    clean = ("import os\nimport unittest\nfrom nemo_rl.utils.run_hooks import RunHooks\n"
             "CACHE = 'NEMO_RL_MODEL_CACHE'\nos.environ.get(CACHE)\nos.environ['PYTHONPATH'] = 'x'\n"
             "MODEL = 'scripted-test-backend'\n")
    assert hook_problems(clean) == []
