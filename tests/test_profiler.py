"""tf_rdma in TensorFlow's profiler: the trace the profiler writes holds
tf_rdma's ops and their phases (kernels/common/trace.h, docs/observability.md).

Two real processes over shared memory: worker:0 sends ``ping`` to worker:1,
which answers ``pong`` (ping + 0.5), then both run a ring allreduce. After
warm-up steps (connections, regions) worker:0 captures a profile with
``tf.profiler.experimental.start(logdir)`` ... ``stop()`` around a few more
steps, one of them with tf_rdma's events switched off
(``tfrdma_trace_events``). The test reads the XPlane file the profiler wrote
under ``logdir/plugins/profile`` with the proto that TensorFlow ships
(``tensorflow.tsl.profiler.protobuf.xplane_pb2``) and checks the tf_rdma
events in it: their names (ops and phases), each event's key, bytes, peer and
step, that the phases lie inside their op, and that only the steps with the
events on are there. Nothing here looks at a picture.

The same worker:0 then times the trace check and the recording of one event
in a loop (``tfrdma_trace_bench``, thread CPU time) against the budget
(docs/observability.md, "Cost": "nothing measurable" off, under 1 us per
event on). What the events add to a profiled hop between two processes is
measured by bench/trace_cost.py, not here.
"""

import statistics

import pytest

from conftest import inside, make_cluster, named, read_xplane_events, run_tasks

pytestmark = pytest.mark.timeout(300)

ELEMENTS = 1024          # float32: 4 KiB per ping and pong
COLL_ELEMENTS = 4096     # float32: 16 KiB allreduced
BLOCK = 4096             # bytes: the ring moves 2 chunks of 2 blocks
INSTANCE = "grads/bucket#0"  # '#' is TraceMe syntax: it travels percent-encoded
WARMUP = 2
STEPS = 3                # profiled steps with tf_rdma's events on
QUIET = WARMUP + 2       # one more profiled step, tf_rdma's events off
BENCH_OFF_RUNS, BENCH_OFF_CHECKS = 7, 1_000_000  # the loop, tracing off
BENCH_ON_RUNS, BENCH_ON_EVENTS = 5, 4_000        # and within a session
SENDER_TASK = "/job:worker/task:0"
ECHO_TASK = "/job:worker/task:1"

PROGRAM = r"""
SENDER, ECHO = "worker:0", "worker:1"
ping = tf_rdma.Plan([tf_rdma.Transfer("ping", SENDER, ECHO, "float32",
                                      [ELEMENTS])], name="ping")
pong = tf_rdma.Plan([tf_rdma.Transfer("pong", ECHO, SENDER, "float32",
                                      [ELEMENTS])], name="pong")
start()
from tf_rdma import _loader
from tf_rdma import collectives as C

def one_step(step):
    ok = True
    if task == SENDER:
        tf_rdma.ops.send(tf.fill([ELEMENTS], float(step)), ping, "ping")
        y = tf_rdma.ops.recv(pong, "pong")
        ok = float(y.numpy()[0]) == step + 0.5
        del y  # the slot goes back to worker:1: a release
    else:
        x = tf_rdma.ops.recv(ping, "ping")
        tf_rdma.ops.send(x + 0.5, pong, "pong")
        del x
    z = C.all_reduce(tf.fill([COLL_ELEMENTS], float(step)), algorithm="ring",
                     name=INSTANCE, block_bytes=BLOCK)
    return ok and float(z.numpy()[-1]) == 2.0 * step

good = [one_step(s) for s in range(1, WARMUP + 1)]
events = _loader.load().c.tfrdma_trace_events
if task == SENDER:
    tf.profiler.experimental.start(LOGDIR)
for s in range(WARMUP + 1, WARMUP + STEPS + 2):
    if task == SENDER:
        events(0 if s == QUIET else 1)
    good.append(one_step(s))
if task == SENDER:
    tf.profiler.experimental.stop()
    # The trace check and one event, timed in a loop (this thread's CPU time).
    bench = _loader.load().c.tfrdma_trace_bench
    off = [bench(BENCH_OFF_CHECKS) / BENCH_OFF_CHECKS
           for _ in range(BENCH_OFF_RUNS)]
    tf.profiler.experimental.start(BENCH_LOGDIR)
    on = [bench(BENCH_ON_EVENTS) / BENCH_ON_EVENTS for _ in range(BENCH_ON_RUNS)]
    tf.profiler.experimental.stop()
    result({"good": good, "off_ns": off, "on_ns": on})
else:
    result({"good": good})
"""


