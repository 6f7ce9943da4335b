"""Profiling a rewritten function on the workers that run it.

A rewritten function's sends and recvs run in the worker servers, not in
the client, so the client's own ``tf.profiler.experimental.start`` does not
see them. Every tf_rdma server is a TensorFlow gRPC server, which hosts
TensorFlow's profiler service: ``tf.profiler.experimental.client.trace``
(or TensorBoard's "Capture profile") records a worker while the client
runs steps (docs/observability.md, "Profiling the workers").

Two real `python -m tf_rdma.server` processes over shared memory; a client
runs a rewritten step (worker:0 computes 4 KiB, worker:1 consumes it) in a
loop and traces each worker in turn. The test reads each worker's XPlane:
worker:0 holds the transfer's tf_rdma.send with its credit wait and write,
worker:1 its tf_rdma.recv with the data wait and the release, under the
key the plan gives the edge, with its bytes and the other worker as peer.
Both are traced at once, so they share calls: a call carries one id on both
sides (the rewrite matches calls). `fn.explain(measured=True)` then shows
what the traced calls took on each worker (kernels/common/recent.h, asked
with the TfRdmaReport op), and a worker's counters reach the client the same
way. The client's results stay exact.
"""

import glob
import os
import shutil

import pytest

from conftest import (REWRITE_CLIENT, base_env, inside, named, read_xplane_events,
                      run_rewrite_client)

pytestmark = pytest.mark.timeout(240)

W0, W1 = "/job:worker/task:0", "/job:worker/task:1"
ELEMENTS = 1024  # float32: 4 KiB

CLIENT = REWRITE_CLIENT + r"""
exact = [exact_call() for _ in range(3)]
untraced = fn.explain(file=open(os.devnull, "w"), measured=True)
stop = threading.Event()

def loop():
    while not stop.is_set():
        exact.append(exact_call())

runner = threading.Thread(target=loop)
runner.start()
try:  # both workers at once: one .xplane.pb per worker
    tf.profiler.experimental.client.trace(
        ",".join("grpc://" + a for a in cluster["worker"]), LOGDIR, 1500)
finally:
    stop.set()
    runner.join()
from tf_rdma import measured
explained = fn.explain(file=open(os.devnull, "w"), measured=True, last=10)
key = fn.plan.transfers[0].key
print("RESULT " + json.dumps({
    "keys": [t.key for t in fn.plan.transfers], "calls": len(exact),
    "exact": all(exact), "explained": explained, "untraced": untraced,
    "workers": cluster["worker"],
    "send": measured.summarize(
        measured.task_report("recent", W0)["keys"].get(key, []), "send", 10),
    "recv": measured.summarize(
        measured.task_report("recent", W1)["keys"].get(key, []), "recv", 10),
    "stats": measured.task_report("stats", W1)}), flush=True)
"""


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    logdir = str(tmp_path_factory.mktemp("cluster-profile"))
    env = base_env({"TF_RDMA_TRANSPORT": "shm", "TF_RDMA_TIMEOUT": "60"})
    program = (f"LOGDIR = {logdir!r}\nELEMENTS = {ELEMENTS}\n"
               f"REWRITE_TIMEOUT = 60\n" + CLIENT)
    result, _ = run_rewrite_client(program, env, timeout=180)
    assert result["exact"], result
    assert result["keys"], result
    return (result,) + tuple(worker_events(logdir, address)
                             for address in result["workers"])


def worker_events(logdir, address):
    """The events of the one worker at `address` (its file is named
    host_port.xplane.pb), read with conftest's reader."""
    host, port = address.rsplit(":", 1)
    paths = glob.glob(os.path.join(logdir, "plugins", "profile", "*",
                                   f"{host}_{port}.xplane.pb"))
    assert len(paths) == 1, (address, os.listdir(logdir))
    alone = os.path.join(logdir, port, "plugins", "profile", "run")
    os.makedirs(alone)
    shutil.copy(paths[0], alone)
    return read_xplane_events(os.path.join(logdir, port), prefix="tf_rdma.")


