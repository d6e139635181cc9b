"""Run a function on a module right after it is first imported, in any process.

What the benchmark's ``examples/bench/instrument/sitecustomize.py`` (timing) and
the functional tests' ``tests/functional/overtake/sitecustomize.py`` share: a
``sys.meta_path`` finder that lets the normal finders find the module and wraps
its loader, so nothing is imported early and a process that never imports the
module pays nothing.
"""

from __future__ import annotations

import importlib.abc
import sys
from typing import Any, Callable


class AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``hooks[name](module)`` once, right after module ``name`` has executed."""

    def __init__(self, hooks: dict[str, Callable[[Any], None]]):
        self.hooks = dict(hooks)

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.hooks:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return None
        hook = self.hooks.pop(fullname)
        original = loader.exec_module

        def exec_module(module):
            original(module)
            hook(module)

        loader.exec_module = exec_module
        return spec

    @classmethod
    def install(cls, hooks: dict[str, Callable[[Any], None]]) -> "AfterImport":
        finder = cls(hooks)
        sys.meta_path.insert(0, finder)
        return finder
