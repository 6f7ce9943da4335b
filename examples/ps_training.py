"""Parameter-server training with ``@tf_rdma.rewrite``: an MLP on sklearn's digits.

What it shows
-------------
A classic parameter-server step, written as one ``tf.function`` with plain
``tf.device`` placement:

* the variables (weights, biases and their momentum slots) live on the ps
  tasks, layer by layer round-robin (``/job:ps/task:*``);
* every worker task (``/job:worker/task:*``) holds the whole training set in
  its own memory, picks its share of the step's batch (the step number is the
  only argument the client sends), reads the weights from the ps tasks, runs
  the forward and backward pass and produces one gradient per variable;
* the ps tasks average the workers' gradients and apply momentum SGD to
  their variables.

So every step moves all the weights from the ps tasks to each worker and all
the gradients back: about 2 x 4.5 MB per worker with the default model
(64-1024-1024-10). TensorFlow sends each of those tensors over gRPC. Wrapped
in ``tf_rdma.rewrite``, the same function moves them through tf_rdma instead:
the decorator finds every cross-task tensor, gives it a preallocated slot on
the receiving task and swaps the edge for a send/recv pair (shared memory on
one host, TCP or RDMA between hosts). Nothing else in the code changes.

The script trains two copies of the model from the same initial weights, one
with the plain ``tf.function`` (gRPC) and one with the rewritten function
(tf_rdma), step by step interleaved, so that both see the same machine. It
checks that the two losses are bit-identical at every step and that the
test accuracy reaches the target, then prints the step times (median after
warm-up), the speedup and the plan the rewrite made. It exits with status 1
if a loss differs or the accuracy target is missed.

Each timed step is one client call of the step function, so it includes
TensorFlow's dispatch of the function to every task (a few ms on top of the
compute and the transfers).

How to run
----------
From the repository root, with tf_rdma built (and scikit-learn installed)::

    tf-rdma launch -n 1 --ps 1 -- python examples/ps_training.py
    tf-rdma launch -n 2 --ps 2 -- python examples/ps_training.py --hidden 512
    tf-rdma launch -n 1 --ps 1 -- python examples/ps_training.py --quick

``--json PATH`` also writes the losses, the step times and the plan summary
as JSON (used by ``bench/rewrite.py`` and the tests).
"""

import argparse
import json
import os
import statistics
import sys
import time

MiB = 1024 * 1024


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Train an MLP on sklearn's digits, parameter-server "
                    "style (variables on ps tasks, forward/backward on "
                    "worker tasks), with and without @tf_rdma.rewrite. Run "
                    "it under `tf-rdma launch -n 1 --ps 1 -- python "
                    "examples/ps_training.py`.")
    parser.add_argument("--hidden", type=int, nargs="+", default=None,
                        metavar="UNITS",
                        help="hidden layer sizes (default: 1024 1024)")
    parser.add_argument("--batch", type=int, default=32,
                        help="global batch size, split over the workers "
                             "(default 32)")
    parser.add_argument("--steps", type=int, default=None,
                        help="training steps (default 300; --quick 60)")
    parser.add_argument("--warmup", type=int, default=5,
                        help="first steps left out of the step times "
                             "(default 5)")
    parser.add_argument("--lr", type=float, default=0.02,
                        help="learning rate (default 0.02)")
    parser.add_argument("--momentum", type=float, default=0.9,
                        help="momentum (default 0.9)")
    parser.add_argument("--target", type=float, default=None,
                        help="test accuracy to reach (default 0.95; "
                             "--quick 0.85)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true",
                        help="60 steps, accuracy target 0.85 (for tests)")
    parser.add_argument("--no-grpc", dest="grpc", action="store_false",
                        help="train only the rewritten model (no baseline, "
                             "no loss comparison)")
    parser.add_argument("--local", action="store_true",
                        help="also train a third copy with every variable "
                             "on worker 0: the same step without ps "
                             "traffic, the reference for what the transfers "
                             "cost (with one worker: no cross-task tensor at "
                             "all)")
    parser.add_argument("--json", metavar="PATH",
                        help="also write the results as JSON to PATH")
    args = parser.parse_args(argv)
    if args.hidden is None:
        args.hidden = [1024, 1024]
    if args.steps is None:
        args.steps = 60 if args.quick else 300
    if args.target is None:
        args.target = 0.85 if args.quick else 0.95
    if args.steps <= args.warmup:
        parser.error("--steps must be larger than --warmup")
    if args.batch < 1 or min(args.hidden) < 1:
        parser.error("--batch and --hidden must be positive")
    return args


