"""Failure is loud and bounded: dead peers, stalled peers, plan mismatches, bad input.

Real processes, real shared memory, real sockets. To keep process start-ups
(seconds each) few, each launch covers several cases:

- `killed`: worker:0 holds a tensor it received from worker:1 (depth 1) and
  sends to worker:1 in an endless loop; worker:1 receives a few steps, has a
  send to worker:0 blocked waiting for the held slot's credit, and SIGKILLs
  worker:0. Both of worker:1's waits must fail fast with UnavailableError.
- `mixed`: a clean transfer, a stalled peer (a recv that nothing feeds), each
  op's own timeout, and plan hash mismatches in both orders (receiver sets
  the region up first, sender first); both processes exit normally, so their
  segments must go.
- `bad_input`: one process, no peer: configuration errors, ops before the
  endpoint runs, tensors that do not fit the plan, an unknown peer task.
"""

import json

import pytest
import tf_rdma
import tf_rdma.server  # noqa: F401  (tf_rdma.server.remove_stale_segments)

from conftest import (DATA_PATH_TRANSPORTS, collect, make_cluster, run_tasks,
                      shm_segments, spawn_task, use_transport)

pytestmark = pytest.mark.timeout(300)

PEER0 = "/job:worker/task:0"
PEER1 = "/job:worker/task:1"

HELPERS = """
import signal, threading
"""


def _assert_names(error, *parts):
    assert error is not None, "expected an error, the op succeeded"
    for part in parts:
        assert part in error["message"], (part, error)


# ---------------------------------------------------------------------------
# A peer killed with SIGKILL.

KILLED = HELPERS + """
to1 = tf_rdma.Plan([tf_rdma.Transfer("a", "worker:0", "worker:1", "float32",
                                     [256])], name="killed_a", depth=2)
to0 = tf_rdma.Plan([tf_rdma.Transfer("b", "worker:1", "worker:0", "float32",
                                     [256])], name="killed_b", depth=1)
RECEIVED_BEFORE_KILL = 20
ep = start()

if task == "worker:0":
    held = tf_rdma.ops.recv(to0, "b")  # held until this process dies
    touch("pid0", str(os.getpid()))
    step = 0
    while True:  # until worker:1 kills this process
        step += 1
        tf_rdma.ops.send(tf.fill([256], float(step)), to1, "a")
else:
    result({"pid": os.getpid()})
    tf_rdma.ops.send(tf.fill([256], 1.0), to0, "b")
    blocked = {}
    def send_step_2():
        blocked["error"] = error_of(
            lambda: tf_rdma.ops.send(tf.fill([256], 2.0), to0, "b", timeout=60))
        blocked["at"] = time.monotonic()
    sender = threading.Thread(target=send_step_2)
    sender.start()
    values = [float(tf_rdma.ops.recv(to1, "a")[0])
              for _ in range(RECEIVED_BEFORE_KILL)]
    pid0 = int(wait_file("pid0"))
    time.sleep(0.5)  # send_step_2 is now waiting for worker:0's credit
    segments_while_running = segments_of()
    os.kill(pid0, signal.SIGKILL)
    killed_at = time.monotonic()
    # Steps worker:0 completed before it died may still be delivered; the
    # first recv past them must fail.
    after_kill = []
    recv_error = None
    for _ in range(10):
        try:
            after_kill.append(float(tf_rdma.ops.recv(to1, "a", timeout=60)[0]))
        except Exception as e:
            recv_error = {"type": type(e).__name__, "message": str(e),
                          "elapsed_s": time.monotonic() - killed_at}
            break
    sender.join(30)
    send_error = blocked.get("error")
    if send_error is not None:
        send_error["elapsed_s"] = blocked["at"] - killed_at
    # The dead process's segments are stale; this live one's are not.
    dead_prefix = "tfrdma.%d." % pid0
    dead_before = sorted(n for n in os.listdir("/dev/shm")
                         if n.startswith(dead_prefix))
    collected = tf_rdma.server.remove_stale_segments()
    dead_after = sorted(n for n in os.listdir("/dev/shm")
                        if n.startswith(dead_prefix))
    result({"pid": os.getpid(), "values": values, "after_kill": after_kill,
            "recv_error": recv_error, "send_error": send_error,
            "sender_thread_done": not sender.is_alive(),
            "segments_while_running": segments_while_running,
            "dead_segments_before": dead_before,
            "dead_segments_after": dead_after, "collected": collected,
            "own_segments_after_collect": segments_of()})
"""


