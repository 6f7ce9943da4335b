"""Model parallelism with ``@tf_rdma.rewrite``: an MLP split over two tasks.

What it shows
-------------
One model, cut in two: the first layers and their variables live on
``/job:worker/task:0``, the remaining layers, the loss and their variables on
``/job:worker/task:1``. A training step, written as one ``tf.function`` with
plain ``tf.device`` placement, runs

1. task 0: the first stage's forward pass on the step's batch (the inputs
   live on task 0), up to the cut activations ``h``;
2. task 1: the second stage's forward pass from ``h``, the loss (the labels
   live on task 1), the gradients of its own variables and the gradient of
   the loss with respect to ``h``;
3. task 0: the first stage's backward pass from that gradient
   (``tape.gradient(h, ..., output_gradients=dh)``);
4. each task applies momentum SGD to its own variables.

Only two tensors cross tasks per step: the activations ``h`` (task 0 -> 1)
and their gradient (task 1 -> 0), ``batch x cut width`` floats each (with the
default model, 64-1024 on task 0 and 1024-1024-10 on task 1, and a batch of
128: 0.5 MiB each way). TensorFlow moves them over gRPC; wrapped in
``tf_rdma.rewrite``, the same function moves them through preallocated
tf_rdma slots. Nothing else in the code changes.

The script trains two copies of the model from the same initial weights, one
with the plain ``tf.function`` (gRPC) and one with the rewritten function,
step by step interleaved, checks that their losses are bit-identical at every
step and that the test accuracy reaches the target, and prints the step
times, the speedup and the plan. It exits with status 1 if a loss differs or
the accuracy target is missed.

Each timed step is one client call (TensorFlow's dispatch to both tasks
included). The cut tensors are much smaller than the weights that a
parameter-server step moves (examples/ps_training.py), so here compute and
dispatch dominate and the speedup is small: model parallelism is chosen for
models that do not fit on one task, not to save traffic.

How to run
----------
From the repository root, with tf_rdma built (and scikit-learn installed)::

    tf-rdma launch -n 2 -- python examples/model_parallel.py
    tf-rdma launch -n 2 -- python examples/model_parallel.py --quick

``--json PATH`` also writes the losses, step times and plan summary as JSON.
"""

import argparse
import json
import os
import statistics
import sys
import time

MiB = 1024 * 1024
TASKS = ("/job:worker/task:0", "/job:worker/task:1")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Train an MLP on sklearn's digits split over two tasks "
                    "(first layers on worker 0, the rest on worker 1), with "
                    "and without @tf_rdma.rewrite. Run it under "
                    "`tf-rdma launch -n 2 -- python "
                    "examples/model_parallel.py`.")
    parser.add_argument("--stage0", type=int, nargs="+", default=[1024],
                        metavar="UNITS",
                        help="hidden layers on task 0; the last one is the "
                             "cut (default: 1024)")
    parser.add_argument("--stage1", type=int, nargs="*", default=[1024],
                        metavar="UNITS",
                        help="hidden layers on task 1, before the 10-way "
                             "output layer (default: 1024)")
    parser.add_argument("--batch", type=int, default=128,
                        help="batch size (default 128)")
    parser.add_argument("--steps", type=int, default=None,
                        help="training steps (default 200; --quick 40)")
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
                        help="40 steps, accuracy target 0.85 (for tests)")
    parser.add_argument("--no-grpc", dest="grpc", action="store_false",
                        help="train only the rewritten model")
    parser.add_argument("--local", action="store_true",
                        help="also train a third copy with both stages on "
                             "task 0: the same step without cross-task "
                             "tensors, the reference for what the transfers "
                             "cost")
    parser.add_argument("--json", metavar="PATH",
                        help="also write the results as JSON to PATH")
    args = parser.parse_args(argv)
    if args.steps is None:
        args.steps = 40 if args.quick else 200
    if args.target is None:
        args.target = 0.85 if args.quick else 0.95
    if args.steps <= args.warmup:
        parser.error("--steps must be larger than --warmup")
    if args.batch < 1 or min(args.stage0 + args.stage1 + [1]) < 1:
        parser.error("--batch and the layer sizes must be positive")
    return args