def cluster_from_env():
    """The cluster from TF_CONFIG, or None with a hint on stderr."""
    raw = os.environ.get("TF_CONFIG")
    if not raw:
        print("ps_training: TF_CONFIG is not set. Run me under the launcher:\n"
              "    tf-rdma launch -n 1 --ps 1 -- python "
              "examples/ps_training.py", file=sys.stderr)
        return None
    cluster = json.loads(raw).get("cluster", {})
    if not cluster.get("worker") or not cluster.get("ps"):
        print("ps_training: the cluster needs at least one worker and one ps "
              "task (tf-rdma launch -n 1 --ps 1)", file=sys.stderr)
        return None
    return cluster


def load_digits(seed, n_test=360):
    """sklearn's bundled 8x8 digits (no download): train and test split."""
    import numpy as np
    from sklearn.datasets import load_digits as sk_load_digits

    digits = sk_load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    order = np.random.RandomState(seed).permutation(len(x))
    test, train = order[:n_test], order[n_test:]
    return x[train], y[train], x[test], y[test]


def initial_weights(sizes, seed):
    """Glorot-uniform weights and zero biases, as numpy arrays."""
    import numpy as np

    rng = np.random.RandomState(seed)
    params = []
    for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
        limit = np.sqrt(6.0 / (fan_in + fan_out))
        params.append(rng.uniform(-limit, limit, (fan_in, fan_out))
                      .astype(np.float32))
        params.append(np.zeros([fan_out], np.float32))
    return params