@pytest.fixture(scope="module")
def profile_run(tmp_path_factory):
    """The two tasks' run: {"events": the profile's host-plane events,
    "bench": worker:0's loop timings, "bench_events": their profile's}."""
    logdir = str(tmp_path_factory.mktemp("profile"))
    bench_logdir = str(tmp_path_factory.mktemp("bench"))
    constants = dict(ELEMENTS=ELEMENTS, COLL_ELEMENTS=COLL_ELEMENTS,
                     BLOCK=BLOCK, INSTANCE=INSTANCE, WARMUP=WARMUP,
                     STEPS=STEPS, QUIET=QUIET, LOGDIR=logdir,
                     BENCH_LOGDIR=bench_logdir, BENCH_OFF_RUNS=BENCH_OFF_RUNS,
                     BENCH_OFF_CHECKS=BENCH_OFF_CHECKS,
                     BENCH_ON_RUNS=BENCH_ON_RUNS,
                     BENCH_ON_EVENTS=BENCH_ON_EVENTS)
    program = "".join(f"{k} = {v!r}\n" for k, v in constants.items()) + PROGRAM
    out = run_tasks({"worker:0": program, "worker:1": program},
                    cluster=make_cluster(2),
                    env={"TF_RDMA_TRANSPORT": "shm", "TF_RDMA_TIMEOUT": "60"},
                    timeout=240)
    for task, res in out.items():
        assert res.result["good"] == [True] * (WARMUP + STEPS + 1), (
            f"{task} computed wrong values: {res.result}")
    return {"events": read_xplane_events(logdir, prefix="tf_rdma."),
            "bench": out["worker:0"].result,
            "bench_events": read_xplane_events(bench_logdir, prefix="tf_rdma.")}


@pytest.fixture(scope="module")
def profile(profile_run):
    return profile_run["events"]


#: The steps within the session with tf_rdma's events on.
PROFILED_STEPS = set(range(WARMUP + 1, WARMUP + STEPS + 2)) - {QUIET}


def test_send_and_its_phases(profile):
    sends = named(profile, "tf_rdma.send", "ping")
    assert {e["stats"]["step"] for e in sends} == PROFILED_STEPS, sends
    for e in sends:
        assert e["stats"]["bytes"] == 4 * ELEMENTS, e
        assert e["stats"]["peer"] == ECHO_TASK, e
    for phase in ("tf_rdma.credit_wait", "tf_rdma.write"):
        found = named(profile, phase, "ping")
        assert {e["stats"]["step"] for e in found} == PROFILED_STEPS, (
            phase, found)
        for e in found:
            op = [s for s in sends if s["stats"]["step"] == e["stats"]["step"]]
            assert inside(e, op[0]), (phase, e, op[0])
            assert e["stats"]["bytes"] == 4 * ELEMENTS, e
            assert e["stats"]["peer"] == ECHO_TASK, e
    # The write follows the credit wait.
    for step in PROFILED_STEPS:
        wait = [e for e in named(profile, "tf_rdma.credit_wait", "ping")
                if e["stats"]["step"] == step][0]
        write = [e for e in named(profile, "tf_rdma.write", "ping")
                 if e["stats"]["step"] == step][0]
        assert write["start_ps"] >= wait["end_ps"] - 1_000_000, (wait, write)


