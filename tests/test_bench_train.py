"""The arithmetic of bench/train.py's report: the nocomm reference and the
scaling check.

Speed targets live in bench/, not in timed tests: these check that what it
prints is computed right from the step times it is given. No worker runs.
"""

import types

import pytest

from conftest import load_bench



@pytest.fixture(scope="module")
def train():
    return load_bench("train.py")


def _args(**kw):
    base = dict(warmup=1, batch=32)
    base.update(kw)
    return types.SimpleNamespace(**base)


def _doc(rank, times, losses=None, payload=100, **extra):
    return {"rank": rank, "done": True, "step_times": times,
            "losses": losses or [1.0] * len(times),
            "info": {"payload_bytes": payload}, **extra}


def test_nocomm_is_a_default_system_of_both_models(train):
    assert "nocomm" in train.DEFAULT_SYSTEMS
    assert "nocomm" in train.EMBEDDING_SYSTEMS
    args = train.build_parser().parse_args(["--systems", "tf_rdma",
                                            "nocomm"])
    assert args.systems == ["tf_rdma", "nocomm"]
    assert train.system_name("nocomm", "auto") == "nocomm"


def test_nocomm_step_is_the_slowest_ranks_and_hands_nothing_over(train):
    docs = [_doc(0, [9.0, 0.1, 0.3, 0.2], untimed_steps_after=0),
            _doc(1, [9.0, 0.2, 0.1, 0.4], untimed_steps_after=2)]
    r = train.combine("nocomm", 2, docs, _args(), grad_bytes=400)
    # Warm-up step dropped; per step the max over ranks: 0.2, 0.3, 0.4.
    assert r["median_s"] == pytest.approx(0.3)
    assert r["min_s"] == pytest.approx(0.2)
    assert r["P"] == 2 and r["global_batch"] == 64
    assert r["samples_per_s"] == pytest.approx(64 / 0.3)
    assert r["payload_bytes_per_rank"] == 0
    assert r["size_bytes"] == 100
    assert r["untimed_steps_after"] == [0, 2]


def test_scaling_is_nocomm_over_each_strategy(train):
    results = [{"system": "mwms-ring", "median_s": 1.0},
               {"system": "tf_rdma-auto", "median_s": 0.25},
               {"system": "nocomm", "median_s": 0.2},
               {"system": "local", "median_s": 0.1}]
    scaling = train.add_scaling(results)
    assert scaling == pytest.approx({"mwms-ring": 0.2,
                                     "tf_rdma-auto": 0.8})
    assert "scaling_vs_nocomm" not in results[2]
    assert "scaling_vs_nocomm" not in results[3]
    assert train.add_scaling([{"system": "tf_rdma-auto",
                               "median_s": 0.25}]) == {}


@pytest.mark.parametrize("rdma_s, ranks, ending", [
    (0.22, 2, "target >= 85%): met; for context mwms-ring 20%"),
    (0.25, 2, "target >= 85%): MISSED; for context mwms-ring 20%"),
    (0.25, 4, "the target, >= 85%, is set at P=2); for context mwms-ring "
              "20%"),
])
def test_scaling_check_line(train, rdma_s, ranks, ending):
    rdma = {"system": "tf_rdma-auto", "median_s": rdma_s}
    nocomm = {"system": "nocomm", "median_s": 0.2}
    results = [{"system": "mwms-ring", "median_s": 1.0}, rdma, nocomm]
    line = train.scaling_check(rdma, nocomm, train.add_scaling(results),
                               ranks)
    kept = round(100 * 0.2 / rdma_s)
    assert line.startswith(f"check: P={ranks}: RdmaStrategy keeps {kept}% "
                           f"of the communication-free step (tf_rdma-auto ")
    assert line.endswith(ending)


def test_scaling_check_without_nocomm(train):
    rdma = {"system": "tf_rdma-auto", "median_s": 0.25}
    assert "no scaling" in train.scaling_check(rdma, None, {}, 2)


def test_the_cpu_bound_ends_the_scaling_line(train):
    """All workers' CPU per step over the CPUs caps the step from below."""
    rdma = {"system": "tf_rdma-auto", "median_s": 0.16, "cpu_per_step_s": 0.30}
    nocomm = {"system": "nocomm", "median_s": 0.135, "cpu_per_step_s": 0.26}
    text, cap = train.cpu_bound(rdma, nocomm, 2)
    assert cap == pytest.approx(0.135 / 0.15)
    assert text == ("CPU per step, all workers: tf_rdma-auto 300.00 ms, nocomm "
                    "260.00 ms (+40.00 ms); on 2 CPUs a step of tf_rdma-auto's "
                    "takes at least 150.00 ms, so it keeps at most 90% here")
    line = train.scaling_check(rdma, nocomm,
                               train.add_scaling([rdma, nocomm]), 2, cpus=2)
    assert line.endswith("; " + text), line
    # Without the CPU times (an older run's JSON) or the CPU count: no clause.
    assert train.cpu_bound({"system": "x", "median_s": 0.2}, nocomm, 2) == ("", None)
    assert "CPU per step" not in train.scaling_check(
        rdma, nocomm, train.add_scaling([rdma, nocomm]), 2)


def test_cpu_per_step_sums_the_workers_timed_steps(train):
    """The warm-up and nocomm's untimed steps after the timed ones (their
    CPU is recorded too) are left out; the workers' medians add up."""
    docs = [_doc(0, [9.0, 0.1, 0.3], step_cpu=[5.0, 0.2, 0.4, 7.0],
                 untimed_steps_after=1),
            _doc(1, [9.0, 0.2, 0.1], step_cpu=[5.0, 0.3, 0.1],
                 untimed_steps_after=0)]
    r = train.combine("nocomm", 2, docs, _args(), grad_bytes=400)
    assert r["cpu_per_step_s"] == pytest.approx(0.3 + 0.2)
    # An older worker without step_cpu: no CPU time, no bound.
    old = [_doc(0, [9.0, 0.1]), _doc(1, [9.0, 0.2])]
    assert "cpu_per_step_s" not in train.combine("nocomm", 2, old, _args(),
                                                 grad_bytes=400)
