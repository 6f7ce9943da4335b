"""Ordinary faults end in a clear error, never a hang, a crash or a leak.

Regression tests for issue 13's findings, each a scenario of real processes:

- `stalled_receiver` (tcp): a reader is SIGSTOPped while a 64 MiB tensor is
  on its way; the writer's send, with a 4 s timeout, fails by then with an
  error naming the tensor and the peer (sendmsg used to block for as long as
  TCP retransmits, 25 s here and ~15 min in a real partition).
- `restart` (shm and tcp): worker:0 and worker:1 exchange tensors both ways,
  worker:0 is SIGKILLed and started again with the same task and plan. The
  survivor's waits fail at once with an error saying that worker:0
  restarted and what to do; the new worker:0 gets the same from both
  directions (as a writer whose region the survivor refuses, as a reader
  whose survivor refuses to write on); a transfer the old process never
  began continues; over shm the survivor removes the dead process's
  segments from /dev/shm.
- `refused_open` (shm): a writer whose plan the reader refuses retries its
  send 40 times; its credit region is made once, not once per retry.
- `ring_stall` (shm): in a 3-rank ring allreduce, worker:2 is SIGSTOPped;
  every other rank's timeout names worker:2, including rank 1, which waits
  for the healthy worker:0.
"""

import os
import signal
import time

import pytest

from conftest import collect, make_cluster, spawn_task

pytestmark = pytest.mark.timeout(240)

HELPERS = """
import signal, threading
"""


def _env(tmp_path, transport, timeout_s=None):
    env = {"TEST_SYNC_DIR": str(tmp_path), "TF_RDMA_TRANSPORT": transport}
    if timeout_s is not None:
        env["TF_RDMA_TIMEOUT"] = str(timeout_s)
    return env


def _error(result, key):
    error = result[key]
    assert error is not None, f"{key}: expected an error, the op succeeded"
    return error


# ---------------------------------------------------------------------------
# A receiver stopped with SIGSTOP while a large tensor is in flight (tcp).

STALLED_RECEIVER = HELPERS + """
plan = tf_rdma.Plan([tf_rdma.Transfer("big", "worker:0", "worker:1",
                                      "float32", [16 << 20])],
                    name="stalled", depth=2)
ep = start()
big = tf.fill([16 << 20], 1.0)
if task == "worker:1":
    touch("pid1", str(os.getpid()))
    got = tf_rdma.ops.recv(plan, "big")
    touch("got1")
    time.sleep(120)  # stopped by the test's writer meanwhile
else:
    pid1 = int(wait_file("pid1"))
    tf_rdma.ops.send(big, plan, "big")  # step 1 lands; the reader holds it
    wait_file("got1")
    os.kill(pid1, signal.SIGSTOP)
    # Step 2 has a free copy (depth 2): it goes straight to the socket, which
    # fills up and stays full while the reader is stopped.
    error = error_of(lambda: tf_rdma.ops.send(big, plan, "big", timeout=4))
    os.kill(pid1, signal.SIGCONT)
    os.kill(pid1, signal.SIGKILL)
    result({"error": error})
"""


def test_send_to_stopped_receiver_honours_its_deadline(tmp_path):
    cluster = make_cluster(2)
    env = _env(tmp_path, "tcp")
    procs = {t: spawn_task(t, STALLED_RECEIVER, cluster, env)
             for t in ("worker:1", "worker:0")}
    out = collect(procs, timeout=120)
    w0 = out["worker:0"]
    assert w0.returncode == 0, w0.describe()
    error = _error(w0.result, "error")
    assert error["type"] == "DeadlineExceededError", error
    assert error["elapsed_s"] < 4 + 2, error
    assert "'big'" in error["message"] and "/job:worker/task:1" in error["message"], error
    assert "stopped reading" in error["message"], error


# ---------------------------------------------------------------------------
# A task restarted with the same index and plan.

