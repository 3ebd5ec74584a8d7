"""``pdserve serve`` / ``demo`` settings generated from the config dataclasses, and user errors
as one message with exit code 2 (no cluster is started: every error here fails before Ray)."""

from __future__ import annotations

import argparse
import dataclasses
import re

import pytest

from pdserve.cli import settings
from pdserve.cli.demo import DEMO_MEMORY_BUDGET, demo_options
from pdserve.cli.main import build_parser, main
from pdserve.cli.settings import NOT_FLAGS, RENAMES, SECTIONS, field_comments
from pdserve.cluster.options import ClusterOptions
from pdserve.router.core import RouterConfig

MiB = 1 << 20
VLLM_NAMES = {  # vLLM's flag -> our (section, field)
    "--dtype": ("engine", "dtype"), "--max-model-len": ("engine", "max_model_len"),
    "--block-size": ("engine", "block_size"), "--kv-cache-dtype": ("engine", "kv_cache_dtype"),
    "--max-num-seqs": ("engine", "max_num_seqs"),
    "--max-num-batched-tokens": ("engine", "max_num_batched_tokens"),
    "--enable-prefix-caching": ("engine", "enable_prefix_caching"),
    "--enable-chunked-prefill": ("engine", "enable_chunked_prefill"),
    "--attention-backend": ("engine", "attention_backend"), "--seed": ("engine", "seed"),
    "--device": ("engine", "device"),
    "--tensor-parallel-size": ("engine", "tensor_parallel_size"),
}


def _command_parser(command: str) -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    chosen = sub.choices[command]
    chosen.format_help()  # adds the generated flags (they are added on first use)
    return chosen


def _actions(command: str) -> dict[str, argparse.Action]:
    return {flag: a for a in _command_parser(command)._actions for flag in a.option_strings}


def _expected_flag(section: str, name: str) -> str:
    rename = RENAMES.get((section, name))
    return rename.flag if rename else "--" + name.replace("_", "-")


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def _options(*argv: str, base: ClusterOptions | None = None) -> ClusterOptions:
    return settings.options_from_args(_args("serve", *argv), base or ClusterOptions())


@pytest.mark.parametrize("command", ["serve", "demo"])
def test_every_config_field_has_a_flag(command):
    actions = _actions(command)
    for section, (cls, _title) in SECTIONS.items():
        for f in dataclasses.fields(cls):
            if (section, f.name) in NOT_FLAGS:
                continue
            flag = _expected_flag(section, f.name)
            assert flag in actions, f"{cls.__name__}.{f.name} has no {flag} in pdserve {command}"
            assert actions[flag].dest == f"{section}:{f.name}"
    names = {(s, f.name) for s, (cls, _) in SECTIONS.items() for f in dataclasses.fields(cls)}
    assert set(NOT_FLAGS) <= names, "NOT_FLAGS names a field that no longer exists"


def test_new_dataclass_fields_get_flags_and_unsupported_types_fail(monkeypatch):
    @dataclasses.dataclass(frozen=True)
    class NewerRouterConfig(RouterConfig):  # RouterConfig as another change may extend it
        brand_new_knob: int = 7  # a knob added after the flags were written
        other_s: float | None = None  # optional

    monkeypatch.setitem(SECTIONS, "router", (NewerRouterConfig, "router settings"))
    actions = _actions("serve")
    assert "a knob added after the flags were written" in actions["--brand-new-knob"].help
    args = _args("serve", "--brand-new-knob", "9", "--other-s", "none", "--max-attempts", "2")
    options = settings.options_from_args(args, ClusterOptions(router=NewerRouterConfig()))
    assert options.router == NewerRouterConfig(brand_new_knob=9, other_s=None, max_attempts=2)

    @dataclasses.dataclass(frozen=True)
    class Bad(RouterConfig):
        hosts: list = dataclasses.field(default_factory=list)  # no flag type for a list

    monkeypatch.setitem(SECTIONS, "router", (Bad, "bad"))
    with pytest.raises(TypeError, match="Bad.hosts"):
        settings.all_settings()


