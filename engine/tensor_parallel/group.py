"""Tensor parallel engines: one engine computed by a group of N ranks, each holding 1/N of
every layer's heads and MLP (the splits: :mod:`pdserve.models.tensor_parallel`).

Rank 0 is the engine as at N=1: scheduler, block manager, sampling, the KV handoff. Ranks
1..N-1 are follower processes it starts on its own machine (``python -m
pdserve.engine.tensor_parallel.follower_main``), so a worker's ranks are placed together and
restarted as one. Each rank's KV pool holds its own K/V heads of the same blocks: block ids
mean the same on every rank, and only rank 0 keeps the block tables.

Formation, in order, over a ``TCPStore`` on loopback that rank 0 hosts:

1. :meth:`Followers.start`: rank 0 publishes the engine config and starts the followers,
   which load their shards while rank 0 loads its own.
2. :meth:`Followers.join`: rank 0 publishes its memory ledger (the block count every rank
   allocates); each follower allocates its pool and answers "ready" or its error.
3. All ranks form one gloo (CPU) or NCCL (CUDA) group.

Per step, rank 0's :class:`TensorParallelRunner` broadcasts the flat batch (a fixed header,
then one int64 tensor of tokens, positions, slots, offsets, lengths and block tables) and
every rank runs the same forward; the decoder all-reduces after each block's output
projections. Only rank 0 computes logits. A worker whose ranks do more than the forward
names a :class:`RankRole` its followers build: it gets each batch's extras and the calls rank
0 makes between steps (``call_ranks``). Values in the store and pickled messages are signed
under a key only the group holds (:class:`Signer`).

A follower whose rank 0 is gone exits (its parent changes, or the group breaks), and is
killed by the kernel if it cannot notice (stopped, or hung: :func:`watch_parent`); a follower
that is gone breaks the group: rank 0's next collective raises, its engine loop dies and the
worker is restarted with a new group. A follower that is there but does not answer (stopped,
or in a collective that never ends) leaves rank 0's step waiting: the engine loop's step bound
finds it stuck (``pdserve.engine.engine_loop``) and the worker is replaced.
"""

from __future__ import annotations

import ctypes
import datetime
import hmac
import logging
import os
import pickle
import secrets
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pdserve.engine.capacity.memory import MemoryLedger
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine_loop import EngineBrokenError
from pdserve.engine.step.model_runner import ModelInput, ModelRunner
from pdserve.engine.tensor_parallel.follower_main import SECRET_ENV
from pdserve.kernels.lora import LoraBatch
from pdserve.models.attention import AttentionMetadata
from pdserve.models.config import ModelConfig

logger = logging.getLogger(__name__)

FOLLOWER_MODULE = "pdserve.engine.tensor_parallel.follower_main"
OP_STOP, OP_FORWARD, OP_CALL = 0, 1, 2
# op, num_tokens, num_seqs, block table width, max_query_len, max_context_len, the rows
# sampled, and the bytes of the pickled extras (FORWARD) or call (CALL) that follow the body
HEADER_WORDS = 8
STEP_TIMEOUT_S = 300.0  # a collective inside a step waits this long for the other ranks
IDLE_TIMEOUT = datetime.timedelta(days=365)  # a follower waits this long for the next step
START_TIMEOUT_S = 900.0  # followers load their shards and allocate within this
PARENT_ENV = "PDSERVE_TENSOR_PARENT_PID"  # rank 0's pid: a follower dies with that process
PR_SET_PDEATHSIG = 1  # prctl(2)
MAC_BYTES = 32  # HMAC-SHA256
LOOPBACK = "127.0.0.1"  # a worker's ranks share its machine: their store and group stay on it


@dataclass(frozen=True)
class FollowerSpec:
    """What rank 0 tells its followers through the store, before they load."""

    config: EngineConfig  # the engine's (the followers resolve the model from it)
    num_threads: int  # torch intra-op threads of each rank (rank 0's)
    step_timeout_s: float  # how long a collective inside a step waits for the other ranks
    role: RankRole | None = None  # what they do besides the forward (None: nothing)


def store_address(store: dist.TCPStore) -> str:
    return f"{LOOPBACK}:{store.port}"


class TamperedError(RuntimeError):
    """A value in the group's store or a broadcast message that no rank of the group wrote."""


