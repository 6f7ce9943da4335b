"""TF_RDMA_TIMELINE, `tf-rdma timeline merge` and `plot` (docs/observability.md, "Timeline").

A 2-worker run over shared memory with TF_RDMA_TIMELINE set: each worker
sends a tensor to the other every step (both ways) and both run ring
allreduces. Each process writes its own Chrome-trace file; the test merges
them with the command line (a subprocess, as a user would) and checks:

- both tasks' files exist, named <job>-<index>.<pid>.json, are JSON arrays
  with the process_name metadata, and hold clock offsets of the peer with
  a round trip > 0;
- the merged file has both tasks' events, with the right keys, bytes, peers
  and steps, every phase (credit_wait, write, data_wait, release; reduce and
  copy in the allreduces);
- causality across the two clocks: every recv's data arrival (the end of
  its data_wait, else the recv's end) is after the start of the matching
  send's write (same key and step), within the merge's error bounds plus a
  small slack;
- `tf-rdma timeline plot` writes a PNG.

One process with TF_RDMA_TIMELINE set measures the cost of an event with
the timeline's sink (tfrdma_trace_bench) and finds them all in its file;
with TF_RDMA_TIMELINE_EVENTS=ops it records the ops' events and none of
their phases; one without it writes nothing and keeps tracing off. The merge logic (a
path through a middle task, an unreachable task, a malformed or cut-short
file) is checked on synthetic files (fast).
"""

import json
import os
import statistics
import subprocess
import sys

import pytest

from conftest import REPO, make_cluster, run_tasks
from tf_rdma import timeline

STEPS = 6
ELEMENTS = 1024          # float32: 4 KiB each way per step
COLL_ELEMENTS = 4096     # float32: 16 KiB allreduced
BLOCK = 4096
INSTANCE = "grads/bucket0"
A, B = "/job:worker/task:0", "/job:worker/task:1"
# Slack on top of the merge's error bound: the merged ts are rounded to ns,
# and the bound is an estimate on a busy machine.
SLACK_US = 20.0

PROGRAM = r"""
A, B = "/job:worker/task:0", "/job:worker/task:1"
from tf_rdma.cluster import canonical_task
me = canonical_task(task)
peer = B if me == A else A
plan = tf_rdma.Plan([tf_rdma.Transfer("a2b", A, B, "float32", [ELEMENTS]),
                     tf_rdma.Transfer("b2a", B, A, "float32", [ELEMENTS])],
                    name="pingpong")
start()
from tf_rdma import collectives as C
good = []
for step in range(1, STEPS + 1):
    if me == A:
        tf_rdma.ops.send(tf.fill([ELEMENTS], float(step)), plan, "a2b")
        y = tf_rdma.ops.recv(plan, "b2a")
    else:
        tf_rdma.ops.send(tf.fill([ELEMENTS], -float(step)), plan, "b2a")
        y = tf_rdma.ops.recv(plan, "a2b")
    good.append(abs(float(y.numpy()[0])) == step)
    del y  # the slot goes back to the sender: a release
    z = C.all_reduce(tf.fill([COLL_ELEMENTS], float(step)), algorithm="ring",
                     name=INSTANCE, block_bytes=BLOCK)
    good.append(float(z.numpy()[-1]) == 2.0 * step)
# The timeline's writer measures a new peer's clock within 0.5 s of its
# connection (and again at exit); stay connected past that for certain.
time.sleep(1.0)
touch("done_" + me[-1])
wait_file("done_" + peer[-1])
threads = set()
for tid in os.listdir("/proc/self/task"):
    try:
        with open(f"/proc/self/task/{tid}/comm") as f:
            threads.add(f.read().strip())
    except FileNotFoundError:  # the thread ended meanwhile
        pass
result({"good": good, "pid": os.getpid(), "threads": sorted(threads)})
"""


