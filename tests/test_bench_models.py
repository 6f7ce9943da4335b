"""The arithmetic of bench/models.py's report: its table and check lines.

The children it runs are tested with their own quick runs (test_bench_ps,
with a real network among its models; test_parity trains every network);
here it is given their JSON documents and must compute the shares, the
cells and the goals' verdicts from them. No cluster starts.
"""

import types

import pytest

from conftest import load_bench


@pytest.fixture(scope="module")
def models():
    return load_bench("models.py")


def _ps_doc(grpc_s, rdma_s, ceiling_s, bound=None):
    results = [{"system": system, "model": "vgg16", "ps": 1,
                "median_s": seconds, "steps_per_s": 2 / seconds}
               for system, seconds in (("pss-grpc", grpc_s),
                                       ("pss-tf_rdma", rdma_s),
                                       ("ceiling", ceiling_s))]
    results[1]["moved_bytes_per_step"] = 4 << 20
    return {"results": results,
            "checks": [{"model": "vgg16", "ps": 1, "bound": bound or {}}],
            "config": {"shapes": [{"models": [
                {"model": "vgg16", "weight_bytes": 4000}]}]}}


def _dp_doc(mwms_s, rdma_s, nocomm_s, rdma_cpu_s):
    results = [{"system": system, "median_s": seconds,
                "samples_per_s": 32 / seconds, "cpu_per_step_s": cpu}
               for system, seconds, cpu in (("mwms-ring", mwms_s, 0.0),
                                            ("tf_rdma-auto", rdma_s, rdma_cpu_s),
                                            ("nocomm", nocomm_s, 0.1))]
    results[1]["payload_bytes_per_rank"] = 2 << 20
    return {"results": results, "config": {"params": 1000},
            "machine": {"cores": 2}}


def _args(**kw):
    return types.SimpleNamespace(**{"models": ["vgg16"], "ps": [1],
                                    "quick": False, **kw})


def test_table_cells_are_samples_per_second_and_shares(models):
    rows, lines, data = models.gather(
        _args(), _ps_doc(0.4, 0.25, 0.2), {"vgg16": _dp_doc(0.5, 0.2, 0.1, 0.2)})
    (row,) = rows
    batch = models.networks.BATCH["bench"]
    assert row[0] == f"vgg16 (32x32x3, {batch})"
    assert row[1] == "0.0 M"  # 1000 parameters
    assert row[2] == "4 MiB / 2 MiB"
    # PS: steps/s x batch; beside the baselines, ceiling step / their step.
    assert row[3] == f"{2 / 0.4 * batch:.0f} (50%)"
    assert row[4] == f"{2 / 0.25 * batch:.0f} (80%)"
    assert row[5] == f"{2 / 0.2 * batch:.0f}"
    assert row[6:] == ["64 (20%)", "160 (50%)", "320"]
    assert data[0]["ps_share"] == pytest.approx(0.8)
    assert data[0]["dp_share"] == pytest.approx(0.5)
    assert len(lines) == 2


def test_a_missed_share_says_whether_the_machine_allows_it(models):
    # PS: the CPU bound (70%) is below the goal: out of reach here.
    _, lines, _ = models.gather(
        _args(modes=["ps"]),
        _ps_doc(0.4, 0.25, 0.2, bound={"share_cpu": 0.7,
                                       "share_dispatch": 0.95}), {})
    (ps_line,) = lines
    assert "80% of the ceiling (goal >= 90%): MISSED" in ps_line
    assert "out of reach here: at most 70% by CPU, at most 95% by the empty step" in ps_line
    # DP: 0.15 s of CPU a step on 2 CPUs: at least 0.075 s, nocomm 0.1 s;
    # spinning counts, so it is the step's bound as it runs, not the
    # machine's.
    _, lines, _ = models.gather(_args(), {}, {"vgg16": _dp_doc(0.5, 0.2, 0.1, 0.15)})
    (dp_line,) = lines
    assert "50% of the ceiling (goal >= 90%): MISSED; as the step runs now: " in dp_line
    assert "spinning included" in dp_line and "at most 133%" in dp_line


def test_ahead_of_the_baseline_only_where_communication_shows(models):
    # gRPC's step 0.4 s against the ceiling's 0.2: communication is half of
    # it, and tf_rdma must be ahead; MWMS within 10% of nocomm: no goal.
    _, lines, _ = models.gather(
        _args(), _ps_doc(0.4, 0.5, 0.2), {"vgg16": _dp_doc(0.105, 0.1, 0.1, 0.1)})
    ps_line, dp_line = lines
    assert "0.80x pss-grpc (communication is 50% of its step; goal: ahead): MISSED" in ps_line
    assert "100% of the ceiling (goal >= 90%): met" in dp_line
    assert "1.05x mwms-ring (whose step is within 10% of the ceiling's: no goal)" in dp_line


def test_arguments_are_checked(models, capsys):
    parser = models.build_parser()
    assert parser.parse_args([]).models == list(models.networks.NAMES)
    for argv, fragment in ((["--workers", "1"], "--workers must be at least 2"),
                           (["--ps", "0"], "--ps takes counts of at least 1"),
                           (["--models", "alexnet"], "invalid choice: 'alexnet'")):
        with pytest.raises(SystemExit):
            models.main(argv)
        assert fragment in capsys.readouterr().err
