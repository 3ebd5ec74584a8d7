"""The Helm chart (helm/pdserve), rendered offline by Helm's own library (helm-python-sdk).

Fixtures:
* ``values_files``: every values file under ``helm/pdserve/ci/``, by name.
* ``render(values=None, values_file=None)``: the chart rendered as release "pd" in namespace
  "serving"; returns :class:`Rendered` (the parsed objects; ``one(kind, name_suffix)``).
* ``kuberay_crd``: the path of KubeRay's RayCluster CRD (see :func:`find_kuberay_crd`).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "pdserve"
CRD_PATH = Path("shared", "schemas", "kuberay", "ray.io_rayclusters.yaml")
CRD_SOURCE = ("ray-operator/config/crd/bases/ray.io_rayclusters.yaml of KubeRay "
              "(github.com/ray-project/kuberay)")


class Rendered:
    """The objects one render produced (NOTES.txt aside)."""

    def __init__(self, files: dict[str, str]):
        self.files = files
        self.objects = [doc for name, text in sorted(files.items()) if name.endswith(".yaml")
                        for doc in yaml.safe_load_all(text) if doc]

    def of(self, kind: str) -> list[dict]:
        return [o for o in self.objects if o["kind"] == kind]

    def one(self, kind: str, suffix: str = "") -> dict:
        found = [o for o in self.of(kind) if o["metadata"]["name"].endswith(suffix)]
        assert len(found) == 1, f"{kind} *{suffix}: {len(found)} found"
        return found[0]


def render_chart(values: dict | None = None) -> Rendered:
    import helm_python

    chart = helm_python.Chart.load(str(CHART))
    return Rendered(chart.render(values or {}, name="pd", namespace="serving"))


@pytest.fixture(scope="session")
def values_files() -> dict[str, dict]:
    return {path.name.removesuffix("-values.yaml"): yaml.safe_load(path.read_text()) or {}
            for path in sorted((CHART / "ci").glob("*-values.yaml"))}


@pytest.fixture(scope="session")
def render():
    cache: dict[str, Rendered] = {}

    def run(values: dict | None = None) -> Rendered:
        key = repr(values)
        if key not in cache:
            cache[key] = render_chart(values)
        return cache[key]

    return run


def find_kuberay_crd() -> Path | None:
    """$PDSERVE_KUBERAY_CRD, else ``shared/schemas/kuberay/ray.io_rayclusters.yaml`` in a
    folder above this checkout, else beside the checkout this one was cloned from."""
    if os.environ.get("PDSERVE_KUBERAY_CRD"):
        path = Path(os.environ["PDSERVE_KUBERAY_CRD"])
        return path if path.is_file() else None
    roots = [REPO, *REPO.parents]
    origin = subprocess.run(["git", "-C", str(REPO), "config", "--get", "remote.origin.url"],
                            capture_output=True, text=True).stdout.strip()
    if origin and Path(origin).is_dir():  # a clone of a local checkout
        roots += [Path(origin).resolve(), *Path(origin).resolve().parents]
    for root in roots:
        if (root / CRD_PATH).is_file():
            return root / CRD_PATH
    return None


@pytest.fixture(scope="session")
def kuberay_crd() -> Path:
    path = find_kuberay_crd()
    if path is None:
        pytest.skip(f"KubeRay's RayCluster CRD not found: fetch {CRD_SOURCE} and point "
                    f"PDSERVE_KUBERAY_CRD at it")
    return path