def cli(*args, check=True):
    """Runs `tf-rdma ARGS` (this checkout's) and returns the CompletedProcess."""
    env = dict(os.environ, PYTHONPATH=REPO)
    proc = subprocess.run([sys.executable, "-m", "tf_rdma.cli", *args],
                          capture_output=True, text=True, timeout=120,
                          cwd=REPO, env=env)
    if check:
        assert proc.returncode == 0, (args, proc.stdout, proc.stderr)
    return proc


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tl_dir = str(tmp_path_factory.mktemp("timeline"))
    sync_dir = str(tmp_path_factory.mktemp("sync"))
    constants = dict(STEPS=STEPS, ELEMENTS=ELEMENTS, COLL_ELEMENTS=COLL_ELEMENTS,
                     BLOCK=BLOCK, INSTANCE=INSTANCE)
    program = "".join(f"{k} = {v!r}\n" for k, v in constants.items()) + PROGRAM
    out = run_tasks({"worker:0": program, "worker:1": program},
                    cluster=make_cluster(2),
                    env={"TF_RDMA_TRANSPORT": "shm", "TF_RDMA_TIMEOUT": "60",
                         "TF_RDMA_TIMELINE": tl_dir, "TEST_SYNC_DIR": sync_dir},
                    timeout=180)
    for task, res in out.items():
        assert res.result["good"] == [True] * (2 * STEPS), (task, res.result)
    merged_path = os.path.join(str(tmp_path_factory.mktemp("merged")), "merged.json")
    merge = cli("timeline", "merge", tl_dir, "-o", merged_path)
    with open(merged_path) as f:
        merged = json.load(f)
    return {"dir": tl_dir, "out": out, "merged": merged, "merged_path": merged_path,
            "merge_stdout": merge.stdout}


pytestmark = pytest.mark.timeout(300)


def events_of(merged, task, name, key=None):
    pid = merged["tf_rdma"]["tasks"][task]["pid"]
    return [e for e in merged["traceEvents"] if e.get("ph") == "X" and e["pid"] == pid
            and e["name"] == name and (key is None or e["args"]["key"] == key)]


def test_each_process_writes_its_own_file(run):
    for task, index in ((A, 0), (B, 1)):
        pid = run["out"][f"worker:{index}"].result["pid"]
        path = os.path.join(run["dir"], f"worker-{index}.{pid}.json")
        assert os.path.exists(path), (path, os.listdir(run["dir"]))
        with open(path) as f:
            events = json.load(f)  # a whole JSON array: the process stopped it
        assert isinstance(events, list)
        names = [e["args"]["name"] for e in events if e["name"] == "process_name"]
        assert names == [task], names
        info = timeline.read(path)
        assert info["task"] == task and info["dropped_events"] == 0, info
        peer = B if task == A else A
        offsets = [o for o in info["offsets"] if o["peer"] == peer]
        assert offsets, f"{path} holds no clock offset of {peer}: {info['offsets']}"
        for o in offsets:
            assert o["rtt_ns"] > 0, o
            # One host, one clock: the offset is within its error bound.
            assert abs(o["offset_ns"]) <= o["rtt_ns"] / 2 + 1_000_000, o


# docs/observability.md, "Threads": every thread tf_rdma starts.
THREADS = {"tfrdma-accept", "tfrdma-auth", "tfrdma-engine", "tfrdma-poller",
           "tfrdma-progress", "tfrdma-reader", "tfrdma-timeline",
           "tfrdma-watchdog"}


def test_tf_rdma_threads_are_named(run):
    """tf_rdma's threads carry their role, not the name of the thread that
    started them ("python", "tf_Compute"): top -H, perf and gdb tell them
    apart."""
    for task, res in run["out"].items():
        names = set(res.result["threads"])
        ours = {n for n in names if n.startswith("tfrdma-")}
        assert ours <= THREADS, (task, ours - THREADS)
        # Always there once the endpoint runs, a peer is connected, a
        # collective ran and the timeline is on.
        needed = {"tfrdma-accept", "tfrdma-progress", "tfrdma-reader",
                  "tfrdma-engine", "tfrdma-timeline"}
        assert needed <= names, (task, sorted(names))


