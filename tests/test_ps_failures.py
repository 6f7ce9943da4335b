"""Failures under ParameterServerStrategy + ClusterCoordinator, rewritten step.

Real processes: `python -m tf_rdma.server` for the workers and the ps, a real
coordinator process (job `chief`) that schedules a `@tf_rdma.rewrite` step,
real SIGKILLs. Plain ParameterServerStrategy (the same step without the
rewrite) is the oracle for what TensorFlow itself does. What each case does
and what it takes is written up in docs/reliability.md ("Parameter-server
failures").
"""

import json
import os
import signal

import pytest

from conftest import LiveCluster

pytestmark = pytest.mark.timeout(240)

# The coordinator. SCENARIO: "worker" (SIGKILL worker:1 mid-step, check the
# ps released its regions, restart it, check it trains through tf_rdma),
# "ps" (SIGKILL ps:0: join must raise, in time), "cancel" (a step that
# fails on the worker: how long the waits of its other parts last).
COORDINATOR = r"""
import json, os, signal, subprocess, sys, time
import numpy as np
import tensorflow as tf
import tf_rdma
import tf_rdma.measured

SCENARIO = os.environ["SCENARIO"]
MODE = os.environ["MODE"]
PIDS = json.loads(os.environ["SERVER_PIDS"])
CLUSTER = json.loads(os.environ["TF_CONFIG"])["cluster"]
PS0, W1 = "/job:ps/task:0", "/job:worker/task:1"
STEPS = 300
def result(obj):
    print("RESULT " + json.dumps(obj), flush=True)

resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
strategy = tf.distribute.experimental.ParameterServerStrategy(resolver)
coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
N = 256
with strategy.scope():
    w = tf.Variable(tf.ones([N, N]) * 0.01, name="w")

def replica_fn(s):
    x = tf.ones([512, N]) * tf.cast(s % 7, tf.float32) * 0.01
    with tf.GradientTape() as tape:
        wr = w.read_value()
        h = tf.matmul(x, wr)
        for _ in range(12):                       # ~50 ms of work per step
            h = tf.tanh(tf.matmul(h, wr))
        loss = tf.reduce_mean(h * h)
    g = tape.gradient(loss, w)
    if SCENARIO == "cancel":
        # Step 3 fails on the worker before its gradient leaves: the ps's
        # recv of it, and the worker's recv of the updated weights (which
        # need it), wait for a tensor that never comes.
        g = tf.debugging.check_numerics(g / tf.cast(3 - s, tf.float32), "boom")
    w.assign_sub(0.1 * g)
    if SCENARIO == "cancel":
        loss += tf.reduce_sum(w.read_value()) * 0.0
    return loss

@tf.function
def step(s):
    return strategy.run(replica_fn, args=(s,))

fn = tf_rdma.rewrite(step) if MODE == "rewrite" else step

def run(steps):
    rvs = [coordinator.schedule(fn, args=(tf.constant(i),)) for i in steps]
    coordinator.join()
    return [float(r.fetch()) for r in rvs]

def regions_of(task, peer):
    info = tf_rdma.measured.task_report("info", task)
    return sorted(r["name"] for r in info["regions"] if peer in r["name"])

def segments_of(pid):
    return sorted(n for n in os.listdir("/dev/shm")
                  if n.startswith("tfrdma.%d." % pid))

def stats(task):
    return tf_rdma.measured.task_report("stats", task)

def moved(st):
    return {k: sum(p[k] for p in st["peers"]) for k in ("writes", "receives")}

out = {"warm": run([0, 1, 2, 4])}  # step 3 fails in "cancel"
if SCENARIO == "worker":
    rvs = [coordinator.schedule(fn, args=(tf.constant(i),)) for i in range(STEPS)]
    time.sleep(0.5)                               # steps are running
    out["ps_regions_before"] = regions_of(PS0, "/job:worker/task:1")
    out["ps_segments_before"] = len(segments_of(PIDS["ps:0"]))
    os.kill(PIDS["worker:1"], signal.SIGKILL)
    killed = time.monotonic()
    # The ps releases what it held for the dead worker (polled while the
    # coordinator reschedules its steps).
    while (regions_of(PS0, "/job:worker/task:1") and
           time.monotonic() - killed < 20):
        time.sleep(0.05)
    out["released_after_s"] = time.monotonic() - killed
    out["ps_regions_after"] = regions_of(PS0, "/job:worker/task:1")
    out["ps_segments_after"] = len(segments_of(PIDS["ps:0"]))
    coordinator.join()
    out["join_after_kill_s"] = time.monotonic() - killed
    losses = [float(r.fetch()) for r in rvs]
    out["finished"] = sum(1 for l in losses if np.isfinite(l))
if SCENARIO == "worker" and os.environ.get("RESTART") == "1":
    # The worker comes back: a new process at the same address, after longer
    # than the op timeout, when the ps has unmapped the credit regions of its
    # sends to the old process (slots still bound to the lost connection must
    # not read them).
    time.sleep(float(os.environ["RESTART_AFTER_S"]))
    env = dict(os.environ, TF_CONFIG=json.dumps(
        {"cluster": CLUSTER, "task": {"type": "worker", "index": 1}}))
    proc = subprocess.Popen([sys.executable, "-m", "tf_rdma.server"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, start_new_session=True)
    with open(os.environ["RESTARTED_PID_FILE"], "w") as f:
        f.write(str(proc.pid))
    restarted = time.monotonic()
    # Steps go to it once it serves (a call that reaches its address before
    # then is refused by gRPC, which the coordinator raises).
    line = ""
    while "ready" not in line and time.monotonic() - restarted < 90:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
    out["restarted_ready_s"] = time.monotonic() - restarted
    out["restarted_moved"] = None
    while time.monotonic() - restarted < 90:
        out["after_restart"] = run(range(8))
        try:
            m = moved(stats(W1))
        except tf.errors.OpError:                 # not serving yet
            time.sleep(0.5)
            continue
        if m["writes"] and m["receives"]:
            out["restarted_moved"] = m
            out["restarted_trains_after_s"] = time.monotonic() - restarted
            break
        time.sleep(0.5)
    if MODE == "rewrite":
        out["ps_regions_restarted"] = regions_of(PS0, "/job:worker/task:1")
elif SCENARIO == "ps":
    rvs = [coordinator.schedule(fn, args=(tf.constant(i),)) for i in range(STEPS)]
    time.sleep(0.5)
    os.kill(PIDS["ps:0"], signal.SIGKILL)
    killed = time.monotonic()
    try:
        coordinator.join()
        out["error"] = None
    except Exception as e:  # what the user gets: checked by the test
        out["error"] = {"type": type(e).__name__,
                        "mro": [c.__name__ for c in type(e).__mro__],
                        "message": str(e)[:3000]}
    out["join_after_kill_s"] = time.monotonic() - killed
elif SCENARIO == "cancel":
    ps_before = stats(PS0)["peers"]
    rv = coordinator.schedule(fn, args=(tf.constant(3),))
    t0 = time.monotonic()
    try:
        coordinator.join()
        out["error"] = None
    except Exception as e:
        out["error"] = {"type": type(e).__name__, "message": str(e)[:2000]}
    failed = time.monotonic()
    out["join_s"] = failed - t0
    # How long the waits of the failed call's parts go on, on each task.
    ends = {}
    while len(ends) < 2 and time.monotonic() - failed < 30:
        waiting = {
            "worker": sum(stats(t)["data_waiting"]
                          for t in ("/job:worker/task:0", "/job:worker/task:1")),
            "ps": stats(PS0)["data_waiting"]}
        for part, n in waiting.items():
            if n == 0 and part not in ends:
                ends[part] = time.monotonic() - failed
        time.sleep(0.05)
    out["waits_end_after_s"] = ends
    # Did the ps's part wait at all (its recv of the gradient)? It never
    # got the gradient: a wait that ended early was cancelled.
    ps_after = stats(PS0)["peers"]
    total = lambda peers, k: sum(p[k] for p in peers)
    out["ps_data_waits"] = (total(ps_after, "data_waits") -
                            total(ps_before, "data_waits"))
    out["ps_receives"] = (total(ps_after, "receives") -
                          total(ps_before, "receives"))
    out["ps_waited_s"] = (total(ps_after, "data_wait_ns") -
                          total(ps_before, "data_wait_ns")) / 1e9
result(out)
sys.stdout.flush()
os._exit(0)   # the coordinator's threads may wait for the dead task
"""


