"""Keras ``fit`` with ``tf_rdma.distribute.RdmaStrategy``: an MLP on sklearn's digits.

What it shows
-------------
Synchronous data-parallel training, one process per worker, written as
ordinary Keras::

    strategy = tf_rdma.distribute.RdmaStrategy()      # cluster from TF_CONFIG
    with strategy.scope():
        model = make_model()
        model.compile(optimizer=..., loss=..., metrics=["accuracy"])
    model.fit(x_train, y_train, batch_size=GLOBAL_BATCH, epochs=...)
    model.evaluate(x_test, y_test)

Each worker reads its half of every global batch, computes the gradients of
its half, and the gradients are summed over the workers in static buckets by
tf_rdma's pipelined all-reduce (shared memory here; TCP or RDMA between
hosts). Every worker starts from the chief's initial weights and ends with
the same weights.

The script then trains the same model from the same weights, on the same
batches, under TensorFlow's ``MultiWorkerMirroredStrategy`` (gRPC, with its
own collectives) and prints the test accuracy of both and their training
throughput in samples per second (epochs after the first, which includes the
tracing). It exits with status 1 if RdmaStrategy misses the accuracy target.

What to expect
--------------
On the 2-core test VM (shared memory between the workers; other jobs
running), the default run reaches 0.961 test accuracy under both strategies
(the same weights: both start from the chief's and sum the same gradients)
and RdmaStrategy trained at 1.25x to 1.65x the samples/s of
MultiWorkerMirroredStrategy over four runs (one run, with other jobs
loading the machine heavily, measured 0.6x); ``--quick`` reaches 0.936. The
model's 1.2 MB of gradients fit one 4 MiB bucket (``--bucket-bytes`` to
split them). Timings on a loaded 2-core machine vary by tens of percent
from run to run.

How to run
----------
From the repository root, with tf_rdma built (and scikit-learn installed)::

    tf-rdma launch -n 2 -- python examples/keras_digits.py
    tf-rdma launch -n 2 -- python examples/keras_digits.py --quick
    python examples/keras_digits.py --workers 2        # the same, without launch

A strategy runs *in* every worker process (SPMD), so this script plays two
parts. Started with a ``TF_CONFIG`` that names no task -- as ``tf-rdma
launch`` starts its command, the client of a cluster of tf_rdma servers --
it is the *driver*: it takes the number of workers from that cluster and
starts that many copies of itself as workers, on fresh local ports, each
with its own ``TF_CONFIG`` task (the launched servers are not used: a server
process cannot run this program's Python), once with RdmaStrategy and once
with MultiWorkerMirroredStrategy, and prints the comparison (the workers
of both each bound to their own CPUs where there are enough, as ``tf-rdma
launch`` binds its tasks). Started with a
``TF_CONFIG`` task (``--strategy`` says which), it is one worker; that is
how it runs on a real cluster, one copy per host.

Keras 3.15's ``fit`` does not run under a multi-worker
MultiWorkerMirroredStrategy of TensorFlow 2.21 as is; the baseline applies
the two fixes of ``patch_mwms_for_keras_fit`` in examples/mwms_keras.py (see
there). RdmaStrategy needs neither.
"""

import argparse
import json
import os
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
RESULT_PREFIX = "KERAS_DIGITS_RESULT "


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Keras fit of an MLP on sklearn's digits with "
                    "RdmaStrategy, compared with MultiWorkerMirroredStrategy. "
                    "Run it under `tf-rdma launch -n 2 -- python "
                    "examples/keras_digits.py`.")
    parser.add_argument("--workers", type=int, default=None,
                        help="workers to start when there is no cluster "
                             "(default: the cluster's, else 2)")
    parser.add_argument("--strategy", choices=("rdma", "mwms"),
                        default="rdma",
                        help="in a worker: which strategy (default rdma)")
    parser.add_argument("--hidden", type=int, nargs="+", default=[512, 512],
                        metavar="UNITS",
                        help="hidden layer sizes (default: 512 512)")
    parser.add_argument("--batch", type=int, default=64,
                        help="global batch size (default 64)")
    parser.add_argument("--epochs", type=int, default=None,
                        help="epochs (default 8; --quick 3)")
    parser.add_argument("--lr", type=float, default=0.02,
                        help="learning rate (default 0.02)")
    parser.add_argument("--bucket-bytes", type=int, default=None,
                        help="RdmaStrategy's largest gradient bucket "
                             "(default: the strategy's)")
    parser.add_argument("--target", type=float, default=None,
                        help="test accuracy RdmaStrategy must reach "
                             "(default 0.95; --quick 0.9)")
    parser.add_argument("--quick", action="store_true",
                        help="a short run, as the tests use")
    parser.add_argument("--no-baseline", action="store_true",
                        help="skip the MultiWorkerMirroredStrategy run")
    parser.add_argument("--timeout", type=float, default=600,
                        help="seconds each set of workers may take "
                             "(default 600)")
    args = parser.parse_args(argv)
    if args.epochs is None:
        args.epochs = 3 if args.quick else 8
    if args.target is None:
        args.target = 0.9 if args.quick else 0.95
    if args.epochs < 2:
        parser.error("--epochs must be at least 2 (the first is not timed)")
    return args