# Peer death is seen through the pair's socket on every transport (for shm
# and verbs the socket carries only set-up, for tcp the data too), and for
# verbs also as failed completions: test each.
@pytest.fixture(scope="module", params=DATA_PATH_TRANSPORTS)
def killed(request, tmp_path_factory):
    use_transport(request.param)
    sync_dir = tmp_path_factory.mktemp("killed")
    cluster = make_cluster(2)
    env = {"TF_RDMA_TIMEOUT": "30", "TEST_SYNC_DIR": str(sync_dir),
           "TF_RDMA_TRANSPORT": request.param}
    procs = {t: spawn_task(t, KILLED, cluster, env)
             for t in ("worker:0", "worker:1")}
    try:
        out = collect(procs, timeout=120)
    finally:
        # The killed task could not remove its segments; worker:1 collects
        # them (test below). Should it have failed to, do not leave them.
        tf_rdma.server.remove_stale_segments()
    return procs, out


def test_killed_process_segments_are_collected_live_ones_kept(killed):
    _, out = killed
    r = out["worker:1"].result
    # The killed process's regions are gone: removed by the survivor when
    # it saw the connection drop (shm peers; test_faults checks that on its
    # own), or else by the explicit collection; every segment of the running
    # process stays in place.
    assert r["dead_segments_after"] == [], r
    count, nbytes = r["collected"]
    assert count >= len(r["dead_segments_before"]) and nbytes >= 4096 * count
    assert r["own_segments_after_collect"] == r["segments_while_running"]


def test_killed_sender_fails_waiting_recv(killed):
    procs, out = killed
    w0, w1 = out["worker:0"], out["worker:1"]
    assert w0.returncode == -9, w0.describe()
    assert w1.returncode == 0, w1.describe()
    r = w1.result
    assert r["values"] == [float(s) for s in range(1, 21)]
    # At most the `depth` steps already written (and one in flight when the
    # kill landed) may still arrive, and they are the next steps in order.
    assert len(r["after_kill"]) <= 3, r
    assert r["after_kill"] == [float(21 + i) for i in range(len(r["after_kill"]))]
    error = r["recv_error"]
    _assert_names(error, "'a'", PEER0,
                  f"step {21 + len(r['after_kill'])}")
    assert error["type"] == "UnavailableError", error
    assert error["elapsed_s"] < 5, error  # its timeout was 60 s


def test_killed_receiver_fails_blocked_send(killed):
    _, out = killed
    r = out["worker:1"].result
    assert r["sender_thread_done"]
    error = r["send_error"]
    _assert_names(error, "'b'", PEER0, "step 2")
    assert error["type"] == "UnavailableError", error
    assert error["elapsed_s"] < 5, error  # its timeout was 60 s


def test_survivor_removes_its_segments(killed):
    procs, out = killed
    r = out["worker:1"].result
    assert r["pid"] == procs["worker:1"].pid
    assert r["segments_while_running"], "worker:1 had no segments to remove"
    assert shm_segments(pids=[procs["worker:1"].pid]) == []


def test_a_killed_peer_is_logged_as_a_lost_connection(killed):
    _, out = killed
    assert f"lost connection {PEER0} -> {PEER1}" in out["worker:1"].stderr


# ---------------------------------------------------------------------------
# A peer that ends normally says goodbye: its survivor does not log a lost
# connection, and a wait on it fails at once saying that it stopped.

