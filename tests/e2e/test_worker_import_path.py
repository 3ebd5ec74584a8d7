"""Inside a Ray worker of the test cluster no folder of the repository shadows a third-party
module, even for a task that imports transformers before pdserve: Ray puts the driver's working
directory (the repository root, under ``make test``) on the worker's sys.path when the task
starts, and the worker set-up of ``init_ray`` keeps it from taking effect. And the workers run at
nice 0, not Ray's default 15 (below Ray's own daemons and any client on the node)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import ray.cloudpickle

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]


def imports_in_a_worker() -> dict:
    import importlib

    import transformers.integrations.hub_kernels  # noqa: F401  (imports HF's kernels)

    import pdserve.kernels

    third_party = importlib.import_module("kernels")  # the top-level name, whoever owns it
    return {"kernels": third_party.__file__, "pdserve.kernels": pdserve.kernels.__file__,
            "path": list(sys.path)}


def test_a_ray_task_imports_third_party_kernels_not_ours(ray_session):
    # The task ships by value: its module is this test file, which workers cannot import.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        task = ray_session.remote(imports_in_a_worker)
        report = ray_session.get(task.remote(), timeout=120)
    finally:
        ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    assert "site-packages" in Path(report["kernels"]).parts
    assert Path(report["pdserve.kernels"]).parent == ROOT / "kernels"
    assert str(ROOT) not in report["path"]


def niceness() -> int:
    return os.nice(0)


def test_ray_workers_run_at_nice_0(ray_session):
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        assert ray_session.get(ray_session.remote(niceness).remote(), timeout=120) == 0
    finally:
        ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
