"""The CLI's memory plan equals the worker's, and a worker's MemoryBudgetError is recognised
after crossing the Ray boundary (as a task error's cause, or as the text of a dead actor)."""

from __future__ import annotations

import pickle
import re
import traceback

import pytest
from ray.exceptions import ActorDiedError, RayTaskError

from pdserve.cli.preflight import user_error
from pdserve.engine.capacity.budget_check import check_engine_fits
from pdserve.engine.capacity.memory import MemoryBudgetError
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm import LLM

MiB = 1 << 20


@pytest.mark.parametrize("engine", [
    dict(memory_budget_bytes=300 * MiB),
    dict(memory_budget_bytes=200 * MiB, kv_cache_dtype="int8", block_size=8),
    dict(memory_budget_bytes=180 * MiB, max_num_batched_tokens=256, max_model_len=512,
         dtype="bfloat16"),
])
def test_plan_in_the_cli_equals_the_workers(tiny_dir, engine):
    config = EngineConfig(model=str(tiny_dir), device="cpu", **engine)
    assert check_engine_fits(config) == LLM(**vars(config)).memory_ledger.num_kv_blocks


def test_plan_counts_tied_embeddings_once(hf_checkpoint):
    path = hf_checkpoint("qwen2-bias-tied")
    config = EngineConfig(model=str(path), device="cpu", memory_budget_bytes=40 * MiB,
                          max_num_batched_tokens=128, max_num_seqs=8)
    assert check_engine_fits(config) == LLM(**vars(config)).memory_ledger.num_kv_blocks


def test_too_small_budget_names_the_numbers_and_the_fix(tiny_dir):
    config = EngineConfig(model=str(tiny_dir), device="cpu", memory_budget_bytes=MiB)
    with pytest.raises(MemoryBudgetError) as exc:
        check_engine_fits(config)
    message = str(exc.value)
    with pytest.raises(MemoryBudgetError, match=re.escape(message)):
        LLM(**vars(config))  # the worker raises the same message
    at_least = int(re.search(r"--memory-budget-mib to at least (\d+)", message).group(1))
    fixed = EngineConfig(model=str(tiny_dir), device="cpu", memory_budget_bytes=at_least * MiB)
    assert check_engine_fits(fixed) >= 1


def test_pinned_pool_or_unknown_budget_skips_the_budget(tiny_dir):
    pinned = EngineConfig(model=str(tiny_dir), device="cpu", memory_budget_bytes=MiB,
                          num_kv_blocks=16)
    assert check_engine_fits(pinned) is None


def _worker_error() -> MemoryBudgetError:
    return MemoryBudgetError("the memory budget (1.0 MiB) is too small for this model: ...")


def _task_error(cause: BaseException) -> RayTaskError:
    text = "".join(traceback.format_exception(cause))
    return RayTaskError("WorkerActor.__init__", text, cause)


def test_memory_budget_error_survives_pickling_and_ray_wrapping():
    error = _worker_error()
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is MemoryBudgetError and str(copy) == str(error)
    assert isinstance(copy, ValueError)
    for wrapped in (error, _task_error(error), _task_error(error).as_instanceof_cause(),
                    ActorDiedError(_task_error(error))):
        found = user_error(wrapped)
        assert isinstance(found, MemoryBudgetError) and str(found) == str(error), wrapped


def test_other_errors_are_not_user_errors():
    assert user_error(RuntimeError("boom")) is None
    assert user_error(_task_error(ValueError("MemoryBudget nothing"))) is None
    assert user_error(ActorDiedError(_task_error(RuntimeError("boom")))) is None