ENDED = HELPERS + """
to1 = tf_rdma.Plan([tf_rdma.Transfer("e", "worker:0", "worker:1", "float32",
                                     [64])], name="ended", depth=2)
start()
if task == "worker:0":
    tf_rdma.ops.send(tf.fill([64], 1.0), to1, "e")
    wait_file("got1")
    result({"pid": os.getpid()})  # and exits: the endpoint stops at exit
else:
    first = float(tf_rdma.ops.recv(to1, "e")[0])
    touch("got1")
    t0 = time.monotonic()
    error = error_of(lambda: tf_rdma.ops.recv(to1, "e", timeout=60).numpy())
    result({"first": first, "error": error})
"""


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_peer_that_ends_normally_says_goodbye(transport, tmp_path):
    use_transport(transport)
    out = run_tasks({"worker:0": ENDED, "worker:1": ENDED}, timeout=120,
                    env={"TEST_SYNC_DIR": str(tmp_path),
                         "TF_RDMA_TRANSPORT": transport})
    survivor = out["worker:1"]
    assert survivor.result["first"] == 1.0
    error = survivor.result["error"]
    _assert_names(error, "'e'", PEER0, f"{PEER0} stopped its endpoint")
    assert error["type"] == "UnavailableError", error
    assert error["elapsed_s"] < 10, error  # its timeout was 60 s
    assert "lost connection" not in survivor.stderr, survivor.stderr
    assert "lost connection" not in out["worker:0"].stderr


# The goodbye on a busy connection: worker:1 streams tensors to worker:0
# over tcp, whose frames keep worker:0's reader thread for that connection
# waking, and worker:0 closes its endpoint in the middle of the stream (its
# reader leaves at once; the connection must still get its goodbye).
ENDED_BUSY = HELPERS + """
to0 = tf_rdma.Plan([tf_rdma.Transfer("f", "worker:1", "worker:0", "float32",
                                     [16])], name="busy_stop", depth=16)
ep = start()
if task == "worker:0":
    got = []
    def receive():
        while True:
            try:
                got.append(float(tf_rdma.ops.recv(to0, "f", timeout=20)[0]))
            except Exception:
                return
    thread = threading.Thread(target=receive, daemon=True)
    thread.start()
    while len(got) < 300 and thread.is_alive():
        time.sleep(0.001)
    ep.close()
    thread.join(30)
    wait_file("done")
    result({"received": len(got)})
else:
    step, error = 0, None
    while error is None:
        step += 1
        error = error_of(lambda: tf_rdma.ops.send(
            tf.fill([16], float(step)), to0, "f", timeout=30))
    touch("done")
    result({"error": error, "steps": step})
"""


def test_a_busy_connection_still_gets_its_goodbye(tmp_path):
    use_transport("tcp")
    out = run_tasks({"worker:0": ENDED_BUSY, "worker:1": ENDED_BUSY},
                    timeout=120, env={"TEST_SYNC_DIR": str(tmp_path),
                                      "TF_RDMA_TRANSPORT": "tcp"})
    assert out["worker:0"].result["received"] >= 300
    sender = out["worker:1"]
    error = sender.result["error"]
    _assert_names(error, "'f'", PEER0, f"{PEER0} stopped its endpoint")
    assert error["type"] == "UnavailableError", error
    assert error["elapsed_s"] < 10, error  # its timeout was 30 s
    assert "lost connection" not in sender.stderr, sender.stderr


# ---------------------------------------------------------------------------
# A clean transfer, a stalled peer and plan hash mismatches, in one run.

def _mixed_plans():
    """Plans shared by the test and the tasks (the test checks the hashes)."""
    def plan(name, dtype):
        return tf_rdma.Plan([tf_rdma.Transfer("m", "worker:0", "worker:1",
                                              dtype, [64])], name=name)
    return {
        "first_recv_0": plan("mm_recv_first", "float32"),
        "first_recv_1": plan("mm_recv_first", "int32"),
        "first_send_0": plan("mm_send_first", "float32"),
        "first_send_1": plan("mm_send_first", "int32"),
    }


