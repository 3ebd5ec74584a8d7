"""LoRA adapters on a real cluster (Ray + Redis + OpenAI HTTP + gRPC), disaggregated (1P+1D,
every prompt on the prefill worker) and colocated: four adapters of ranks 1, 4, 8 and 16 on
different projections, seeded by ``--lora-modules``, and the base model, sent as one concurrent
burst, each answer PEFT's greedy tokens; an adapter loaded at run time through the admin API
serves, then unloaded is 404, through either of two routers; bad adapters are refused naming
them and change nothing; the admin key guards the admin paths; ``/v1/models`` and gRPC
``model``. Colocated over two workers of two slots each: a request for an adapter goes to a
worker holding it (where one does); ``pdserve status`` and the router's metrics show each
worker's slots."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest

from pdserve.api.admin_client import AdminClient, trace_dict
from pdserve.api.client import PdserveClient, PdserveError
from pdserve.models.checkpoint import open_checkpoint
from pdserve.router.config import RouterConfig
from pdserve.testing.lora_adapters import peft_greedy, write_peft_adapter
from pdserve.testing.waits import wait_for

pytestmark = pytest.mark.e2e

API_KEY = "lora-e2e-key"
ADMIN_KEY = "lora-e2e-admin-key"
MAX_TOKENS = 8
LONG = 96  # tokens of the stream that is in flight while its adapter is unloaded
# name -> (rank, target modules): every projection covered, each adapter its own set
ADAPTERS = {"r1": (1, ("q_proj", "v_proj")),
            "r4": (4, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                       "down_proj")),
            "r8": (8, ("o_proj", "down_proj")),
            "r16": (16, ("k_proj", "gate_proj", "up_proj"))}
LORA = {"enable_lora": True, "max_lora_rank": 16, "max_loras": 4}
PROMPTS = [[5, 17, 42, 9, 88, 3, 250], [7, 7, 300, 12, 41, 63, 8, 99, 150, 2, 31]]


@pytest.fixture(scope="module")
def loras(model_dir, tmp_path_factory):
    """name -> folder: the four seeded adapters, one loaded at run time, a rank too large."""
    root = tmp_path_factory.mktemp("e2e-loras")
    dirs = {name: write_peft_adapter(model_dir, root / name, rank, targets, seed=i + 1)
            for i, (name, (rank, targets)) in enumerate(ADAPTERS.items())}
    dirs["late"] = write_peft_adapter(model_dir, root / "late", 2, ("up_proj",), seed=9)
    dirs["r32"] = write_peft_adapter(model_dir, root / "r32", 32, ("q_proj",), seed=10)
    return dirs


@pytest.fixture(scope="module")
def expected(model_dir, loras):
    """model -> PEFT's greedy ids per prompt (None: the base model)."""
    return {name: peft_greedy(model_dir, loras.get(name), PROMPTS, MAX_TOKENS)
            for name in [None, *ADAPTERS, "late"]}


def _modules(loras) -> tuple[str, ...]:
    return tuple(f"{name}={loras[name]}" for name in ADAPTERS)


@pytest.fixture(scope="module")
def cluster(start_cluster, model_dir, loras):
    cluster = start_cluster(model_dir, http_port=0, api_key=API_KEY, admin_api_key=ADMIN_KEY,
                            engine=LORA, lora_modules=_modules(loras), num_routers=2,
                            router=RouterConfig(disaggregation="always"))
    yield cluster
    cluster.stop()


def _burst(cluster, model_dir, expected, headers) -> None:
    """Every model x prompt at once over HTTP; each answer PEFT's text."""
    tokenizer = open_checkpoint(str(model_dir)).tokenizer()
    base = httpx.get(cluster.http_url + "/v1/models", headers=headers,
                     timeout=30).json()["data"][0]["id"]
    jobs = [(name, i) for name in [None, *ADAPTERS] for i in range(len(PROMPTS))]

    def send(job):
        name, i = job
        body = {"model": name or base, "prompt": PROMPTS[i], "max_tokens": MAX_TOKENS,
                "temperature": 0, "ignore_eos": True}
        reply = httpx.post(cluster.http_url + "/v1/completions", json=body, headers=headers,
                           timeout=120)
        assert reply.status_code == 200, reply.text
        return reply.json()

    with ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(send, jobs))
    for (name, i), answer in zip(jobs, answers, strict=True):
        assert answer["model"] == (name or base)
        assert answer["choices"][0]["text"] == tokenizer.decode(expected[name][i]), (name, i)
    # the adapters differ from the base model and from each other on these prompts
    assert len({tuple(map(tuple, expected[n])) for n in [None, *ADAPTERS]}) == 5