def test_flag_collisions_are_refused(monkeypatch):
    @dataclasses.dataclass(frozen=True)
    class Clash(RouterConfig):
        block_size: int = 1  # same name as EngineConfig.block_size

    monkeypatch.setitem(SECTIONS, "router", (Clash, "clash"))
    with pytest.raises(ValueError, match="--block-size"):
        settings.all_settings()


def test_vllm_names_set_the_same_settings():
    actions = _actions("serve")
    for flag, (section, name) in VLLM_NAMES.items():
        assert actions[flag].dest == f"{section}:{name}", flag
    options = _options("--dtype", "float16", "--max-model-len", "128", "--block-size", "8",
                       "--kv-cache-dtype", "int8", "--max-num-seqs", "4",
                       "--max-num-batched-tokens", "256", "--no-enable-prefix-caching",
                       "--no-enable-chunked-prefill", "--attention-backend", "torch",
                       "--seed", "5", "--device", "cpu")
    assert options.engine == dict(dtype="float16", max_model_len=128, block_size=8,
                                  kv_cache_dtype="int8", max_num_seqs=4,
                                  max_num_batched_tokens=256, enable_prefix_caching=False,
                                  enable_chunked_prefill=False, attention_backend="torch",
                                  seed=5, device="cpu")


def test_comment_parsing_trailing_continued_and_leading():
    @dataclasses.dataclass
    class Commented:
        alpha: int = 1  # first line of alpha,
        # continued on a second line
        beta: str = "x"  # beta's own
        # a leading comment for gamma
        gamma: bool = False
        delta: float | None = None
        epsilon: int = dataclasses.field(  # split over
            default=3)  # two lines

    comments = field_comments(Commented)
    assert comments["alpha"] == "first line of alpha, continued on a second line"
    assert comments["beta"] == "beta's own"
    assert comments["gamma"] == "a leading comment for gamma"
    assert comments["delta"] == ""
    assert comments["epsilon"] == "split over two lines"


def test_help_comes_from_the_source_comments_and_shows_the_default():
    actions = _actions("serve")
    for section, (cls, _title) in SECTIONS.items():
        comments = field_comments(cls)
        for f in dataclasses.fields(cls):
            if (section, f.name) in NOT_FLAGS or not comments.get(f.name):
                continue
            help_text = actions[_expected_flag(section, f.name)].help.replace("%%", "%")
            first_words = re.sub(r"``\w+``", "", comments[f.name]).split()[:3]
            assert " ".join(first_words) in re.sub(r"--[\w-]+", "", help_text), (f.name, help_text)
            assert "default:" in help_text
    assert "(default: 16)" in actions["--block-size"].help
    assert str(RouterConfig().migration_limit) in actions["--migration-limit"].help


def test_only_passed_flags_override_the_dataclass_defaults():
    plain = _options()
    assert plain.engine == {} and plain.router == RouterConfig()
    assert dataclasses.replace(plain, log_level="WARNING") == ClusterOptions()
    one = _options("--block-size", "8", "--migration-limit", "0", "--registry-ttl-s", "9")
    assert one.engine == {"block_size": 8}
    assert one.router == dataclasses.replace(RouterConfig(), migration_limit=0)
    assert one.ttl_s == 9.0 and one.heartbeat_s == ClusterOptions().heartbeat_s


def test_demo_keeps_its_own_defaults_unless_overridden():
    demo = settings.options_from_args(_args("demo"), demo_options())
    assert demo == demo_options()
    assert demo.engine["memory_budget_bytes"] == DEMO_MEMORY_BUDGET and demo.port == 0
    bigger = settings.options_from_args(_args("demo", "--memory-budget-mib", "100", "--port",
                                              "7000"), demo_options())
    assert bigger.engine["memory_budget_bytes"] == 100 * MiB and bigger.port == 7000
    assert f"default: {DEMO_MEMORY_BUDGET // MiB})" in _actions("demo")["--memory-budget-mib"].help


def test_demo_help_lists_the_same_settings_as_serve():
    serve = {f for f, a in _actions("serve").items() if ":" in a.dest}
    demo = {f for f, a in _actions("demo").items() if ":" in a.dest}
    assert serve == demo and len(serve) > 30


