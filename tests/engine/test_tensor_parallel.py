"""Tensor parallel engines on CPU over gloo: real follower processes, real process groups.

Greedy output at TP=2 (and TP=4, where K/V heads are replicated) equals Hugging Face fp32
token for token on the families that split; settings that cannot work are refused naming the
setting before any process starts; the ranks' processes end with the engine, whether it is
closed, its follower is killed mid-run or its own process dies."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine_loop import EngineLoop, EngineStalledError
from pdserve.engine.tensor_parallel import group
from pdserve.engine.tensor_parallel.group import FOLLOWER_MODULE, Followers
from pdserve.testing.waits import wait_for
from pdserve.worker_api import WorkRequest

transformers = pytest.importorskip("transformers")

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
ENGINE = dict(device="cpu", dtype="float32", block_size=4, num_kv_blocks=96,
              max_num_batched_tokens=16)
# Every FAMILY_PARAMS entry, with the fewest overrides that let it split two ways where its
# own shapes cannot (llama-mha-odd has 3 heads, llama3-rope 3 K/V heads: both refused below)
SPLITTABLE = {"llama-gqa": {}, "qwen2-bias-tied": {}, "qwen3-qknorm": {},
              "mistral-window": {}, "qwen2-layer-window": {},
              "llama-mha-odd": dict(num_attention_heads=4, num_key_value_heads=4),
              "llama3-rope": dict(num_key_value_heads=2)}


def _prompts(n: int = 3, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 480) for _ in range(length)] for length in (5, 23, 37)[:n]]


def _follower_pids() -> list[int]:
    """Processes running a tensor parallel follower, started by anyone (test isolation)."""
    out = subprocess.run(["pgrep", "-f", FOLLOWER_MODULE], capture_output=True, text=True)
    return [int(pid) for pid in out.stdout.split()]


def _wait_gone(pids: list[int], timeout_s: float = 20.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    alive = pids
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [pid for pid in alive if os.path.exists(f"/proc/{pid}")
                 and "zombie" not in _status(pid)]
    return alive


def _status(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/status") as f:
            return f.read()
    except OSError:
        return "zombie"


@pytest.mark.parametrize("name", SPLITTABLE)
def test_tp2_greedy_equals_hf(name, hf_checkpoint, hf_greedy):
    path = hf_checkpoint(name, **SPLITTABLE[name])
    prompts = _prompts()
    with LLM(str(path), tensor_parallel_size=2, **ENGINE) as llm:
        ours = [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        assert llm.engine.parts.block_manager.num_used_blocks == 0
    assert ours == hf_greedy(path, prompts, GREEDY.max_tokens)


def test_tp4_replicates_kv_heads_and_equals_hf(hf_checkpoint, hf_greedy):
    """4 ranks over 2 K/V heads: each rank holds one query head and a copy of its K/V head."""
    path = hf_checkpoint("llama-gqa")
    prompts = _prompts()
    with LLM(str(path), tensor_parallel_size=4, **ENGINE) as llm:
        assert llm.engine.parts.runner.model.config.num_key_value_heads == 1
        ours = [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert ours == hf_greedy(path, prompts, GREEDY.max_tokens)


def test_tp2_row_parallel_biases_are_added_once(tmp_path, hf_greedy):
    """o_proj and down_proj biases (Llama attention_bias, mlp_bias): only rank 0 adds them."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=96, intermediate_size=160, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, vocab_size=301, max_position_embeddings=256, head_dim=24,
        attention_bias=True, mlp_bias=True)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.2)
    model.save_pretrained(tmp_path)
    prompts = [[t % 300 + 1 for t in p] for p in _prompts()]
    with LLM(str(tmp_path), tensor_parallel_size=2, **ENGINE) as llm:
        ours = [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert ours == hf_greedy(tmp_path, prompts, GREEDY.max_tokens)


def test_speculative_decoding_on_a_tp2_target(hf_checkpoint):
    """The draft runs unsharded on rank 0; the TP target verifies: greedy unchanged."""
    path = hf_checkpoint("llama-gqa")
    prompts = _prompts() + [[7, 8, 9] * 8]
    with LLM(str(path), **ENGINE) as llm:
        expected = [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    spec = {"method": "draft_model", "model": str(path), "num_speculative_tokens": 2}
    with LLM(str(path), tensor_parallel_size=2, speculative_config=spec, **ENGINE) as llm:
        ours = [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        assert llm.spec_decode_stats()["num_accepted_tokens"] > 0
    assert ours == expected


@pytest.mark.parametrize("value", [0, -1, True, 1.5, "2", None])
def test_tensor_parallel_size_must_be_a_positive_int(tiny_dir, value):
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        EngineConfig(model=str(tiny_dir), tensor_parallel_size=value)


@pytest.mark.parametrize(("name", "size", "field"), [
    ("llama-mha-odd", 2, "num_attention_heads"),  # 3 heads
    ("llama3-rope", 2, "num_key_value_heads"),  # 6 heads over 3 K/V heads
    ("llama-gqa", 2**63, "num_attention_heads"),
])
def test_a_model_that_does_not_split_is_refused_before_any_rank_starts(
        hf_checkpoint, name, size, field):
    before = set(_follower_pids())
    with pytest.raises(ValueError, match=f"tensor_parallel_size \\({size}\\).*{field}"):
        LLM(str(hf_checkpoint(name)), tensor_parallel_size=size, **ENGINE)
    assert set(_follower_pids()) == before


def test_int8_kv_with_tensor_parallelism_is_refused(tiny_dir):
    with pytest.raises(ValueError, match="kv_cache_dtype='int8' with tensor_parallel_size"):
        EngineConfig(model=str(tiny_dir), kv_cache_dtype="int8", tensor_parallel_size=2)


def test_close_ends_every_rank(hf_checkpoint):
    llm = LLM(str(hf_checkpoint("llama-gqa")), tensor_parallel_size=2, **ENGINE)
    followers = llm.engine.parts.runner.followers
    assert followers.alive() == [True]
    llm.close()
    assert followers.alive() == [False]
    assert llm.engine.broken() is None  # stopped on purpose: not a broken group


def test_an_idle_spell_longer_than_the_step_timeout_keeps_the_group(
        hf_checkpoint, monkeypatch):
    """Followers wait for the next step as long as the engine idles; the step timeout bounds
    only the collectives inside a step."""
    monkeypatch.setattr(group, "STEP_TIMEOUT_S", 1.0)
    with LLM(str(hf_checkpoint("llama-gqa")), tensor_parallel_size=2, **ENGINE) as llm:
        first = [o.token_ids for o in llm.generate(_prompts(2), GREEDY, use_tqdm=False)]
        time.sleep(3.0)
        assert llm.engine.parts.runner.followers.alive() == [True]
        again = [o.token_ids for o in llm.generate(_prompts(2), GREEDY, use_tqdm=False)]
    assert again == first


# a real-time signal has no name in signal.Signals: it is described by its number
KILLERS = [(signal.SIGKILL, "SIGKILL"), (signal.SIGRTMIN + 6, f"signal {signal.SIGRTMIN + 6}")]


@pytest.mark.parametrize("killer, named", KILLERS, ids=["SIGKILL", "realtime"])
def test_a_killed_follower_fails_the_step_at_once(hf_checkpoint, killer, named):
    """A rank that dies mid-service breaks the group: rank 0's next step raises (the worker
    around it is then restarted as one) instead of waiting out a timeout."""
    llm = LLM(str(hf_checkpoint("llama-gqa")), tensor_parallel_size=2, **ENGINE)
    try:
        llm.generate(_prompts(1), GREEDY, use_tqdm=False)
        pid = llm.engine.parts.runner.followers._procs[0].pid
        assert llm.engine.broken() is None
        os.kill(pid, killer)
        # what a worker's liveness check reports, even while a step would wait on the rank
        assert wait_for(llm.engine.broken, 20, "rank 1's exit") == \
            f"tensor parallel rank 1 (pid {pid}) exited: killed by {named}"
        start = time.monotonic()
        with pytest.raises(RuntimeError):
            llm.generate(_prompts(1), GREEDY, use_tqdm=False)
        assert time.monotonic() - start < 60  # a broken connection, not the step timeout
    finally:
        llm.close()


def test_a_stopped_follower_leaves_rank_0_stuck_until_the_step_bound(hf_checkpoint):
    """A SIGSTOPped rank is not gone (nothing reports it), but rank 0's step waits on it in a
    collective: past the step bound the engine loop is stuck, says so and refuses work; the
    step returns once the rank runs again, and the loop then ends (the worker is replaced)."""
    llm = LLM(str(hf_checkpoint("llama-gqa")), tensor_parallel_size=2, **ENGINE)
    engine = llm.engine
    loop = EngineLoop("tp-loop", engine.step, engine.has_unfinished_requests,
                      watch=engine.broken, step_timeout_s=1.0).start()
    pid = engine.parts.runner.followers._procs[0].pid
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    try:
        os.kill(pid, signal.SIGSTOP)
        loop.call(engine.add_work, WorkRequest("r", _prompts(1)[0], params, seed=1,
                                               arrival_time=time.time())).result(10)
        stuck = wait_for(loop.stuck, 20, "the stuck verdict")
        assert stuck.startswith("stuck: a step has run") and engine.broken() is None
        assert isinstance(loop.call(lambda: None).exception(0), EngineStalledError)
        os.kill(pid, signal.SIGCONT)
        wait_for(lambda: loop.error, 30, "the loop's end")
        assert "EngineStalledError: stuck: a step ran" in loop.error
    finally:
        os.kill(pid, signal.SIGCONT)
        loop.stop()
        llm.close()


def test_a_follower_that_dies_while_starting_is_reported(hf_checkpoint):
    config = EngineConfig(model=str(hf_checkpoint("llama-gqa")), tensor_parallel_size=2,
                          **ENGINE)
    followers = Followers.start(config)
    followers._procs[0].kill()
    with pytest.raises(RuntimeError, match="rank 1 exited with code"):
        followers.join(ledger=None, device=torch.device("cpu"))  # (never read: rank 1 is gone)
    followers.stop()


@pytest.mark.parametrize("stopped", [False, True], ids=["running", "stopped"])
def test_followers_exit_when_rank_0_is_killed(hf_checkpoint, tmp_path, stopped):
    """Rank 0's process killed with SIGKILL (no cleanup runs): its followers notice their
    parent is gone and exit; a SIGSTOPped one, which cannot notice, is killed by the kernel
    (it would otherwise hold its device for good)."""
    script = tmp_path / "rank0.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        from pdserve import LLM
        llm = LLM({str(hf_checkpoint("llama-gqa"))!r}, tensor_parallel_size=2, device="cpu",
                  dtype="float32", block_size=4, num_kv_blocks=16)
        print(*(p.pid for p in llm.engine.parts.runner.followers._procs), flush=True)
        time.sleep(600)
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(pid) for pid in proc.stdout.readline().split()]
        assert pids and all(os.path.exists(f"/proc/{pid}") for pid in pids)
        for pid in pids if stopped else []:
            os.kill(pid, signal.SIGSTOP)
    finally:
        proc.kill()
        proc.wait()
    assert _wait_gone(pids) == []


def test_the_groups_store_takes_only_values_its_ranks_signed():
    """A local process that reaches the loopback store cannot pass a value off as a rank's
    (a forged report would start a request whose heads never arrived)."""
    import datetime

    import torch.distributed as dist

    from pdserve.engine.tensor_parallel.group import SignedStore, Signer, TamperedError

    raw = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                        timeout=datetime.timedelta(seconds=5))
    store = SignedStore(raw, Signer(b"k" * 32))
    store.set("report/kv/1/1/1", "")
    assert store.get("report/kv/1/1/1") == b""
    raw.set("report/kv/1/1/1", b"")  # written by someone without the key
    with pytest.raises(TamperedError, match="not signed by this tensor parallel group"):
        store.get("report/kv/1/1/1")
    SignedStore(raw, Signer(b"x" * 32)).set("spec", b"pickle")  # another group's key
    with pytest.raises(TamperedError):
        store.get("spec")
    store.set("published/a/1", "x")
    raw.set("published/a/1", raw.get("published/a/1")[:-1] + b"y")  # the value changed
    with pytest.raises(TamperedError):
        store.get("published/a/1")


def test_a_follower_started_by_hand_refuses_to_run():
    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_TENSOR_GROUP_SECRET"}
    out = subprocess.run([sys.executable, "-m", FOLLOWER_MODULE, "--store", "127.0.0.1:1",
                          "--rank", "1", "--size", "2"], capture_output=True, text=True,
                         env=env, timeout=60)
    assert out.returncode == 2
    assert "PDSERVE_TENSOR_GROUP_SECRET is not set" in out.stderr
