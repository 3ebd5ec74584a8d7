"""The dependency arrows of DESIGN.md section 1 hold: no package imports what sits above it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# package -> pdserve packages and third-party roots it must never import
FORBIDDEN = {
    "kernels": {"pdserve.models", "pdserve.engine", "pdserve.kv_transfer", "pdserve.router",
                "pdserve.cluster", "pdserve.api", "ray", "grpc", "redis"},
    "models": {"pdserve.engine", "pdserve.kv_transfer", "pdserve.router", "pdserve.cluster",
               "pdserve.api", "ray", "grpc", "redis"},
    "engine": {"pdserve.kv_transfer", "pdserve.prefill_worker", "pdserve.decode_worker",
               "pdserve.router", "pdserve.cluster", "pdserve.api", "ray", "grpc", "redis"},
    "kv_transfer": {"pdserve.models", "pdserve.engine", "pdserve.router", "pdserve.cluster",
                    "ray", "grpc", "redis"},
    "prefill_worker": {"pdserve.decode_worker", "pdserve.router", "pdserve.cluster", "ray",
                       "grpc", "redis"},
    "decode_worker": {"pdserve.prefill_worker", "pdserve.router", "pdserve.cluster", "ray",
                      "grpc", "redis"},
    "router": {"pdserve.prefill_worker", "pdserve.decode_worker", "pdserve.kv_transfer",
               "pdserve.models", "pdserve.kernels", "pdserve.cluster", "ray", "redis"},
    "api": {"pdserve.engine", "pdserve.router", "pdserve.cluster", "ray", "redis"},
}


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_upward_imports(package):
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for name in imported_modules(path):
            if any(name == f or name.startswith(f + ".") for f in FORBIDDEN[package]):
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, "\n".join(bad)


def test_no_bare_package_imports():
    folders = set(FORBIDDEN) | {"cluster", "bench"}
    bad = [f"{p.relative_to(ROOT)} imports {n}" for p in ROOT.rglob("*.py")
           if not any(part.startswith(".") for part in p.relative_to(ROOT).parts)
           for n in imported_modules(p) if n.split(".")[0] in folders]
    assert not bad, "\n".join(bad)


ENGINE_INTERNALS = {"parts", "scheduler", "sampler", "runner", "block_manager"}
WORKER_PACKAGES = ("prefill_worker", "decode_worker")


@pytest.mark.parametrize("package", WORKER_PACKAGES)
def test_workers_run_the_engine_step_without_touching_its_internals(package):
    """Every worker runs LLMEngine.step (its role lives in the policy and StepHooks): no
    worker module reads ``engine.parts`` / ``engine.scheduler`` / ... or steps on its own."""
    offenders = []
    for path in sorted((ROOT / package).glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr in ENGINE_INTERNALS
                    and isinstance(node.value, ast.Attribute) and node.value.attr == "engine"):
                offenders.append(f"{path.name}:{node.lineno} engine.{node.attr}")
            if isinstance(node, ast.FunctionDef) and node.name in ("step", "_step"):
                offenders.append(f"{path.name}:{node.lineno} defines {node.name}()")
    assert not offenders, offenders