def test_bool_and_optional_parsing():
    on = _options("--colocated", "--enable-prefix-caching", "--reserve-wait-s", "2.5",
                  "--num-kv-blocks", "64", "--lease-s", "3")
    assert on.colocated is True and on.engine["enable_prefix_caching"] is True
    assert on.router.reserve_wait_s == 2.5 and on.engine["num_kv_blocks"] == 64
    assert on.lease_s == 3.0
    off = _options("--no-colocated", "--no-kv-int8-keep-edge-layers", "--metrics-port", "none",
                   "--reserve-wait-s", "None", "--memory-budget-mib", "64")
    assert off.colocated is False and off.engine["kv_int8_keep_edge_layers"] is False
    assert off.metrics_port is None and off.router.reserve_wait_s is None
    assert off.engine["memory_budget_bytes"] == 64 * MiB


def test_lease_reaches_the_worker_specs(tiny_dir):
    from pdserve.cluster.launcher import EmbeddedCluster

    cluster = EmbeddedCluster(_options("--lease-s", "7.5", "--heartbeat-s", "0.5",
                                       "--registry-ttl-s", "4"))
    cluster.model, cluster.redis_url = str(tiny_dir), "redis://127.0.0.1:1"
    specs = cluster.worker_specs()
    assert {(s.lease_s, s.heartbeat_s, s.ttl_s) for s in specs} == {(7.5, 0.5, 4.0)}


def test_each_pool_has_its_own_cpus_and_device(tiny_dir):
    from pdserve.cluster.launcher import EmbeddedCluster

    def specs(*argv):
        cluster = EmbeddedCluster(_options(*argv))
        cluster.model, cluster.redis_url = str(tiny_dir), "redis://127.0.0.1:1"
        return {s.role: (s.resources.num_cpus, s.resources.torch_threads, s.config.device)
                for s in cluster.worker_specs()}

    assert specs("--worker-cpus", "2") == {"prefill": (2, 2, "cpu"), "decode": (2, 2, "cpu")}
    assert specs("--prefill-worker-cpus", "3", "--decode-worker-cpus", "0") == {
        "prefill": (3, 3, "cpu"), "decode": (0, 1, "cpu")}
    assert specs("--colocated", "--decode-worker-cpus", "2", "--prefill-worker-cpus", "5") == {
        "colocated": (2, 2, "cpu")}  # a colocated pool takes decode's settings
    assert specs("--device", "cuda", "--prefill-device", "cpu", "--decode-device", "cpu") \
        == {"prefill": (1, 1, "cpu"), "decode": (1, 1, "cpu")}
    with pytest.raises(ValueError, match="prefill on cpu, decode on cuda.*not the other way"):
        specs("--prefill-device", "cpu", "--decode-device", "cuda")  # (before resolving)


def test_a_tensor_parallel_worker_asks_for_each_rank(tiny_dir):
    """--tensor-parallel-size N, or a pool's own size: each worker asks Ray for N x its CPUs
    (one process per rank, each with its pool's threads) and its engine runs N ranks."""
    from pdserve.cluster.launcher import EmbeddedCluster

    def specs(*argv):
        cluster = EmbeddedCluster(_options(*argv))
        cluster.model, cluster.redis_url = str(tiny_dir), "redis://127.0.0.1:1"
        return {s.role: (s.resources.num_cpus, s.resources.torch_threads,
                         s.config.tensor_parallel_size) for s in cluster.worker_specs()}

    assert specs("--worker-cpus", "3", "--prefill-tensor-parallel-size", "2") == {
        "prefill": (6, 3, 2), "decode": (3, 3, 1)}
    assert specs("--tensor-parallel-size", "2", "--decode-tensor-parallel-size", "1") == {
        "prefill": (2, 1, 2), "decode": (1, 1, 1)}
    assert specs("--colocated", "--decode-tensor-parallel-size", "2",
                 "--prefill-tensor-parallel-size", "4") == {"colocated": (2, 1, 2)}
    options = _options("--colocated", "--tensor-parallel-size", "2", "--worker-cpus", "3",
                       "--decode", "2")
    assert options.local_ray_cpus(cores=2) == 12  # 2 workers x 2 ranks x 3 CPUs
    with pytest.raises(ValueError, match="prefill_tensor_parallel_size must be a positive"):
        ClusterOptions(prefill_tensor_parallel_size=0)
    with pytest.raises(ValueError, match="worker_gpus must be 1"):
        _options("--decode-tensor-parallel-size", "2", "--worker-gpus", "0.5")


