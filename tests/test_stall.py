"""The stall inspector (TF_RDMA_STALL_WARNING; kernels/engine/stall.cc).

A wait longer than the warning logs one line per stalled slot naming the
tensor or collective, this task's step, the peer and the peer's own
position (asked over the control connection, or what this side knows when
the peer does not answer); a timeout's error carries the same facts.

- `test_stopped_sender_on_the_op_path`: 2 workers exchange a tensor and an
  ack per step; the receiver SIGSTOPs the sender for STOP_S at a known step:
  its stderr has the stall line naming the tensor, its step, the sender, and
  the sender's last written step (learnt locally: a stopped peer does not
  answer); after SIGCONT every step's values are right.
- `test_stopped_sender_under_a_rewritten_function`: a client calls a
  rewritten function on two `tf_rdma.server`s and stops worker:0 (the
  sender) for STOP_S before a call: worker:1's line names the tensor's key,
  the call, worker:0 as not answering and its last write (the step of the
  3 warm-up calls); the calls return exact values.
- `test_stopped_worker_in_an_allreduce`: 3 workers run allreduces; worker 0
  SIGSTOPs worker 2 for STOP_S: another worker's line names the collective,
  its step and either a peer that answered and itself waits for worker 2 (a
  chain) or worker 2 as not answering; the results equal numpy's sums.
- `test_timeouts_carry_the_peer_position`: with TF_RDMA_TIMEOUT=3 a recv
  whose sender stopped after 2 steps, a send whose reader holds the copy it
  needs, and an allreduce the peer never joins fail with the peer's answer
  in the error.
- `test_setting_is_checked`: bad TF_RDMA_STALL_WARNING values are errors
  naming the value (fast, no processes).

The STOP_S stops are longer than the warning (1 s) plus one watchdog scan
(0.25 s) plus the bounded question to the stopped peer (1 s).
"""

import re
import tempfile

import pytest

from conftest import (REWRITE_CLIENT, base_env, make_cluster, run_rewrite_client,
                      run_tasks)
from tf_rdma import settings
from tf_rdma.errors import ConfigError

STOP_S = 3.0
A, B = "/job:worker/task:0", "/job:worker/task:1"
STALL_ENV = {"TF_RDMA_STALL_WARNING": "1", "TF_RDMA_TIMEOUT": "30"}

# Stops `pid` for `seconds` from a process of its own (so that neither the
# stopped task nor the GIL of the one that asks holds the SIGCONT back).
STOPPER = """
import subprocess
def stop_for(pid, seconds):
    subprocess.Popen([sys.executable, "-c",
                      "import os, signal, time; os.kill(%d, signal.SIGSTOP); "
                      "time.sleep(%f); os.kill(%d, signal.SIGCONT)"
                      % (pid, seconds, pid)])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # until it is stopped
        with open("/proc/%d/stat" % pid) as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        time.sleep(0.01)
    raise TimeoutError("task %d was not stopped" % pid)
"""


def stall_lines(stderr):
    return [line for line in stderr.splitlines() if "stall: " in line]


OPS_PROGRAM = STOPPER + """
A, B = "/job:worker/task:0", "/job:worker/task:1"
from tf_rdma.cluster import canonical_task
me = canonical_task(task)
plan = tf_rdma.Plan([tf_rdma.Transfer("x", A, B, "float32", [64]),
                     tf_rdma.Transfer("ack", B, A, "int32", [1])], name="stall")
start()
touch("pid_" + me[-1], str(os.getpid()))
bad = []
for step in range(1, STEPS + 1):
    if me == A:
        tf_rdma.ops.send(tf.fill([64], float(step)), plan, "x")
        tf_rdma.ops.recv(plan, "ack").numpy()
    else:
        x = tf_rdma.ops.recv(plan, "x").numpy()
        if not (x == step).all():
            bad.append([step, x.tolist()[:3]])
        del x
        if step == STOP_AT:
            # The sender now waits for this step's ack: stopped there, it
            # has written step STOP_AT and not STOP_AT + 1.
            stop_for(int(wait_file("pid_0")), STOP_S)
        tf_rdma.ops.send(tf.constant([step]), plan, "ack")
result({"bad": bad})
"""


@pytest.mark.timeout(120)
def test_stopped_sender_on_the_op_path():
    constants = dict(STEPS=8, STOP_AT=5, STOP_S=STOP_S)
    program = "".join(f"{k} = {v!r}\n" for k, v in constants.items()) + OPS_PROGRAM
    with tempfile.TemporaryDirectory() as sync:
        out = run_tasks({A: program, B: program}, cluster=make_cluster(2),
                        env=dict(STALL_ENV, TEST_SYNC_DIR=sync), timeout=100)
    assert out[B].result == {"bad": []}, out[B].describe()
    lines = stall_lines(out[B].stderr)
    wanted = [line for line in lines
              if "recv of tensor 'x' step 6 waits" in line and
              f"for its data from {A}, which does not answer" in line and
              "the last it wrote here was step 5" in line]
    assert wanted, out[B].describe()
    assert lines[0].startswith(f"tf_rdma[{B}]: stall: "), lines
    print("\n".join(lines))


