#!/usr/bin/env python3
"""Data-parallel training throughput: tf_rdma.distribute.RdmaStrategy vs
MultiWorkerMirroredStrategy, P local worker processes, and their scaling
against the same step without communication.

Usage::

    python bench/train.py [--json PATH] [--steps N] [--quick]

The script is its own orchestrator and never imports TensorFlow itself. For
each system it starts P worker processes (this file again, in ``--worker``
mode) under a hard time limit, the strategies' workers with ``TF_CONFIG``
set per process (cluster ports from ``tf_rdma.cluster.free_ports``); every
worker trains the same Keras model under its strategy and writes its step
times and losses to a file, which the orchestrator collects.

``mwms-ring``
    ``tf.distribute.MultiWorkerMirroredStrategy`` with
    ``CommunicationImplementation.RING``: the Keras optimizer sums the
    gradients with ``get_replica_context().all_reduce``, TensorFlow's
    collectives over gRPC.
``tf_rdma-<algorithm>``
    ``tf_rdma.distribute.RdmaStrategy(algorithm=..., bucket_bytes=...)``
    (``--algorithm``, default auto; ``--bucket-bytes``, default the
    strategy's), used the same way; ``TF_RDMA_SECRET`` is set for the job.
``nocomm``
    No communication, P workers: P worker processes started the same way
    (same model, per-worker batch, loop, seeds and data, the loss still
    scaled by the global batch), each under the default strategy and
    applying its own gradients: the step with the gradient sum skipped, the
    P workers sharing the cores as the strategies' workers do. They share
    no collective, so files in the work folder line them up outside the
    timed steps: every rank starts its timed steps once all have warmed up
    and keeps stepping, untimed, until all have finished theirs. The
    reference of the scaling.
``local``
    One process alone on the machine, the default strategy, the
    per-replica batch: the step without communication and without sharing
    the cores.

Scaling = nocomm's step time / a strategy's (the fraction of the
communication-free throughput it keeps, same P and batch); the issue's
target is RdmaStrategy >= 85% at P = 2, printed as a check line, with
MWMS's for context.

The model is communication-bound on purpose: a multilayer perceptron with
large dense layers (by default 1024-4096-4096-1024-10, 25.2 M parameters,
101 MB of float32 gradients summed every step) on synthetic data (a fixed
random batch of 32 per worker, the same for both systems), plain SGD (a
momentum update adds passes over the 101 MB of weights: compute that would
hide the communication on a machine with few cores). Every worker seeds Keras
the same way, so both systems start from the same weights and see the same
data; their losses are printed side by side (they should agree to rounding:
the sums may be taken in another order).

The step is the custom training loop of TensorFlow's multi-worker tutorial:
a ``tf.function`` that runs ``strategy.run(step_fn)`` (forward, loss scaled
by the global batch, ``GradientTape``, ``optimizer.apply_gradients``, which
sums the gradients over the replicas as it does inside ``model.fit``) and
returns the loss summed over the replicas. Not ``model.fit``: Keras 3.15's
fit fails under a multi-worker MWMS (``_maybe_symbolic_build`` calls
``strategy.reduce`` eagerly on a PerReplica batch).

``--model embedding``: a recommender-style model instead, whose largest
gradient is sparse: an ``Embedding`` table of ``--vocab`` x ``--dim``
(default 10^6 x 64 float32, 256 MB) looked up ``--ids`` times per sample
(default 8), then Dense 256 and 64 (ReLU) and one logit, binary
cross-entropy, plain SGD, per-replica batch 512. The table's gradient is an
``IndexedSlices`` of batch x ids rows. Systems: ``tf_rdma`` (RdmaStrategy,
sparse rows all-gathered, as MWMS does), ``tf_rdma_dense``
(``sparse_as_dense=True``: the whole table all-reduced every step) and
``mwms``. Each worker reports the bytes it hands to the collectives per step
(its gradient payload: rows and indices of a sparse gradient, the whole
table of a dense one, plus the dense layers).

Timing: every worker times each call of the step until its loss is back
(``.numpy()``); the time of a step is the slowest rank's, and the first
--warmup steps (tracing, the strategy's setup) are not counted.
samples/s = P x per-replica batch / median step time.
"""

import argparse
import os
import statistics
import sys
import time

from _harness import networks
from _harness.children import (add_bind_argument, add_local_cluster,
                               add_process_arguments,
                               make_tf_rdma_job, run_processes, work_dir,
                               worker_env)