class Signer:
    """HMAC-SHA256 under the group's secret, which rank 0 draws and hands its followers in
    their environment (``SECRET_ENV``): a local process that reaches the loopback store or
    slips into the group cannot pass a value off as a rank's."""

    def __init__(self, secret: bytes):
        self._secret = secret

    def sign(self, label: str, value: bytes) -> bytes:
        return hmac.new(self._secret, label.encode() + b"\0" + value, "sha256").digest() + value

    def open(self, label: str, signed: bytes) -> bytes:
        value = signed[MAC_BYTES:]
        if not hmac.compare_digest(self.sign(label, value)[:MAC_BYTES], signed[:MAC_BYTES]):
            raise TamperedError(f"{label!r} is not signed by this tensor parallel group")
        return value


class SignedStore:
    """The group's store, every value signed under its key (:class:`Signer`)."""

    def __init__(self, store: dist.Store, signer: Signer):
        self.raw = store  # (the process group's own rendezvous uses it as it is)
        self._signer = signer

    def set(self, key: str, value: bytes | str) -> None:
        value = value.encode() if isinstance(value, str) else value
        self.raw.set(key, self._signer.sign(key, value))

    def get(self, key: str) -> bytes:
        return self._signer.open(key, self.raw.get(key))

    def check(self, key: str) -> bool:
        return self.raw.check([key])

    def delete(self, key: str) -> None:
        self.raw.delete_key(key)