# A rewritten function's client: the servers' pids come in TEST_SERVER_PIDS.
# After warm-up calls it stops worker:0 (the sender) and makes one call: the
# call's part on worker:1 waits for the tensor, then runs on after SIGCONT.
STALLED_CALL = REWRITE_CLIENT + STOPPER + """
exact = [exact_call() for _ in range(3)]
stop_for(int(os.environ["TEST_SERVER_PIDS"].split()[0]), STOP_S)
exact += [exact_call() for _ in range(2)]
print("RESULT " + json.dumps({"exact": exact,
                              "key": fn.plan.transfers[0].key}), flush=True)
"""


@pytest.mark.timeout(150)
def test_stopped_sender_under_a_rewritten_function():
    """The rewrite path: worker:1's part of a call waits for a tensor from a
    stopped worker:0; its line names the tensor's key, the call, the sender
    as not answering; after SIGCONT the calls return exact values."""
    program = (f"STOP_S = {STOP_S!r}\nELEMENTS = 64\nREWRITE_TIMEOUT = 30\n"
               + STALLED_CALL)
    result, logs = run_rewrite_client(program, base_env(STALL_ENV))
    assert result["exact"] == [True] * 5, result
    key = result["key"]
    lines = stall_lines(logs[1][1])
    wanted = [line for line in lines
              if f"recv of tensor '{key}'" in line and
              f"for its data from {A}, which does not answer" in line and
              # the 3 warm-up calls: its slot's step, learnt locally
              "(its step 3 on this slot)" in line]
    assert wanted, "\n".join(lines) or logs[1][1][-3000:]
    assert lines[0].startswith(f"tf_rdma[{B}]: stall: "), lines
    print("\n".join(lines))


COLLECTIVE_PROGRAM = STOPPER + """
from tf_rdma import collectives as C
from tf_rdma.cluster import canonical_task
me = int(canonical_task(task)[-1])
start()
touch("pid_%d" % me, str(os.getpid()))
bad = []
for call in range(1, CALLS + 1):
    if me == 0 and call == STOP_AT:
        stop_for(int(wait_file("pid_2")), STOP_S)
    xs = [np.arange(N, dtype=np.float32) * (r + 1) + call for r in range(3)]
    y = C.all_reduce(tf.constant(xs[me]), algorithm="ring", block_bytes=1024,
                     name="grads/bucket3").numpy()
    if not np.array_equal(y, sum(xs)):
        bad.append(call)
result({"bad": bad})
"""


@pytest.mark.timeout(120)
def test_stopped_worker_in_an_allreduce():
    constants = dict(CALLS=8, STOP_AT=5, STOP_S=STOP_S, N=2000)
    program = ("".join(f"{k} = {v!r}\n" for k, v in constants.items()) +
               COLLECTIVE_PROGRAM)
    tasks = [f"/job:worker/task:{i}" for i in range(3)]
    with tempfile.TemporaryDirectory() as sync:
        out = run_tasks({t: program for t in tasks}, cluster=make_cluster(3),
                        env=dict(STALL_ENV, TEST_SYNC_DIR=sync), timeout=100)
    for t in tasks:
        assert out[t].result == {"bad": []}, out[t].describe()
    stopped = tasks[2]
    lines = [line for t in tasks[:2] for line in stall_lines(out[t].stderr)]
    pattern = re.compile(r"stall: allreduce 'grads/bucket3' step (\d+) waits "
                         r"[\d.]+ s for ")
    named = [line for line in lines if pattern.search(line)]
    assert named, "\n".join(out[t].describe() for t in tasks)
    assert all(int(pattern.search(line).group(1)) >= 5 for line in named), named
    chain = [line for line in named
             if "itself waits: allreduce 'grads/bucket3'" in line and
             stopped in line.split("itself waits:")[1]]
    silent = [line for line in named
              if f"{stopped}, which does not answer" in line]
    assert chain or silent, named
    print("\n".join(named))


TIMEOUT_PROGRAM = """
A, B = "/job:worker/task:0", "/job:worker/task:1"
from tf_rdma import collectives as C
from tf_rdma.cluster import canonical_task
me = canonical_task(task)
plan = tf_rdma.Plan([tf_rdma.Transfer("x", A, B, "float32", [16])], name="late")
held = tf_rdma.Plan([tf_rdma.Transfer("h", A, B, "float32", [16])], name="held",
                    depth=1)
start(timeout=3)
if me == A:
    for step in range(2):
        tf_rdma.ops.send(tf.zeros([16]), plan, "x")
    tf_rdma.ops.send(tf.zeros([16]), held, "h")
    wait_file("held")
    # B holds step 1 of the depth-1 slot: step 2 waits for its credit.
    send = error_of(lambda: tf_rdma.ops.send(tf.ones([16]), held, "h"))
    result({"send": send})
    wait_file("done")          # alive and answering, never sends x's step 3
else:
    for step in range(2):
        tf_rdma.ops.recv(plan, "x").numpy()
    h = tf_rdma.ops.recv(held, "h")
    touch("held")
    recv = error_of(lambda: tf_rdma.ops.recv(plan, "x").numpy())
    coll = error_of(lambda: C.all_reduce(tf.ones([100]), algorithm="ring",
                                         block_bytes=256, name="never"))
    touch("done")
    result({"recv": recv, "collective": coll})
"""