def test_merge_prints_offsets_and_holds_both_tasks(run):
    out = run["merge_stdout"]
    assert f"{A}: offset +0.000 ms ± 0.000 ms" in out and "(reference)" in out, out
    assert f"{B}: offset " in out, out
    info = run["merged"]["tf_rdma"]
    assert info["reference"] == A
    assert set(info["tasks"]) == {A, B}, info
    assert info["tasks"][B]["error_ns"] > 0, info
    names = {e["args"]["name"] for e in run["merged"]["traceEvents"]
             if e.get("name") == "process_name"}
    assert names == {A, B}, names


def test_sends_recvs_and_their_phases(run):
    merged = run["merged"]
    steps = set(range(1, STEPS + 1))
    for sender, receiver, key in ((A, B, "a2b"), (B, A, "b2a")):
        for name, task, peer in (("tf_rdma.send", sender, receiver),
                                 ("tf_rdma.credit_wait", sender, receiver),
                                 ("tf_rdma.write", sender, receiver),
                                 ("tf_rdma.recv", receiver, sender),
                                 ("tf_rdma.data_wait", receiver, sender),
                                 ("tf_rdma.release", receiver, sender)):
            found = events_of(merged, task, name, key)
            assert {e["args"]["step"] for e in found} == steps, (name, task, found)
            for e in found:
                assert e["args"]["peer"] == peer, e
                assert e["dur"] >= 0, e
                if name in ("tf_rdma.send", "tf_rdma.write", "tf_rdma.recv"):
                    assert e["args"]["bytes"] == 4 * ELEMENTS, e


def test_collectives_and_their_phases(run):
    merged = run["merged"]
    for task in (A, B):
        calls = events_of(merged, task, "tf_rdma.collective", INSTANCE)
        assert {e["args"]["step"] for e in calls} == set(range(1, STEPS + 1)), calls
        for e in calls:
            assert e["args"]["kind"] == "allreduce", e
            assert e["args"]["algorithm"] == "ring", e
            assert e["args"]["bytes"] == 4 * COLL_ELEMENTS, e
        # Ring on 2 ranks, 2 chunks of 2 blocks: per call 2 blocks reduced,
        # 2 copied out (as tests/test_profiler.py counts them).
        for phase in ("tf_rdma.reduce", "tf_rdma.copy"):
            found = events_of(merged, task, phase, INSTANCE)
            assert len(found) == 2 * STEPS, (task, phase, len(found))
            assert all(e["args"]["bytes"] == BLOCK for e in found), found[:3]


def test_data_arrives_after_it_was_written(run):
    """Causality across the two processes' clocks, within the error bounds."""
    merged = run["merged"]
    tasks = merged["tf_rdma"]["tasks"]
    checked = 0
    for sender, receiver, key in ((A, B, "a2b"), (B, A, "b2a")):
        bound_us = (tasks[sender]["error_ns"] + tasks[receiver]["error_ns"]) / 1000
        writes = {e["args"]["step"]: e for e in events_of(merged, sender, "tf_rdma.write", key)}
        waits = {e["args"]["step"]: e for e in events_of(merged, receiver, "tf_rdma.data_wait", key)}
        for recv in events_of(merged, receiver, "tf_rdma.recv", key):
            step = recv["args"]["step"]
            wait = waits.get(step)
            arrival = wait["ts"] + wait["dur"] if wait else recv["ts"] + recv["dur"]
            write = writes[step]
            assert arrival >= write["ts"] - bound_us - SLACK_US, (
                f"{key} step {step}: {receiver} saw the data at {arrival:.3f} us, "
                f"before {sender} started writing it at {write['ts']:.3f} us "
                f"(error bound {bound_us:.3f} us + {SLACK_US} us slack)")
            checked += 1
    assert checked == 2 * STEPS


