"""Point-to-point demo: one tensor from task 0 to task 1, gRPC vs tf_rdma.

What it shows
-------------
A ``tf.function`` moves a float32 tensor (64 MiB by default) from
``/job:worker/task:0`` to ``/job:worker/task:1`` in two ways:

* TensorFlow's own path: the tensor is read on task 0 and used on task 1, so
  TensorFlow sends it over gRPC (serialised, copied into RPC buffers, copied
  again and allocated afresh on arrival, every call);
* tf_rdma: ``tf_rdma.ops.send`` on task 0 writes the tensor straight into a
  slot that the plan preallocated in task 1's memory (shared memory here,
  RDMA on a cluster with an RDMA NIC), and ``tf_rdma.ops.recv`` on task 1
  hands that slot to its consumers without a copy.

It first checks that both ways deliver the tensor bit for bit (the whole
received tensor is fetched and compared with the source, for two different
contents, so that a stale slot would be caught), then times ~10 calls of
each (after a warm-up) and prints the medians, the speedup and the static
memory plan. It exits with status 1 if the tensors differ.

Each timed call is one client call of the function: it includes TensorFlow's
dispatch of the function to both tasks (a few ms), not only the transfer. See
bench/p2p.py for per-transfer numbers and smaller sizes.

How to run
----------
From the repository root, with tf_rdma built::

    tf-rdma launch -n 2 -- python examples/p2p_demo.py
    tf-rdma launch -n 2 -- python examples/p2p_demo.py --size-mib 16 --runs 20

``tf-rdma launch`` starts the two tasks as local tf_rdma servers and runs this
script as the client (TF_CONFIG holds the cluster, TF_RDMA_SECRET the job
secret). ``TF_RDMA_TRANSPORT=tcp tf-rdma launch ...`` makes the servers use
the TCP transport instead of shared memory.
"""

import argparse
import json
import os
import statistics
import sys
import time

SRC = "/job:worker/task:0"
DST = "/job:worker/task:1"
MiB = 1024 * 1024


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Move a float32 tensor from task 0 to task 1 through "
                    "TensorFlow's gRPC and through tf_rdma, check that both "
                    "arrive bit-exact and compare their times. Run it under "
                    "`tf-rdma launch -n 2 -- python examples/p2p_demo.py`.")
    parser.add_argument("--size-mib", type=float, default=64.0, metavar="MIB",
                        help="tensor size in MiB (default 64)")
    parser.add_argument("--runs", type=int, default=10, metavar="N",
                        help="timed calls of each function after the warm-up "
                             "(default 10)")
    args = parser.parse_args(argv)
    if not args.size_mib > 0:
        parser.error("--size-mib must be positive")
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    return args


def cluster_from_env():
    """The cluster from TF_CONFIG, or None with a hint on stderr."""
    raw = os.environ.get("TF_CONFIG")
    if not raw:
        print("p2p_demo: TF_CONFIG is not set. Run me under the launcher:\n"
              "    tf-rdma launch -n 2 -- python examples/p2p_demo.py",
              file=sys.stderr)
        return None
    cluster = json.loads(raw).get("cluster", {})
    if len(cluster.get("worker", [])) < 2:
        print("p2p_demo: the cluster needs at least 2 worker tasks "
              "(tf-rdma launch -n 2)", file=sys.stderr)
        return None
    return cluster


def human_bytes(n):
    if n >= MiB:
        return f"{n / MiB:g} MiB"
    if n >= 1024:
        return f"{n / 1024:g} KiB"
    return f"{n} B"


