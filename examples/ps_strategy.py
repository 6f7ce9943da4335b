"""ParameterServerStrategy training with ``@tf_rdma.rewrite``: an MLP on digits.

What it shows
-------------
TensorFlow 2's own parameter-server training, unchanged but for one
decorator: a ``ParameterServerStrategy`` puts the MLP's variables (and their
momentum slots) on the ps tasks, a ``ClusterCoordinator`` (this program)
schedules training steps, and each step runs on whichever worker is free,
reading the weights from the ps tasks and applying momentum SGD there. The
step is written once as a ``tf.function``; ``tf_rdma.rewrite`` makes its
ps<->worker tensors move through tf_rdma's slots, on whichever worker the
coordinator runs it (one plan per worker).

The script trains two copies of the model from the same initial weights:
one with the plain step (TensorFlow's gRPC path), one with the rewritten
step. First synchronously (schedule one step, join, the next), checking that
the two losses are bit-identical at every step; then asynchronously (many
steps scheduled at once, as PSS is used), timing the steps per second of
each. It prints the losses, the test accuracy, the throughput and what each
worker's plan moves, and exits with status 1 if a loss differs or the
accuracy target is missed.

So that the sync comparison does not depend on which worker runs a step,
each worker's dataset yields the whole training set as one element, and a
step cuts its batch out of it at a global step counter that lives on a ps
task.

How to run
----------
From the repository root, with tf_rdma built (and scikit-learn installed)::

    tf-rdma launch -n 2 --ps 2 --coordinator -- python examples/ps_strategy.py
    tf-rdma launch -n 2 --ps 1 --coordinator -- python examples/ps_strategy.py --quick
"""