@pytest.mark.timeout(120)
def test_timeouts_carry_the_peer_position():
    with tempfile.TemporaryDirectory() as sync:
        out = run_tasks({A: TIMEOUT_PROGRAM, B: TIMEOUT_PROGRAM},
                        cluster=make_cluster(2),
                        env={"TEST_SYNC_DIR": sync}, timeout=100)
    got = out[B].result
    recv = got["recv"]
    assert recv and "DeadlineExceeded" in recv["type"], got
    assert "tensor 'x' (peer /job:worker/task:0 on 127.0.0.1, step 3)" in recv["message"], recv
    assert (f"waiting for the data; {A} has written step 2 of it and is not "
            "waiting to send it") in recv["message"], recv
    coll = got["collective"]
    assert coll and "DeadlineExceeded" in coll["type"], got
    assert "allreduce 'never'" in coll["message"], coll
    assert f"{A} has not started this collective" in coll["message"], coll
    send = out[A].result["send"]
    assert send and "DeadlineExceeded" in send["type"], send
    assert "tensor 'h' (peer /job:worker/task:1 on 127.0.0.1, step 2)" in send["message"], send
    assert (f"release the slot it used at step 1; {B} has taken step 1 of it "
            "and is not waiting for it") in send["message"], send
    print(recv["message"], coll["message"], send["message"], sep="\n")


ABSENT_PEER_PROGRAM = """
A, B = "/job:worker/task:0", "/job:worker/task:1"
plan = tf_rdma.Plan([tf_rdma.Transfer("x", A, B, "float32", [16])], name="absent")
start()
result({"send": error_of(lambda: tf_rdma.ops.send(tf.zeros([16]), plan, "x"))})
"""


@pytest.mark.timeout(120)
def test_a_send_to_a_peer_that_never_starts():
    """worker:1 never runs: worker:0's send keeps dialling it. The stall
    inspector names the send, its step and the peer it cannot connect to
    while that lasts; the send fails at its timeout."""
    out = run_tasks({A: ABSENT_PEER_PROGRAM}, cluster=make_cluster(2),
                    env={"TF_RDMA_STALL_WARNING": "1", "TF_RDMA_TIMEOUT": "4"},
                    timeout=100)
    send = out[A].result["send"]
    assert send and "DeadlineExceeded" in send["type"], send
    lines = stall_lines(out[A].stderr)
    wanted = [line for line in lines
              if "stall: send of tensor 'x' step 1 waits" in line and
              f"to connect to {B} and open its region there, which has not "
              "accepted a connection from this side yet (not started, or not "
              "reachable at its address)" in line]
    assert wanted, out[A].describe()
    print(wanted[0])


@pytest.mark.fast
@pytest.mark.parametrize("raw", ["-1", "soon", "nan", "inf", "1e9"])
def test_setting_is_checked(raw):
    with pytest.raises(ConfigError) as info:
        settings.stall_warning_seconds(env={"TF_RDMA_STALL_WARNING": raw})
    assert "TF_RDMA_STALL_WARNING" in str(info.value)
    assert repr(raw) in str(info.value)


@pytest.mark.fast
def test_setting_values():
    assert settings.stall_warning_seconds(env={}) == 10.0
    assert settings.stall_warning_seconds(env={"TF_RDMA_STALL_WARNING": "0"}) == 0
    assert settings.stall_warning_seconds(
        env={"TF_RDMA_STALL_WARNING": "0.5"}) == 0.5
    assert settings.stall_warning_seconds(2, env={}) == 2.0


COST = r"""
from tf_rdma import _loader
bench = _loader.load().c.tfrdma_stall_bench
runs = [bench(200_000) / 200_000 for _ in range(5)]
result({"ns": runs})
"""


@pytest.mark.timeout(120)
def test_registration_cost():
    """What a wait that sleeps pays to be watched: a registration and its
    end, in a loop in one process (thread CPU time). A transfer that does
    not wait pays nothing."""
    import statistics
    out = run_tasks({A: COST}, cluster=make_cluster(1), timeout=100)
    runs = out[A].result["ns"]
    median = statistics.median(runs)
    print(f"stall registration: {median:.0f} ns per wait (runs {runs})")
    # A mutex, an allocation and a push, then a mutex and a pop: well under
    # a microsecond; 2 us leaves room for a busy machine.
    assert median < 2000, runs