from _harness.report import (Run, print_table, result_entry, save_json,
                             slowest_rank, verdict)
from _harness.units import human_time
from _harness.worker import (MWMS, group_cluster, mwms_ring,
                             set_tf_config)

SYSTEM_KINDS = ("mwms", "tf_rdma", "tf_rdma_dense", "nocomm", "local")
DEFAULT_SYSTEMS = ("mwms", "tf_rdma", "nocomm", "local")
EMBEDDING_SYSTEMS = ("mwms", "tf_rdma", "tf_rdma_dense", "nocomm", "local")
LOCAL = "local"
NOCOMM = "nocomm"
NO_COMMUNICATION = (LOCAL, NOCOMM)  # systems whose workers share nothing
ALGORITHMS = ("auto", "lp", "ring", "tree", "rhd", "oneshot")
OP = "train_step"
LOG_PREFIX = "[train] "

DEFAULT_HIDDEN = (4096, 4096, 1024)
DEFAULT_FEATURES = 1024
DEFAULT_CLASSES = 10
DEFAULT_BATCH = 32
DEFAULT_STEPS = 30
QUICK_STEPS = 8
DEFAULT_WARMUP = 5
QUICK_WARMUP = 3

# The targets, printed, never asserted.
TARGET_SPEEDUP = 2.0
TARGET_SCALING = 0.85            # RdmaStrategy step vs nocomm's, P = 2
TARGET_SCALING_RANKS = 2
EMBEDDING_TARGET_SPEEDUP = 3.0   # sparse RdmaStrategy vs MWMS, P = 2
EMBEDDING_TARGET_BYTES = 10.0    # bytes: dense / sparse
EMBEDDING_BATCH = 512


def log(message):
    print(LOG_PREFIX + message, file=sys.stderr, flush=True)


def count_params(features, hidden, classes):
    sizes = [features] + list(hidden) + [classes]
    return sum(a * b + b for a, b in zip(sizes, sizes[1:]))


def describe_model(args):
    """(text, parameters) of the model --model selects; the parameters of
    a real network are None (its workers count them)."""
    if args.model in networks.NAMES:
        shape = "x".join(map(str, networks.input_shape(args.model,
                                                       args.network_size)))
        return (f"{args.model} ({args.network_size} size: input {shape}; "
                f"bench/_harness/networks.py)", None)
    if args.model == "embedding":
        params = (args.vocab * args.dim
                  + count_params(args.ids * args.dim, (256, 64), 1))
        return (f"embedding {args.vocab}x{args.dim} looked up {args.ids}x "
                f"per sample, then 256-64-1", params)
    return (f"{args.features}-{'-'.join(map(str, args.hidden))}-"
            f"{args.classes}",
            count_params(args.features, args.hidden, args.classes))


def system_name(kind, algorithm):
    if kind in NO_COMMUNICATION:
        return kind
    if kind == "tf_rdma_dense":
        return f"tf_rdma-{algorithm}-dense"
    return MWMS if kind == "mwms" else f"tf_rdma-{algorithm}"


# --- worker (one rank of one system) ---


