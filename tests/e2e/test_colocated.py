"""Colocated worker actors (both phases in one worker): the baseline, end to end."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.api.client import AsyncPdserveClient, PdserveError

pytestmark = pytest.mark.e2e

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def model_dir(hf_checkpoint):
    return hf_checkpoint("qwen2", max_position_embeddings=2048)


@pytest.fixture(scope="module")
def cluster(start_cluster, model_dir):
    c = start_cluster(model_dir, colocated=True, num_decode=1, engine=dict(num_kv_blocks=512))
    yield c
    c.stop()


def test_concurrent_greedy_equals_offline(cluster, model_dir, e2e):
    prompts = e2e.prompts(0, 8)
    expected = e2e.reference(model_dir, prompts, MAX_TOKENS)
    results = e2e.generate_all(cluster.target, prompts, MAX_TOKENS)
    assert [r.token_ids for r in results] == expected
    assert all(r.finish_reason == "length" for r in results)


def test_cancel_mid_stream_and_deadline_free_every_block(cluster, e2e):
    async def main():
        async with AsyncPdserveClient(cluster.target) as client:
            stream = client.generate_stream([5, 6, 7, 8] * 5, max_tokens=1000,
                                            temperature=0.0, ignore_eos=True, timeout=60)
            async for _chunk in stream:
                break  # cancel mid-stream
            await stream.aclose()
            got = []
            with pytest.raises(PdserveError) as err:
                async for chunk in client.generate_stream([9, 10, 11], max_tokens=2000,
                                                          temperature=0.0, ignore_eos=True,
                                                          timeout=1.5):
                    got.append(chunk)
            return err.value.code, got

    code, got = asyncio.run(main())
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert got, "the deadline should expire mid-stream, after token 0"
    assert e2e.wait_idle(cluster) == {"colocated-0": 0}