MATPLOTLIB_MISSING = ("tf-rdma timeline plot needs matplotlib (requirements-dev.txt), "
                      "which this environment lacks")


def test_plot_writes_a_png(run, tmp_path):
    pytest.importorskip("matplotlib", reason=MATPLOTLIB_MISSING)
    png = str(tmp_path / "timeline.png")
    proc = cli("timeline", "plot", run["merged_path"], "-o", png)
    assert "wrote" in proc.stdout, proc.stdout
    with open(png, "rb") as f:
        data = f.read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", data[:8]
    assert 5_000 < len(data) < 2_000_000, len(data)


COST = r"""
from tf_rdma import _loader
start()
bench = _loader.load().c.tfrdma_trace_bench
N = 20_000
per_event = [bench(N) / N for _ in range(5)]
tf_rdma.server._endpoint.close()  # stops the timeline: the file is complete
result({"ns": per_event, "n": 5 * N, "cwd_files": os.listdir(".")})
"""


def test_timeline_event_cost_and_file(tmp_path):
    tl_dir = tmp_path / "tl"
    out = run_tasks({"worker:0": COST}, cluster=make_cluster(1),
                    env={"TF_RDMA_TIMELINE": str(tl_dir)}, timeout=120)
    res = out["worker:0"].result
    cost = statistics.median(res["ns"])
    print(f"timeline cost: {cost:.0f} ns per event (runs {res['ns']})")
    # The budget for an event with tracing on.
    assert cost < 1000, f"an event costs {cost:.0f} ns with the timeline on, expected < 1000"
    files = os.listdir(tl_dir)
    assert len(files) == 1, files
    info = timeline.read(str(tl_dir / files[0]))
    writes = [e for e in info["events"] if e["name"] == "tf_rdma.write"
              and e["args"]["key"] == "bench/tensor:0"]
    assert len(writes) + info["dropped_events"] == res["n"], (len(writes), info["dropped_events"])
    assert len(writes) == res["n"], f"{info['dropped_events']} events dropped"


OPS_ONLY = r"""
from tf_rdma import _loader
from tf_rdma import collectives as C
start()
_loader.load().c.tfrdma_trace_bench(1000)  # 1000 write phases
for _ in range(3):
    y = C.all_reduce(tf.ones([256]), name="solo", algorithm="ring")
tf_rdma.server._endpoint.close()
result({"sum": float(y.numpy().sum())})
"""


def test_timeline_of_ops_leaves_the_phases_out(tmp_path):
    """TF_RDMA_TIMELINE_EVENTS=ops: the ops' events, none of their phases."""
    tl_dir = tmp_path / "tl"
    out = run_tasks({"worker:0": OPS_ONLY}, cluster=make_cluster(1),
                    env={"TF_RDMA_TIMELINE": str(tl_dir),
                         "TF_RDMA_TIMELINE_EVENTS": "ops"}, timeout=120)
    res = out["worker:0"]
    assert res.result["sum"] == 256.0, res.result
    assert "without phases" in res.stderr, res.stderr
    files = os.listdir(tl_dir)
    assert len(files) == 1, files
    names = [e["name"] for e in timeline.read(str(tl_dir / files[0]))["events"]]
    assert names.count("tf_rdma.collective") == 3, names
    assert "tf_rdma.write" not in names, sorted(set(names))
    assert set(names) == {"tf_rdma.collective"}, sorted(set(names))


UNSET = r"""
from tf_rdma import _loader
os.chdir(WORKDIR)
start()
bench = _loader.load().c.tfrdma_trace_bench
off = [bench(200_000) / 200_000 for _ in range(5)]
tf_rdma.server._endpoint.close()
result({"off_ns": off})
"""