def run_coordinator(scenario, mode, transport, tmp_path, workers=2, ps=1,
                    timeout=200, restart=False):
    """Runs COORDINATOR against a fresh cluster; returns (RESULT, logs).

    ``logs`` maps each server's name (``"ps0"``, ...) and ``"coordinator"``
    to the tail of its stderr.
    """
    log_dir = tmp_path / f"{scenario}-{mode}-{transport}"
    log_dir.mkdir()
    op_timeout = 10
    cluster = LiveCluster({"worker": workers, "ps": ps}, str(log_dir),
                          env={"TF_RDMA_TRANSPORT": transport},
                          op_timeout=op_timeout, coordinator=True)
    cluster.start()
    pid_file = log_dir / "restarted.pid"
    pids = {f"{job}:{name[len(job):]}": p.pid for name, p in cluster.procs.items()
            for job in ("worker", "ps") if name.startswith(job)}
    try:
        proc, results = cluster.run_client(COORDINATOR, timeout=timeout, env={
            "SCENARIO": scenario, "MODE": mode, "RESTARTED_PID_FILE": str(pid_file),
            "RESTART": "1" if restart else "0",
            "RESTART_AFTER_S": str(op_timeout + 1),
            "SERVER_PIDS": json.dumps(pids)})
    finally:
        if pid_file.exists():  # the worker the coordinator started again
            try:
                os.killpg(int(pid_file.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass
        cluster.stop()
    logs = {name: text[-4000:] for name, text in _server_logs(cluster).items()}
    if proc.returncode != 0 or not results:
        pytest.fail(f"coordinator failed ({proc.returncode}):\n"
                    f"{proc.stderr[-4000:]}\n" +
                    "\n".join(f"--- {t}\n{l}" for t, l in logs.items()))
    logs["coordinator"] = proc.stderr[-20000:]
    return results[-1], logs


def _server_logs(cluster):
    logs = {}
    for name in cluster.procs:
        with open(os.path.join(cluster.log_dir, name + ".err")) as f:
            logs[name] = f.read()
    return logs


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_worker_killed_then_restarted(transport, tmp_path):
    out, logs = run_coordinator("worker", "rewrite", transport, tmp_path,
                                restart=True)
    coordinator_log = logs["coordinator"]
    print("MEASURED", transport, json.dumps(
        {k: out.get(k) for k in ("join_after_kill_s", "released_after_s",
                                 "restarted_ready_s",
                                 "restarted_trains_after_s")}))
    # 1. Killed mid-step: its closures ran on worker:0; training went on.
    assert out["finished"] == 300, out
    assert "Worker /job:worker/replica:0/task:1 failed" in coordinator_log, \
        coordinator_log[-3000:]
    assert out["join_after_kill_s"] < 60, out
    # ... and the ps released what it held for it, at once.
    assert len(out["ps_regions_before"]) == 2, out  # its data + our credits
    assert out["ps_regions_after"] == [], (out, logs["ps0"])
    assert out["released_after_s"] < 5, out
    assert out["ps_segments_after"] == out["ps_segments_before"] - 2, out
    assert "released region" in logs["ps0"], logs["ps0"]
    # 2. Restarted: it gets steps again, through tf_rdma, and the ps has
    # fresh regions for it (no refusal).
    assert out["restarted_moved"] is not None, (out, logs)
    assert out["restarted_moved"]["writes"] > 0, out
    assert out["restarted_moved"]["receives"] > 0, out
    assert len(out["ps_regions_restarted"]) == 2, out
    assert "does not resume transfers" not in logs["ps0"], logs["ps0"]
    assert all(x == x for x in out["after_restart"]), out  # no NaN


@pytest.mark.timeout(300)
def test_ps_killed_fails_like_plain_pss(tmp_path):
    plain, _ = run_coordinator("ps", "plain", "shm", tmp_path, timeout=120)
    rewritten, logs = run_coordinator("ps", "rewrite", "shm", tmp_path,
                                      timeout=120)
    # TensorFlow's own answer (the oracle): join raises within seconds.
    assert plain["error"] is not None, plain
    for out in (plain, rewritten):
        assert out["error"] is not None, out
        # Within TF_RDMA_TIMEOUT (10 s), not retried as a worker failure.
        assert out["join_after_kill_s"] < 10, out
    # The same kind of error as without the rewrite: Unavailable (tf_rdma's
    # own error for a dead peer is Unavailable too, and reaches the
    # coordinator as such, never as Internal).
    assert rewritten["error"]["type"] == plain["error"]["type"], (plain,
                                                                  rewritten)
    assert "UnavailableError" in rewritten["error"]["mro"], rewritten
    print("MEASURED ps", plain["join_after_kill_s"],
          rewritten["join_after_kill_s"])
    message = rewritten["error"]["message"]
    assert "replaced by InternalError" not in message, message
    # Whichever error reached the coordinator first (gRPC's or tf_rdma's),
    # it names the ps the way the coordinator recognises a ps failure; a
    # tf_rdma error wrapped in the worker's name without it would be taken
    # for a worker failure and retried for ever.
    if "tf_rdma" in message:
        assert "remote target /job:ps/replica:0/task:0" in message, message


def test_failed_step_ends_its_waits(tmp_path):
    out, logs = run_coordinator("cancel", "rewrite", "shm", tmp_path)
    assert out["error"] is not None and "boom" in out["error"]["message"], out
    ends = out["waits_end_after_s"]
    print("MEASURED cancel", json.dumps(
        {k: out.get(k) for k in ("join_s", "waits_end_after_s",
                                 "ps_data_waits", "ps_waited_s")}))
    # The worker's own recv (of the weights its failed gradient would have
    # updated) is cancelled with its step: it ends at once, not at the 10 s
    # timeout.
    assert ends.get("worker", 99) < 3, (out, logs)
    # The ps's part is another component of the same call, on another
    # task: its recv of the gradient did wait (and never got it), and ended
    # at once too, so TensorFlow cancelled that component when the worker's
    # failed (docs/reliability.md); without the cancellation callback it
    # waited out TF_RDMA_TIMEOUT (10 s).
    assert out["ps_data_waits"] >= 1, out
    assert ends.get("ps", 99) < 3, (out, logs)
    assert out["ps_waited_s"] < 3, out