MIXED = HELPERS + """
clean = tf_rdma.Plan([tf_rdma.Transfer("c", "worker:0", "worker:1", "int64",
                                       [100])], name="clean")
stall = tf_rdma.Plan([tf_rdma.Transfer("s", "worker:0", "worker:1", "float32",
                                       [8])], name="stall")
stall2 = tf_rdma.Plan([tf_rdma.Transfer("s2", "worker:0", "worker:1",
                                        "float32", [8])], name="stall2")
plans = {k: tf_rdma.Plan.from_json(v) for k, v in
         json.loads(os.environ["TEST_PLANS"]).items()}
ep = start()
me = task[-1]

if task == "worker:0":
    for step in (1, 2, 3):
        tf_rdma.ops.send(tf.range(100, dtype=tf.int64) * step, clean, "c")
    # stall: never send "s".
    wait_file("stall_done")
    # The receiver has set region mm_recv_first up with its plan.
    wait_file("recv_first_claimed")
    zeros = tf.zeros([64], tf.float32)
    p = plans["first_recv_" + me]
    recv_first = error_of(lambda: [tf_rdma.ops.send(zeros, p, "m", timeout=3)
                                   for _ in range(3)])
    # Sender first: its first send sets the region up with its plan.
    p = plans["first_send_" + me]
    opened = error_of(lambda: tf_rdma.ops.send(zeros, p, "m", timeout=3))
    touch("send_first_opened")
    send_first = error_of(lambda: [tf_rdma.ops.send(zeros, p, "m", timeout=3)
                                   for _ in range(2)])
    wait_file("mixed_done_1")
    result({"pid": os.getpid(), "recv_first": recv_first,
            "send_first_opened": opened, "send_first": send_first,
            "segments_while_running": segments_of()})
else:
    clean_values = [tf_rdma.ops.recv(clean, "c").numpy().tolist()
                    for _ in range(3)]
    import resource
    def cpu_seconds():
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime
    cpu_before = cpu_seconds()
    stalled = error_of(lambda: tf_rdma.ops.recv(stall, "s", timeout=2))
    stalled["cpu_s"] = cpu_seconds() - cpu_before
    # Each op's own timeout counts, not the one of the slot's first op.
    timeouts = [error_of(lambda: tf_rdma.ops.recv(stall2, "s2", timeout=t))
                for t in (1, 3)]
    touch("stall_done")
    p = plans["first_recv_" + me]
    box = {}
    def recv_first_thread():
        box["error"] = error_of(lambda: tf_rdma.ops.recv(p, "m", timeout=4))
    th = threading.Thread(target=recv_first_thread)
    th.start()
    time.sleep(1.0)  # the recv has claimed its slot and set the region up
    touch("recv_first_claimed")
    th.join(30)
    p = plans["first_send_" + me]
    wait_file("send_first_opened")
    send_first = error_of(lambda: tf_rdma.ops.recv(p, "m", timeout=4))
    segments = segments_of()
    touch("mixed_done_1")
    result({"pid": os.getpid(), "clean": clean_values, "stalled": stalled,
            "timeouts": timeouts,
            "recv_first": box.get("error"), "recv_first_done": not th.is_alive(),
            "send_first": send_first, "segments_while_running": segments})
"""


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    sync_dir = tmp_path_factory.mktemp("mixed")
    plans = _mixed_plans()
    cluster = make_cluster(2)
    env = {"TF_RDMA_TIMEOUT": "20", "TEST_SYNC_DIR": str(sync_dir),
           "TEST_PLANS": json.dumps({k: p.to_json() for k, p in plans.items()})}
    procs = {t: spawn_task(t, MIXED, cluster, env)
             for t in ("worker:0", "worker:1")}
    out = collect(procs, timeout=120)
    return procs, plans, out


def test_mixed_tasks_exit_cleanly(mixed):
    _, _, out = mixed
    bad = [r for r in out.values() if r.returncode != 0]
    assert not bad, "\n".join(r.describe() for r in out.values())


