"""A short run of the soak (bench/soak.py), and proof that its check can fail.

bench/soak.py runs 10^5 steps on demand; here the same code runs a few
thousand steps per transport so that ``make test`` catches a leak or a
mismatch that shows up quickly:

- ``test_short_soak_over_shm_and_tcp``: 1,500 steps per transport, a sample
  every 250 from step 500 (the warm-up: one period of the dynamic sizes,
  and the first sample after it). Every tensor checked on arrival: 0
  mismatches. Threads (but gRPC's load-following ``event_engine`` pool,
  which may move by the soak's slack), /dev/shm segments and their bytes
  equal at every sample after the warm-up, fds within 1; no segment left
  once the servers stopped. RSS is noisier over so few
  steps than the 1% that the long run asks, so here each task may grow by
  at most ``SHORT_RUN_RSS_GROWTH_MIB`` between the first and the last
  sample after the warm-up (a leak of one 32 KiB static tensor a step
  would add 31 MiB here).
- ``test_corrupted_tensors_are_reported``: ``--inject-corruption`` changes
  one word of a tensor on its sending task, after the checksum, once per
  kind of traffic (static, dynamic, back, allreduce) at known steps: the
  run reports exactly those (edge, task, step) mismatches (the allreduce on
  both ranks) and exits 1. Without it, a check that never fires would pass
  the test above just as well.

Both run ``bench/soak.py`` as a subprocess (servers, client and verdict as a
user runs them) under a hard timeout, with their JSON in a temporary
directory.
"""

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO

sys.path.insert(0, os.path.join(REPO, "bench"))
import soak  # noqa: E402 - bench/soak.py; its import loads no TensorFlow

SOAK = os.path.join(REPO, "bench", "soak.py")
SHORT_RUN_STEPS = 1500
SHORT_RUN_SAMPLE_EVERY = 250
SHORT_RUN_RSS_GROWTH_MIB = 4
TRANSPORTS = ("shm", "tcp")
MiB = 1024 * 1024

# Hard limits. On an idle 2-core VM the short soak takes about a minute and
# the corruption run a third of that; most of it is starting TensorFlow in
# three processes per transport, which takes several times longer when
# other work shares the cores.
SHORT_RUN_TIMEOUT_S = 280
CORRUPTION_RUN_TIMEOUT_S = 150


def run_soak(out_dir, *args, timeout):
    """Runs bench/soak.py with ``args``; returns (exit status, output, {transport: doc}).

    Past ``timeout`` the soak gets SIGTERM (it stops its servers and
    client) and the test fails; its children also die with it.
    """
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, SOAK, "--out-dir", str(out_dir), "--no-plot",
         "--timeout", str(timeout), *args],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            output, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
        pytest.fail(f"bench/soak.py did not finish within {timeout} s:\n"
                    + output[-4000:])
    docs = {}
    for transport in TRANSPORTS:
        path = os.path.join(out_dir, f"soak-{transport}.json")
        if os.path.exists(path):
            with open(path) as f:
                docs[transport] = json.load(f)
    return proc.returncode, output, docs


@pytest.mark.timeout(SHORT_RUN_TIMEOUT_S + 40)
def test_short_soak_over_shm_and_tcp(tmp_path):
    status, output, docs = run_soak(
        tmp_path, "--transport", "both", "--steps", str(SHORT_RUN_STEPS),
        "--sample-every", str(SHORT_RUN_SAMPLE_EVERY),
        # Judged below in MiB: RSS is noisy over 1,000 steps.
        "--max-rss-growth", "100", timeout=SHORT_RUN_TIMEOUT_S)
    assert sorted(docs) == list(TRANSPORTS), output[-4000:]
    for transport, doc in docs.items():
        summary = doc["summary"]
        assert summary["steps"] == SHORT_RUN_STEPS, (transport, output[-4000:])
        assert summary["mismatches"] == 0, (transport, summary["first_mismatches"])
        # The plan really has static and dynamic edges both ways.
        kinds = sorted(t["dynamic"] for t in doc["config"]["plan"]["transfers"])
        assert kinds == [False, False, True], doc["config"]["plan"]
        after = [s for s in doc["samples"]
                 if s["step"] >= summary["warmup_until_step"]]
        # Warm-up: one period of the dynamic sizes, up to the next sample.
        assert summary["warmup_until_step"] == 500, summary
        assert [s["step"] for s in after] == list(range(
            500, SHORT_RUN_STEPS + 1, SHORT_RUN_SAMPLE_EVERY))
        for task in ("worker:0", "worker:1"):
            series = {k: [s[task][k] for s in after]
                      for k in ("rss_bytes", "fds", "shm_segments",
                                "shm_bytes")}
            elastic = [sum(s[task]["thread_names"].get(n, 0)
                           for n in soak.ELASTIC_THREAD_NAMES) for s in after]
            series["threads_fixed"] = [
                sum(s[task]["thread_names"].values()) - e
                for s, e in zip(after, elastic)]
            where = (transport, task, series)
            # Every thread stays, except gRPC's pool that follows the load.
            assert len(set(series["threads_fixed"])) == 1, where
            assert max(elastic) - min(elastic) <= soak.DEFAULT_ELASTIC_THREAD_SLACK
            assert len(set(series["shm_segments"])) == 1, where
            assert len(set(series["shm_bytes"])) == 1, where
            assert series["shm_segments"][0] > 0, where  # tf_rdma's regions
            assert max(series["fds"]) - min(series["fds"]) <= 1, where
            growth = series["rss_bytes"][-1] - series["rss_bytes"][0]
            assert growth < SHORT_RUN_RSS_GROWTH_MIB * MiB, where
        assert summary["segments_left_after_shutdown"] == [], summary
        assert summary["pass"], summary["failures"]
    assert status == 0, output[-4000:]


@pytest.mark.timeout(CORRUPTION_RUN_TIMEOUT_S + 40)
def test_corrupted_tensors_are_reported(tmp_path):
    injected = {"static": 60, "dynamic": 90, "back": 120, "allreduce": 150}
    args = ["--transport", "shm", "--steps", "200", "--sample-every", "50",
            "--warmup", "50"]
    for edge, step in injected.items():
        args += ["--inject-corruption", f"{step}:{edge}"]
    status, output, docs = run_soak(tmp_path, *args,
                                    timeout=CORRUPTION_RUN_TIMEOUT_S)
    assert status == 1, output[-4000:]
    summary = docs["shm"]["summary"]
    assert summary["steps"] == 200, output[-4000:]
    got = sorted((m["step"], m["edge"], m["task"])
                 for m in summary["first_mismatches"])
    assert got == [(60, "static", "worker:1"), (90, "dynamic", "worker:1"),
                   (120, "back", "worker:0"), (150, "allreduce", "worker:0"),
                   (150, "allreduce", "worker:1")]
    assert summary["mismatches"] == 5
    assert not summary["pass"]
    assert "FAIL: 5 mismatches" in output, output[-4000:]
