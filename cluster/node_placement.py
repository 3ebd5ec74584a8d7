"""What a worker actor asks Ray for, and on which nodes each pool lands (docs/autoscaling.md).

A worker asks Ray for what it uses:

* **a GPU on CUDA** (``num_gpus=1``; ``--worker-gpus 0.5`` lets two workers share one, each
  then needs its own ``--memory-budget-mib``). Ray makes visible to an actor only the GPUs it
  asked for, so a worker that asked for none would see no device and serve on CPU without a
  word.
  The launcher resolves ``--device auto`` once per cluster: CUDA when the Ray cluster has a
  ``GPU`` resource, else CPU; the resolved device is written into every worker's engine
  config, so a CUDA worker that finds no GPU fails instead of falling back.
* **CPUs**: ``--worker-cpus N`` (default 1). A CPU worker runs N torch threads (intra-op; one
  inter-op thread); ``0`` asks Ray for no CPU and runs one thread (pools may then share cores
  beyond what Ray counts). A GPU worker asks for the same CPUs for its host-side work.
* **its pool's custom resource**, one unit: ``pdserve_prefill``, ``pdserve_decode`` or
  ``pdserve_colocated`` (:func:`pool_resource`). A node advertises how many workers of a pool
  it takes, e.g. ``ray start --resources '{"pdserve_prefill": 8}'``. ``--pool-placement``:

  - ``auto`` (default): a pool goes to the nodes advertising its resource when at least one
    live node does (checked at every worker start, so nodes may join later); otherwise the
    pool shares whatever nodes there are (the embedded default: one local node);
  - ``require``: always ask for the resource (a worker waits, starting, until such a node
    has room);
  - ``any``: never ask for it.

The functions here are pure: the pool manager passes ``ray.cluster_resources()`` in.
"""

from __future__ import annotations

from dataclasses import dataclass

PLACEMENTS = ("auto", "require", "any")


def pool_resource(role: str) -> str:
    """The Ray custom resource that nodes for ``role``'s pool advertise."""
    return f"pdserve_{role}"


@dataclass(frozen=True)
class WorkerResources:
    """What one worker actor asks Ray for (its pool resource is added at start)."""

    num_cpus: float = 0.0  # CPUs Ray reserves for the worker
    num_gpus: float = 0.0  # GPUs Ray reserves (and makes visible): 1 on CUDA
    torch_threads: int = 1  # torch intra-op threads in the worker process
    placement: str = "auto"  # auto | require | any: see the module docstring

    def __post_init__(self) -> None:
        if self.num_cpus < 0 or self.num_gpus < 0:
            raise ValueError(f"num_cpus and num_gpus must be >= 0, got {self.num_cpus}, "
                             f"{self.num_gpus}")
        if self.torch_threads < 1:
            raise ValueError(f"torch_threads must be >= 1, got {self.torch_threads}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"pool_placement must be one of {PLACEMENTS}, "
                             f"got {self.placement!r}")


def resolve_device(device: str, cluster_resources: dict[str, float]) -> str:
    """The device every worker of a cluster uses: ``device`` unless "auto", which is CUDA
    when the Ray cluster has a GPU and CPU otherwise. ValueError for CUDA without a GPU."""
    has_gpu = cluster_resources.get("GPU", 0.0) >= 1.0
    if device == "auto":
        return "cuda" if has_gpu else "cpu"
    if device == "cuda" and not has_gpu:
        raise ValueError("device is cuda but the Ray cluster has no GPU resource (start its "
                         "nodes with GPUs, or pass --device cpu)")
    return device


def check_pool_devices(devices: dict[str, str]) -> None:
    """ValueError when the pools' ``devices`` (role -> "cpu" | "cuda"; "auto", not resolved
    yet, is not compared) cannot exchange KV: NCCL between GPUs, gloo between CPUs, and from a
    GPU prefill pool to a CPU decode pool over gloo with the blocks staged through host memory;
    a CPU prefill pool feeding a GPU decode pool is not built."""
    if devices.get("prefill") == "cpu" and devices.get("decode") == "cuda":
        raise ValueError("prefill on cpu, decode on cuda: KV moves from GPU prefill workers "
                         "to CPU decode workers (staged through host memory), not the other "
                         "way; give --prefill-device cuda, or --decode-device cpu")


def worker_resources(device: str, worker_cpus: int, placement: str = "auto",
                     worker_gpus: float = 1.0, ranks: int = 1) -> WorkerResources:
    """What each worker asks for on ``device`` ("cpu" | "cuda", already resolved): per
    tensor parallel rank (``ranks`` of them, one process each) ``worker_cpus`` CPUs and
    threads, and ``worker_gpus`` GPU on CUDA."""
    if worker_cpus < 0:
        raise ValueError(f"worker_cpus must be >= 0, got {worker_cpus}")
    if not 0 < worker_gpus <= 1:
        raise ValueError(f"worker_gpus must be in (0, 1], got {worker_gpus}")
    return WorkerResources(num_cpus=float(worker_cpus * ranks),
                           num_gpus=worker_gpus * ranks if device == "cuda" else 0.0,
                           torch_threads=max(1, worker_cpus), placement=placement)


def actor_resources(resources: WorkerResources, role: str,
                    cluster_resources: dict[str, float] | None) -> dict:
    """Ray actor options (num_cpus, num_gpus, resources) for one worker of ``role``;
    ``cluster_resources``: ``ray.cluster_resources()`` now (needed for "auto")."""
    name = pool_resource(role)
    if resources.placement == "require":
        wants_pool = True
    elif resources.placement == "any":
        wants_pool = False
    else:
        wants_pool = (cluster_resources or {}).get(name, 0.0) > 0.0
    return {"num_cpus": resources.num_cpus, "num_gpus": resources.num_gpus,
            "resources": {name: 1.0} if wants_pool else {}}


def cpus_needed(resources: WorkerResources, max_workers: int) -> float:
    """CPUs the pools ask of Ray at their largest."""
    return resources.num_cpus * max_workers