def test_a_burst_of_adapters_disaggregated(cluster, model_dir, expected):
    _burst(cluster, model_dir, expected, {"Authorization": f"Bearer {API_KEY}"})


def test_grpc_model_field(cluster, expected):
    with PdserveClient(cluster.target, api_key=API_KEY, timeout=120) as client:
        assert client.model_info().lora_adapters == sorted(ADAPTERS)
        for name in ("r8", ""):
            result = client.generate(PROMPTS[1], model=name, max_tokens=MAX_TOKENS,
                                     temperature=0.0, ignore_eos=True)
            assert result.token_ids == expected[name or None][1]
        with pytest.raises(PdserveError) as info:
            client.generate(PROMPTS[0], model="missing", max_tokens=2)
        assert info.value.code == grpc.StatusCode.NOT_FOUND and "model" in info.value.details


def test_models_lists_the_adapters(cluster, loras):
    models = httpx.get(cluster.http_url + "/v1/models", timeout=30,
                       headers={"Authorization": f"Bearer {API_KEY}"}).json()["data"]
    base = models[0]["id"]
    assert [m["id"] for m in models] == [base, *sorted(ADAPTERS)]
    for model in models[1:]:
        assert model["parent"] == base and model["root"] == str(loras[model["id"]])
        assert model["object"] == "model"


def test_load_serve_unload_through_the_admin_api(cluster, loras, expected, model_dir):
    long_late = peft_greedy(model_dir, loras["late"], [PROMPTS[1]], LONG)[0]
    url, admin = cluster.http_url, {"Authorization": f"Bearer {ADMIN_KEY}"}
    user = {"Authorization": f"Bearer {API_KEY}"}
    body = {"lora_name": "late", "lora_path": str(loras["late"])}
    refused = httpx.post(url + "/v1/load_lora_adapter", json=body, headers=user, timeout=60)
    assert refused.status_code == 403  # an inference key is no admin key
    loaded = httpx.post(url + "/v1/load_lora_adapter", json=body, headers=admin, timeout=60)
    assert loaded.status_code == 200, loaded.text
    completion = {"model": "late", "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS,
                  "temperature": 0, "ignore_eos": True}
    with PdserveClient(cluster.target, api_key=API_KEY, timeout=120) as client:
        result = client.generate(PROMPTS[0], model="late", max_tokens=MAX_TOKENS,
                                 temperature=0.0, ignore_eos=True)
        assert result.token_ids == expected["late"][0]  # a worker read it on first use
        stream = client.generate_stream(PROMPTS[1], model="late", max_tokens=LONG,
                                        temperature=0.0, ignore_eos=True)
        token_ids = list(next(stream).token_ids)
        unloaded = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "late"},
                              headers=admin, timeout=60)
        assert unloaded.status_code == 200, unloaded.text
        token_ids += [t for chunk in stream for t in chunk.token_ids]
        assert token_ids == long_late  # a request in flight finishes under its adapter
        gone = httpx.post(url + "/v1/completions", json=completion, headers=user, timeout=60)
        assert gone.status_code == 404
        assert gone.json()["error"]["code"] == "model_not_found"
        with pytest.raises(PdserveError) as info:
            client.generate(PROMPTS[0], model="late", max_tokens=2)
        assert info.value.code == grpc.StatusCode.NOT_FOUND


