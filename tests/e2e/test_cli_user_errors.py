"""A user error a worker finds itself (here: a budget too small, on a joined Ray cluster where
the CLI cannot check it first) still ends ``pdserve serve`` with exit 2 and one message."""

from __future__ import annotations

import signal

import pytest

from pdserve.cluster.cli import main

pytestmark = pytest.mark.e2e


def test_worker_budget_error_crosses_ray_and_exits_2(ray_session, redis_url, tiny_dir, capsys):
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with pytest.raises(SystemExit) as exc:  # --ray-address: joins the session's Ray
            main(["serve", "--model", str(tiny_dir), "--ray-address", "session", "--redis-url",
                  redis_url, "--port", "0", "--metrics-port", "none", "--memory-budget-mib",
                  "1"])
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    assert exc.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("pdserve serve: error: the memory budget (1.0 MiB) is too small"), last
    assert "--memory-budget-mib to at least" in last and "--num-kv-blocks" in last
    assert ray_session.is_initialized()  # a joined cluster is left running
