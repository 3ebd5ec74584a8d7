"""A seeded sampled request draws the same tokens alone and in a batch of others.

The chaos and e2e tests compare what workers stream (every request shares a batch there) with
the offline engine running each request alone. CPU attention is not bit-for-bit invariant to the
batch's shape, so this holds only while the rounding differences stay at the last bit; a change
that moved them further (folding GQA into the query length did) flips a sampled token near a
boundary. This pins the chaos tests' own workload, offline, in seconds."""

from __future__ import annotations

from pdserve import LLM, SamplingParams
from pdserve.bench.failover import chaos_requests, reference_tokens


def test_seeded_requests_draw_the_same_tokens_alone_and_batched(hf_checkpoint):
    model = str(hf_checkpoint("qwen2", max_position_embeddings=2048))
    requests = chaos_requests(16, seed=sum(map(ord, "raise")), prefix="raise", min_tokens=192,
                              max_tokens=256)
    alone = reference_tokens(model, requests, block_size=4, num_kv_blocks=2048)
    llm = LLM(model, dtype="float32", num_kv_blocks=512)
    together = llm.generate([r.prompt for r in requests],
                            [SamplingParams(**r.sampling) for r in requests], use_tqdm=False)
    assert [o.token_ids for o in together] == alone