def test_clean_transfer_alongside_failures(mixed):
    _, _, out = mixed
    assert out["worker:1"].result["clean"] == [
        [i * step for i in range(100)] for step in (1, 2, 3)]


def test_stalled_peer_times_out(mixed):
    _, _, out = mixed
    error = out["worker:1"].result["stalled"]
    _assert_names(error, "'s'", PEER0, "step 1")
    assert error["type"] == "DeadlineExceededError", error
    assert 1.9 <= error["elapsed_s"] <= 6, error
    # The wait slept (futex) instead of spinning: a 2 s busy wait would cost
    # about 2 s of CPU.
    assert error["cpu_s"] < 0.5, error


def test_each_op_has_its_own_timeout(mixed):
    _, _, out = mixed
    short, longer = out["worker:1"].result["timeouts"]
    _assert_names(short, "'s2'", PEER0, "step 1")
    _assert_names(longer, "'s2'", PEER0, "step 1")
    assert short["type"] == longer["type"] == "DeadlineExceededError"
    assert 0.9 <= short["elapsed_s"] <= 2.5, short
    assert 2.9 <= longer["elapsed_s"] <= 5, longer


def _check_mismatch(send_error, recv_error, hashes, limit_s):
    """Both ends fail in bounded time, each naming both plan hashes."""
    assert send_error is not None and recv_error is not None, (send_error,
                                                               recv_error)
    for error in (send_error, recv_error):
        assert error["elapsed_s"] < limit_s, error
        for h in hashes:
            assert h in error["message"], (h, error)


def test_plan_hash_mismatch_receiver_first(mixed):
    _, plans, out = mixed
    h0, h1 = plans["first_recv_0"].hash, plans["first_recv_1"].hash
    assert h0 != h1
    assert out["worker:1"].result["recv_first_done"]
    _check_mismatch(out["worker:0"].result["recv_first"],
                    out["worker:1"].result["recv_first"], (h0, h1), 12)


def test_plan_hash_mismatch_sender_first(mixed):
    _, plans, out = mixed
    h0, h1 = plans["first_send_0"].hash, plans["first_send_1"].hash
    assert h0 != h1
    r0 = out["worker:0"].result
    _check_mismatch(r0["send_first_opened"] or r0["send_first"],
                    out["worker:1"].result["send_first"], (h0, h1), 8)


def test_no_segments_left_after_clean_exit(mixed):
    procs, _, out = mixed
    pids = []
    for task, proc in procs.items():
        r = out[task].result
        assert r["pid"] == proc.pid
        assert r["segments_while_running"], f"{task} had no segments"
        pids.append(proc.pid)
    assert shm_segments(pids=pids) == []


# ---------------------------------------------------------------------------
# Bad input, one process.

