"""The floors of docs/architecture.md hold: no folder imports one above it, and the arrows
between folders form no cycle."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The floors, bottom up: each folder (or top-level module) -> the pdserve folders it may import.
# Everything else is a backward arrow. A new folder must be placed here (the test of the folder
# list fails until it is), and the arrows must stay acyclic.
MAY_IMPORT = {
    "import_path": set(),
    "net": set(),
    "kernels": set(),
    "models": {"kernels"},
    "engine": {"kernels", "models"},
    "kv_transfer": {"kernels", "net"},
    "api": {"net"},
    "prefill_worker": {"kernels", "models", "engine", "kv_transfer", "net"},
    "decode_worker": {"kernels", "models", "engine", "kv_transfer", "net"},
    "router": {"engine", "api", "net"},
    "cluster": {"kernels", "models", "engine", "kv_transfer", "api", "net", "prefill_worker",
                "decode_worker", "router"},
    "bench": {"kernels", "models", "engine", "kv_transfer", "api", "net", "prefill_worker",
              "decode_worker", "router", "cluster", "testing"},
    "cli": {"kernels", "models", "engine", "kv_transfer", "api", "net", "prefill_worker",
            "decode_worker", "router", "cluster", "bench"},
    "__init__": {"engine", "import_path"},  # the public facade: pdserve.LLM, SamplingParams
    "testing": {"engine", "models", "kernels", "api", "router", "net"},
    "draw_check": {"engine"},
}
# Third-party packages only the floors that own them may import.
OWNERS = {"ray": {"cluster", "bench", "cli"}, "redis": {"cluster", "bench", "cli"},
          "grpc": {"api", "router", "cluster", "bench", "cli"}}


def floor_of(path: Path) -> str:
    parts = path.relative_to(ROOT).parts
    return parts[0] if len(parts) > 1 else path.stem


def package_files() -> list[Path]:
    return [p for p in sorted(ROOT.rglob("*.py"))
            if not any(part.startswith(".") for part in p.relative_to(ROOT).parts)
            and p.relative_to(ROOT).parts[0] not in ("tests", "helm", "docs")]


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_every_floor_is_placed():
    assert {floor_of(p) for p in package_files()} == set(MAY_IMPORT)


def test_the_floors_have_no_cycle():
    done: set[str] = set()

    def visit(floor: str, path: tuple[str, ...]) -> None:
        assert floor not in path, " -> ".join((*path, floor))
        if floor not in done:
            for lower in MAY_IMPORT[floor]:
                visit(lower, (*path, floor))
            done.add(floor)

    for floor in MAY_IMPORT:
        visit(floor, ())


def pdserve_floor(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if parts[0] == "pdserve" and len(parts) > 1 else None


@pytest.mark.parametrize("floor", sorted(MAY_IMPORT))
def test_no_backward_arrows(floor):
    bad = []
    for path in package_files():
        if floor_of(path) != floor:
            continue
        for name in imported_modules(path):
            target = pdserve_floor(name)
            if target is not None and target != floor and target not in MAY_IMPORT[floor]:
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
            owners = OWNERS.get(name.split(".")[0])
            if owners is not None and floor not in owners:
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, "\n".join(bad)


def test_no_bare_package_imports():
    bad = [f"{p.relative_to(ROOT)} imports {n}" for p in ROOT.rglob("*.py")
           if not any(part.startswith(".") for part in p.relative_to(ROOT).parts)
           for n in imported_modules(p) if n.split(".")[0] in MAY_IMPORT]
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