RESTART = HELPERS + """
plans = {
    "a": tf_rdma.Plan([tf_rdma.Transfer("a", "worker:0", "worker:1", "float32",
                                        [1024])], name="restart_a", depth=2),
    "b": tf_rdma.Plan([tf_rdma.Transfer("b", "worker:1", "worker:0", "float32",
                                        [1024])], name="restart_b", depth=2),
    # Never used before the restart: continues afterwards.
    "c": tf_rdma.Plan([tf_rdma.Transfer("c", "worker:0", "worker:1", "float32",
                                        [8])], name="restart_c", depth=2),
}
STEPS = 5
ep = start()
incarnation = os.environ.get("TEST_INCARNATION", "first")

def send(key, value, **kw):
    tf_rdma.ops.send(tf.fill(plans[key].slot(key).shape, float(value)),
                     plans[key], key, **kw)

def recv(key, **kw):
    return float(tf_rdma.ops.recv(plans[key], key, **kw)[0])

if task == "worker:0" and incarnation == "first":
    touch("pid0", str(os.getpid()))
    for step in range(1, STEPS + 1):
        send("a", step)
        assert recv("b") == 100 + step
    touch("exchanged0")
    time.sleep(120)  # SIGKILLed by worker:1
elif task == "worker:0":
    # The new process: same task, same plans.
    report = {"pid": os.getpid()}
    report["send_a"] = error_of(lambda: send("a", 1, timeout=20))
    touch("restarted_sent")
    report["recv_b"] = error_of(lambda: recv("b", timeout=20))
    send("c", 7.0, timeout=20)
    report["c_sent"] = True
    result(report)
else:
    report = {"pid": os.getpid()}
    for step in range(1, STEPS + 1):
        assert recv("a") == step
        send("b", 100 + step)
    pid0 = int(wait_file("pid0"))
    wait_file("exchanged0")
    report["old_segments"] = segments_of(pid0)
    # A recv of the next step waits when worker:0 dies and a new one comes.
    waiting = {}
    def wait_for_a():
        waiting["error"] = error_of(lambda: recv("a", timeout=60))
        waiting["at"] = time.monotonic()
    waiter = threading.Thread(target=wait_for_a)
    waiter.start()
    time.sleep(0.3)
    os.kill(pid0, signal.SIGKILL)
    killed_at = time.monotonic()
    deadline = killed_at + 5
    while segments_of(pid0) and time.monotonic() < deadline:
        time.sleep(0.05)
    report["old_segments_after"] = segments_of(pid0)
    report["old_segments_gone_s"] = time.monotonic() - killed_at
    touch("killed0")
    wait_file("restarted_sent", timeout=90)
    waiter.join(60)
    report["recv_a"] = waiting.get("error")
    report["recv_a_ended_s"] = waiting.get("at", 1e9) - killed_at
    # The same step again, now that a new worker:0 has connected.
    report["recv_a_after"] = error_of(lambda: recv("a", timeout=20))
    # The survivor writes b on: the new worker:0 is a new reader.
    report["send_b"] = error_of(lambda: send("b", 999, timeout=20))
    report["c"] = recv("c", timeout=30)
    result(report)
"""


@pytest.fixture(scope="module", params=["shm", "tcp"])
def restart(request, tmp_path_factory):
    transport = request.param
    tmp = tmp_path_factory.mktemp("restart_" + transport)
    cluster = make_cluster(2)
    env = _env(tmp, transport, timeout_s=30)
    first = {t: spawn_task(t, RESTART, cluster, env)
             for t in ("worker:0", "worker:1")}
    deadline = time.monotonic() + 90
    while not os.path.exists(tmp / "killed0"):
        assert time.monotonic() < deadline, "worker:0 was never killed"
        assert first["worker:1"].poll() is None, collect(first, 5)
        time.sleep(0.05)
    env["TEST_INCARNATION"] = "second"
    second = spawn_task("worker:0", RESTART, cluster, env)
    out = collect({"worker:1": first["worker:1"], "worker:0": second},
                  timeout=150)
    out["first worker:0"] = collect({"worker:0": first["worker:0"]}, 5)["worker:0"]
    return transport, out


def test_restarted_writer_fails_survivors_wait_at_once(restart):
    transport, out = restart
    w1 = out["worker:1"]
    assert w1.returncode == 0, w1.describe()
    r = w1.result
    # The wait in progress fails as soon as the connection drops...
    error = _error(r, "recv_a")
    assert error["type"] == "UnavailableError", error
    assert "/job:worker/task:0 was lost" in error["message"], error
    assert r["recv_a_ended_s"] < 5, r
    # ... and once the new process has connected, the step cannot be had:
    # the error says that the peer restarted and what to do.
    error = _error(r, "recv_a_after")
    assert error["type"] == "FailedPreconditionError", error
    assert "/job:worker/task:0 restarted" in error["message"], error
    assert "restart every task" in error["message"], error
    assert error["elapsed_s"] < 5, error


