"""bench/ps.py: a --quick run on the smallest cluster, and its arithmetic.

The run starts one worker, one ps task and the coordinator (about 40 s on
2 cores) and checks what the bench is for: the table and the JSON are
there, pss-tf_rdma moved the step's bytes through tf_rdma (every task's
counters against the plan), its losses and the ceiling's are pss-grpc's
bit for bit (one worker: the updates come in one order), and nothing of the cluster is left
(processes, /dev/shm segments). Speed targets are printed, not asserted:
the arithmetic of the check lines is tested on given numbers.
"""

import json
import os
import signal
import subprocess
import sys

import pytest

from conftest import BENCH, load_bench, shm_segments

SCRIPT = os.path.join(BENCH, "ps.py")
RUN_TIMEOUT = 150
#: The quick run's models: the bench's own and one real network (Keras 2
#: layers; its ceiling's variables per worker through the bench's creator).
QUICK_MODELS = ("mlp", "embedding", "cnn", "transformer")


@pytest.fixture(scope="module")
def ps():
    return load_bench("ps.py")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """``bench/ps.py --quick`` on 1 worker and 1 ps: (stdout, JSON)."""
    out = str(tmp_path_factory.mktemp("ps") / "ps.json")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TF_CONFIG", None)
    proc = subprocess.Popen(
        [sys.executable, SCRIPT, "--quick", "--workers", "1", "--ps", "1",
         "--models", *QUICK_MODELS, "--timeout", str(RUN_TIMEOUT - 30),
         "--json", out],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)  # the launcher tears its cluster down
        try:
            proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        pytest.fail(f"bench/ps.py --quick did not finish in {RUN_TIMEOUT} s")
    assert proc.returncode == 0, stdout[-3000:] + stderr[-5000:]
    with open(out) as f:
        return stdout, json.load(f)


@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_quick_run_prints_the_table_and_writes_the_json(ps, quick_run):
    stdout, doc = quick_run
    assert "tf_rdma steps/s" in stdout and "ceiling steps/s" in stdout
    for model in QUICK_MODELS:
        assert f"check: {model}, 1 worker(s), 1 ps" in stdout
    assert doc["bench"] == "ps"
    assert doc["machine"]["cores"] >= 1 and doc["machine"]["cpu_model"]
    ops = {}
    for r in doc["results"]:
        assert {"system", "op", "size_bytes", "P", "median_s", "min_s",
                "runs"} <= set(r)
        assert r["P"] == 1 and r["ps"] == 1 and r["runs"] == 2
        assert 0 < r["min_s"] <= r["median_s"]
        ops.setdefault(r["op"], set()).add(r["system"])
    assert ops == {f"{m}-step": set(ps.SYSTEMS)
                   for m in (ps.EMPTY,) + QUICK_MODELS}
    assert len(doc["checks"]) == len(QUICK_MODELS)


@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_tf_rdma_moved_the_planned_bytes_and_matched_plain_pss(ps, quick_run):
    _, doc = quick_run
    (shape,) = doc["config"]["shapes"]
    for m in shape["models"]:
        # One plan (one worker); with one ps task every transfer is static,
        # so the counters of all tasks add up to the plan, step by step.
        assert m["plans"] == 1, m["model"]
        assert m["plan_bytes_per_step"] > 0
        assert m["moved_bytes_per_step"] == m["plan_bytes_per_step"], m["model"]
        assert sum(m["sent_bytes_per_step"].values()) == m["moved_bytes_per_step"]
        assert m["kept"] == []
        losses = m["losses"]
        assert len(losses[ps.GRPC]) == len(losses[ps.RDMA]) > 0
        assert m["losses_identical"] is True, m["model"]
        # The ceiling is the same step: with one worker, the same trajectory.
        assert m["ceiling_losses_identical"] is True, m["model"]
    rdma = [r for r in doc["results"] if r["system"] == ps.RDMA]
    assert all(r["size_bytes"] == r["moved_bytes_per_step"] for r in rdma)


@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_quick_run_leaves_no_process_or_segment(quick_run):
    _, doc = quick_run
    (shape,) = doc["config"]["shapes"]
    pids = shape["cluster_pids"]
    assert len(pids) == 4  # the coordinator, the launcher, worker and ps
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        assert b"tf_rdma" not in cmdline and b"ps.py" not in cmdline, pid
    assert shm_segments(pids) == []


def _result(ps, system, median_s, cpu_per_step_s=0.01, busy=1.0, others=0.0,
            size=8 << 20):
    r = {"system": system, "model": "mlp", "P": 1, "ps": 1,
         "size_bytes": size, "median_s": median_s,
         "cpu_per_step_s": cpu_per_step_s, "busy_cpus": busy,
         "others_cpus": others}
    return r


def _row(ps, grpc, rdma, ceiling, rdma_cpu=0.01, size=8 << 20):
    row = {ps.GRPC: _result(ps, ps.GRPC, grpc, size=size),
           ps.RDMA: _result(ps, ps.RDMA, rdma, rdma_cpu, size=size),
           ps.CEILING: _result(ps, ps.CEILING, ceiling, size=size)}
    row[ps.RDMA].update(share_of_ceiling=ceiling / rdma,
                        speedup_vs_grpc=grpc / rdma)
    return row


def test_bounds_come_from_the_cpu_the_ceiling_and_the_empty_step(ps):
    row = _row(ps, grpc=0.020, rdma=0.012, ceiling=0.010, rdma_cpu=0.030)
    empty = _row(ps, grpc=0.006, rdma=0.005, ceiling=0.002)
    b = ps.bounds(row, empty, cpus=2)
    # tf_rdma's 30 ms of CPU on 2 CPUs: at least 15 ms a step.
    assert b["share_cpu"] == pytest.approx(0.010 / 0.015)
    assert b["speedup_ceiling"] == pytest.approx(2.0)
    assert b["dispatch_s"] == pytest.approx(0.003)
    assert b["share_dispatch"] == pytest.approx(0.010 / 0.013)
    assert b["speedup_dispatch"] == pytest.approx(0.020 / 0.013)
    assert ps.bounds(row, None, cpus=2)["share_dispatch"] is None


def test_a_missed_goal_says_whether_it_is_out_of_reach(ps):
    row = _row(ps, grpc=0.020, rdma=0.012, ceiling=0.010, rdma_cpu=0.030)
    empty = _row(ps, grpc=0.006, rdma=0.005, ceiling=0.002)
    c = ps.check(row, empty, cpus=2)
    assert c["verdict"] == "MISSED"
    assert "share (target >= 90%) MISSED" in c["line"]
    assert "speedup (target >= 1.5x) met" in c["line"]
    assert "share out of reach here" in c["line"]
    assert "at most 67%" in c["line"] and "about 77%" in c["line"]
    # Enough CPUs, no empty-step estimate: missed but not bound.
    c = ps.check(row, None, cpus=8)
    assert "share not bound here" in c["line"]
    met = ps.check(_row(ps, grpc=0.020, rdma=0.0105, ceiling=0.010), empty,
                   cpus=2)
    assert met["verdict"] == "met" and "bound" not in met["line"].split(":")[-1]


def test_small_steps_are_not_judged(ps):
    row = _row(ps, grpc=0.020, rdma=0.015, ceiling=0.010, size=1 << 20)
    c = ps.check(row, None, cpus=2)
    assert c["verdict"] == "not applicable"
    assert c["line"].endswith("the goals apply above 4 MiB a step")