def test_pool_settings_name_the_bad_field():
    with pytest.raises(ValueError, match="prefill_worker_cpus must be >= 0"):
        ClusterOptions(prefill_worker_cpus=-1)
    with pytest.raises(ValueError, match="decode_device must be one of auto, cpu, cuda"):
        ClusterOptions(decode_device="tpu")
    opts = ClusterOptions(prefill_worker_cpus=4, num_prefill=2, num_decode=2)
    assert opts.local_ray_cpus(cores=2) == 16  # 4 workers at up to 4 CPUs each


def _run_cli(capsys, *argv: str) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    return exc.value.code, capsys.readouterr().err


@pytest.mark.parametrize(("argv", "flags"), [
    (["--block-size", "0"], ["--block-size"]),
    (["--kv-cache-dtype", "fp4"], ["--kv-cache-dtype"]),
    (["--dtype", "float8"], ["--dtype"]),
    (["--max-num-seqs", "-1"], ["--max-num-seqs"]),
    (["--max-num-batched-tokens", "lots"], ["--max-num-batched-tokens"]),
    (["--memory-budget-mib", "0"], ["--memory-budget-mib"]),
    (["--memory-safety-margin", "0.9"], ["--memory-safety-margin"]),
    (["--heartbeat-s", "10"], ["--heartbeat-s", "--registry-ttl-s"]),
    (["--lease-s", "0"], ["--lease-s"]),
    (["--decode", "0"], ["--decode"]),
    (["--port", "70000"], ["--port"]),
    (["--max-model-len", "1000000"], ["--max-model-len"]),
    (["--no-enable-chunked-prefill", "--max-num-batched-tokens", "512", "--max-model-len",
      "1024"], ["--max-num-batched-tokens", "--max-model-len"]),
    (["--colocated", "--tensor-parallel-size", "3"], ["--tensor-parallel-size"]),
    (["--colocated", "--tensor-parallel-size", str(2**63)], ["--tensor-parallel-size"]),
    (["--prefill-tensor-parallel-size", "3"], ["--prefill-tensor-parallel-size"]),
    (["--otlp-traces-endpoint", "localhost:4317"], ["--otlp-traces-endpoint"]),
])
@pytest.mark.parametrize("command", ["serve", "demo"])
def test_bad_values_exit_2_with_one_message_naming_the_flag(capsys, no_cluster, tiny_dir,
                                                            command, argv, flags):
    code, err = _run_cli(capsys, command, "--model", str(tiny_dir), *argv)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"pdserve {command}: error: "), err
    assert "Traceback" not in err
    for flag in flags:
        assert flag in lines[0], (flag, lines[0])


def test_missing_model_folder_names_model(capsys, no_cluster, tmp_path):
    code, err = _run_cli(capsys, "serve", "--model", str(tmp_path / "nothing-here"))
    assert code == 2 and "argument --model:" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("command", ["serve", "demo"])
def test_memory_budget_too_small_exits_2_with_one_line(capsys, no_cluster, tiny_dir, command):
    code, err = _run_cli(capsys, command, "--model", str(tiny_dir), "--memory-budget-mib", "1")
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    line = lines[0]
    for flag in ("--memory-budget-mib", "--num-kv-blocks", "--max-model-len",
                 "--max-num-batched-tokens", "--kv-cache-dtype int8"):
        assert flag in line, flag
    assert "(1.0 MiB)" in line and re.search(r"need [\d.]+ MiB", line)
    assert int(re.search(r"--memory-budget-mib to at least (\d+)", line).group(1)) > 1


def test_scheduling_policy_sets_the_pools_and_the_router():
    from pdserve.cli.settings import Overrides, apply_overrides
    from pdserve.cluster.options import ClusterOptions

    options = apply_overrides(ClusterOptions(), Overrides(engine={"scheduling_policy": "priority"}))
    assert options.engine["scheduling_policy"] == "priority"
    assert options.router.scheduling_policy == "priority"