BAD_INPUT = HELPERS + """
from tf_rdma.errors import ConfigError, PlanError
plan = tf_rdma.Plan([tf_rdma.Transfer("x", "worker:0", "worker:1", "float32",
                                      [4]),
                     tf_rdma.Transfer("y", "worker:1", "worker:0", "int32",
                                      [3])])
far = tf_rdma.Plan([tf_rdma.Transfer("far", "worker:0", "worker:5", "float32",
                                     [4])], name="far")
report = {}

# Configuration, checked before the endpoint starts.
secret = os.environ.pop("TF_RDMA_SECRET")
report["no_secret"] = error_of(start)
os.environ["TF_RDMA_SECRET"] = secret
os.environ["TF_RDMA_TRANSPORT"] = "bogus"
report["bogus_transport"] = error_of(start)
del os.environ["TF_RDMA_TRANSPORT"]
os.environ["TF_RDMA_TIMEOUT"] = "-1"
report["negative_timeout"] = error_of(start)
del os.environ["TF_RDMA_TIMEOUT"]
os.environ["TF_RDMA_POLL_US"] = "lots"
report["bad_poll"] = error_of(start)
del os.environ["TF_RDMA_POLL_US"]

# Ops before the endpoint runs.
report["send_before_start"] = error_of(
    lambda: tf_rdma.ops.send(tf.zeros([4]), plan, "x", timeout=2))
report["recv_before_start"] = error_of(
    lambda: tf_rdma.ops.recv(plan, "y", timeout=2))

start()
report["wrong_dtype"] = error_of(
    lambda: tf_rdma.ops.send(tf.zeros([4], tf.int32), plan, "x", timeout=2))
report["wrong_shape"] = error_of(
    lambda: tf_rdma.ops.send(tf.zeros([5]), plan, "x", timeout=2))
report["unknown_key_send"] = error_of(
    lambda: tf_rdma.ops.send(tf.zeros([4]), plan, "nope", timeout=2))
report["unknown_key_recv"] = error_of(
    lambda: tf_rdma.ops.recv(plan, "nope", timeout=2))
# The kernel's own check, past the Python wrapper.
slot = plan.slot("x")
report["kernel_wrong_shape"] = error_of(
    lambda: tf_rdma.ops.raw_ops().tf_rdma_send(
        tf.zeros([5]), tensor_name="x", peer=slot.dst, region=slot.region,
        plan_hash=plan.hash, region_bytes=slot.region_bytes,
        credit_bytes=slot.credit_bytes, offset=slot.offset,
        stride=slot.stride, depth=slot.depth,
        credit_index=slot.credit_index, shape=list(slot.shape),
        timeout_ms=2000))
# A slot that does not fit its region (as a hand-made or corrupt plan could say).
report["region_too_small"] = error_of(
    lambda: tf_rdma.ops.raw_ops().tf_rdma_send(
        tf.zeros([4]), tensor_name="x", peer=slot.dst, region=slot.region,
        plan_hash=plan.hash, region_bytes=4096,
        credit_bytes=slot.credit_bytes, offset=4096 - 64,
        stride=slot.stride, depth=slot.depth,
        credit_index=slot.credit_index, shape=list(slot.shape),
        timeout_ms=2000))
# Copies whose span wraps past 2**64 (64 x 2**58 bytes): checked
# arithmetic refuses them (the unchecked sum used to wrap to a small end and
# let recvs read from beyond the region).
report["span_wraps"] = error_of(
    lambda: tf_rdma.ops.raw_ops().tf_rdma_recv(
        dtype=tf.float32, tensor_name="y", peer=slot.dst, region=slot.region,
        plan_hash=plan.hash, region_bytes=4096,
        credit_bytes=slot.credit_bytes, offset=0, stride=1 << 58, depth=64,
        credit_index=0, shape=[4], timeout_ms=2000))
report["unknown_peer"] = error_of(
    lambda: tf_rdma.ops.send(tf.zeros([4]), far, "far", timeout=2))
result(report)
"""


@pytest.fixture(scope="module")
def bad_input(tmp_path_factory):
    sync_dir = tmp_path_factory.mktemp("bad_input")
    out = run_tasks({"worker:0": BAD_INPUT}, cluster=make_cluster(2),
                    env={"TEST_SYNC_DIR": str(sync_dir)}, timeout=90)
    return out["worker:0"].result


def test_config_errors(bad_input):
    error = bad_input["no_secret"]
    assert error is not None and error["type"] == "ConfigError", error
    assert "TF_RDMA_SECRET" in error["message"], error
    error = bad_input["bogus_transport"]
    assert error is not None and error["type"] == "ConfigError", error
    assert "bogus" in error["message"], error
    error = bad_input["negative_timeout"]
    assert error is not None and error["type"] == "ConfigError", error
    assert "-1" in error["message"], error
    error = bad_input["bad_poll"]
    assert error is not None and error["type"] == "ConfigError", error
    assert "TF_RDMA_POLL_US" in error["message"] and "lots" in error["message"]
    for case in ("no_secret", "bogus_transport", "negative_timeout", "bad_poll"):
        assert "ValueError" in bad_input[case]["mro"], bad_input[case]


