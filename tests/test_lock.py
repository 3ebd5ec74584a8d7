"""requirements.lock pins every dependency pyproject.toml declares, within its ranges, and the
venv the suite runs in was installed from it (``make venv``)."""

from __future__ import annotations

import re
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]


def read_lock() -> dict[str, Version]:
    pins = {}
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        name, sep, version = line.partition("==")
        assert sep and re.fullmatch(r"[A-Za-z0-9._-]+", name), f"not an exact pin: {line!r}"
        pins[canonicalize_name(name)] = Version(version)
    return pins


def declared() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    return [Requirement(r) for r in [*project["dependencies"], *extras["test"],
                                      *extras["triton"]]]


def torch_spec() -> Requirement:
    match = re.search(r"^TORCH_SPEC \?= (\S+)$", (ROOT / "Makefile").read_text(), re.M)
    return Requirement(match.group(1))


def test_every_declared_dependency_is_pinned_within_its_range():
    pins = read_lock()
    problems = []
    for req in declared():
        name = canonicalize_name(req.name)
        if name == "torch":  # pinned by the Makefile (the build depends on the machine)
            assert "torch" not in pins
            version = next(iter(torch_spec().specifier)).version
        elif name not in pins:
            problems.append(f"{req.name} is not in requirements.lock")
            continue
        else:
            version = pins[name]
        if not req.specifier.contains(version, prereleases=True):
            problems.append(f"{req.name}=={version} is outside pyproject's {req.specifier}")
    assert not problems, "\n".join(problems) + "\nRun `make lock`, then `make test`."


def test_the_lock_pins_the_installer_and_the_build_backend():
    """`make venv` installs pip from the lock and the project with --no-build-isolation."""
    assert {"pip", "setuptools", "wheel"} <= set(read_lock())


def test_the_venv_is_the_lock():
    """Every locked package is installed at its locked version (`make test-latest`, which runs
    on the newest releases, deselects this test and prints the drift instead)."""
    wrong = {}
    for name, version in read_lock().items():
        try:
            installed = Version(metadata.version(name))
        except metadata.PackageNotFoundError:
            installed = None
        if installed != version:
            wrong[name] = f"locked {version}, installed {installed}"
    assert not wrong, f"{wrong}\nThe venv was not installed from the lock: run `make venv`."