def test_unset_writes_nothing_and_tracing_stays_off(tmp_path):
    env = {"TF_RDMA_TIMELINE": ""}
    out = run_tasks({"worker:0": f"WORKDIR = {str(tmp_path)!r}\n" + UNSET},
                    cluster=make_cluster(1), env=env, timeout=120)
    off = statistics.median(out["worker:0"].result["off_ns"])
    # Off, an untraced transfer's check is a load or two; a tap left on
    # would cost hundreds of ns per event.
    assert off < 10, f"tracing off costs {off:.2f} ns per check, expected < 10"
    assert os.listdir(tmp_path) == [], os.listdir(tmp_path)
    assert "timeline" not in out["worker:0"].stderr, out["worker:0"].stderr


# Synthetic files: the merge's logic on its own.

def write_file(path, task, origin_ns, events=(), offsets=(), end=True):
    lines = [{"ph": "M", "name": "process_name", "pid": 7, "tid": 0, "args": {"name": task}},
             {"ph": "M", "name": "tf_rdma_timeline", "pid": 7, "tid": 0,
              "args": {"task": task, "pid": 7, "origin_ns": origin_ns, "version": 1}}]
    for name, ts, dur in events:
        lines.append({"ph": "X", "name": name, "pid": 7, "tid": 1, "ts": ts, "dur": dur,
                      "args": {"key": "k", "bytes": 4, "peer": "p", "step": 1}})
    for peer, offset, rtt in offsets:
        lines.append({"ph": "M", "name": "tf_rdma_clock_offset", "pid": 7, "tid": 0,
                      "args": {"peer": peer, "offset_ns": offset, "rtt_ns": rtt,
                               "measured_at_ns": origin_ns}})
    text = "[\n" + "".join(json.dumps(e) + ",\n" for e in lines)
    if end:
        text += json.dumps({"ph": "M", "name": "tf_rdma_timeline_end", "pid": 7, "tid": 0,
                            "args": {"dropped_events": 0}}) + "\n]\n"
    path.write_text(text)
    return str(path)


C = "/job:worker/task:2"


@pytest.mark.fast
def test_merge_reaches_a_task_through_a_middle_one(tmp_path):
    # B's clock is 5 ms ahead of A's, C's 2 ms behind B's; A measured B, B
    # measured C (and C measured B badly: the smaller round trip wins).
    write_file(tmp_path / "worker-0.1.json", A, 1_000_000_000,
               [("tf_rdma.write", 10.0, 1.0)], [(B, 5_000_000, 40_000)])
    write_file(tmp_path / "worker-1.2.json", B, 1_005_000_000 + 3_000,
               [("tf_rdma.recv", 0.0, 2.0)], [(C, -2_000_000, 10_000)])
    write_file(tmp_path / "worker-2.3.json", C, 1_003_000_000,
               [("tf_rdma.send", 5.0, 1.0)], [(B, 2_100_000, 90_000)], end=False)
    merged = timeline.merge([str(tmp_path)])
    info = merged["tf_rdma"]
    assert info["reference"] == A
    assert info["tasks"][B]["offset_ns"] == 5_000_000
    assert info["tasks"][B]["error_ns"] == 20_000
    assert info["tasks"][C]["offset_ns"] == 3_000_000
    assert info["tasks"][C]["error_ns"] == 25_000
    assert info["tasks"][C]["path"] == [A, B, C]
    ts = {e["name"]: e["ts"] for e in merged["traceEvents"] if e.get("ph") == "X"}
    # On A's clock: A's origin is ts 0; B's started 3 us after A's; C's at
    # A's origin too (1.003 s on C's clock is 1.000 s on A's).
    assert ts == {"tf_rdma.write": 10.0, "tf_rdma.recv": 3.0, "tf_rdma.send": 5.0}, ts
    # --reference moves the origin of the offsets.
    again = timeline.merge([str(tmp_path)], reference="worker:1")
    assert again["tf_rdma"]["tasks"][A]["offset_ns"] == -5_000_000


