"""No folder of the repository shadows a third-party module (pdserve.import_path).

The repository root is the ``pdserve`` package; run from it, ``python -m``/``-c`` and Ray put the
root on ``sys.path``, where ``kernels/`` would hide Hugging Face's ``kernels`` (which
transformers imports) and every other folder a module of its name. The Ray worker case is in
``tests/e2e/test_worker_import_path.py``.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pdserve
from pdserve.import_path import SOURCE_ROOT, install

ROOT = Path(__file__).resolve().parents[1]
# Every name the root holds that Python could import as a top-level module.
# (a folder without __init__.py, like tests/, imports as a namespace package)
TOP_LEVEL_NAMES = sorted(p.stem for p in ROOT.iterdir()
                         if (p.is_dir() and p.name.isidentifier())
                         or (p.suffix == ".py" and p.name != "__init__.py"))

PROBE = """
import importlib.util, json, sys
{first}
import transformers
from transformers.integrations import hub_kernels  # imports Hugging Face's kernels
import pdserve.kernels
def where(name):
    spec = importlib.util.find_spec(name)
    if spec is None:
        return []
    return [spec.origin] if spec.origin else list(spec.submodule_search_locations)
origins = {{name: where(name) for name in {names!r}}}
print(json.dumps({{"origins": origins, "pdserve.kernels": pdserve.kernels.__file__,
                   "path": sys.path}}))
"""


def run_from_root(*args: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
    out = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def from_source_tree(name: str, origin: str) -> bool:
    """``origin`` (a module's file, or a namespace package's folder) is the root's ``name``."""
    return Path(origin).resolve() in (ROOT / name / "__init__.py", ROOT / f"{name}.py",
                                      ROOT / name)


def assert_not_shadowed(report: dict) -> None:
    assert Path(report["pdserve.kernels"]).parent == ROOT / "kernels"
    shadowed = {name: places for name, places in report["origins"].items()
                if any(from_source_tree(name, place) for place in places)}
    assert not shadowed, f"top-level names resolved into the source tree: {shadowed}"
    # transformers depends on Hugging Face's kernels: it is installed, and is that one
    assert "site-packages" in Path(report["origins"]["kernels"][0]).parts


def test_the_root_holds_names_that_could_shadow():
    assert {"kernels", "api", "models", "engine", "tests"} <= set(TOP_LEVEL_NAMES)
    assert Path(SOURCE_ROOT) == ROOT


def test_python_c_from_the_root_after_import_pdserve():
    """``python -c`` puts '' (the working directory, here the root) first on sys.path;
    ``python -m pdserve.<module>`` puts the root there and imports pdserve first the same way."""
    report = run_from_root("-c", PROBE.format(first="import pdserve", names=TOP_LEVEL_NAMES))
    assert_not_shadowed(report)
    assert "" not in report["path"] and str(ROOT) not in report["path"]


def test_without_the_guard_the_root_does_shadow():
    """The failure guarded against is real: from the root, before ``import pdserve``."""
    code = ("import importlib.util, json; "
            "print(json.dumps({'origin': importlib.util.find_spec('kernels').origin}))")
    assert Path(run_from_root("-c", code)["origin"]).parent == ROOT / "kernels"


def test_a_root_entry_added_later_is_dropped_before_the_next_import(monkeypatch):
    """Ray adds the driver's working directory to a worker's path after start-up: the finder
    :func:`install` leaves on sys.meta_path removes it before any top-level lookup."""
    install()
    monkeypatch.setattr(sys, "path", [str(ROOT), *sys.path])
    assert importlib.util.find_spec("pdserve_test_no_such_module") is None  # a lookup
    assert str(ROOT) not in sys.path
    spec = importlib.machinery.PathFinder.find_spec("kernels")  # what sys.path now finds
    assert spec is not None and not from_source_tree("kernels", spec.origin)


def test_this_process_is_clean():
    """The test runner itself (``make test`` runs ``python -P``; a bare ``python -m pytest``
    from the root is cleaned by ``import pdserve`` in tests/conftest.py)."""
    assert pdserve.__file__ and not any(
        Path(entry or os.curdir).resolve() == ROOT for entry in sys.path)