def test_recv_data_wait_and_release(profile):
    recvs = named(profile, "tf_rdma.recv", "pong")
    assert {e["stats"]["step"] for e in recvs} == PROFILED_STEPS, recvs
    for e in recvs:
        assert e["stats"]["bytes"] == 4 * ELEMENTS, e
        assert e["stats"]["peer"] == ECHO_TASK, e
    waits = named(profile, "tf_rdma.data_wait", "pong")
    assert {e["stats"]["step"] for e in waits} == PROFILED_STEPS, waits
    for e in waits:
        op = [r for r in recvs if r["stats"]["step"] == e["stats"]["step"]][0]
        assert inside(e, op), (e, op)
    # The tensor was dropped within the session: its slot went back.
    releases = named(profile, "tf_rdma.release", "pong")
    assert {e["stats"]["step"] for e in releases} == PROFILED_STEPS, releases
    for e in releases:
        op = [r for r in recvs if r["stats"]["step"] == e["stats"]["step"]][0]
        assert e["start_ps"] >= op["end_ps"] - 1_000_000, (e, op)
        assert e["stats"]["peer"] == ECHO_TASK, e


def test_collective_and_its_phases(profile):
    calls = named(profile, "tf_rdma.collective", INSTANCE)
    assert {e["stats"]["step"] for e in calls} == PROFILED_STEPS, (
        calls, sorted({e["name"] for e in profile if "tf_rdma" in e["name"]}))
    for e in calls:
        assert e["stats"]["kind"] == "allreduce", e
        assert e["stats"]["algorithm"] == "ring", e
        assert e["stats"]["bytes"] == 4 * COLL_ELEMENTS, e
        assert e["stats"]["peer"] == f"{SENDER_TASK} {ECHO_TASK}", e
    # Ring on 2 ranks, chunks of 8 KiB = 2 blocks: the reduce-scatter sends
    # one chunk and reduces the other where it landed, the allgather sends
    # the reduced chunk and copies the other out; every block received is
    # released. Per call: 4 blocks sent, 4 received, 2 reduced, 2 copied.
    per_call = {"tf_rdma.credit_wait": 4, "tf_rdma.write": 4,
                "tf_rdma.data_wait": 4, "tf_rdma.reduce": 2,
                "tf_rdma.copy": 2, "tf_rdma.release": 4}
    for phase, count in per_call.items():
        found = named(profile, phase, INSTANCE)
        assert len(found) == count * STEPS, (phase, len(found), found[:3])
        for e in found:
            assert e["stats"]["peer"] == ECHO_TASK, e
            assert e["stats"]["bytes"] == BLOCK, e
            assert any(inside(e, c) for c in calls), (phase, e)


def test_only_profiled_steps_are_traced(profile):
    """Neither the warm-up steps before the session nor the step within it
    with tf_rdma's events switched off (tfrdma_trace_events(0)) left an
    event; the steps after it (switched on again) did."""
    steps = {e["stats"]["step"] for e in profile
             if e["name"] in ("tf_rdma.send", "tf_rdma.recv",
                              "tf_rdma.collective")}
    assert steps == PROFILED_STEPS, steps



def test_trace_cost_per_event(profile_run):
    """The trace check and one event, in a loop: within the budget."""
    res = profile_run["bench"]
    off = statistics.median(res["off_ns"])
    on = statistics.median(res["on_ns"])
    print(f"trace cost: off {off:.2f} ns per check, on {on:.0f} ns per event "
          f"(runs off {res['off_ns']}, on {res['on_ns']})")
    # Off: two loads and a branch (about a nanosecond); 10 ns leaves room
    # for a busy machine and still fails if the check took a clock or a lock.
    assert off < 10, f"tracing off costs {off:.2f} ns per check, expected < 10"
    # On: the budget.
    assert on < 1000, f"tracing on costs {on:.0f} ns per event, expected < 1000"
    # The events were recorded (the on-runs did record, not skip).
    events = profile_run["bench_events"]
    assert (len(named(events, "tf_rdma.write", "bench/tensor:0")) ==
            BENCH_ON_RUNS * BENCH_ON_EVENTS)