def connect_store(address: str, timeout_s: float) -> dist.TCPStore:
    host, port = address.rsplit(":", 1)
    return dist.TCPStore(host, int(port), is_master=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank ``rank``'s device: the rank-th GPU of the worker's, or the CPU."""
    return torch.device("cuda", rank) if device.type == "cuda" else device


class TensorGroup:
    """One rank's side of its group: the all-reduce the decoder calls, and the step batches
    rank 0 sends and the followers receive."""

    def __init__(self, store: SignedStore, rank: int, size: int, device: torch.device,
                 step_timeout_s: float, signer: Signer):
        self.rank, self.size, self.device = rank, size, device
        self._signer = signer  # the pickled extras and calls are signed
        store = dist.PrefixStore("tensor-group", store.raw)
        timeout = datetime.timedelta(seconds=step_timeout_s)
        if device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self._pg = dist.ProcessGroupNCCL(store, rank, size, opts)
        else:
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = timeout
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=LOOPBACK)]
            self._pg = dist.ProcessGroupGloo(store, rank, size, opts)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over the ranks, in place (every rank ends with the same values)."""
        self._pg.allreduce([tensor]).wait()

    def _broadcast(self, tensor: torch.Tensor, timeout: datetime.timedelta | None = None):
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        if timeout is not None:
            opts.timeout = timeout
        self._pg.broadcast([tensor], opts).wait()

    # -- rank 0 ----------------------------------------------------------------------------
    def send_batch(self, batch: ModelInput, extras: object = None,
                   lora_slots: torch.Tensor | None = None) -> None:
        """A step's batch, with what the followers' role needs for it (``extras``) and, when
        the engine serves LoRA, each row's adapter slot (``lora_slots``, -1: the base model)."""
        meta = batch.metadata
        num_seqs, width = meta.block_tables.shape
        blob = self._pickled(extras)
        header = torch.tensor([OP_FORWARD, len(batch.input_ids), num_seqs, width,
                               meta.max_query_len, meta.max_context_len,
                               len(batch.sample_indices), blob.numel()], dtype=torch.int64)
        body = torch.cat([t.reshape(-1).to(torch.int64) for t in (
            batch.input_ids, batch.positions, meta.slot_mapping, meta.cu_seqlens_q,
            meta.context_lens, meta.block_tables, batch.sample_indices,
            *(() if lora_slots is None else (lora_slots,)))])
        self._broadcast(header.to(self.device))
        self._broadcast(body.to(self.device))
        if blob.numel():
            self._broadcast(blob.to(self.device))

    def send_call(self, method: str, args: tuple) -> int:
        """Have every follower's role run ``method(*args)``; returns how many failed."""
        blob = self._pickled((method, args))
        self._broadcast(torch.tensor([OP_CALL, 0, 0, 0, 0, 0, 0, blob.numel()],
                                     dtype=torch.int64, device=self.device))
        self._broadcast(blob.to(self.device))
        return self.count_failures(False)

    def count_failures(self, failed: bool) -> int:
        """Every rank says whether its part failed; returns how many did (all ranks)."""
        flag = torch.tensor([int(failed)], dtype=torch.int64, device=self.device)
        self.all_reduce(flag)
        return int(flag.item())

    def send_stop(self) -> None:
        self._broadcast(torch.tensor([OP_STOP] + [0] * (HEADER_WORDS - 1),
                                     dtype=torch.int64, device=self.device))

    # -- followers ---------------------------------------------------------------------------
    def recv(self, backend: str, serves_lora: bool = False) -> Message | None:
        """The next message from rank 0, or None when it stops the group; waits as long as
        the engine idles. ``serves_lora``: every batch brings its rows' adapter slots."""
        header = torch.empty(HEADER_WORDS, dtype=torch.int64, device=self.device)
        self._broadcast(header, IDLE_TIMEOUT)
        op, num_tokens, num_seqs, width, max_query_len, max_context_len, sampled, nbytes = \
            header.tolist()
        if op == OP_STOP:
            return None
        if op == OP_CALL:
            return Message(op, payload=self._recv_pickled(nbytes))
        sizes = [num_tokens] * 3 + [num_seqs + 1, num_seqs, num_seqs * width, sampled]
        if serves_lora:
            sizes.append(num_tokens)
        body = torch.empty(sum(sizes), dtype=torch.int64, device=self.device)
        self._broadcast(body)
        input_ids, positions, slots, cu_seqlens, context_lens, tables, rows, *lora_slots = \
            body.split(sizes)
        meta = AttentionMetadata(
            slot_mapping=slots, cu_seqlens_q=cu_seqlens.to(torch.int32),
            context_lens=context_lens.to(torch.int32),
            block_tables=tables.to(torch.int32).view(num_seqs, width),
            max_query_len=max_query_len, max_context_len=max_context_len, backend=backend,
            lora=LoraBatch.of(lora_slots[0]) if lora_slots else None)
        return Message(op, (input_ids, positions, meta, rows),
                       self._recv_pickled(nbytes) if nbytes else None)

    def _pickled(self, obj: object) -> torch.Tensor:
        if obj is None:
            return torch.empty(0, dtype=torch.uint8)
        signed = self._signer.sign("message", pickle.dumps(obj))
        return torch.frombuffer(bytearray(signed), dtype=torch.uint8)

    def _recv_pickled(self, nbytes: int) -> object:
        blob = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self._broadcast(blob)
        return pickle.loads(self._signer.open("message", blob.cpu().numpy().tobytes()))


@dataclass
class Message:
    """What a follower receives: a forward (its batch, and its role's extras) or a call."""

    op: int  # OP_FORWARD | OP_CALL
    batch: tuple | None = None  # FORWARD: (input_ids, positions, AttentionMetadata, sampled rows)
    payload: object = None  # FORWARD: the extras (or None); CALL: (method, args)


@dataclass(frozen=True)
class RankRole:
    """What followers do besides the forward, for a worker whose ranks take part in more
    (receiving or sending their heads of the KV): ``path`` names the class ("module:Class",
    imported by the follower), built with a :class:`RankContext` and ``args``. Its methods:
    ``before_forward(extras)`` (may return ``after_layer(i)``), ``after_forward(extras)``,
    whatever rank 0 calls by name (:meth:`TensorParallelRunner.call_ranks`), ``close()``."""

    path: str
    args: tuple = ()

    @classmethod
    def of(cls, role: type, *args) -> RankRole:
        return cls(f"{role.__module__}:{role.__qualname__}", args)


@dataclass
class RankContext:
    """What a follower's role is built from: its shard, its pool, its place in the group."""

    model: torch.nn.Module  # this rank's shard
    caches: list  # this rank's KV pool: its K/V heads of every block
    rank: int
    size: int
    device: torch.device
    config: EngineConfig  # the engine's
    model_config: ModelConfig  # the whole model's (the shard's is model.config)
    store: SignedStore

    def publish(self, name: str, value: str) -> None:
        """A value rank 0 reads once the group has formed (:meth:`Followers.published`)."""
        self.store.set(f"published/{name}/{self.rank}", value)

    def report(self, name: str, value: str) -> None:
        """A value rank 0 polls (:meth:`TensorParallelRunner.reports`)."""
        self.store.set(f"report/{name}/{self.rank}", value)


# The kernel's parent-death signal (watch_parent) comes when the *thread* that started a
# follower ends, not its process: every follower is started from this one thread, which lives
# as long as the process, so an engine built on a short-lived thread keeps its followers.
_SPAWNER = ThreadPoolExecutor(1, thread_name_prefix="tensor-spawn")


def describe_exit(returncode: int) -> str:
    """How a process ended, from its ``Popen.returncode``: a signal without a name (a
    real-time one) by its number."""
    if returncode >= 0:
        return f"exit code {returncode}"
    try:
        return f"killed by {signal.Signals(-returncode).name}"
    except ValueError:
        return f"killed by signal {-returncode}"


def _stop_processes(procs: list[subprocess.Popen], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Followers:
    """Rank 0's handle on ranks 1..N-1: the processes it started, then their group."""

    def __init__(self, store: SignedStore, procs: list[subprocess.Popen], size: int,
                 step_timeout_s: float, signer: Signer):
        self._store, self._procs, self.size = store, procs, size
        self._signer = signer
        self.step_timeout_s = step_timeout_s
        self.group: TensorGroup | None = None
        self._finalizer = weakref.finalize(self, _stop_processes, procs, 0.0)

    @classmethod
    def start(cls, config: EngineConfig, role: RankRole | None = None) -> Followers:
        """Publish the spec and start ranks 1..N-1 (step 1); they begin loading at once."""
        size = config.tensor_parallel_size
        raw = dist.TCPStore(LOOPBACK, 0, is_master=True, wait_for_workers=False,
                            timeout=datetime.timedelta(seconds=START_TIMEOUT_S))
        secret = secrets.token_bytes(32)
        signer = Signer(secret)
        store = SignedStore(raw, signer)
        spec = FollowerSpec(config, torch.get_num_threads(), STEP_TIMEOUT_S, role)
        store.set("spec", pickle.dumps(spec))
        env = {**os.environ, SECRET_ENV: secret.hex(), PARENT_ENV: str(os.getpid())}
        procs = [_SPAWNER.submit(subprocess.Popen, [
            sys.executable, "-m", FOLLOWER_MODULE, "--store", store_address(raw), "--rank",
            str(rank), "--size", str(size)], env=env).result() for rank in range(1, size)]
        logger.info("tensor parallel: started ranks 1..%d (pids %s)", size - 1,
                    ", ".join(str(p.pid) for p in procs))
        return cls(store, procs, size, spec.step_timeout_s, signer)

    def join(self, ledger: MemoryLedger, device: torch.device) -> TensorGroup:
        """Publish the ledger, wait for every follower's pool (step 2), form the group
        (step 3). Raises RuntimeError with a follower's own error when one fails."""
        self._store.set("ledger", pickle.dumps(ledger))
        waiting = {rank: f"ready/{rank}" for rank in range(1, self.size)}
        deadline = time.monotonic() + START_TIMEOUT_S
        while waiting:
            for rank, key in list(waiting.items()):
                if self._store.check(key):
                    error = self._store.get(key).decode()
                    if error:
                        raise RuntimeError(f"tensor parallel rank {rank} failed to start: "
                                           f"{error}")
                    del waiting[rank]
                elif (code := self._procs[rank - 1].poll()) is not None:
                    raise RuntimeError(f"tensor parallel rank {rank} exited with code {code} "
                                       f"while starting (its log is above)")
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor parallel ranks {sorted(waiting)} were not ready "
                                   f"within {START_TIMEOUT_S:.0f} s")
            time.sleep(0.02)
        self.group = TensorGroup(self._store, 0, self.size, device, self.step_timeout_s,
                                 self._signer)
        logger.info("tensor parallel: group of %d formed", self.size)
        return self.group

    def published(self, name: str) -> list[str]:
        """What each follower's role published under ``name`` while starting, in rank order."""
        return [self._store.get(f"published/{name}/{rank}").decode()
                for rank in range(1, self.size)]

    def reports(self, name: str) -> list[str | None]:
        """Each follower's report ``name`` (None: not yet), in rank order."""
        keys = [f"report/{name}/{rank}" for rank in range(1, self.size)]
        return [self._store.get(k).decode() if self._store.check(k) else None for k in keys]

    def clear_reports(self, name: str) -> None:
        for rank in range(1, self.size):
            self._store.delete(f"report/{name}/{rank}")

    def stop(self) -> None:
        """Tell the followers to exit, then reap them (killed after a grace period)."""
        if self.group is not None:
            try:
                self.group.send_stop()
            except Exception as exc:  # a broken group: the followers exit on their own
                logger.warning("tensor parallel: stop message not delivered (%s)", exc)
            self.group = None
        else:
            for proc in self._procs:
                proc.kill()
        _stop_processes(self._procs)
        self._finalizer.detach()

    def alive(self) -> list[bool]:
        return [proc.poll() is None for proc in self._procs]

    def exited(self) -> str | None:
        """Which rank's process has ended while the group runs (None: every rank runs, or
        the group was stopped). A collective with that rank fails, or waits out the step
        timeout: either way the group is broken."""
        if self.group is None:
            return None
        for rank, proc in enumerate(self._procs, start=1):
            if (code := proc.poll()) is not None:
                return (f"tensor parallel rank {rank} (pid {proc.pid}) exited: "
                        f"{describe_exit(code)}")
        return None


class TensorParallelRunner(ModelRunner):
    """Rank 0's runner: every forward is first broadcast to the followers, which run it on
    their shards in step (the decoder's all-reduces keep the ranks together)."""

    def __init__(self, *args, followers: Followers, **kwargs):
        super().__init__(*args, **kwargs)
        if followers.group is None:
            raise ValueError("the followers have not joined a group yet")
        self.followers = followers
        self.group = followers.group
        self.step_extras: object = None  # what the followers' role gets with the next batch

    def run(self, batch: ModelInput,
            after_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        extras, self.step_extras = self.step_extras, None
        lora_slots = None
        if self.serves_lora:
            lora = batch.metadata.lora
            lora_slots = (torch.full_like(batch.input_ids, -1) if lora is None
                          else lora.token_slots)
        self.group.send_batch(batch, extras, lora_slots)
        return super().run(batch, after_layer)

    def call_ranks(self, method: str, *args) -> None:
        """Run ``method(*args)`` on every follower's role and wait for all. A rank that failed
        it, or a group that broke, leaves the ranks out of step: EngineBrokenError, which
        ends the engine loop, so the worker is replaced as one."""
        try:
            failed = self.group.send_call(method, args)
        except Exception as exc:
            raise EngineBrokenError(f"tensor parallel group broken during {method}: "
                                    f"{exc}") from exc
        if failed:
            raise EngineBrokenError(f"{failed} tensor parallel rank(s) failed {method}; "
                                    f"their logs say why")

    def call_ranks_counting(self, method: str, *args) -> int:
        """Run ``method(*args)`` on every follower's role and wait for all; returns how many
        failed it (a failure the caller undoes on every rank, as a KV tier load that some
        rank could not make). A group that broke: EngineBrokenError."""
        try:
            return self.group.send_call(method, args)
        except Exception as exc:
            raise EngineBrokenError(f"tensor parallel group broken during {method}: "
                                    f"{exc}") from exc

    def published(self, name: str) -> list[str]:
        return self.followers.published(name)

    def reports(self, name: str) -> list[str | None]:
        return self.followers.reports(name)

    def clear_reports(self, name: str) -> None:
        self.followers.clear_reports(name)

    def close(self) -> None:
        self.followers.stop()


def watch_parent(poll_s: float = 1.0) -> None:
    """Exit this process (a follower) as soon as the process that started it is gone. The
    kernel kills it then too (PR_SET_PDEATHSIG), so a follower that cannot notice (SIGSTOPped,
    or hung) does not outlive rank 0 holding its device."""
    parent = int(os.environ.pop(PARENT_ENV, 0)) or os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            logger.warning("no parent-death signal: prctl failed (errno %d)", ctypes.get_errno())
    except (OSError, AttributeError) as exc:  # not Linux: the watch below is all there is
        logger.warning("no parent-death signal: %s", exc)
    if os.getppid() != parent:  # rank 0 ended before the signal was set
        os._exit(0)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(0)

    threading.Thread(target=watch, name="tensor-parent-watch", daemon=True).start()
