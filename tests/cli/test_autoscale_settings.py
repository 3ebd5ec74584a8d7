"""``pdserve serve`` autoscaler and placement settings: generated flags, the YAML file under
the flags, and the checks that fail before anything starts."""

from __future__ import annotations

import pytest

from pdserve.cli import settings
from pdserve.cli.main import build_parser
from pdserve.cluster.options import ClusterOptions


def _options(*argv: str) -> ClusterOptions:
    return settings.options_from_args(build_parser().parse_args(["serve", *argv]),
                                      ClusterOptions())


def test_the_issue_flags_set_the_autoscaler_config():
    opts = _options("--autoscale", "--min-prefill", "1", "--max-prefill", "2", "--min-decode",
                    "1", "--max-decode", "3", "--max-workers", "4", "--scale-interval-s", "2",
                    "--scale-up-delay-s", "1", "--scale-down-delay-s", "5", "--ttft-slo-ms",
                    "200", "--itl-slo-ms", "30", "--worker-cpus", "2", "--pool-placement",
                    "require")
    a = opts.autoscale
    assert a.enabled and (a.min_prefill, a.max_prefill, a.min_decode, a.max_decode) == \
        (1, 2, 1, 3)
    assert (a.max_workers, a.scale_interval_s, a.scale_up_delay_s, a.scale_down_delay_s) == \
        (4, 2.0, 1.0, 5.0)
    assert (a.ttft_slo_ms, a.itl_slo_ms) == (200.0, 30.0)
    assert opts.worker_cpus == 2 and opts.pool_placement == "require"
    assert not _options().autoscale.enabled  # off unless asked


def test_the_yaml_file_sits_under_the_flags(tmp_path):
    path = tmp_path / "values.yaml"
    path.write_text("autoscale:\n  enabled: true\n  maxDecode: 3\n  itlSloMs: 40\n")
    opts = _options("--autoscale-config", str(path), "--max-decode", "2")
    assert opts.autoscale.enabled and opts.autoscale.max_decode == 2  # the flag wins
    assert opts.autoscale.itl_slo_ms == 40.0


@pytest.mark.parametrize("argv, flag", [
    (["--autoscale", "--min-decode", "3", "--max-decode", "2"], "--max-decode"),
    (["--autoscale", "--colocated"], "--colocated"),
    (["--worker-cpus", "-1"], "--worker-cpus"),
    (["--pool-placement", "nodes"], "--pool-placement"),
])
def test_bad_settings_name_their_flags(argv, flag):
    with pytest.raises((settings.SettingsError, SystemExit)) as err:
        _options(*argv)
    if err.type is settings.SettingsError:
        assert str(err.value).startswith("argument") and flag in str(err.value).split(":")[0]


def test_an_explicit_local_ray_too_small_for_the_pools_fails_before_starting(tiny_dir):
    from pdserve.cli.preflight import check_cluster

    opts = _options("--ray-num-cpus", "2", "--prefill", "2", "--decode", "2")
    with pytest.raises(settings.SettingsError, match="arguments --ray-num-cpus, "
                                                     "--worker-cpus: ray_num_cpus .2. cannot"):
        check_cluster(opts, str(tiny_dir))
    check_cluster(_options("--ray-num-cpus", "2", "--worker-cpus", "0", "--prefill", "2",
                           "--decode", "2"), str(tiny_dir))


def test_a_bad_yaml_file_is_one_settings_error(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("maxDecod: 2\n")
    with pytest.raises(settings.SettingsError, match="--autoscale-config: .*maxDecod"):
        _options("--autoscale-config", str(path))


def test_a_local_ray_advertises_enough_cpus_for_the_pools_at_their_largest():
    assert ClusterOptions().local_ray_cpus(cores=2) == 2  # 1P+1D on 2 cores
    opts = _options("--autoscale", "--max-prefill", "2", "--max-decode", "2")
    assert opts.local_ray_cpus(cores=2) == 4  # shared cores, said in a warning
    assert _options("--worker-cpus", "0").local_ray_cpus(cores=2) == 2
    autoscaled = _options("--autoscale", "--prefill", "5", "--max-prefill", "2")
    assert autoscaled.initial_targets() == {"prefill": 2, "decode": 1}


@pytest.mark.parametrize("argv, named", [
    (["--decode", "65"], "num_decode (65) exceeds max_workers_per_pool (64)"),
    (["--prefill", "9", "--max-workers-per-pool", "8"], "num_prefill (9) exceeds"),
    (["--autoscale", "--max-decode", "100"], "autoscale max_decode (100) exceeds"),
    (["--max-workers-per-pool", "0"], "max_workers_per_pool must be >= 1"),
])
def test_pool_sizes_stay_under_max_workers_per_pool(argv, named):
    with pytest.raises(settings.SettingsError) as err:
        _options(*argv)
    assert named in str(err.value) and "--max-workers-per-pool" in str(err.value).split(":")[0]
    assert _options("--decode", "65", "--max-workers-per-pool", "65").num_decode == 65


def test_the_pool_manager_refuses_a_target_above_its_ceiling():
    from pdserve.cluster.pools.settings import PoolSettings

    pools = PoolSettings((), max_workers_per_pool=8)
    for size in (0, 8):
        pools.check_pool_size(size)
    for size in (-1, 9, 10**6):
        with pytest.raises(ValueError, match=r"^size must be in \[0, 8\] \(the server's "
                                             r"--max-workers-per-pool\), got"):
            pools.check_pool_size(size)