def worker_main(args):
    rank, nranks = args.rank, args.nranks
    if args.worker not in NO_COMMUNICATION:
        set_tf_config(group_cluster(), rank)
    import numpy as np
    import tensorflow as tf
    import keras

    name = system_name(args.worker, args.algorithm)
    doc = {"system": name, "rank": rank, "P": nranks, "pid": os.getpid(),
           "info": {"tensorflow": tf.__version__, "keras": keras.__version__},
           "step_times": [], "step_cpu": [], "losses": [], "done": False}
    path = os.path.join(args.out, f"rank{rank}.json")

    def save():
        save_json(path, doc)

    save()
    if args.worker in NO_COMMUNICATION:
        # The default strategy: one replica, its "sum" over the replicas is
        # the identity. nocomm's P workers each apply their own gradients.
        strategy = tf.distribute.get_strategy()
    elif args.worker == "mwms":
        strategy = mwms_ring(tf)
    else:
        import tf_rdma
        from tf_rdma.distribute import RdmaStrategy
        doc["info"]["tf_rdma"] = getattr(tf_rdma, "__version__", "?")
        kwargs = {"algorithm": args.algorithm,
                  "sparse_as_dense": args.worker == "tf_rdma_dense"}
        if args.bucket_bytes:
            kwargs["bucket_bytes"] = args.bucket_bytes
        strategy = RdmaStrategy(**kwargs)
    in_sync = 1 if args.worker in NO_COMMUNICATION else nranks
    if strategy.num_replicas_in_sync != in_sync:
        raise SystemExit(f"{name}: {strategy.num_replicas_in_sync} replicas "
                         f"in sync, expected {in_sync}")

    embedding = args.model == "embedding"
    network = args.model in networks.NAMES
    keras.utils.set_random_seed(args.seed)  # same weights on every rank
    with strategy.scope():
        if network:
            model = networks.build(args.model, keras, args.network_size)
        elif embedding:
            layers = [keras.Input(shape=(args.ids,), dtype="int32"),
                      keras.layers.Embedding(args.vocab, args.dim),
                      keras.layers.Flatten(),
                      keras.layers.Dense(256, activation="relu"),
                      keras.layers.Dense(64, activation="relu"),
                      keras.layers.Dense(1)]
        else:
            layers = [keras.Input(shape=(args.features,))]
            layers += [keras.layers.Dense(h, activation="relu")
                       for h in args.hidden]
            layers.append(keras.layers.Dense(args.classes))
        if not network:
            model = keras.Sequential(layers)
        optimizer = keras.optimizers.SGD(learning_rate=args.lr,
                                         momentum=args.momentum)
        optimizer.build(model.trainable_variables)
    doc["info"]["params"] = int(model.count_params())
    if embedding:
        bce = keras.losses.BinaryCrossentropy(from_logits=True,
                                              reduction=None)
        loss_fn = lambda y, logits: bce(y, logits)  # noqa: E731
    else:
        loss_fn = keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction=None)
    global_batch = args.batch * nranks

    def batch_for(worker):
        if network:
            return networks.data(np, args.model, args.batch,
                                 args.network_size, seed=args.seed * 1000 + worker)
        rng = np.random.default_rng(args.seed * 1000 + worker)
        if embedding:
            x = rng.integers(0, args.vocab, (args.batch, args.ids), np.int32)
            y = rng.integers(0, 2, (args.batch, 1)).astype(np.float32)
            return x, y
        x = rng.standard_normal((args.batch, args.features), np.float32)
        y = rng.integers(0, args.classes, args.batch, dtype=np.int64)
        return x, y

    def payload_bytes(grads, variables):
        """Bytes this worker hands to the collectives per step (static; a
        dense gradient whose static shape is unknown has its variable's)."""
        total = 0
        for g, v in zip(grads, variables):
            if isinstance(g, tf.IndexedSlices) and args.worker != \
                    "tf_rdma_dense":
                total += (g.values.shape.num_elements() * g.values.dtype.size
                          + g.indices.shape.num_elements()
                          * g.indices.dtype.size)
            elif isinstance(g, tf.IndexedSlices):
                total += (int(np.prod(g.values.shape[1:])) * args.vocab
                          * g.values.dtype.size)
            else:
                total += v.shape.num_elements() * g.dtype.size
        doc["info"]["payload_bytes"] = int(total)

    x, y = (tf.constant(v) for v in batch_for(rank))

    # A custom training loop, the way TensorFlow's MWMS tutorial writes one:
    # Keras 3's model.fit fails under a multi-worker MWMS (its
    # _maybe_symbolic_build calls strategy.reduce eagerly on a PerReplica
    # batch). The optimizer sums the gradients over the replicas itself
    # (get_replica_context().all_reduce), as it does inside fit.
    @tf.function
    def train_step(x, y):
        def step_fn(x, y):
            with tf.GradientTape() as tape:
                logits = model(x, training=True)
                loss = tf.nn.compute_average_loss(
                    loss_fn(y, logits), global_batch_size=global_batch)
            grads = tape.gradient(loss, model.trainable_variables)
            payload_bytes(grads, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss
        losses = strategy.run(step_fn, args=(x, y))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)

    def step():
        t0, cpu0 = time.perf_counter(), time.process_time()
        loss = float(train_step(x, y).numpy())
        # process_time: every thread of this worker (TensorFlow's, tf_rdma's).
        doc["step_cpu"].append(time.process_time() - cpu0)
        return time.perf_counter() - t0, loss

    def reach(tag):
        """Says in --out that this rank has reached `tag`."""
        open(os.path.join(args.out, f"{tag}.{rank}"), "w").close()

    def all_reached(tag):
        return all(os.path.exists(os.path.join(args.out, f"{tag}.{r}"))
                   for r in range(nranks))

    # nocomm's workers share no collective that would keep them in step, so
    # files in --out do, outside the timed steps: every rank starts its
    # timed steps once all have warmed up, and goes on stepping (untimed)
    # until all have finished theirs, so that each timed step shares the
    # cores with the other P - 1 workers, as RdmaStrategy's steps do.
    nocomm = args.worker == NOCOMM
    save()
    for i in range(args.warmup + args.steps):
        if nocomm and i == args.warmup:
            reach("warm")
            while not all_reached("warm"):
                time.sleep(0.001)
        seconds, loss = step()
        doc["step_times"].append(seconds)
        doc["losses"].append(loss)
    if nocomm:
        reach("timed")
        doc["untimed_steps_after"] = 0
        while not all_reached("timed"):
            step()
            doc["untimed_steps_after"] += 1
    doc["done"] = True
    save()
    return 0


