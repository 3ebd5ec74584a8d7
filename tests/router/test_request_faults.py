"""A request that makes a worker's step fail fails alone, through the real router and real
workers in this process: the client gets RequestFailedError (gRPC INTERNAL), the request is not
retried or migrated, the other requests finish with their own tokens, every worker's engine loop
lives on and every block comes back.

The fault is injected into the sampler for one seed at one output position: position 0 is
sampled by the prefill worker (disaggregated) or in the colocated worker's general step, later
positions by the decode rows."""

from __future__ import annotations

import asyncio

import pytest

from pdserve import SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.sampling.sampler import Sampler
from pdserve.engine.sampling.seeded_uniforms import seed_key
from pdserve.router.backend import ModelSpec, PreparedRequest
from pdserve.router.core import Router, RouterConfig
from pdserve.router.directory import StaticDirectory
from pdserve.router.errors import RequestFailedError
from pdserve.testing.waits import async_wait_for
from pdserve.workers.build import build_local_workers

ENGINE = dict(dtype="float32", block_size=4, num_kv_blocks=96, max_num_batched_tokens=32)
POISON_SEED = 13
SEEDS = (11, POISON_SEED, 15, 17)


def params(seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=8, temperature=0.9, seed=seed, ignore_eos=True)


def poison_sampler(monkeypatch, position: int) -> None:
    sample, poison = Sampler.sample, seed_key(POISON_SEED)

    def poisoned(self, logits, batch):
        if ((batch.seed_keys == poison) & (batch.positions == position)).any():
            raise OverflowError("injected: the poisoned row")
        return sample(self, logits, batch)

    monkeypatch.setattr(Sampler, "sample", poisoned)


async def serve(model_dir, colocated: bool) -> dict[int, list[int] | Exception]:
    config = EngineConfig(model=str(model_dir), **ENGINE)
    handles = build_local_workers(config, num_prefill=0 if colocated else 1,
                                  num_decode=2 if colocated else 1, colocated=colocated)
    router = Router(ModelSpec("t", 256, 509), StaticDirectory(handles, 2.0), tokenize=list,
                    config=RouterConfig(stats_interval_s=0.05, worker_wait_s=5.0))
    await router.start()

    async def one(seed: int):
        tokens, sampling = [], params(seed)
        request = PreparedRequest(f"r{seed}", [3, 5, 7, seed], sampling, sampling.max_tokens)
        try:
            async for delta in router.generate(request):
                tokens += delta.token_ids
        except RequestFailedError as exc:
            return exc
        return tokens

    try:
        results = await asyncio.wait_for(asyncio.gather(*map(one, SEEDS)), 60)
        assert all(h.worker.loop.is_alive for h in handles), "an engine loop died"

        async def idle():
            return not any([(await h.stats()).used_blocks for h in handles])

        await async_wait_for(idle, 10.0, "every worker's blocks back to 0")
        migrations = sum(s.value for m in router.metrics.migrations.collect()
                         for s in m.samples if s.name.endswith("_total"))
        assert migrations == 0, "the poisoned request was moved to another worker"
        return dict(zip(SEEDS, results, strict=True))
    finally:
        await router.stop()
        for h in handles:
            h.close()


@pytest.mark.parametrize(("colocated", "position"), [(False, 0), (False, 3), (True, 0),
                                                     (True, 3)],
                         ids=["prefill-token0", "decode-rows", "colocated-token0",
                              "colocated-rows"])
def test_the_poisoned_request_fails_alone(hf_checkpoint, monkeypatch, colocated, position):
    model_dir = hf_checkpoint("llama")
    clean = asyncio.run(serve(model_dir, colocated))
    poison_sampler(monkeypatch, position)
    results = asyncio.run(serve(model_dir, colocated))
    failed = results.pop(POISON_SEED)
    assert isinstance(failed, RequestFailedError) and "injected" in str(failed)
    assert results == {seed: clean[seed] for seed in results}