# --------------------------------------------------------------------------
# One worker.


class _EpochTimer:
    """A Keras callback that records each epoch's wall time."""

    def __init__(self):
        import keras  # pylint: disable=import-outside-toplevel

        timer = self

        class Callback(keras.callbacks.Callback):
            def on_epoch_begin(self, epoch, logs=None):
                timer.start = time.perf_counter()

            def on_epoch_end(self, epoch, logs=None):
                timer.times.append(time.perf_counter() - timer.start)

        self.times = []
        self.start = None
        self.callback = Callback()


def run_worker(args):
    """Trains under the strategy of ``--strategy``; prints a result line."""
    import numpy as np  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    import keras  # pylint: disable=import-outside-toplevel
    from sklearn.datasets import load_digits  # pylint: disable=import-outside-toplevel
    from sklearn.model_selection import train_test_split  # pylint: disable=import-outside-toplevel

    import tf_rdma  # pylint: disable=import-outside-toplevel
    import tf_rdma.distribute  # pylint: disable=import-outside-toplevel

    if args.strategy == "rdma":
        kwargs = {}
        if args.bucket_bytes is not None:
            kwargs["bucket_bytes"] = args.bucket_bytes
        strategy = tf_rdma.distribute.RdmaStrategy(**kwargs)
        rank = strategy.worker_index
    else:
        import mwms_keras  # pylint: disable=import-outside-toplevel
        strategy = mwms_keras.patch_mwms_for_keras_fit(
            tf.distribute.MultiWorkerMirroredStrategy())
        rank = strategy.cluster_resolver.task_id

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y.astype(np.int64), test_size=0.2, random_state=0)
    # Whole global batches only: every worker runs the same steps.
    n = len(x_train) // args.batch * args.batch
    x_train, y_train = x_train[:n], y_train[:n]

    keras.utils.set_random_seed(1234)  # both strategies start alike
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((64,))]
            + [keras.layers.Dense(u, activation="relu") for u in args.hidden]
            + [keras.layers.Dense(10)])
        model.compile(
            optimizer=keras.optimizers.SGD(args.lr, momentum=0.9),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"])
    timer = _EpochTimer()
    model.fit(x_train, y_train, batch_size=args.batch, epochs=args.epochs,
              shuffle=False, verbose=0, callbacks=[timer.callback])
    result = model.evaluate(x_test, y_test, batch_size=args.batch, verbose=0,
                            return_dict=True)
    timed = sum(timer.times[1:])
    out = {
        "strategy": args.strategy,
        "rank": rank,
        "workers": strategy.num_replicas_in_sync,
        "params": int(model.count_params()),
        "accuracy": float(result["accuracy"]),
        "loss": float(result["loss"]),
        "samples_per_s": n * (args.epochs - 1) / timed,
        "epoch_s": timer.times,
    }
    if args.strategy == "rdma":
        out["buckets"] = [len(p.buckets) for p in strategy.bucket_plans]
    print(RESULT_PREFIX + json.dumps(out), flush=True)
    return 0


# --------------------------------------------------------------------------
# The driver.


def _forward_stderr(stream, env):
    """Copies a worker's stderr to ours, line by line, without TensorFlow's
    start-up notices when `env` asks for no INFO (as tf-rdma launch does)."""
    from tf_rdma.launch import hides_tensorflow_notice  # pylint: disable=import-outside-toplevel

    for line in stream:
        if not hides_tensorflow_notice(line, env):
            sys.stderr.write(line)
            sys.stderr.flush()


def _collect(stream, outputs, index):
    """Reads a worker's stdout to its end into outputs[index]."""
    outputs[index] = stream.read()


def _run_workers(args, strategy, num_workers, passthrough):
    """Starts num_workers copies of this script as workers; returns rank 0's result."""
    sys.path.insert(0, REPO)
    from tf_rdma import cluster as cluster_lib  # pylint: disable=import-outside-toplevel
    from tf_rdma.launch import cpu_shares  # pylint: disable=import-outside-toplevel

    ports = cluster_lib.free_ports(num_workers, cluster_lib.port_offset())
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TF_RDMA_SECRET", os.urandom(16).hex())
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    # Each worker on its own CPUs where there are enough, as tf-rdma launch
    # binds its tasks (both strategies alike).
    shares = cpu_shares(num_workers)
    if shares is not None:
        env["TF_RDMA_HOST_CPUS"] = str(sum(len(share) for share in shares))
    else:
        env.pop("TF_RDMA_HOST_CPUS", None)
    procs, forwarders, outputs = [], [], [""] * num_workers
    for i in range(num_workers):
        e = dict(env, TF_CONFIG=json.dumps(
            {"cluster": cluster, "task": {"type": "worker", "index": i}}))
        share = shares[i] if shares is not None else None
        procs.append(subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--strategy",
             strategy] + passthrough,
            env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True,
            preexec_fn=(None if share is None else
                        lambda share=share: os.sched_setaffinity(0, share))))
        # stderr is forwarded as it comes, stdout (the result) collected.
        forwarders.append(threading.Thread(
            target=_forward_stderr, args=(procs[-1].stderr, env),
            daemon=True))
        forwarders.append(threading.Thread(
            target=_collect, args=(procs[-1].stdout, outputs, i),
            daemon=True))
    for forwarder in forwarders:
        forwarder.start()
    deadline = time.monotonic() + args.timeout
    failed = None
    for i, proc in enumerate(procs):
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            proc.wait()
            failed = failed or f"worker {i} did not finish in {args.timeout:g} s"
        if proc.returncode != 0 and failed is None:
            failed = f"worker {i} exited with status {proc.returncode}"
            for p in procs:
                if p.poll() is None:
                    p.kill()
    for forwarder in forwarders:
        forwarder.join(timeout=10)
    if failed is not None:
        raise RuntimeError(f"{strategy}: {failed}")
    results = [json.loads(line[len(RESULT_PREFIX):])
               for line in outputs[0].splitlines()
               if line.startswith(RESULT_PREFIX)]
    if not results:
        raise RuntimeError(f"{strategy}: worker 0 printed no result")
    return results[-1]