def test_ops_before_the_endpoint_runs(bad_input):
    for case in ("send_before_start", "recv_before_start"):
        error = bad_input[case]
        assert error is not None, case
        assert error["type"] == "FailedPreconditionError", error
        assert "not running" in error["message"], error
        assert error["elapsed_s"] < 2, error


def test_tensor_that_does_not_fit_the_plan(bad_input):
    error = bad_input["wrong_dtype"]
    _assert_names(error, "int32", "float32", "'x'")
    assert error["type"] == "PlanError", error
    error = bad_input["wrong_shape"]
    _assert_names(error, "5", "[4]", "'x'")
    assert error["type"] == "PlanError", error
    for case in ("unknown_key_send", "unknown_key_recv"):
        error = bad_input[case]
        _assert_names(error, "'nope'")
        assert error["type"] == "PlanError", error
    error = bad_input["kernel_wrong_shape"]
    _assert_names(error, "'x'", "[5]", "[4]")
    assert error["type"] == "InvalidArgumentError", error


def test_unknown_peer_task(bad_input):
    error = bad_input["unknown_peer"]
    _assert_names(error, "unknown peer task", "/job:worker/task:5", "'far'")
    assert error["type"] == "InvalidArgumentError", error
    assert error["elapsed_s"] < 2, error


def test_region_too_small(bad_input):
    error = bad_input["region_too_small"]
    _assert_names(error, "'x'", "region too small", "4096")
    assert error["type"] == "InvalidArgumentError", error
    error = bad_input["span_wraps"]
    _assert_names(error, "'y'", "64 copies of 288230376151711744 bytes",
                  "region too small")
    assert error["type"] == "InvalidArgumentError", error


# ---------------------------------------------------------------------------
# A write the receiving NIC refuses (softnic's TF_RDMA_SOFTNIC_CORRUPT_RKEY:
# the sender's first RDMA WRITE carries a key no region has). The cause must
# be named, not only "connection lost".

REFUSED_WRITE = """
ep = start()
plan = tf_rdma.Plan([tf_rdma.Transfer("w", "worker:0", "worker:1", "float32", [1024])],
                    name="refused", depth=2)
if task == "worker:0":
    result({"send": error_of(lambda: [tf_rdma.ops.send(tf.fill([1024], float(i)), plan, "w",
                                                       timeout=20) for i in range(3)])})
else:
    result({"recv": error_of(lambda: [tf_rdma.ops.recv(plan, "w", timeout=20)
                                      for _ in range(3)])})
"""


def test_refused_rdma_write_names_the_cause():
    from conftest import verbs_missing  # pylint: disable=import-outside-toplevel

    use_transport("verbs")
    if verbs_missing() is None:
        pytest.skip("softnic's fault knob: on an RDMA host the write is not corrupted")
    cluster = make_cluster(2)
    env = {"TF_RDMA_TIMEOUT": "20", "TF_RDMA_TRANSPORT": "verbs"}
    procs = {"worker:0": spawn_task("worker:0", REFUSED_WRITE, cluster,
                                    dict(env, TF_RDMA_SOFTNIC_CORRUPT_RKEY="1")),
             "worker:1": spawn_task("worker:1", REFUSED_WRITE, cluster, env)}
    out = collect(procs, timeout=120)
    send = out["worker:0"].result["send"]
    recv = out["worker:1"].result["recv"]
    _assert_names(send, "'w'", PEER1)
    _assert_names(recv, "'w'", PEER0)
    assert send["type"] == recv["type"] == "UnavailableError", (send, recv)
    # The cause reaches at least one end, whichever learns of it first: the
    # writer from its completion (remote access error), the receiver from its
    # NIC's async event (access violation). The other end may see only the
    # closed connection: the writer when the receiver's close flushed its
    # write before the NAK was read, the receiver when the writer's close
    # came before its event (docs/verbs.md, Failures).
    assert ("remote access error" in send["message"]
            or "access violation" in recv["message"]), (send, recv)
