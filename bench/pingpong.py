"""SPMD ping-pong latency: two processes, no client, no gRPC on the data path.

Worker 0 sends a tensor to worker 1 and waits for it to come back; worker 1
receives it and sends it back. Both run a ``tf.function`` with a ``tf.range``
loop of --iters iterations, so TensorFlow's per-call dispatch is paid once per
run, not per transfer. The round trip per iteration is what two tf_rdma
transfers (and the loop's own overhead) cost. There is no gRPC baseline here:
TensorFlow's own Send/Recv only exist inside one client-driven graph (see
bench/p2p.py for that comparison).

    python bench/pingpong.py [--sizes 4K 64K] [--transports shm tcp]
                             [--poll-us 0 50] [--runs 5] [--json PATH]

Prints one row per (transport, poll setting, size); --json writes the same
shape as bench/p2p.py with op "pingpong-rtt".
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

WORKER = r"""
import json, os, sys, time
import tensorflow as tf
import tf_rdma
role, iters, runs, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
cluster = json.loads(os.environ["BENCH_CLUSTER"])
n = max(1, size // 4)
plan = tf_rdma.Plan([
    tf_rdma.Transfer("ping", "worker:0", "worker:1", "float32", [n]),
    tf_rdma.Transfer("pong", "worker:1", "worker:0", "float32", [n])],
    name="pingpong")
tf_rdma.start_endpoint("worker:" + role, cluster)

@tf.function
def ping(x):
    for _ in tf.range(iters):
        tf_rdma.ops.send(x, plan, "ping")
        x = tf_rdma.ops.recv(plan, "pong")
    return x[0]

@tf.function
def pong():
    for _ in tf.range(iters):
        tf_rdma.ops.send(tf_rdma.ops.recv(plan, "ping"), plan, "pong")
    return tf.constant(0)

x = tf.ones([n])
times = []
for r in range(runs + 1):  # the first run traces and sets up; not timed
    t0 = time.perf_counter()
    (ping(x) if role == "0" else pong()).numpy()
    if r:
        times.append((time.perf_counter() - t0) / iters)
if role == "0":
    print("RESULT " + json.dumps(times), flush=True)
"""

SIZES = {"4K": 4096, "64K": 65536, "1M": 1 << 20}


def run_pair(transport, poll_us, size, iters, runs, timeout):
    from tf_rdma import cluster as cluster_lib
    ports = cluster_lib.free_ports(2)
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2",
               TF_RDMA_TRANSPORT=transport, TF_RDMA_POLL_US=str(poll_us),
               BENCH_CLUSTER=json.dumps(cluster))
    env.setdefault("TF_RDMA_SECRET", os.urandom(16).hex())
    # A file, not `python -c`: AutoGraph needs the loop's source.
    script = os.path.join(tempfile.gettempdir(), f"tf_rdma_pingpong_{os.getpid()}.py")
    with open(script, "w") as f:
        f.write(WORKER)
    procs = [subprocess.Popen([sys.executable, script, str(r), str(iters),
                               str(runs), str(size)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for r in ("1", "0")]
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            p.kill()
        os.unlink(script)
    for p, (_, err) in zip(procs, outs):
        if p.returncode != 0:
            raise SystemExit(f"pingpong worker failed ({transport}, "
                             f"poll {poll_us} us):\n{err[-2000:]}")
    line = [l for l in outs[1][0].splitlines() if l.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["4K", "64K"],
                        choices=sorted(SIZES))
    parser.add_argument("--transports", nargs="+", default=["shm", "tcp"],
                        choices=["shm", "tcp", "verbs"])
    parser.add_argument("--poll-us", nargs="+", type=int, default=[0, 50],
                        help="TF_RDMA_POLL_US values to compare")
    parser.add_argument("--iters", type=int, default=2000,
                        help="round trips per timed run")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    results = []
    print(f"{'transport':9}  {'poll':>6}  {'size':>5}  {'median RTT':>11}  {'min RTT':>9}")
    for transport in args.transports:
        for poll in args.poll_us:
            for size_name in args.sizes:
                times = run_pair(transport, poll, SIZES[size_name], args.iters,
                                 args.runs, args.timeout)
                med, low = statistics.median(times), min(times)
                print(f"{transport:9}  {poll:>4}us  {size_name:>5}  "
                      f"{med * 1e6:>8.1f} us  {low * 1e6:>6.1f} us", flush=True)
                results.append({"system": f"tf_rdma-{transport}-poll{poll}us",
                                "op": "pingpong-rtt", "size_bytes": SIZES[size_name],
                                "P": 2, "median_s": med, "min_s": low,
                                "runs": len(times)})
    if args.json:
        machine = {"cores": os.cpu_count(), "load_at_end": os.getloadavg()[0],
                   "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        with open(args.json, "w") as f:
            json.dump({"bench": "pingpong", "machine": machine,
                       "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