def batch_indices(n_train, batch, steps, seed):
    """Indices of every step's batch: a fresh permutation per epoch."""
    import numpy as np

    rng = np.random.RandomState(seed + 1)
    per_epoch = max(1, n_train // batch)
    epochs = -(-steps // per_epoch)
    rows = [rng.permutation(n_train)[:per_epoch * batch] for _ in
            range(epochs)]
    return np.concatenate(rows).astype(np.int32)[:steps * batch]


def plan_report(fn):
    """The plan of a rewritten function and what it kept, grouped by reason."""
    analysis = fn.analyses[-1]
    lines = [fn.plan.summary()]
    kept = {}
    for e in analysis.edges:
        if e.kind in ("kept", "dynamic"):
            route = f"{e.src} -> {e.dst}"
            kept.setdefault((e.kind, route, e.reason), []).append(e)
    moved = len(analysis.edges) - sum(len(v) for v in kept.values())
    lines.append(f"cross-task edges: {len(analysis.edges)}; {moved} moved by "
                 f"tf_rdma, the rest left to TensorFlow:")
    for (kind, route, reason), edges in sorted(kept.items()):
        data = sum(1 for e in edges if e.index >= 0)
        what = (f"{data} tensor(s), {len(edges) - data} control edge(s)"
                if data else f"{len(edges)} control edge(s)")
        lines.append(f"  {kind}: {what} {route}: {reason}")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    cluster = cluster_from_env()
    if cluster is None:
        return 2

    import numpy as np
    import tensorflow as tf

    import tf_rdma

    workers = [f"/job:worker/task:{i}" for i in range(len(cluster["worker"]))]
    ps_tasks = [f"/job:ps/task:{i}" for i in range(len(cluster["ps"]))]
    num_workers = len(workers)
    if args.batch % num_workers:
        print(f"ps_training: --batch {args.batch} is not a multiple of the "
              f"{num_workers} workers", file=sys.stderr)
        return 2
    local_batch = args.batch // num_workers

    tf.config.experimental_connect_to_cluster(tf.train.ClusterSpec(cluster))

    x_train, y_train, x_test, y_test = load_digits(args.seed)
    if args.batch > len(x_train):
        print(f"{os.path.basename(__file__)}: --batch {args.batch} is larger "
              f"than the {len(x_train)} training examples", file=sys.stderr)
        return 2
    sizes = [x_train.shape[1]] + list(args.hidden) + [10]
    init = initial_weights(sizes, args.seed)
    order = batch_indices(len(x_train), args.batch, args.steps, args.seed)
    weight_bytes = sum(p.nbytes for p in init)

    # The data set lives on every worker (it is small); a step only needs its
    # number from the client.
    data = []
    for w in workers:
        with tf.device(w):
            data.append({
                "x": tf.Variable(x_train, trainable=False, name="x_train"),
                "y": tf.Variable(y_train, trainable=False, name="y_train"),
                "order": tf.Variable(order, trainable=False, name="order"),
            })
    with tf.device(workers[0]):
        test_x = tf.Variable(x_test, trainable=False, name="x_test")
        test_y = tf.Variable(y_test, trainable=False, name="y_test")

    class Model:
        """The MLP's variables and momentum slots, layer l on hosts[l % n]."""

        def __init__(self, tag, hosts):
            self.params, self.slots = [], []
            for i, value in enumerate(init):
                with tf.device(hosts[(i // 2) % len(hosts)]):
                    kind = "w" if i % 2 == 0 else "b"
                    self.params.append(
                        tf.Variable(value, name=f"{tag}_{kind}{i // 2}"))
                    self.slots.append(tf.Variable(
                        tf.zeros_like(value), trainable=False,
                        name=f"{tag}_m_{kind}{i // 2}"))

        def logits(self, x):
            h = x
            for i in range(0, len(self.params), 2):
                h = tf.matmul(h, self.params[i]) + self.params[i + 1]
                if i + 2 < len(self.params):
                    h = tf.nn.relu(h)
            return h

    def make_step(model):
        @tf.function
        def train_step(step):
            losses, grads = [], []
            for w, device in enumerate(workers):
                with tf.device(device):
                    start = step * args.batch + w * local_batch
                    idx = tf.slice(data[w]["order"].read_value(), [start],
                                   [local_batch])
                    x = tf.gather(data[w]["x"], idx)
                    y = tf.gather(data[w]["y"], idx)
                    with tf.GradientTape() as tape:
                        loss = tf.reduce_mean(
                            tf.nn.sparse_softmax_cross_entropy_with_logits(
                                labels=y, logits=model.logits(x)))
                    grads.append(tape.gradient(loss, model.params))
                    losses.append(loss)
            for i, (var, slot) in enumerate(zip(model.params, model.slots)):
                with tf.device(var.device):
                    g = grads[0][i]
                    if num_workers > 1:
                        g = tf.add_n([gw[i] for gw in grads]) / num_workers
                    # The fused in-place kernel that TensorFlow's own
                    # MomentumOptimizer uses: one pass over var, slot and g.
                    tf.raw_ops.ResourceApplyMomentum(
                        var=var.handle, accum=slot.handle,
                        lr=tf.constant(args.lr), grad=g,
                        momentum=tf.constant(args.momentum))
            with tf.device(workers[0]):
                return tf.add_n(losses) / num_workers if num_workers > 1 \
                    else losses[0]
        return train_step

    def make_eval(model):
        @tf.function
        def accuracy():
            with tf.device(workers[0]):
                predicted = tf.argmax(model.logits(test_x), axis=1,
                                      output_type=tf.int32)
                return tf.reduce_mean(
                    tf.cast(tf.equal(predicted, test_y), tf.float32))
        return accuracy

    runs = {}
    if args.grpc:
        runs["grpc"] = Model("grpc", ps_tasks)
    runs["tf_rdma"] = Model("rdma", ps_tasks)
    if args.local:
        runs["local"] = Model("local", workers[:1])
    steps = {"grpc": make_step(runs["grpc"])} if args.grpc else {}
    steps["tf_rdma"] = tf_rdma.rewrite(make_step(runs["tf_rdma"]))
    if args.local:
        steps["local"] = make_step(runs["local"])
    evals = {name: make_eval(model) for name, model in runs.items()}
    # Make sure every variable's initial value has landed before the first
    # step (remote eager ops are not ordered with remote function calls).
    for model in runs.values():
        for v in model.params + model.slots:
            tf.reduce_sum(v).numpy()
    for d in data:
        for v in d.values():
            tf.reduce_sum(v).numpy()

    print(f"tf_rdma parameter-server training: MLP {'-'.join(map(str, sizes))} "
          f"on sklearn digits ({len(x_train)} train / {len(x_test)} test)")
    print(f"{num_workers} worker(s), {len(ps_tasks)} ps task(s); batch "
          f"{args.batch}, {args.steps} steps, momentum SGD lr={args.lr:g}; "
          f"weights {weight_bytes / MiB:.2f} MiB: each step moves them to "
          f"every worker and the gradients back")
    print(f"(servers' TF_RDMA_TRANSPORT: "
          f"{os.environ.get('TF_RDMA_TRANSPORT', 'auto')}; TensorFlow "
          f"{tf.__version__}, tf_rdma {tf_rdma.__version__})")
    print()

    losses = {name: [] for name in steps}
    times = {name: [] for name in steps}
    report_every = max(1, args.steps // 6)
    header = "  step " + "".join(f"{'loss ' + n:>16s}" for n in steps)
    print(header)
    t_train = time.perf_counter()
    for i in range(args.steps):
        s = tf.constant(i, tf.int32)
        for name, fn in steps.items():
            t0 = time.perf_counter()
            loss = fn(s).numpy()  # .numpy() waits for the step to finish
            times[name].append(time.perf_counter() - t0)
            losses[name].append(loss)
        if i % report_every == 0 or i == args.steps - 1:
            print(f"  {i:4d} " + "".join(f"{losses[n][-1]:16.6f}"
                                         for n in steps))
    train_s = time.perf_counter() - t_train
    accuracy = {name: float(fn().numpy()) for name, fn in evals.items()}

    ok = True
    print()
    if args.grpc:
        a = np.array(losses["grpc"], np.float32).view(np.uint32)
        b = np.array(losses["tf_rdma"], np.float32).view(np.uint32)
        differ = np.flatnonzero(a != b)
        identical = len(differ) == 0
        if identical:
            print(f"losses: bit-identical at all {args.steps} steps, gRPC vs "
                  f"tf_rdma")
        else:
            ok = False
            print(f"losses: DIFFERENT at {len(differ)} of {args.steps} steps, "
                  f"first at step {differ[0]}")
    else:
        identical = None
    if args.local:
        same = losses["local"] == losses["tf_rdma"]
        print(f"losses of the local copy: "
              f"{'the same' if same else 'not the same'} as tf_rdma's "
              f"(informational: other placement, same kernels)")
    for name, acc in accuracy.items():
        reached = acc >= args.target
        ok = ok and reached
        print(f"test accuracy ({name}): {acc:.4f} (target {args.target:g}: "
              f"{'reached' if reached else 'MISSED'})")

    load = os.getloadavg()
    med = {n: statistics.median(t[args.warmup:]) for n, t in times.items()}
    print(f"\nstep time, median of {args.steps - args.warmup} steps after "
          f"{args.warmup} warm-up (client dispatch included; load average "
          f"{load[0]:.2f} on {os.cpu_count()} cores):")
    for name, t in times.items():
        print(f"  {name:8s} median {med[name] * 1e3:8.2f} ms   "
              f"min {min(t[args.warmup:]) * 1e3:8.2f} ms")
    speedup = None
    if args.grpc:
        speedup = med["grpc"] / med["tf_rdma"]
        print(f"  speedup: tf_rdma is {speedup:.2f}x "
              f"{'faster' if speedup >= 1 else 'slower'} than gRPC")
    print(f"  training took {train_s:.1f} s in all")

    fn = steps["tf_rdma"]
    plan = fn.plan
    print("\nthe plan @tf_rdma.rewrite made for the step (fn.plan; "
          "fn.explain() lists every edge it kept):")
    summary = plan_report(fn)
    print(summary)

    if args.json:
        doc = {
            "example": "ps_training",
            "model": sizes, "batch": args.batch, "steps": args.steps,
            "warmup": args.warmup, "workers": num_workers,
            "ps": len(ps_tasks), "weight_bytes": weight_bytes,
            "losses": {n: [float(x) for x in l] for n, l in losses.items()},
            "losses_identical": identical,
            "accuracy": accuracy, "target": args.target,
            "step_times_s": times,
            "median_step_s": med, "speedup": speedup,
            "plan": {"name": plan.name, "hash": plan.hash,
                     "transfers": len(plan.transfers),
                     "bytes_per_step": plan.bytes_per_step},
            "plan_summary": summary,
            "loadavg_end": list(load),
            "ok": ok,
        }
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
    if not ok:
        print("\nFAILED: see above", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