def test_restarted_task_is_told_the_peer_refuses_it_both_ways(restart):
    transport, out = restart
    w0 = out["worker:0"]
    assert w0.returncode == 0, w0.describe()
    r = w0.result
    for key in ("send_a", "recv_b"):
        error = _error(r, key)
        if "restarted" not in error["message"]:
            pytest.fail(f"{key}: {error}\n{w0.describe()}\n"
                        f"{out['worker:1'].describe()}")
        assert "restart every task" in error["message"], (key, error)
    # The survivor's own send on b names the restart as well.
    error = _error(out["worker:1"].result, "send_b")
    assert "/job:worker/task:0 restarted" in error["message"], error


def test_transfer_never_begun_continues_after_restart(restart):
    transport, out = restart
    assert out["worker:0"].result.get("c_sent") is True, out["worker:0"].describe()
    assert out["worker:1"].result["c"] == 7.0


def test_survivor_removes_dead_peers_segments(restart):
    transport, out = restart
    r = out["worker:1"].result
    assert out["first worker:0"].returncode == -signal.SIGKILL
    assert r["old_segments"], r  # it had regions
    # Both share this host's /dev/shm, whatever the transport between them.
    assert r["old_segments_after"] == [], r
    assert r["old_segments_gone_s"] < 5, r
    assert "of a peer that died" in out["worker:1"].stderr


# ---------------------------------------------------------------------------
# Refused OPENs do not leak credit regions.

REFUSED_OPEN = HELPERS + """
transfer = tf_rdma.Transfer("x", "worker:0", "worker:1", "float32", [16])
# Same region name, different plans: the reader refuses the writer's OPEN.
mine = tf_rdma.Plan([transfer], name="refused", depth=2 if task == "worker:1" else 3)
ep = start()
if task == "worker:1":
    touch("ready1")
    error = error_of(lambda: tf_rdma.ops.recv(mine, "x", timeout=5))
    wait_file("done0", timeout=120)
    result({"error": error})
else:
    wait_file("ready1")
    errors = []
    for _ in range(40):
        e = error_of(lambda: tf_rdma.ops.send(tf.ones([16]), mine, "x", timeout=5))
        errors.append(e)
    result({"errors": errors, "segments": segments_of(os.getpid()),
            "fds": len(os.listdir("/proc/self/fd"))})
    touch("done0")
"""


def test_refused_open_makes_one_credit_region_not_one_per_retry(tmp_path):
    cluster = make_cluster(2)
    procs = {t: spawn_task(t, REFUSED_OPEN, cluster, _env(tmp_path, "shm"))
             for t in ("worker:1", "worker:0")}
    out = collect(procs, timeout=150)
    w0 = out["worker:0"]
    assert w0.returncode == 0, w0.describe()
    r = w0.result
    assert all(e is not None for e in r["errors"]), r["errors"]
    assert all("plan" in e["message"] for e in r["errors"]), r["errors"][:2]
    # One credit region (it used to be one per refused OPEN: 40 here).
    assert len(r["segments"]) == 1, r["segments"]


# ---------------------------------------------------------------------------
# A stopped rank in a ring.

RING_STALL = HELPERS + """
from tf_rdma import collectives as C
ep = start()
x = tf.ones([4096])
first = C.all_reduce(x, algorithm="ring", name="ring_stall", timeout=30)
touch("first" + task[-1], str(os.getpid()))
if task == "worker:2":
    time.sleep(120)  # stopped by worker:0
else:
    if task == "worker:0":
        for t in ("first1", "first2"):
            wait_file(t)
        pid2 = int(wait_file("first2"))
        os.kill(pid2, signal.SIGSTOP)
        touch("stopped")
    else:
        wait_file("stopped")
    error = error_of(lambda: C.all_reduce(x, algorithm="ring", name="ring_stall",
                                          timeout=3))
    result({"first": float(first[0]), "error": error})
    if task == "worker:0":
        time.sleep(0.5)
        os.kill(pid2, signal.SIGKILL)
"""


def test_ring_timeout_names_the_stopped_rank(tmp_path):
    cluster = make_cluster(3)
    procs = {f"worker:{i}": spawn_task(f"worker:{i}", RING_STALL, cluster,
                                       _env(tmp_path, "shm"))
             for i in range(3)}
    out = collect(procs, timeout=120)
    for t in ("worker:0", "worker:1"):
        w = out[t]
        assert w.returncode == 0, w.describe()
        r = w.result
        assert r["first"] == 3.0, r
        error = _error(r, "error")
        assert error["type"] == "DeadlineExceededError", error
        assert "/job:worker/task:2" in error["message"], (t, error)
    # Rank 1 waits for the healthy worker:0; its error still names worker:2
    # as the one not taking what it was sent.
    message = out["worker:1"].result["error"]["message"]
    assert "not taking the blocks this rank sent: /job:worker/task:2" in message, message
