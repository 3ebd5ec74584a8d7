"""The cluster's LoRA adapter registry against a real redis-server: ``--lora-modules`` parsing,
the checks a load meets before anything changes, the signed copy in Redis (written, repaired
after FLUSHALL and garbage, adopted by a restarted router), and the mirror of the other
routers."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from pdserve.cluster.adapters import (
    AdapterMirror,
    AdapterRegistry,
    AdapterStore,
    LoraSettings,
    check_adapter,
    check_lora_modules,
)
from pdserve.cluster.control_plane import ControlPlaneHealth
from pdserve.cluster.options import ClusterOptions, parse_lora_module, parse_lora_modules
from pdserve.cluster.record_auth import RecordAuth
from pdserve.models.checkpoint import open_checkpoint
from pdserve.models.lora_files import adapter_digest
from pdserve.router.adapters import ServedAdapters, resolve_model
from pdserve.router.admin_server import LoraDisabledError, UnknownAdapterError
from pdserve.router.errors import UnknownModelError
from pdserve.testing.lora_adapters import write_peft_adapter

from .conftest import AUTH


@pytest.fixture(scope="module")
def base(tiny_dir):
    return tiny_dir


@pytest.fixture(scope="module")
def lora_dirs(base, tmp_path_factory):
    """Two good adapters (ranks 2 and 8) and the bad ones, each named for its fault."""
    root = tmp_path_factory.mktemp("loras")
    dirs = {"r2": write_peft_adapter(base, root / "r2", 2, ("q_proj", "v_proj"), seed=1),
            "r8": write_peft_adapter(base, root / "r8", 8, seed=2)}
    dirs["rank16"] = write_peft_adapter(base, root / "rank16", 16, ("o_proj",), seed=3)
    missing = shutil.copytree(dirs["r2"], root / "no-weights")
    (missing / "adapter_model.safetensors").unlink()
    dirs["no-weights"] = missing
    for fault, edit in (("layer-99", _to_layer_99), ("bad-shape", _transposed)):
        folder = shutil.copytree(dirs["r2"], root / fault)
        tensors = load_file(folder / "adapter_model.safetensors")
        save_file(edit(tensors), folder / "adapter_model.safetensors")
        dirs[fault] = folder
    return dirs


def _to_layer_99(tensors: dict) -> dict:
    return {key.replace("layers.0.", "layers.99."): t for key, t in tensors.items()}


def _transposed(tensors: dict) -> dict:
    return {key: t.T.contiguous() if "lora_A" in key else t for key, t in tensors.items()}


@pytest.fixture(scope="module")
def settings(base):
    return LoraSettings(True, 8, open_checkpoint(base).model_config, ("tiny", str(base)))


def test_lora_modules_take_vllm_forms():
    assert parse_lora_module("sql=/a/b") == ("sql", "/a/b")
    assert parse_lora_module('{"name": "chat", "path": "/c"}') == ("chat", "/c")
    assert parse_lora_module("x=/p=q") == ("x", "/p=q")  # the first = splits
    for bad, says in (("sql", "NAME=PATH"), ("=/p", "non-empty"), ("a=", "non-empty"),
                      ('{"name": 1}', "name and path"), ("{nope", "not JSON")):
        with pytest.raises(ValueError, match=says):
            parse_lora_module(bad)
    with pytest.raises(ValueError, match="'a' more than once"):
        parse_lora_modules(["a=/x", "b=/y", "a=/z"])


def test_lora_modules_need_enable_lora():
    with pytest.raises(ValueError, match="lora_modules needs enable_lora"):
        ClusterOptions(lora_modules=("a=/x",))
    options = ClusterOptions(lora_modules=["a=/x"], engine={"enable_lora": True})
    assert options.lora_modules == ("a=/x",)


def test_check_adapter_refuses_with_the_adapters_name(lora_dirs, settings):
    ref = check_adapter("sql", str(lora_dirs["r2"]), settings)
    assert (ref.name, ref.digest) == ("sql", adapter_digest(lora_dirs["r2"]))
    cases = {"no-weights": "adapter_model.safetensors", "rank16": "above max_lora_rank",
             "layer-99": "has no model.layers.99", "bad-shape": "do not fit"}
    for fault, says in cases.items():
        with pytest.raises(ValueError, match=f"'{fault}'.*{says}"):
            check_adapter(fault, str(lora_dirs[fault]), settings)
    with pytest.raises(ValueError, match="'missing'.*is not a folder"):
        check_adapter("missing", str(lora_dirs["r2"].parent / "nowhere"), settings)
    with pytest.raises(ValueError, match="'tiny'.*base model's"):
        check_adapter("tiny", str(lora_dirs["r2"]), settings)
    with pytest.raises(ValueError, match="'sql' is already loaded"):
        check_adapter("sql", str(lora_dirs["r8"]), settings, ["sql"])
    off = LoraSettings(False, 8, None, ("tiny",))
    with pytest.raises(LoraDisabledError, match="--enable-lora"):
        check_adapter("sql", str(lora_dirs["r2"]), off)


def test_lora_modules_are_checked_before_the_cluster_starts(lora_dirs, base):
    options = ClusterOptions(engine={"enable_lora": True, "max_lora_rank": 8},
                             lora_modules=(f"a={lora_dirs['r2']}", f"b={lora_dirs['rank16']}"))
    with pytest.raises(ValueError, match="'b'.*above max_lora_rank"):
        check_lora_modules(options, str(base))
    options.lora_modules = (f"a={lora_dirs['r2']}",)
    assert [r.name for r in check_lora_modules(options, str(base))] == ["a"]


def _store(redis_url: str, cluster: str) -> AdapterStore:
    return AdapterStore(redis_url, cluster, AUTH, ControlPlaneHealth())


def test_the_registry_refuses_before_anything_changes(redis_url, lora_dirs, settings):
    async def main():
        store, served = _store(redis_url, "lora-refuse"), ServedAdapters()
        registry = AdapterRegistry(store, settings, served)
        await registry.start([("sql", str(lora_dirs["r2"]))])
        before = (registry.list(), served.all(), store.client.get(store.key))
        for name, fault in (("bad", "rank16"), ("bad", "layer-99"), ("bad", "bad-shape"),
                            ("bad", "no-weights"), ("sql", "r8"), ("tiny", "r8")):
            with pytest.raises(ValueError, match=f"'{name}'"):
                await registry.load(name, str(lora_dirs[fault]))
            assert (registry.list(), served.all(), store.client.get(store.key)) == before
        with pytest.raises(UnknownAdapterError, match="'nope' is not loaded"):
            await registry.unload("nope")
        await registry.stop()

    asyncio.run(main())


def test_load_unload_reach_the_doors_and_redis(redis_url, lora_dirs, settings):
    async def main():
        store, served = _store(redis_url, "lora-cycle"), ServedAdapters()
        registry = AdapterRegistry(store, settings, served)
        await registry.start()
        assert store.read() == [] and len(served) == 0  # an empty copy: known, none
        ref = await registry.load("chat", str(lora_dirs["r8"]))
        assert served.get("chat") == ref and store.read() == [ref]
        assert resolve_model("model", "chat", ("tiny",), served) == ref
        assert resolve_model("model", "tiny", ("tiny",), served) is None
        assert await registry.unload("chat") == ref
        assert store.read() == [] and served.get("chat") is None
        with pytest.raises(UnknownModelError, match="model: the model 'chat' does not exist"):
            resolve_model("model", "chat", ("tiny",), served)
        await registry.stop()

    asyncio.run(main())


def test_the_copy_is_repaired_and_a_restarted_router_adopts_it(redis_url, lora_dirs, settings):
    async def main():
        store = _store(redis_url, "lora-repair")
        registry = AdapterRegistry(store, settings, ServedAdapters(), store.health)
        await registry.start([("sql", str(lora_dirs["r2"]))])
        chat = await registry.load("chat", str(lora_dirs["r8"]))
        await registry.unload("sql")
        mirror_served = ServedAdapters()
        mirror = AdapterMirror(_store(redis_url, "lora-repair"), mirror_served)
        await mirror.start()
        assert mirror_served.all() == [chat]
        for spoil in (lambda: store.client.delete(store.key),  # FLUSHALL's effect on it
                      lambda: store.client.set(store.key, b"\xffgarbage"),
                      lambda: store.client.set(store.key, json.dumps(  # not signed by us
                          {"adapters": "[]", "tag": RecordAuth("other").tag("x")}))):
            spoil()
            await mirror.sync()
            assert mirror_served.all() == [chat]  # unknown is not "none"
            await registry.sync()
            assert store.read() == [chat]
        assert store.health.repairs == 3
        assert store.health.malformed >= 1 and store.health.untrusted >= 1
        await registry.stop()
        # a restart adopts the copy: the seed unloaded at run time stays unloaded
        again = AdapterRegistry(store, settings, ServedAdapters())
        await again.start([("sql", str(lora_dirs["r2"]))])
        assert again.list() == [chat] and again.served.all() == [chat]
        await again.stop()

    asyncio.run(main())
