"""What tf_rdma's profiler events cost (docs/observability.md, "Cost").

Two measurements, each in its own processes:

- loop: one process times the trace check and the recording of one event
  in a loop (``tfrdma_trace_bench``: this thread's CPU time, so a busy
  machine that preempts it does not count): --loop-runs runs of 1,000,000
  checks with no profiler session, then --loop-runs runs of --loop-events
  events within one session.
- hops: a chain of 2 x --hops transfers of 4 KiB between two processes over
  shm (worker:0 sends, worker:1 sends it back), --calls calls without a
  profiler session, then twice that within one session, tf_rdma's events
  switched on and off every --switch calls (``tfrdma_trace_events``) so
  that both modes see the same machine. A profiler session costs
  TensorFlow's own tracing too (its executor records every op), so
  tf_rdma's share is the difference of the per-hop medians within the
  session, divided by the 6 events of a hop (send, credit_wait, write on
  one side; recv, data_wait, release on the other).

    python bench/trace_cost.py [--only loop|hops] [--hops 16] [--calls 200]
                               [--switch 10] [--timeout 300] [--json PATH]

Prints one row per measurement with the issue's budget (under 1 us per
event with tracing on; nothing measurable off). About a minute on 2 cores.
The functional side (which events a session holds, and that switched-off
events are not recorded) is tests/test_profiler.py's.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

ELEMENTS = 1024  # float32: 4 KiB per hop

PRELUDE = r"""
import json, os, sys, time
import tensorflow as tf
import tf_rdma
from tf_rdma import _loader
args = json.loads(os.environ["BENCH_ARGS"])
def result(obj):
    print("RESULT " + json.dumps(obj), flush=True)
"""

LOOP = r"""
bench = _loader.load().c.tfrdma_trace_bench
def per_event(n):
    return bench(n) / n
off = [per_event(1_000_000) for _ in range(args["runs"])]
tf.profiler.experimental.start(args["logdir"])
on = [per_event(args["events"]) for _ in range(args["runs"])]
tf.profiler.experimental.stop()
result({"off_ns": off, "on_ns": on})
"""

HOPS = r"""
task = os.environ["BENCH_TASK"]
cluster = json.loads(os.environ["BENCH_CLUSTER"])
HOPS, CALLS, SWITCH, ELEMENTS = (args["hops"], args["calls"], args["switch"],
                                 args["elements"])
SENDER, ECHO = "worker:0", "worker:1"
there = tf_rdma.Plan([tf_rdma.Transfer(f"ping{i}", SENDER, ECHO, "float32",
                                       [ELEMENTS]) for i in range(HOPS)],
                     name="there")
back = tf_rdma.Plan([tf_rdma.Transfer(f"pong{i}", ECHO, SENDER, "float32",
                                      [ELEMENTS]) for i in range(HOPS)],
                    name="back")
tf_rdma.start_endpoint(task, cluster)
events = _loader.load().c.tfrdma_trace_events

@tf.function
def chain(x):
    for i in range(HOPS):
        if task == SENDER:
            tf_rdma.ops.send(x, there, f"ping{i}")
            x = tf_rdma.ops.recv(back, f"pong{i}")
        else:
            x = tf_rdma.ops.recv(there, f"ping{i}")
            tf_rdma.ops.send(x, back, f"pong{i}")
    return x[0]

def timed():
    t0 = time.perf_counter()
    chain(x).numpy()
    return time.perf_counter() - t0

def wait_file(path, timeout=60):
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError("no " + path)
        time.sleep(0.02)

me, other = ((SENDER, ECHO) if task == SENDER else (ECHO, SENDER))
x = tf.zeros([ELEMENTS])
for _ in range(20):
    chain(x)
