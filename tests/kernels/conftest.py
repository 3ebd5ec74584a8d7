"""Kernel test fixtures.

``TRITON_INTERPRET=1`` is set at import, before any ``pdserve.kernels`` Triton module is
imported: ``@triton.jit`` picks the interpreter when the decorator runs, so what matters is that
no Triton kernel module was imported earlier in the session (the CPU path never imports one).

* ``gen``: a torch Generator seeded fresh from the OS each run; the seed is printed (shown on
  failure) and ``PDSERVE_TEST_SEED`` replays one.
* Every test marked ``triton`` runs with ``torch.empty`` / ``torch.empty_like`` POISONED (NaN for
  floats, -128 for int8, -1 for other ints), so an output element a kernel never writes fails.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from pdserve.testing.paged_batches import new_seed, poison_  # noqa: E402


@pytest.fixture
def gen() -> torch.Generator:
    seed = int(os.environ.get("PDSERVE_TEST_SEED") or new_seed())
    print(f"seed={seed} (replay with PDSERVE_TEST_SEED={seed})")
    return torch.Generator().manual_seed(seed)


@pytest.fixture(autouse=True)
def _poisoned_allocations(request, monkeypatch):
    """Poison fresh allocations during Triton tests (harmless to correct code)."""
    if request.node.get_closest_marker("triton") is None:
        yield
        return
    from pdserve.kernels import kv_write

    if not torch.cuda.is_available() and \
            type(kv_write._write_kv_kernel).__name__ != "InterpretedFunction":
        pytest.fail("pdserve Triton kernels were imported before TRITON_INTERPRET=1 was set")
    empty, empty_like = torch.empty, torch.empty_like
    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison_(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison_(empty_like(*a, **k)))
    yield
