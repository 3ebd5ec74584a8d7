"""Keeps pdserve's source tree off ``sys.path``, so its folders never shadow other packages.

The repository root is the ``pdserve`` package itself (pyproject maps ``pdserve`` to ``.``), so
its folders (``kernels``, ``api``, ``models``, ``engine``, ``tests``, ...) are pdserve's
subpackages. Were the root a ``sys.path`` entry, they would also be importable as top-level
modules and hide third-party packages of the same name: transformers imports Hugging Face's
``kernels``, and would get ours. Three things put the root there when run from a clone:

1. ``python -m ...`` and ``python -c ...`` put the working directory first on ``sys.path``;
2. a script puts its own folder first;
3. Ray puts the driver's working directory on a worker's ``sys.path`` when the worker runs its
   first task: after the worker has started, so it cannot simply be removed once.

:func:`install` removes the root from ``sys.path`` and puts a finder first on
``sys.meta_path`` that removes it again before any later top-level import (so the entry Ray
inserts is gone before the task imports anything). ``import pdserve`` calls it first of all,
which covers ``python -m pdserve.<module>``, the ``pdserve`` command, every actor pdserve starts
(their modules are pdserve's) and any process that imports pdserve before a third-party package.
A local Ray that ``init_ray`` starts preloads this module in every worker, so even a task that
imports transformers before pdserve is covered. Processes that run other code from the root
(the test runner, ``python -c`` helpers) are started with ``python -P``, which never puts the
working directory on the path.
"""

from __future__ import annotations

import os
import sys

SOURCE_ROOT = os.path.dirname(os.path.realpath(__file__))
_resolved: dict[str, str] = {}  # sys.path entry -> its real path ('' is the working directory)


def install() -> None:
    """Drops the source root from ``sys.path`` now and before every later top-level import.
    Safe to call any number of times; a no-op for an installed (non-editable) pdserve, whose
    folder is never on the path."""
    drop_source_root()
    if not any(finder is SourceRootDropper for finder in sys.meta_path):
        sys.meta_path.insert(0, SourceRootDropper)


def drop_source_root() -> None:
    """Removes every ``sys.path`` entry that names the source root."""
    if any(_is_source_root(entry) for entry in sys.path):
        sys.path[:] = [entry for entry in sys.path if not _is_source_root(entry)]


class SourceRootDropper:
    """A meta path finder that finds nothing: before the path finder (next in line) looks for a
    top-level module, it drops the source root from ``sys.path``. Submodules are looked up in
    their package's own folder, so they need no check."""

    @staticmethod
    def find_spec(fullname: str, path=None, target=None) -> None:
        if path is None:
            drop_source_root()
        return None


def _is_source_root(entry: str) -> bool:
    if not entry:  # the working directory, which can change: never cached
        return os.path.realpath(os.curdir) == SOURCE_ROOT
    resolved = _resolved.get(entry)
    if resolved is None:
        resolved = _resolved[entry] = os.path.realpath(entry)
    return resolved == SOURCE_ROOT