@pytest.mark.fast
def test_merge_names_an_unreachable_task(tmp_path):
    write_file(tmp_path / "worker-0.1.json", A, 0, offsets=[(B, 0, 1000)])
    write_file(tmp_path / "worker-1.2.json", B, 0)
    write_file(tmp_path / "worker-2.3.json", C, 0)
    with pytest.raises(timeline.TimelineError, match=r"no clock offsets connect "
                       r"/job:worker/task:2 \(.*worker-2\.3\.json\) to the reference"):
        timeline.merge([str(tmp_path)])
    with pytest.raises(timeline.TimelineError, match="reference task /job:ps/task:0"):
        timeline.merge([str(tmp_path)], reference="ps:0")


@pytest.mark.fast
def test_merge_names_a_malformed_file_and_no_files(tmp_path):
    bad = tmp_path / "worker-0.1.json"
    bad.write_text('{"traceEvents": [{"ph": "X", ')
    with pytest.raises(timeline.TimelineError, match=r"worker-0\.1\.json: malformed JSON"):
        timeline.merge([str(tmp_path)])
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(timeline.TimelineError, match="no timeline files"):
        timeline.merge([str(empty)])
    foreign = tmp_path / "other.json"
    foreign.write_text("[]")
    with pytest.raises(timeline.TimelineError, match="no tf_rdma_timeline metadata"):
        timeline.merge([str(foreign)])


@pytest.mark.fast
def test_a_file_cut_short_is_read_to_its_last_whole_event(tmp_path):
    path = write_file(tmp_path / "worker-0.1.json", A, 0,
                      [("tf_rdma.write", 1.0, 1.0), ("tf_rdma.send", 2.0, 1.0)], end=False)
    with open(path, "a") as f:
        f.write('{"ph": "X", "name": "tf_rdma.re')  # killed mid-line
    info = timeline.read(path)
    assert [e["name"] for e in info["events"]] == ["tf_rdma.write", "tf_rdma.send"]
    assert info["dropped_events"] is None


@pytest.mark.fast
def test_cli_errors_and_help(tmp_path):
    write_file(tmp_path / "worker-0.1.json", A, 0)
    write_file(tmp_path / "worker-1.2.json", B, 0)
    proc = cli("timeline", "merge", str(tmp_path), "-o", str(tmp_path / "m.json"),
               check=False)
    assert proc.returncode == 1, proc
    assert "error: no clock offsets connect /job:worker/task:1" in proc.stderr, proc.stderr
    for args in (("timeline", "--help"), ("timeline", "merge", "--help"),
                 ("timeline", "plot", "--help")):
        assert cli(*args).stdout.startswith("usage: tf-rdma timeline"), args


@pytest.mark.fast
def test_plot_draws_a_window_and_refuses_an_empty_one(tmp_path):
    pytest.importorskip("matplotlib", reason=MATPLOTLIB_MISSING)
    write_file(tmp_path / "worker-0.1.json", A, 0,
               [("tf_rdma.send", 1000.0, 500.0), ("tf_rdma.write", 1200.0, 300.0)],
               [(B, 0, 1000)])
    write_file(tmp_path / "worker-1.2.json", B, 0,
               [("tf_rdma.recv", 900.0, 700.0), ("tf_rdma.data_wait", 900.0, 650.0)])
    merged = timeline.merge([str(tmp_path)])
    png = tmp_path / "window.svg"
    timeline.plot(merged, str(png), start_ms=0.5, end_ms=2.0)
    svg = png.read_text()
    assert svg.startswith("<?xml") and "data_wait" in svg and "credit_wait" not in svg
    with pytest.raises(timeline.TimelineError, match="no events to draw between 5.0 and 6.0 ms"):
        timeline.plot(merged, str(tmp_path / "empty.png"), start_ms=5.0, end_ms=6.0)