def cluster_from_env():
    """The cluster from TF_CONFIG, or None with a hint on stderr."""
    raw = os.environ.get("TF_CONFIG")
    if not raw:
        print("model_parallel: TF_CONFIG is not set. Run me under the "
              "launcher:\n    tf-rdma launch -n 2 -- python "
              "examples/model_parallel.py", file=sys.stderr)
        return None
    cluster = json.loads(raw).get("cluster", {})
    if len(cluster.get("worker", [])) < 2:
        print("model_parallel: the cluster needs 2 worker tasks "
              "(tf-rdma launch -n 2)", file=sys.stderr)
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
            kept.setdefault((e.kind, f"{e.src} -> {e.dst}", e.reason),
                            []).append(e)
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

    tf.config.experimental_connect_to_cluster(tf.train.ClusterSpec(cluster))

    x_train, y_train, x_test, y_test = load_digits(args.seed)
    if args.batch > len(x_train):
        print(f"{os.path.basename(__file__)}: --batch {args.batch} is larger "
              f"than the {len(x_train)} training examples", file=sys.stderr)
        return 2
    sizes = [x_train.shape[1]] + args.stage0 + args.stage1 + [10]
    cut = len(args.stage0)  # Layers [0, cut) on task 0, the rest on task 1.
    init = initial_weights(sizes, args.seed)
    order = batch_indices(len(x_train), args.batch, args.steps, args.seed)
    stage_bytes = [sum(p.nbytes for p in init[:2 * cut]),
                   sum(p.nbytes for p in init[2 * cut:])]
    cut_bytes = 4 * args.batch * sizes[cut]

    # Inputs on task 0, labels on task 1 (on task 0 too for --local); the
    # batch order on both. The client only sends the step number.
    values = {"x": x_train, "y": y_train, "order": order, "test_x": x_test,
              "test_y": y_test}
    placed = {TASKS[0]: ["x", "order", "test_x"] + (
                  ["y", "test_y"] if args.local else []),
              TASKS[1]: ["y", "order", "test_y"]}
    data = {}
    for task, names in placed.items():
        with tf.device(task):
            data[task] = {k: tf.Variable(values[k], trainable=False, name=k)
                          for k in names}

    class Stage:
        """Some dense layers and their momentum slots, on one task."""

        def __init__(self, tag, task, values, last):
            self.task, self.last = task, last
            self.params, self.slots = [], []
            with tf.device(task):
                for i, value in enumerate(values):
                    self.params.append(tf.Variable(value, name=f"{tag}_p{i}"))
                    self.slots.append(tf.Variable(
                        tf.zeros_like(value), trainable=False,
                        name=f"{tag}_m{i}"))

        def __call__(self, h):
            n = len(self.params)
            for i in range(0, n, 2):
                h = tf.matmul(h, self.params[i]) + self.params[i + 1]
                if not (self.last and i + 2 == n):
                    h = tf.nn.relu(h)
            return h

        def apply(self, grads):
            for var, slot, g in zip(self.params, self.slots, grads):
                tf.raw_ops.ResourceApplyMomentum(
                    var=var.handle, accum=slot.handle,
                    lr=tf.constant(args.lr), grad=g,
                    momentum=tf.constant(args.momentum))

    def make_model(tag, tasks=TASKS):
        return (Stage(f"{tag}_s0", tasks[0], init[:2 * cut], last=False),
                Stage(f"{tag}_s1", tasks[1], init[2 * cut:], last=True))

    def make_step(model):
        stage0, stage1 = model
        d0, d1 = data[stage0.task], data[stage1.task]

        @tf.function
        def train_step(step):
            start = step * args.batch
            with tf.device(stage0.task):
                idx = tf.slice(d0["order"].read_value(), [start],
                               [args.batch])
                x = tf.gather(d0["x"], idx)
                with tf.GradientTape() as tape0:
                    h = stage0(x)
            with tf.device(stage1.task):
                idx = tf.slice(d1["order"].read_value(), [start],
                               [args.batch])
                y = tf.gather(d1["y"], idx)
                with tf.GradientTape() as tape1:
                    tape1.watch(h)
                    loss = tf.reduce_mean(
                        tf.nn.sparse_softmax_cross_entropy_with_logits(
                            labels=y, logits=stage1(h)))
                grads1, dh = tape1.gradient(loss, (stage1.params, h))
                stage1.apply(grads1)
            with tf.device(stage0.task):
                grads0 = tape0.gradient(h, stage0.params,
                                        output_gradients=dh)
                stage0.apply(grads0)
            with tf.device(stage1.task):
                return tf.identity(loss)
        return train_step

    def make_eval(model):
        stage0, stage1 = model

        @tf.function
        def accuracy():
            with tf.device(stage0.task):
                h = stage0(data[TASKS[0]]["test_x"])
            with tf.device(stage1.task):
                predicted = tf.argmax(stage1(h), axis=1, output_type=tf.int32)
                return tf.reduce_mean(tf.cast(
                    tf.equal(predicted, data[stage1.task]["test_y"]),
                    tf.float32))
        return accuracy

    models = {}
    if args.grpc:
        models["grpc"] = make_model("grpc")
    models["tf_rdma"] = make_model("rdma")
    if args.local:
        models["local"] = make_model("local", (TASKS[0], TASKS[0]))
    steps = {"grpc": make_step(models["grpc"])} if args.grpc else {}
    steps["tf_rdma"] = tf_rdma.rewrite(make_step(models["tf_rdma"]))
    if args.local:
        steps["local"] = make_step(models["local"])
    evals = {name: make_eval(m) for name, m in models.items()}
    # Make sure every initial value has landed before the first step
    # (remote eager ops are not ordered with remote function calls).
    for v in [v for d in data.values() for v in d.values()] + [
            p for m in models.values() for s in m for p in s.params + s.slots]:
        tf.reduce_sum(v).numpy()

    print(f"tf_rdma model-parallel training: MLP "
          f"{'-'.join(map(str, sizes))} on sklearn digits "
          f"({len(x_train)} train / {len(x_test)} test)")
    print(f"layers {'-'.join(map(str, sizes[:cut + 1]))} "
          f"({stage_bytes[0] / MiB:.2f} MiB of weights) on {TASKS[0]}, "
          f"{'-'.join(map(str, sizes[cut:]))} "
          f"({stage_bytes[1] / MiB:.2f} MiB) on {TASKS[1]}")
    print(f"batch {args.batch}, {args.steps} steps, momentum SGD "
          f"lr={args.lr:g}; per step the cut activations "
          f"[{args.batch}, {sizes[cut]}] ({cut_bytes / MiB:.2f} MiB) go to "
          f"task 1 and their gradient comes back")
    print(f"(servers' TF_RDMA_TRANSPORT: "
          f"{os.environ.get('TF_RDMA_TRANSPORT', 'auto')}; TensorFlow "
          f"{tf.__version__}, tf_rdma {tf_rdma.__version__})")
    print()

    losses = {name: [] for name in steps}
    times = {name: [] for name in steps}
    report_every = max(1, args.steps // 6)
    print("  step " + "".join(f"{'loss ' + n:>16s}" for n in steps))
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
    identical = None
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
            "example": "model_parallel",
            "model": sizes, "cut": cut, "batch": args.batch,
            "steps": args.steps, "warmup": args.warmup,
            "stage_weight_bytes": stage_bytes, "cut_bytes": cut_bytes,
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