import argparse
import json
import os
import sys
import time


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Train an MLP on sklearn's digits with TensorFlow's "
                    "ParameterServerStrategy, with and without "
                    "@tf_rdma.rewrite. Run it under `tf-rdma launch -n 2 "
                    "--ps 2 --coordinator -- python examples/ps_strategy.py`.")
    parser.add_argument("--hidden", type=int, nargs="+", default=[512, 512],
                        metavar="UNITS", help="hidden layer sizes (default: 512 512)")
    parser.add_argument("--batch", type=int, default=32,
                        help="batch size of a step (default 32)")
    parser.add_argument("--steps", type=int, default=None,
                        help="synchronous steps (default 150; --quick 40)")
    parser.add_argument("--async-steps", type=int, default=None,
                        help="asynchronous steps timed per copy (default 300; --quick 60)")
    parser.add_argument("--lr", type=float, default=0.02, help="learning rate (default 0.02)")
    parser.add_argument("--target", type=float, default=None,
                        help="test accuracy to reach (default 0.93; --quick 0.8)")
    parser.add_argument("--quick", action="store_true", help="fewer steps (for tests)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    args.steps = args.steps or (40 if args.quick else 150)
    args.async_steps = args.async_steps or (60 if args.quick else 300)
    args.target = args.target if args.target is not None else (0.8 if args.quick else 0.93)
    if args.batch < 1 or min(args.hidden) < 1 or args.steps < 1 or args.async_steps < 1:
        parser.error("--batch, --hidden, --steps and --async-steps must be positive")
    return args


def check_tf_config():
    """The cluster's jobs, or None with a hint on stderr."""
    config = json.loads(os.environ.get("TF_CONFIG") or "{}")
    cluster = config.get("cluster", {})
    if config.get("task", {}).get("type") != "chief" or not cluster.get("ps"):
        print("ps_strategy: TF_CONFIG must name this program's task chief:0 in a "
              "cluster with ps tasks. Run me under the launcher:\n"
              "    tf-rdma launch -n 2 --ps 2 --coordinator -- python "
              "examples/ps_strategy.py", file=sys.stderr)
        return None
    return cluster


def main(argv=None):
    args = parse_args(argv)
    cluster = check_tf_config()
    if cluster is None:
        return 2

    import numpy as np
    import tensorflow as tf
    from sklearn.datasets import load_digits

    import tf_rdma

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    order = np.random.RandomState(0).permutation(len(x))
    x, y, x_test, y_test = x[order[360:]], y[order[360:]], x[order[:360]], y[order[:360]]
    if args.batch > len(x):
        print(f"ps_strategy: --batch {args.batch} is larger than the {len(x)} "
              f"training examples", file=sys.stderr)
        return 2
    sizes = [x.shape[1]] + args.hidden + [10]
    rng = np.random.RandomState(1)
    init = []
    for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
        limit = np.sqrt(6.0 / (fan_in + fan_out))
        init += [rng.uniform(-limit, limit, (fan_in, fan_out)).astype(np.float32),
                 np.zeros(fan_out, np.float32)]

    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    strategy = tf.distribute.experimental.ParameterServerStrategy(resolver)
    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    workers = [f"/job:worker/task:{i}" for i in range(len(cluster["worker"]))]
    per_worker = coordinator.create_per_worker_dataset(
        lambda: tf.data.Dataset.from_tensors((x, y)).repeat())
    iterator = iter(per_worker)
    rows = len(x)

    def make_copy():
        with strategy.scope():
            params = [tf.Variable(v) for v in init]
            slots = [tf.Variable(tf.zeros_like(v)) for v in init]
            counter = tf.Variable(0, dtype=tf.int32)

        def logits(inputs):
            h = inputs
            for i in range(0, len(params), 2):
                h = h @ params[i] + params[i + 1]
                if i + 2 < len(params):
                    h = tf.nn.relu(h)
            return h

        def replica_fn(x_all, y_all):
            k = counter.assign_add(1, read_value=True) - 1
            start = (k * args.batch) % (rows - args.batch)
            xb = tf.slice(x_all, [start, 0], [args.batch, sizes[0]])
            yb = tf.slice(y_all, [start], [args.batch])
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                    yb, logits(xb)))
            for v, s, g in zip(params, slots, tape.gradient(loss, params)):
                tf.raw_ops.ResourceApplyMomentum(
                    var=v.handle, accum=s.handle, lr=tf.constant(args.lr), grad=g,
                    momentum=tf.constant(0.9))
            return loss

        @tf.function
        def step(it):
            return strategy.run(replica_fn, args=next(it))

        def accuracy():
            predicted = np.argmax(logits(tf.constant(x_test)).numpy(), axis=1)
            return float(np.mean(predicted == y_test))

        return step, accuracy

    plain_step, plain_accuracy = make_copy()
    rdma_step, rdma_accuracy = make_copy()
    rdma_step = tf_rdma.rewrite(rdma_step)
    steps = {"grpc": plain_step, "tf_rdma": rdma_step}

    print(f"tf_rdma + ParameterServerStrategy: MLP {'-'.join(map(str, sizes))} on sklearn "
          f"digits; {len(workers)} worker(s), {len(cluster['ps'])} ps task(s), batch "
          f"{args.batch}; TensorFlow {tf.__version__}, tf_rdma {tf_rdma.__version__}")
    print(f"\nsynchronous: {args.steps} steps, each scheduled and joined before the next")
    losses = {name: [] for name in steps}
    report_every = max(1, args.steps // 5)
    for i in range(args.steps):
        for name, fn in steps.items():
            remote = coordinator.schedule(fn, args=(iterator,))
            coordinator.join()
            losses[name].append(remote.fetch())
        if i % report_every == 0 or i == args.steps - 1:
            print(f"  step {i:4d}  loss gRPC {losses['grpc'][-1]:.6f}  "
                  f"tf_rdma {losses['tf_rdma'][-1]:.6f}")
    a = np.array(losses["grpc"], np.float32).view(np.uint32)
    b = np.array(losses["tf_rdma"], np.float32).view(np.uint32)
    identical = bool(np.array_equal(a, b))
    if identical:
        print(f"losses: bit-identical at all {args.steps} steps, gRPC vs tf_rdma")
    else:
        print(f"losses: DIFFERENT at {int(np.sum(a != b))} of {args.steps} steps, "
              f"first at step {int(np.flatnonzero(a != b)[0])}")

    print(f"\nasynchronous: {args.async_steps} steps scheduled at once, per copy")
    rates = {}
    for name, fn in steps.items():
        coordinator.schedule(fn, args=(iterator,))   # warm-up (and traces) first
        coordinator.join()
        start = time.perf_counter()
        for _ in range(args.async_steps):
            coordinator.schedule(fn, args=(iterator,))
        coordinator.join()
        rates[name] = args.async_steps / (time.perf_counter() - start)
        print(f"  {name:8s} {rates[name]:8.1f} steps/s")
    print(f"  tf_rdma: {rates['tf_rdma'] / rates['grpc']:.2f}x the steps/s of gRPC")

    accuracy = {"grpc": plain_accuracy(), "tf_rdma": rdma_accuracy()}
    ok = identical
    for name, acc in accuracy.items():
        reached = acc >= args.target
        ok = ok and reached
        print(f"test accuracy ({name}): {acc:.4f} (target {args.target:g}: "
              f"{'reached' if reached else 'MISSED'})")

    moved = {w: tf_rdma.stats(w)["total"]["bytes_sent"] for w in workers}
    plans = {a.caller_task: a.plan for a in rdma_step.analyses}
    print(f"\none plan per worker (rdma_step.explain() prints them whole):")
    for caller, plan in sorted(plans.items()):
        print(f"  {caller}: {plan.name}, {len(plan.transfers)} transfers, "
              f"{plan.bytes_per_step / 2**20:.2f} MiB a step; sent through "
              f"tf_rdma: {moved.get(caller, 0) / 2**20:.1f} MiB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"example": "ps_strategy", "losses_identical": identical,
                       "losses": {n: [float(v) for v in l] for n, l in losses.items()},
                       "accuracy": accuracy, "steps_per_second": rates,
                       "workers_traced": sorted(plans), "bytes_sent": moved,
                       "ok": ok}, f, indent=1)
            f.write("\n")
    if not ok:
        print("\nFAILED: see above", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