# Per side: the worker's trace (its index in `traces`), its peer, the phases
# inside the op, the phases after it (a recv's release comes when the tensor
# is dropped), and the other side's op, which must not be in this trace.
SIDES = {
    "send": (1, W1, ("tf_rdma.credit_wait", "tf_rdma.write"), (), "tf_rdma.recv"),
    "recv": (2, W0, ("tf_rdma.data_wait",), ("tf_rdma.release",), "tf_rdma.send"),
}


@pytest.mark.parametrize("side", sorted(SIDES))
def test_each_worker_traces_its_side_of_the_transfer_and_its_phases(traces, side):
    index, peer, inner, after, other = SIDES[side]
    result, events = traces[0], traces[index]
    key = result["keys"][0]
    ops = named(events, "tf_rdma." + side, key)
    assert ops, sorted({e["name"] for e in events})
    for e in ops:
        assert e["stats"]["bytes"] == 4 * ELEMENTS and e["stats"]["peer"] == peer, e
    for phase in inner + after:
        assert named(events, phase, key), phase
    for phase in inner:
        for e in named(events, phase, key):
            op = [o for o in ops if o["stats"]["step"] == e["stats"]["step"]]
            assert op and inside(e, op[0]), (phase, e)
    # The other side's events live in the other worker's trace only.
    assert not named(events, other, key)


def test_both_workers_name_a_call_by_one_id(traces):
    """Traced at once, the workers share calls: the rewrite matches calls, so
    a call's recv carries the id its send wrote. (Each worker's trace has
    its own time origin, the start of its session: times are compared within
    one trace only; `tf-rdma timeline merge` puts tasks on one clock.)"""
    result, sender, receiver = traces
    key = result["keys"][0]
    writes = {e["stats"]["step"]: e for e in named(sender, "tf_rdma.write", key)}
    waits = {e["stats"]["step"]: e for e in named(receiver, "tf_rdma.data_wait", key)}
    shared = set(writes) & set(waits)
    assert len(shared) >= max(1, min(len(writes), len(waits)) // 2), (
        len(writes), len(waits), len(shared))


def test_explain_shows_what_the_traced_calls_measured_on_each_worker(traces):
    """fn.explain(measured=True) asks each worker for its last traced calls
    (the TfRdmaReport op, placed on the worker): the send side from
    worker:0, the recv side from worker:1, each with its phases; the
    phases of a call lie within it."""
    result, sender, receiver = traces
    key = result["keys"][0]
    text = result["explained"]
    assert "measured (the last 10 traced calls" in text, text
    assert f"  {key}  {W0} -> {W1}  4096 bytes" in text, text
    send, recv = result["send"], result["recv"]
    assert send["calls"] == 10 and recv["calls"] == 10, (send, recv)
    assert send["bytes"] == recv["bytes"] == 4 * ELEMENTS
    assert set(send) >= {"op", "credit_wait", "write"}, send
    assert set(recv) >= {"op", "data_wait", "release"}, recv
    for side in (send, recv):
        assert 0 < side["op"]["median_us"] <= side["op"]["max_us"], side
    # A phase is part of its call: its median cannot exceed the call's max.
    assert send["write"]["median_us"] <= send["op"]["max_us"], send
    assert recv["data_wait"]["median_us"] <= recv["op"]["max_us"], recv
    assert f"send {send['op']['median_us']:.0f} (max" in text, text
    assert f"recv {recv['op']['median_us']:.0f} (max" in text, text


def test_explain_says_when_nothing_was_traced(traces):
    """Before any profile, the workers hold no events: explain says so per
    side and says how to get them, instead of showing zeros."""
    result, _, _ = traces
    text = result["untraced"]
    assert "    send: no traced call" in text and "    recv: no traced call" in text, text
    assert "nothing traced yet" in text, text


def test_a_workers_counters_reach_the_client(traces):
    """task_report("stats", task) carries a worker's counters to the client:
    worker:1 received 4 KiB per call the client made, from worker:0."""
    result, _, _ = traces
    stats = result["stats"]
    assert stats["task"] == W1, stats
    received = sum(int(p["bytes_received"]) for p in stats["peers"]
                   if p["peer"] == W0)
    assert received >= 4 * ELEMENTS * result["calls"], (received, result["calls"])