# --- orchestrator ---


def run_system(kind, args, workdir):
    name = system_name(kind, args.algorithm)
    nranks = 1 if kind == LOCAL else args.ranks
    out = os.path.join(workdir, name)
    os.makedirs(out)
    env = worker_env()
    add_local_cluster(env, nranks, log)
    if kind in ("tf_rdma", "tf_rdma_dense"):
        make_tf_rdma_job(env, args.transport)
    worker = [sys.executable, os.path.abspath(__file__), "--worker", kind,
              "--nranks", str(nranks), "--out", out,
              "--steps", str(args.steps), "--warmup", str(args.warmup),
              "--batch", str(args.batch), "--features", str(args.features),
              "--classes", str(args.classes), "--lr", str(args.lr),
              "--seed", str(args.seed), "--algorithm", args.algorithm,
              "--momentum", str(args.momentum), "--model", args.model,
              "--vocab", str(args.vocab), "--dim", str(args.dim),
              "--ids", str(args.ids), "--network-size", args.network_size,
              "--hidden"] + [str(h) for h in args.hidden]
    if args.bucket_bytes:
        worker += ["--bucket-bytes", str(args.bucket_bytes)]
    cmds = [worker + ["--rank", str(r)] for r in range(nranks)]
    log(f"{name}: starting {nranks} worker{'s' if nranks > 1 else ''}")
    docs, failure = run_processes(name, cmds, env, out, args.timeout, log,
                                  args.verbose, bind=args.bind == "auto")
    return name, nranks, docs, failure


def combine(name, nranks, docs, args, grad_bytes):
    """Per-rank step times -> one result (per step: max over ranks)."""
    if len(docs) < nranks or not all(d["done"] for d in docs):
        return None
    per_rank = [d["step_times"][args.warmup:] for d in docs]
    per_step = slowest_rank(per_rank)
    if not per_step:
        return None
    median = statistics.median(per_step)
    rank0 = next(d for d in docs if d["rank"] == 0)
    global_batch = args.batch * nranks
    payload = rank0.get("info", {}).get("payload_bytes")
    extra = {}
    # The timed steps' (nocomm's untimed steps after them are left out).
    cpu = [d.get("step_cpu", [])[args.warmup:len(d["step_times"])]
           for d in docs]
    if all(cpu):
        # CPU time of one step, all workers' together (their medians).
        extra["cpu_per_step_s"] = sum(statistics.median(c) for c in cpu)
    if name == NOCOMM:
        # Steps a rank ran after its timed ones, waiting for the others.
        extra["untimed_steps_after"] = [d.get("untimed_steps_after")
                                        for d in docs]
    return result_entry(
        name, OP, payload if payload is not None else grad_bytes, per_step,
        nranks,
        # What a worker hands to the collectives: nothing without any.
        payload_bytes_per_rank=0 if name in NO_COMMUNICATION else payload,
        samples_per_s=global_batch / median, global_batch=global_batch,
        rank0_median_s=statistics.median(per_rank[0]),
        first_loss=rank0["losses"][0] if rank0["losses"] else None,
        last_loss=rank0["losses"][-1] if rank0["losses"] else None,
        **extra)


def add_scaling(results):
    """Each strategy's scaling: nocomm's step time over its own.

    The fraction of the communication-free throughput a strategy keeps
    (same P, model and per-worker batch). Sets ``scaling_vs_nocomm`` in the
    results of the systems that communicate.

    Args:
      results: The results of one run (``combine``'s entries).

    Returns:
      ``{system: scaling}``, empty if nocomm gave no result.
    """
    nocomm = next((r for r in results if r["system"] == NOCOMM), None)
    if nocomm is None:
        return {}
    for r in results:
        if r["system"] not in NO_COMMUNICATION:
            r["scaling_vs_nocomm"] = nocomm["median_s"] / r["median_s"]
    return {r["system"]: r["scaling_vs_nocomm"] for r in results
            if "scaling_vs_nocomm" in r}