def run_driver(args):
    """Runs the workers of both strategies and prints the comparison."""
    num_workers = args.workers
    config = os.environ.get("TF_CONFIG")
    if num_workers is None and config:
        num_workers = len(json.loads(config).get("cluster", {}).get(
            "worker", [])) or None
    num_workers = num_workers or 2
    if config:
        print(f"keras_digits: the cluster's {num_workers} workers run this "
              f"program, each in its own process (fresh local ports)",
              flush=True)
    passthrough = (["--hidden"] + [str(u) for u in args.hidden]
                   + ["--batch", str(args.batch), "--epochs", str(args.epochs),
                      "--lr", repr(args.lr)])
    if args.bucket_bytes is not None:
        passthrough += ["--bucket-bytes", str(args.bucket_bytes)]
    rdma = _run_workers(args, "rdma", num_workers, passthrough)
    buckets = "+".join(str(b) for b in rdma.get("buckets") or [0])
    print(f"RdmaStrategy ({num_workers} workers, {rdma['params']} parameters, "
          f"gradients in {buckets} bucket(s)): test accuracy "
          f"{rdma['accuracy']:.4f}, {rdma['samples_per_s']:.0f} samples/s",
          flush=True)
    status = 0
    if rdma["accuracy"] < args.target:
        print(f"keras_digits: test accuracy {rdma['accuracy']:.4f} is below "
              f"the target {args.target}", flush=True)
        status = 1
    if not args.no_baseline:
        mwms = _run_workers(args, "mwms", num_workers, passthrough)
        print(f"MultiWorkerMirroredStrategy ({num_workers} workers): test "
              f"accuracy {mwms['accuracy']:.4f}, "
              f"{mwms['samples_per_s']:.0f} samples/s", flush=True)
        print(f"RdmaStrategy vs MultiWorkerMirroredStrategy: "
              f"{rdma['samples_per_s']:.0f} vs {mwms['samples_per_s']:.0f} "
              f"samples/s ({rdma['samples_per_s'] / mwms['samples_per_s']:.2f}x)",
              flush=True)
    return status


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    config = json.loads(os.environ.get("TF_CONFIG") or "{}")
    if config.get("task"):
        return run_worker(args)
    return run_driver(args)


if __name__ == "__main__":
    sys.exit(main())