def main(argv=None):
    args = parse_args(argv)
    cluster = cluster_from_env()
    if cluster is None:
        return 2

    import numpy as np
    import tensorflow as tf

    import tf_rdma

    n = max(1, int(args.size_mib * MiB) // 4)
    nbytes = 4 * n
    tf.config.experimental_connect_to_cluster(tf.train.ClusterSpec(cluster))

    # The static plan: one float32 tensor of n elements, task 0 -> task 1.
    # Both tasks derive the same slot layout (and hash) from it.
    plan = tf_rdma.Plan([tf_rdma.Transfer("x", SRC, DST, "float32", [n])],
                        name="p2p_demo")

    with tf.device(SRC):
        v = tf.Variable(tf.random.uniform([n], seed=1))

    # The timed functions return one scalar computed on task 1, so that the
    # result travelling back to the client is tiny and the same for both.
    @tf.function
    def grpc_step():
        with tf.device(SRC):
            x = v.read_value()
        with tf.device(DST):
            y = tf.identity(x)  # used on task 1: TensorFlow sends x by gRPC
            return y[0] + y[-1]

    @tf.function
    def rdma_step():
        with tf.device(SRC):
            x = v.read_value()
            tf_rdma.ops.send(x, plan, "x")
        with tf.device(DST):
            y = tf_rdma.ops.recv(plan, "x")
            return y[0] + y[-1]

    # The check functions return the whole tensor as task 1 received it.
    @tf.function
    def grpc_fetch():
        with tf.device(SRC):
            x = v.read_value()
        with tf.device(DST):
            return tf.identity(x)

    @tf.function
    def rdma_fetch():
        with tf.device(SRC):
            x = v.read_value()
            tf_rdma.ops.send(x, plan, "x")
        with tf.device(DST):
            return tf.identity(tf_rdma.ops.recv(plan, "x"))

    transport = os.environ.get("TF_RDMA_TRANSPORT", "auto")
    print(f"tf_rdma point-to-point demo: a {human_bytes(nbytes)} float32 "
          f"tensor from {SRC} to {DST}")
    print(f"(servers' TF_RDMA_TRANSPORT: {transport}; TensorFlow "
          f"{tf.__version__}, tf_rdma {tf_rdma.__version__})")
    print()

    # 1. Bit-exact check, on two different contents of the source tensor.
    ok = True
    for round_ in (1, 2):
        if round_ == 2:
            v.assign(tf.random.uniform([n], seed=2) * 1e3 - 5e2)
        expected = v.numpy().view(np.uint32)
        for name, fetch in (("gRPC", grpc_fetch), ("tf_rdma", rdma_fetch)):
            got = fetch().numpy().view(np.uint32)
            same_shape = got.shape == expected.shape
            if not same_shape or not np.array_equal(got, expected):
                bad = np.flatnonzero(got != expected) if same_shape else []
                where = (f"{len(bad)} of {n} elements differ, first at index "
                         f"{bad[0]}" if len(bad) else f"shape {got.shape}")
                print(f"check {round_}: {name} delivered a DIFFERENT tensor "
                      f"({where})")
                ok = False
    if not ok:
        print("\nFAILED: the received tensor is not bit-identical to the "
              "source")
        return 1
    print(f"check: task 1 received the full tensor bit-identical to the "
          f"source, through gRPC and through tf_rdma (2 different contents)")

    # 2. Timing: warm-up, then interleaved calls so both see the same machine.
    fns = {"gRPC": grpc_step, "tf_rdma": rdma_step}
    times = {name: [] for name in fns}
    scalars = {name: set() for name in fns}
    warmup = 2
    for r in range(warmup + args.runs):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            out = fn().numpy()  # .numpy() waits for the remote result
            dt = time.perf_counter() - t0
            scalars[name].add(np.float32(out).view(np.uint32).item())
            if r >= warmup:
                times[name].append(dt)
    if len(scalars["gRPC"] | scalars["tf_rdma"]) != 1:
        print("\nFAILED: the timed calls returned different values: "
              f"{scalars}")
        return 1

    print(f"\ntime per call, {args.runs} calls after {warmup} warm-up "
          f"(client dispatch included):")
    med = {name: statistics.median(ts) for name, ts in times.items()}
    for name, ts in times.items():
        print(f"  {name:8s} median {med[name] * 1e3:8.2f} ms   "
              f"min {min(ts) * 1e3:8.2f} ms   "
              f"{nbytes / med[name] / 1e9:6.2f} GB/s")
    speedup = med["gRPC"] / med["tf_rdma"]
    print(f"  speedup: tf_rdma is {speedup:.1f}x "
          f"{'faster' if speedup >= 1 else 'slower'} than gRPC")

    print("\nthe static memory plan both tasks use:")
    print(plan.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