# The calls are in lockstep (every hop waits for the other task), so both
# tasks switch modes at the same call.
times = {"off": [timed() for _ in range(CALLS)], "profiler": [], "on": []}
tf.profiler.experimental.start(os.path.join(args["logdir"], me.replace(":", "")))
open(os.path.join(args["sync"], me.replace(":", "")), "w").close()
wait_file(os.path.join(args["sync"], other.replace(":", "")))
for i in range(2 * CALLS):
    mode = "on" if (i // SWITCH) % 2 else "profiler"
    events(1 if mode == "on" else 0)
    times[mode].append(timed())
tf.profiler.experimental.stop()
events(1)
result(times)
"""


def child_env(extra):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (ROOT, env.get("PYTHONPATH")) if p)
    env.setdefault("TF_RDMA_SECRET", os.urandom(16).hex())
    env.update(extra)
    return env


def run_children(programs, timeout):
    """Starts {name: (program, env)} together; returns {name: result}."""
    procs = {name: subprocess.Popen([sys.executable, "-c", PRELUDE + program],
                                    env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True,
                                    start_new_session=True)
             for name, (program, env) in programs.items()}
    outs = {}
    try:
        for name, proc in procs.items():
            outs[name] = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"trace_cost: no result within {timeout} s")
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
    results = {}
    for name, proc in procs.items():
        out, err = outs[name]
        lines = [l for l in out.splitlines() if l.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            raise SystemExit(f"trace_cost: {name} failed (exit {proc.returncode}):"
                             f"\n{err[-3000:]}")
        results[name] = json.loads(lines[-1][len("RESULT "):])
    return results


def measure_loop(args, work):
    bench_args = {"runs": args.loop_runs, "events": args.loop_events,
                  "logdir": os.path.join(work, "loop")}
    res = run_children({"loop": (LOOP, child_env(
        {"BENCH_ARGS": json.dumps(bench_args)}))}, args.timeout)["loop"]
    off, on = statistics.median(res["off_ns"]), statistics.median(res["on_ns"])
    return {"op": "trace-event-loop", "off_ns_per_check": off,
            "on_ns_per_event": on, "runs": res}


def measure_hops(args, work):
    from tf_rdma import cluster as cluster_lib
    ports = cluster_lib.free_ports(2)
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    sync = os.path.join(work, "sync")
    os.makedirs(sync)
    bench_args = {"hops": args.hops, "calls": args.calls, "switch": args.switch,
                  "elements": ELEMENTS, "logdir": os.path.join(work, "hops"),
                  "sync": sync}
    common = {"BENCH_ARGS": json.dumps(bench_args),
              "BENCH_CLUSTER": json.dumps(cluster), "TF_RDMA_TRANSPORT": "shm",
              "TF_RDMA_TIMEOUT": "60"}
    secret = os.environ.get("TF_RDMA_SECRET") or os.urandom(16).hex()
    programs = {t: (HOPS, child_env({**common, "BENCH_TASK": t,
                                     "TF_RDMA_SECRET": secret}))
                for t in ("worker:0", "worker:1")}
    times = run_children(programs, args.timeout)["worker:0"]
    hop = {mode: statistics.median(t) / (2 * args.hops)
           for mode, t in times.items()}
    return {"op": "trace-4KiB-hop", "hop_s": hop,
            "ns_per_event": (hop["on"] - hop["profiler"]) / 6 * 1e9,
            "calls": {mode: len(t) for mode, t in times.items()}}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=["loop", "hops"])
    parser.add_argument("--loop-runs", type=int, default=7,
                        help="runs of each loop (medians are reported)")
    parser.add_argument("--loop-events", type=int, default=20_000,
                        help="events per run with tracing on")
    parser.add_argument("--hops", type=int, default=16,
                        help="transfers each way per call")
    parser.add_argument("--calls", type=int, default=200,
                        help="calls without a session (twice that within one)")
    parser.add_argument("--switch", type=int, default=10,
                        help="within the session, tf_rdma's events go on and "
                             "off every SWITCH calls")
    parser.add_argument("--timeout", type=float, default=300,
                        help="hard limit per measurement, in seconds")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    load = os.getloadavg()[0]
    if load > (os.cpu_count() or 1) / 2:
        print(f"note: the machine is busy (load average {load:.1f}): the hop "
              f"times move with it; the loop's CPU time does not", flush=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="tf_rdma_trace_cost_") as work:
        if args.only in (None, "loop"):
            r = measure_loop(args, work)
            print(f"loop: tracing off {r['off_ns_per_check']:.2f} ns per check, "
                  f"on {r['on_ns_per_event']:.0f} ns per event "
                  f"(budget: nothing measurable off, < 1000 ns on)", flush=True)
            results.append(r)
        if args.only in (None, "hops"):
            r = measure_hops(args, work)
            hop = r["hop_s"]
            print(f"4 KiB hop: no profiler {hop['off'] * 1e6:.1f} us; in a "
                  f"session without tf_rdma's events {hop['profiler'] * 1e6:.1f} "
                  f"us, with them {hop['on'] * 1e6:.1f} us: "
                  f"{r['ns_per_event']:.0f} ns per event (budget < 1000 ns)",
                  flush=True)
            results.append(r)
    if args.json:
        machine = {"cores": os.cpu_count(), "load_at_start": load,
                   "load_at_end": os.getloadavg()[0],
                   "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        with open(args.json, "w") as f:
            json.dump({"bench": "trace_cost", "machine": machine,
                       "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
