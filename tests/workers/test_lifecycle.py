"""Worker lifecycles end in a leak check: leases expire, aborts are idempotent in every state."""

from __future__ import annotations

import asyncio
import time

from pdserve import SamplingParams
from pdserve.testing.waits import wait_for
from pdserve.worker_api import WorkRequest
from pdserve.workers.host import WorkerHost

PARAMS = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)


def request(request_id: str, n: int = 9) -> WorkRequest:
    return WorkRequest(request_id, list(range(3, 3 + n)), PARAMS, seed=7, arrival_time=time.time())


def test_expired_lease_frees_blocks_and_reports(hf_checkpoint, make_pair):
    pair = make_pair(hf_checkpoint("llama"), lease_s=0.2)
    reservation = pair.decode.reserve(request("late")).result(5)
    assert reservation.num_blocks == 3 and pair.used_blocks() == (0, 3)
    deltas = []
    assert wait_for(lambda: deltas.extend(pair.decode.poll(0.05)) or bool(deltas))
    assert deltas[0].request_id == "late" and deltas[0].finish_reason == "abort"
    assert "lease" in deltas[0].error
    assert pair.used_blocks() == (0, 0)


def test_abort_is_idempotent_in_every_decode_state(hf_checkpoint, make_pair):
    pair = make_pair(hf_checkpoint("llama"))
    pair.decode.abort("never-seen").result(5)  # unknown
    pair.decode.reserve(request("reserved")).result(5)
    for _ in range(2):  # reserved, then already aborted
        pair.decode.abort("reserved").result(5)
    assert pair.used_blocks() == (0, 0)
    req = request("running")
    reservation = pair.decode.reserve(req).result(5)
    # its first decode step begins asleep, so it is still running when stats answers after that
    # step, however fast the rest of its 50 steps go
    pair.decode.loop.inject_fault("stall", 1.0)
    pair.prefill.prefill(req, reservation).result(10)
    assert wait_for(lambda: pair.decode.stats().result(5).num_running == 1)
    for _ in range(2):  # running, then finished
        pair.decode.abort("running").result(5)
    assert wait_for(lambda: pair.used_blocks() == (0, 0))


def test_abort_queued_prefill_fails_its_future(hf_checkpoint, make_pair):
    """Prompts aborted while they wait behind a running step fail their futures (never hang);
    the running one finishes. The first step is stalled so that the others are queued, and
    their aborts sent, before it ends, whatever the machine's speed."""
    from pdserve.prefill_worker.worker import RequestAborted

    pair = make_pair(hf_checkpoint("llama"))
    reqs = [request(f"q{i}", 40) for i in range(6)]
    pair.prefill.loop.inject_fault("stall", 2.0)  # the step that takes q0 begins with 2 s asleep
    futures = [pair.prefill.prefill(r, pair.decode.reserve(r).result(5)) for r in reqs]
    aborts = [pair.prefill.abort(r.request_id) for r in reqs[1:]]
    for r, abort in zip(reqs[1:], aborts, strict=True):
        abort.result(10)
        pair.decode.abort(r.request_id).result(5)
    assert futures[0].result(20).first.new_token_ids
    assert all(isinstance(f.exception(20), RequestAborted) for f in futures[1:])
    pair.decode.abort("q0").result(5)
    assert wait_for(lambda: pair.used_blocks() == (0, 0))


def test_reserve_without_room_is_no_room_now(hf_checkpoint, make_pair):
    import pytest

    from pdserve.worker_api import NeverFits, NoRoomNow

    pair = make_pair(hf_checkpoint("llama"), decode_blocks=24)
    pair.decode.reserve(request("a", 40)).result(5)  # 10 of 24 blocks
    pair.decode.reserve(request("b", 40)).result(5)  # 20 of 24 blocks
    with pytest.raises(NoRoomNow):
        pair.decode.reserve(request("c", 40)).result(5)
    with pytest.raises(NeverFits, match="max_tokens"):  # could never fit: not a capacity issue
        pair.decode.reserve(request("d", 80)).result(5)
    pair.decode.abort("b").result(5)
    pair.decode.abort("a").result(5)
    assert pair.used_blocks() == (0, 0)


def test_a_host_refuses_the_calls_its_workers_role_does_not_answer(hf_checkpoint, make_pair):
    """WorkerHost tells roles by name (the router's process imports it without the workers):
    a prefill worker takes no submit, poll or reserve; a decode worker takes no prefill."""
    pair = make_pair(hf_checkpoint("llama"))
    work = request("wrong-role")
    prefill, decode = WorkerHost(pair.prefill), WorkerHost(pair.decode)

    async def refused(call) -> str:
        try:
            await call
        except TypeError as exc:
            return str(exc)
        raise AssertionError("not refused")

    async def main():
        assert "submit: worker" in await refused(prefill.submit(work, ""))
        assert "is a prefill worker" in await refused(prefill.poll(0.0, ""))
        assert "reserve:" in await refused(prefill.reserve(work, ""))
        assert "is a decode worker" in await refused(decode.prefill(work, None))
        assert await prefill.mailbox_sizes() is None
        assert await decode.mailbox_sizes() is not None

    asyncio.run(main())