def cpu_bound(rdma, nocomm, cpus):
    """What the workers' CPU time allows RdmaStrategy to keep.

    A step cannot take less wall time than the CPU time all workers spend
    on it divided by the CPUs they share. From RdmaStrategy's measured CPU
    per step (spins included, so this bounds the step as it now works, not
    any exchange) that caps the scaling at nocomm's step over that time.

    Args:
      rdma, nocomm: Results with ``cpu_per_step_s`` and ``median_s``.
      cpus: The CPUs the workers share.

    Returns:
      ``(text, cap)``: a clause for the check line and the cap (0..), or
      ``("", None)`` without the CPU times.
    """
    if not nocomm or "cpu_per_step_s" not in rdma or \
            "cpu_per_step_s" not in nocomm:
        return "", None
    least = rdma["cpu_per_step_s"] / cpus
    cap = nocomm["median_s"] / least
    extra = rdma["cpu_per_step_s"] - nocomm["cpu_per_step_s"]
    return (f"CPU per step, all workers: {rdma['system']} "
            f"{human_time(rdma['cpu_per_step_s'])}, nocomm "
            f"{human_time(nocomm['cpu_per_step_s'])} "
            f"({'+' if extra >= 0 else '-'}{human_time(abs(extra))}); on "
            f"{cpus} CPU{'' if cpus == 1 else 's'} a step of "
            f"{rdma['system']}'s takes at least {human_time(least)}, so it "
            f"keeps at most {100 * min(cap, 9.99):.0f}% here"), cap


def scaling_check(rdma, nocomm, scaling, ranks, cpus=None):
    """The scaling check line: RdmaStrategy's against the target.

    Args:
      rdma: RdmaStrategy's result, with ``scaling_vs_nocomm`` when nocomm
        was measured.
      nocomm: nocomm's result, or None.
      scaling: ``add_scaling``'s ``{system: scaling}`` (the others are
        printed for context).
      ranks: P. The target is set at P = 2; at another P the line says so
        instead of a verdict.
      cpus: The CPUs the workers share; with it, and both systems' CPU
        times, the line ends with ``cpu_bound``'s clause.

    Returns:
      The line, or one saying why there is no scaling.
    """
    if nocomm is None or "scaling_vs_nocomm" not in rdma:
        return "check: no scaling (nocomm not run or gave no result)"
    kept = rdma["scaling_vs_nocomm"]
    if ranks == TARGET_SCALING_RANKS:
        target = (f"target >= {100 * TARGET_SCALING:.0f}%): "
                  f"{verdict(kept >= TARGET_SCALING)}")
    else:
        target = (f"the target, >= {100 * TARGET_SCALING:.0f}%, is set at "
                  f"P={TARGET_SCALING_RANKS})")
    others = "; ".join(f"{s} {100 * x:.0f}%" for s, x in scaling.items()
                       if s != rdma["system"])
    bound, _ = cpu_bound(rdma, nocomm, cpus) if cpus else ("", None)
    return (f"check: P={ranks}: RdmaStrategy keeps {100 * kept:.0f}% of the "
            f"communication-free step ({rdma['system']} "
            f"{human_time(rdma['median_s'])} vs nocomm "
            f"{human_time(nocomm['median_s'])}; {target}"
            + (f"; for context {others}" if others else "")
            + (f"; {bound}" if bound else ""))


def orchestrate(args):
    run = Run("train", log)
    model_text, params = describe_model(args)
    grad_bytes = None if params is None else params * 4
    log(f"model {model_text}: "
        + ("" if params is None else
           f"{params / 1e6:.1f} M parameters, {grad_bytes / 1e6:.0f} MB of "
           f"float32 weights; ")
        + f"per-replica batch {args.batch}, P = {args.ranks}")
    skipped = {}
    if "tf_rdma" in args.systems:
        try:
            import importlib.util
            if importlib.util.find_spec("tf_rdma.distribute") is None:
                skipped["tf_rdma"] = "tf_rdma.distribute does not exist yet"
        except Exception as err:  # noqa: BLE001 -- reported as the reason
            skipped["tf_rdma"] = f"import tf_rdma failed: {err}"
    for kind, why in skipped.items():
        log(f"skipping {kind}: {why}")
    results, failed, info, losses = [], [], {}, {}
    with work_dir("tf_rdma_train_", args.keep, log) as workdir:
        for kind in args.systems:
            if kind in skipped:
                continue
            name, nranks, docs, failure = run_system(kind, args, workdir)
            r = combine(name, nranks, docs, args, grad_bytes)
            for d in docs:
                info.setdefault(kind, d.get("info"))
            rank0 = [d for d in docs if d["rank"] == 0]
            if rank0:
                losses[name] = rank0[0]["losses"]
            if r is None:
                failed.append({"system": name,
                               "why": failure or "incomplete results"})
                continue
            results.append(r)
            log(f"  {name}: {human_time(r['median_s'])} per step (min "
                f"{human_time(r['min_s'])}), {r['samples_per_s']:.1f} "
                f"samples/s")
    if params is None:  # a real network's: as its workers counted them
        params = next((i["params"] for i in info.values()
                       if i and "params" in i), None)
        grad_bytes = None if params is None else params * 4
    for kind in SYSTEM_KINDS:
        for key, value in (info.get(kind) or {}).items():
            if key not in ("params", "payload_bytes"):  # not the machine's
                run.machine.setdefault(key, value)

    print(f"{run.headline('training benchmark')}; custom loop, {args.steps} "
          f"timed steps after {args.warmup} warm-up; step time = slowest "
          f"rank; workers "
          + ("bound to their own CPUs where P <= cores (as tf-rdma launch "
             "binds them)" if args.bind == "auto" else "unbound (--bind none)"))
    print(f"model {model_text} ("
          + ("parameters unknown: no worker built it" if params is None else
             f"{params / 1e6:.1f} M parameters, {grad_bytes / 1e6:.0f} MB "
             f"of weights")
          + f"), per-replica batch {args.batch}, P = {args.ranks}")
    print()
    by = {r["system"]: r for r in results}
    mwms = by.get(MWMS)
    nocomm = by.get(NOCOMM)
    scaling = add_scaling(results)
    header = ["system", "P", "step (med)", "step (min)", "samples/s",
              "vs mwms", "vs nocomm", "payload/step", "first loss",
              "last loss"]
    rows = [[r["system"], str(r["P"]), human_time(r["median_s"]),
             human_time(r["min_s"]), f"{r['samples_per_s']:.1f}",
             f"{r['samples_per_s'] / mwms['samples_per_s']:.2f}x"
             if mwms and r["system"] not in NO_COMMUNICATION else "-",
             f"{100 * r['scaling_vs_nocomm']:.0f}%"
             if "scaling_vs_nocomm" in r else "-",
             f"{r['payload_bytes_per_rank'] / 1e6:.2f} MB"
             if r.get("payload_bytes_per_rank")
             and r["system"] not in NO_COMMUNICATION else "-",
             f"{r['first_loss']:.5f}" if r["first_loss"] is not None else "-",
             f"{r['last_loss']:.5f}" if r["last_loss"] is not None else "-"]
            for r in results]
    print_table(header, rows)
    if nocomm:
        print(f"nocomm: no communication, {args.ranks} workers side by "
              f"side, each applying its own gradients (the same model, "
              f"batch and step; losses are rank 0's alone)")
    print()
    for kind, why in skipped.items():
        print(f"skipped {kind}: {why}")
    for f in failed:
        print(f"FAILED {f['system']}: {f['why']}")
    rdma = by.get(system_name("tf_rdma", args.algorithm))
    local = by.get(LOCAL)
    if local:
        extra = ", ".join(
            f"{s} {human_time(by[s]['median_s'] - local['median_s'])}"
            for s in (MWMS, rdma and rdma["system"]) if s in by)
        print(f"one process, no strategy (per-replica batch, no "
              f"communication): {human_time(local['median_s'])} per step"
              + (f"; on top of it: {extra}" if extra else ""))
    if nocomm:
        extra = ", ".join(
            f"{s} {human_time(by[s]['median_s'] - nocomm['median_s'])}"
            for s in (MWMS, rdma and rdma["system"]) if s in by)
        shared = (f" ({nocomm['median_s'] / local['median_s']:.2f}x local's:"
                  f" what sharing the cores costs)" if local else "")
        print(f"{args.ranks} workers side by side, no communication: "
              f"{human_time(nocomm['median_s'])} per step{shared}"
              + (f"; on top of it: {extra}" if extra else ""))
    losses_check = None
    if MWMS in losses and rdma and losses.get(rdma["system"]):
        a, b = losses[MWMS], losses[rdma["system"]]
        n = min(len(a), len(b))
        diff = max((abs(x - y) / max(abs(x), 1e-12)
                    for x, y in zip(a[:n], b[:n])), default=0.0)
        losses_check = {"steps": n, "max_rel_diff": diff}
        agreement = ("bit-identical" if diff == 0 else
                     "agree to rounding (the sums may be taken in another "
                     "order)" if diff < 1e-3 else "DIFFER")
        print(f"losses of {rdma['system']} and {MWMS} over {n} steps: "
              f"largest relative difference {diff:.2e}: {agreement}")
    target = (EMBEDDING_TARGET_SPEEDUP if args.model == "embedding"
              else TARGET_SPEEDUP)
    if rdma and mwms:
        x = rdma["samples_per_s"] / mwms["samples_per_s"]
        bound = ""
        floor = nocomm or local
        if floor:
            # No strategy's step is faster than the step without any
            # communication (each worker computes a whole per-replica batch):
            # nocomm's, P workers sharing the cores, else local's.
            bound = (f"; a step cannot beat {floor['system']}'s "
                     f"{human_time(floor['median_s'])}, so at most "
                     f"{mwms['median_s'] / floor['median_s']:.2f}x here")
        print(f"check: {rdma['system']} {rdma['samples_per_s']:.1f} vs "
              f"{MWMS} {mwms['samples_per_s']:.1f} samples/s: {x:.2f}x "
              f"(target >= {target:g}x): {verdict(x >= target)}{bound}")
    else:
        print("check: no speedup over MWMS (mwms or tf_rdma not run or "
              "gave no result)")
    if rdma:
        print(scaling_check(rdma, nocomm, scaling, args.ranks,
                            len(os.sched_getaffinity(0))))
    dense = by.get(system_name("tf_rdma_dense", args.algorithm))
    if args.model == "embedding" and rdma and dense and \
            rdma.get("payload_bytes_per_rank"):
        fewer = dense["payload_bytes_per_rank"] / rdma["payload_bytes_per_rank"]
        print(f"check: {rdma['system']} hands "
              f"{rdma['payload_bytes_per_rank'] / 1e6:.2f} MB per worker "
              f"and step to the collectives, sparse_as_dense "
              f"{dense['payload_bytes_per_rank'] / 1e6:.1f} MB: "
              f"{fewer:.0f}x fewer (target >= {EMBEDDING_TARGET_BYTES:g}x): "
              f"{verdict(fewer >= EMBEDDING_TARGET_BYTES)}; "
              f"samples/s {rdma['samples_per_s'] / dense['samples_per_s']:.2f}x"
              f" of dense")
    run.finish()
    if args.json:
        config = {"model": model_text,
                  "params": params, "gradient_bytes": grad_bytes,
                  "batch_per_replica": args.batch,
                  "ranks": args.ranks, "steps": args.steps,
                  "warmup": args.warmup, "lr": args.lr,
                  "optimizer": f"SGD, momentum {args.momentum:g}",
                  "algorithm": args.algorithm,
                  "bucket_bytes": args.bucket_bytes,
                  "bind": args.bind,
                  "transport": args.transport or os.environ.get(
                      "TF_RDMA_TRANSPORT", "auto"),
                  "timing": "per step the max over ranks of the step call "
                            "until its loss is back; median/min over the "
                            "timed steps",
                  "losses": losses, "losses_check": losses_check,
                  "scaling_vs_nocomm": scaling,
                  "target_scaling": TARGET_SCALING,
                  "skipped": skipped, "failed": failed,
                  **run.timing()}
        run.save(args.json, config, results)
    return 1 if failed else 0


# --- main ---


def build_parser():
    parser = argparse.ArgumentParser(
        prog="python bench/train.py",
        description="Training throughput of a communication-bound Keras "
                    "model: tf_rdma RdmaStrategy vs\n"
                    "MultiWorkerMirroredStrategy, P local workers, and "
                    "their scaling: the fraction\n"
                    "of the step without communication (nocomm: P workers "
                    "side by side, each\n"
                    "applying its own gradients) that each keeps.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="See bench/README.md for how it measures.")
    parser.add_argument("--json", metavar="PATH",
                        help="also write the results as JSON to PATH")
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK_STEPS} timed steps after "
                             f"{QUICK_WARMUP} warm-up (a smoke run)")
    parser.add_argument("--steps", type=int, metavar="N",
                        help=f"timed steps (default {DEFAULT_STEPS}; "
                             f"--quick {QUICK_STEPS})")
    parser.add_argument("--warmup", type=int, metavar="N",
                        help=f"untimed first steps (default {DEFAULT_WARMUP};"
                             f" --quick {QUICK_WARMUP})")
    parser.add_argument("--ranks", type=int, default=2, metavar="P",
                        help="worker processes (default 2)")
    parser.add_argument("--systems", nargs="+", choices=SYSTEM_KINDS,
                        help="systems to measure (default: mwms tf_rdma "
                             "nocomm local; --model embedding: mwms tf_rdma "
                             "tf_rdma_dense nocomm local; nocomm = P "
                             "workers side by side, each applying its own "
                             "gradients, no communication: the reference "
                             "of the scaling check; local = one process "
                             "alone, no strategy; tf_rdma_dense = "
                             "sparse_as_dense=True)")
    parser.add_argument("--algorithm", choices=ALGORITHMS, default="auto",
                        help="RdmaStrategy's allreduce algorithm (default "
                             "auto)")
    parser.add_argument("--bucket-bytes", type=int, metavar="B",
                        help="RdmaStrategy's bucket size (default: the "
                             "strategy's)")
    parser.add_argument("--hidden", nargs="+", type=int, metavar="UNITS",
                        default=list(DEFAULT_HIDDEN),
                        help="hidden layer widths (default 4096 4096 1024)")
    parser.add_argument("--features", type=int, default=DEFAULT_FEATURES,
                        help=f"input width (default {DEFAULT_FEATURES})")
    parser.add_argument("--classes", type=int, default=DEFAULT_CLASSES,
                        help=f"output classes (default {DEFAULT_CLASSES})")
    parser.add_argument("--batch", type=int,
                        help=f"per-replica batch (default {DEFAULT_BATCH}; "
                             f"--model embedding {EMBEDDING_BATCH}; a real "
                             f"network {networks.BATCH['bench']}, --quick "
                             f"{networks.BATCH['test']})")
    parser.add_argument("--lr", type=float, default=0.01,
                        help="SGD learning rate (default 0.01)")
    parser.add_argument("--momentum", type=float, default=0.0,
                        help="SGD momentum (default 0: plain SGD, one pass "
                             "over the weights per step, so that the step "
                             "stays communication-bound)")
    parser.add_argument("--model", choices=("mlp", "embedding")
                        + networks.NAMES, default="mlp",
                        help="mlp (default; --hidden, --features, --classes),"
                             " embedding (a sparse-gradient recommender "
                             "model; --vocab, --dim, --ids; per-replica "
                             f"batch {EMBEDDING_BATCH} unless --batch) or a "
                             "real network (bench/_harness/networks.py; "
                             "--network-size)")
    parser.add_argument("--vocab", type=int, default=1000000,
                        help="--model embedding: table rows (default 10^6)")
    parser.add_argument("--dim", type=int, default=64,
                        help="--model embedding: table columns (default 64)")
    parser.add_argument("--ids", type=int, default=8,
                        help="--model embedding: lookups per sample "
                             "(default 8)")
    parser.add_argument("--network-size", choices=networks.SIZES,
                        help="a real network's size (default: bench; "
                             "--quick: test)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--transport", choices=("auto", "shm", "tcp", "verbs"),
                        help="TF_RDMA_TRANSPORT for the tf_rdma workers "
                             "(default: the environment's, else auto)")
    parser.add_argument("--timeout", type=float, metavar="S",
                        help="hard limit per system in seconds (default 600;"
                             " --quick 300)")
    add_process_arguments(parser, SYSTEM_KINDS)
    add_bind_argument(parser)
    return parser


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.network_size is None:
        args.network_size = "test" if args.quick else "bench"
    if args.batch is None:
        args.batch = (EMBEDDING_BATCH if args.model == "embedding" else
                      networks.BATCH[args.network_size]
                      if args.model in networks.NAMES else DEFAULT_BATCH)
    if args.systems is None:
        args.systems = list(EMBEDDING_SYSTEMS if args.model == "embedding"
                            else DEFAULT_SYSTEMS)
    if args.steps is None:
        args.steps = QUICK_STEPS if args.quick else DEFAULT_STEPS
    if args.warmup is None:
        args.warmup = QUICK_WARMUP if args.quick else DEFAULT_WARMUP
    if args.steps < 1 or args.warmup < 1:
        parser.error("--steps and --warmup must be at least 1")
    if args.ranks < 2:
        parser.error("--ranks must be at least 2")
    if args.timeout is None:
        args.timeout = 300.0 if args.quick else 600.0
    if args.worker:
        return worker_main(args)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