def test_a_second_router_forwards_loads_and_follows_the_registry(cluster, loras, expected,
                                                                  e2e):
    """router-1 forwards a load to the router that keeps the registry and serves it at once;
    an unload made there reaches router-1 through Redis."""
    first, second = cluster.targets
    with AdminClient(second, api_key=ADMIN_KEY) as admin:
        assert admin.load_lora_adapter("late2", str(loras["late"])).name == "late2"
    sampling = dict(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    for target in (second, first):
        with PdserveClient(target, api_key=API_KEY, timeout=120) as client:
            e2e.wait_for(lambda c=client: "late2" in c.model_info().lora_adapters,
                         what="the adapter on every router")
            assert client.generate(PROMPTS[1], model="late2", **sampling).token_ids \
                == expected["late"][1]
    with AdminClient(first, api_key=ADMIN_KEY) as admin:
        admin.unload_lora_adapter("late2")
    with PdserveClient(second, api_key=API_KEY, timeout=120) as client:
        e2e.wait_for(lambda: "late2" not in client.model_info().lora_adapters,
                     what="the unload on router-1")
        with pytest.raises(PdserveError) as info:
            client.generate(PROMPTS[0], model="late2", max_tokens=2)
        assert info.value.code == grpc.StatusCode.NOT_FOUND


def test_bad_adapters_are_refused_and_change_nothing(cluster, loras, model_dir):
    admin, user = ({"Authorization": f"Bearer {key}"} for key in (ADMIN_KEY, API_KEY))
    before = httpx.get(cluster.http_url + "/v1/models", headers=user, timeout=30).json()
    cases = [({"lora_name": "big", "lora_path": str(loras["r32"])}, "above max_lora_rank"),
             ({"lora_name": "gone", "lora_path": str(loras["r32"]) + "-nowhere"},
              "is not a folder"),
             ({"lora_name": "r1", "lora_path": str(loras["r8"])}, "already loaded"),
             ({"lora_name": before["data"][0]["id"], "lora_path": str(loras["r8"])},
              "base model")]
    for body, says in cases:
        reply = httpx.post(cluster.http_url + "/v1/load_lora_adapter", json=body,
                           headers=admin, timeout=60)
        assert reply.status_code == 400, reply.text
        assert says in reply.text and repr(body["lora_name"]) in reply.json()["error"]["message"]
    with AdminClient(cluster.target, api_key=ADMIN_KEY) as client:
        with pytest.raises(PdserveError) as info:
            client.load_lora_adapter("big", str(loras["r32"]))
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "'big'" in info.value.details
        assert [a.name for a in client.list_lora_adapters()] == sorted(ADAPTERS)
    after = httpx.get(cluster.http_url + "/v1/models", headers=user, timeout=30).json()
    assert [m["id"] for m in after["data"]] == [m["id"] for m in before["data"]]


@pytest.fixture(scope="module")
def colocated(start_cluster, model_dir, loras, cluster):
    """Two colocated workers of two slots each (one cluster at a time on this machine: the
    disaggregated one stops first)."""
    cluster.stop()
    colocated = start_cluster(model_dir, colocated=True, num_decode=2, http_port=0,
                              engine={**LORA, "max_loras": 2}, lora_modules=_modules(loras))
    yield colocated
    colocated.stop()


def test_a_burst_of_adapters_colocated(colocated, model_dir, expected):
    """Four adapters over two workers of two slots: some wait for a slot, all equal PEFT."""
    _burst(colocated, model_dir, expected, {})


def test_requests_for_an_adapter_go_where_it_is_resident(colocated, model_dir, expected):
    """Two requests in turn for each adapter: the second goes to a worker holding it (the
    router's trace says so: a colocated worker is placed as a prefill is), both PEFT's."""
    with AdminClient(colocated.target) as admin, \
            PdserveClient(colocated.target, timeout=120) as client:
        for name in ADAPTERS:
            sources = []
            for _ in range(2):
                out = client.generate(PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0.0,
                                      ignore_eos=True, model=name)
                assert out.token_ids == expected[name][0]
                trace = trace_dict(admin.get_traces([out.request_id])[0])
                assert trace["adapter"] == name
                sources.append(trace["prefill_adapter_source"])
            assert sources[1] in ("resident", "sent"), (name, sources)


def test_status_and_metrics_show_each_workers_adapter_slots(colocated):
    report = json.loads(_pdserve_status(colocated, "--json"))
    workers = {w["worker_id"]: w for w in report["workers"]}
    assert set(workers) == {"colocated-0", "colocated-1"}
    assert all(w["lora_slots"] == 2 and 1 <= len(w["lora_resident"]) <= 2
               for w in workers.values())
    lines = _pdserve_status(colocated).splitlines()
    header = next(line for line in lines if line.startswith("WORKER")).split()
    assert "LORA" in header
    for worker_id, worker in workers.items():
        row = next(line for line in lines if line.startswith(worker_id)).split()
        assert f"{len(worker['lora_resident'])}/2" in row

    def slots() -> bool:  # (the router's metrics follow its next stats refresh)
        text = urllib.request.urlopen(colocated.metrics_url, timeout=10).read().decode()
        return all(f'pdserve_lora_slots{{role="colocated",worker="{w}"}} 2.0' in text
                   for w in workers)

    wait_for(slots, 30, "the router's per-worker LoRA gauges")


def _pdserve_status(cluster, *args: str) -> str:
    result = subprocess.run([sys.executable, "-m", "pdserve.cli.main", "status", "--target",
                             cluster.target, *args], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout
