"""ParameterServerStrategy programs, each trained plain and through tf_rdma.

Run as the coordinator of a cluster of tf_rdma servers (TF_CONFIG names task
chief:0; ``LiveCluster(..., coordinator=True).run_client``)::

    python tests/ps_cases.py CASE [CASE ...]

Each case builds a model twice under a ``ParameterServerStrategy`` from the
same initial values: one copy trains with the plain ``tf.function`` step (the
oracle: TensorFlow's own parameter-server training over gRPC), the other with
the same step through ``tf_rdma.rewrite``. Sync cases schedule one step at a
time (``schedule`` + ``join``) and report whether every loss and every final
weight is the same bit for bit. What the steps moved through tf_rdma comes
from every task's counters (``tf_rdma.measured.task_report``), taken before
and after the rewritten run. One ``RESULT {json}`` line per case; a case that
raises reports its traceback instead, so one broken case fails its own test.

Which worker runs a step is the coordinator's choice. So that a step's input
does not depend on it, the per-worker datasets yield the whole (small) data
set as one element, and a step cuts its batch out of it at a global step
counter that lives on a ps task (``assign_add`` in the step): the k-th step
trains on the same rows whichever worker runs it, with either function.
"""

import json
import os
import sys
import time
import traceback

import numpy as np
import tensorflow as tf

import tf_rdma
from bench._harness import networks

ROWS, FEATURES, CLASSES, BATCH = 512, 64, 10, 32
STEPS = int(os.environ.get("TEST_PS_STEPS", "12"))
ASYNC_STEPS = int(os.environ.get("TEST_PS_ASYNC_STEPS", "200"))
OP_TIMEOUT = float(os.environ.get("TEST_OP_TIMEOUT", "60"))

cluster = json.loads(os.environ["TF_CONFIG"])["cluster"]
WORKERS = [f"/job:worker/task:{i}" for i in range(len(cluster["worker"]))]
PS_TASKS = [f"/job:ps/task:{i}" for i in range(len(cluster["ps"]))]


def result(obj):
    print("RESULT " + json.dumps(obj), flush=True)


def data():
    """A learnable synthetic problem: labels from a fixed random projection."""
    rng = np.random.RandomState(0)
    x = rng.normal(size=(ROWS, FEATURES)).astype(np.float32)
    y = np.argmax(x @ rng.normal(size=(FEATURES, CLASSES)), axis=1).astype(np.int32)
    return x, y


def strategy_with(partitioner=None):
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    strategy = tf.distribute.experimental.ParameterServerStrategy(
        resolver, variable_partitioner=partitioner)
    return strategy, tf.distribute.experimental.coordinator.ClusterCoordinator(
        strategy)


def whole_data_iterator(coordinator, strategy=None):
    """A per-worker iterator whose every element is the whole data set.

    With ``strategy``, through ``distribute_datasets_from_function`` (as
    TensorFlow's parameter-server tutorial builds its input), else a plain
    dataset per worker.
    """
    x, y = data()

    def dataset_fn(_=None):
        return tf.data.Dataset.from_tensors((x, y)).repeat()

    if strategy is None:
        per_worker_fn = dataset_fn
    else:
        def per_worker_fn():
            return strategy.distribute_datasets_from_function(dataset_fn)
    return iter(coordinator.create_per_worker_dataset(per_worker_fn))


def batch_at(x_all, y_all, counter):
    """The rows of the step the global counter (on a ps task) says it is."""
    k = counter.assign_add(1, read_value=True) - 1
    start = (k * BATCH) % (ROWS - BATCH)
    return (tf.slice(x_all, [start, 0], [BATCH, FEATURES]),
            tf.slice(y_all, [start], [BATCH]))


def snapshot():
    """Every server task's tf_rdma counters: {task: total counters}."""
    return {t: tf_rdma.stats(t)["total"] for t in WORKERS + PS_TASKS}


def moved(before, after):
    """Bytes sent through tf_rdma per task between two snapshots."""
    return {t: after[t]["bytes_sent"] - before[t]["bytes_sent"] for t in after}


def bits(values):
    return [np.asarray(v).reshape(-1).view(np.uint8).tobytes().hex() for v in values]


def keras_step(strategy, model, optimizer, batch, training=None):
    """The step of a Keras model on per-worker input: the cross-entropy of
    the rows ``batch(x_all, y_all)`` picks, and the optimizer's update."""
    def replica_fn(x_all, y_all):
        x, y = batch(x_all, y_all)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                y, model(x, training=training)))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def step(it):
        return strategy.run(replica_fn, args=next(it))
    return step


def train_sync(coordinator, step, args, steps=STEPS):
    losses = []
    for _ in range(steps):
        remote = coordinator.schedule(step, args=args)
        coordinator.join()
        losses.append(np.asarray(remote.fetch()))
    return losses


def compare(name, make, coordinator, args_of, extra=None, steps=STEPS):
    """Trains two copies (plain, rewritten) one step at a time; one RESULT.

    ``make()`` returns (step function, variables to compare, init hook);
    both copies start from the plain copy's initial values.
    """
    plain_step, plain_vars = make()
    rdma_fn, rdma_vars = make()
    for a, b in zip(rdma_vars, plain_vars):
        a.assign(b.read_value() if hasattr(b, "read_value") else b)
    rdma_step = tf_rdma.rewrite(rdma_fn, timeout=OP_TIMEOUT)
    plain_losses = train_sync(coordinator, plain_step, args_of(), steps)
    before = snapshot()
    rdma_losses = train_sync(coordinator, rdma_step, args_of(), steps)
    after = snapshot()
    planned = {a.caller_task: a.plan.bytes_per_step for a in rdma_step.analyses}
    report = {
        "case": name,
        "losses_identical": bits(plain_losses) == bits(rdma_losses),
        "weights_identical": bits([v.numpy() for v in plain_vars])
        == bits([v.numpy() for v in rdma_vars]),
        "first_loss": float(plain_losses[0]), "last_loss": float(plain_losses[-1]),
        "callers": sorted(planned),
        "client_tasks": sorted({a.client_task for a in rdma_step.analyses}),
        "planned_bytes_per_step": planned,
        "kept": sorted({e.reason for a in rdma_step.analyses for e in a.edges
                        if e.kind == "kept"}),
        "sent": moved(before, after),
        "steps": steps,
    }
    if extra:
        report.update(extra(rdma_step, rdma_vars, before, after))
    result(report)


# --- the cases -------------------------------------------------------------


def case_mlp():
    """Raw variables (64-256-10), momentum SGD on the ps, per-worker data."""
    strategy, coordinator = strategy_with()
    iterator = whole_data_iterator(coordinator)
    rng = np.random.RandomState(1)
    init = [rng.normal(size=(FEATURES, 256)).astype(np.float32) * 0.1,
            np.zeros(256, np.float32),
            rng.normal(size=(256, CLASSES)).astype(np.float32) * 0.1,
            np.zeros(CLASSES, np.float32)]

    def make():
        with strategy.scope():
            params = [tf.Variable(v) for v in init]
            slots = [tf.Variable(tf.zeros_like(v)) for v in init]
            counter = tf.Variable(0, dtype=tf.int32)

        def replica_fn(x_all, y_all):
            x, y = batch_at(x_all, y_all, counter)
            with tf.GradientTape() as tape:
                h = tf.nn.relu(x @ params[0] + params[1])
                loss = tf.reduce_mean(
                    tf.nn.sparse_softmax_cross_entropy_with_logits(
                        y, h @ params[2] + params[3]))
            for v, s, g in zip(params, slots, tape.gradient(loss, params)):
                tf.raw_ops.ResourceApplyMomentum(
                    var=v.handle, accum=s.handle, lr=tf.constant(0.05),
                    grad=g, momentum=tf.constant(0.9))
            return loss

        @tf.function
        def step(it):
            return strategy.run(replica_fn, args=next(it))
        return step, params + slots + [counter]

    compare("mlp", make, coordinator, lambda: (iterator,))


def case_keras_adam():
    """A Keras 2 model and its Adam (slots on the ps), distributed input."""
    import tf_keras as keras

    strategy, coordinator = strategy_with()
    iterator = whole_data_iterator(coordinator, strategy)

    def make():
        with strategy.scope():
            model = keras.Sequential([
                keras.layers.Dense(128, activation="relu",
                                   input_shape=(FEATURES,)),
                keras.layers.Dense(CLASSES)])
            optimizer = keras.optimizers.Adam(1e-2)
            optimizer.build(model.trainable_variables)
            counter = tf.Variable(0, dtype=tf.int32)

        step = keras_step(strategy, model, optimizer,
                          lambda x_all, y_all: batch_at(x_all, y_all, counter))
        return step, model.variables + optimizer.variables() + [counter]

    def devices(rdma_step, variables, before, after):
        del rdma_step, before, after
        return {"variable_devices": sorted({
            p.device for v in variables for p in getattr(v, "variables", [v])})}

    compare("keras_adam", make, coordinator, lambda: (iterator,), devices)


def _sharded_case(name, partitioner, vocab, dim):
    """MLP weights and an embedding table sharded over the ps tasks.

    The table's rows are looked up by ids of the batch (a sharded lookup:
    each ps gathers its rows), and its gradient goes back as IndexedSlices
    applied with scatter_sub on each shard: only looked-up rows cross.
    """
    strategy, coordinator = strategy_with(partitioner)
    iterator = whole_data_iterator(coordinator)
    rng = np.random.RandomState(2)
    init = [rng.normal(size=(vocab, dim)).astype(np.float32) * 0.1,
            rng.normal(size=(FEATURES + dim, 128)).astype(np.float32) * 0.1,
            np.zeros(128, np.float32),
            rng.normal(size=(128, CLASSES)).astype(np.float32) * 0.1,
            np.zeros(CLASSES, np.float32)]

    def make():
        with strategy.scope():
            table, *dense = [tf.Variable(v) for v in init]
            counter = tf.Variable(0, dtype=tf.int32)

        def replica_fn(x_all, y_all):
            x, y = batch_at(x_all, y_all, counter)
            ids = tf.math.floormod(
                tf.cast(tf.abs(x[:, 0]) * 1000.0, tf.int32), vocab)
            shards = list(getattr(table, "variables", [table]))
            dense_vars = [p for v in dense for p in getattr(v, "variables", [v])]
            with tf.GradientTape() as tape:
                rows = tf.nn.embedding_lookup(table, ids)
                h = tf.nn.relu(tf.concat([x, rows], 1) @ dense[0] + dense[1])
                loss = tf.reduce_mean(
                    tf.nn.sparse_softmax_cross_entropy_with_logits(
                        y, h @ dense[2] + dense[3]))
            grads = tape.gradient(loss, shards + dense_vars)
            for shard, g in zip(shards, grads[:len(shards)]):
                shard.scatter_sub(tf.IndexedSlices(g.values * 0.1, g.indices,
                                                   g.dense_shape))
            for v, g in zip(dense_vars, grads[len(shards):]):
                v.assign_sub(g * 0.1)
            return loss

        @tf.function
        def step(it):
            return strategy.run(replica_fn, args=next(it))
        return step, [table] + dense + [counter]

    def traffic(rdma_step, variables, before, after):
        sent = moved(before, after)
        return {"table_bytes": vocab * dim * 4,
                "table_shards": len(getattr(variables[0], "variables", [0])),
                "bytes_per_step": sum(sent.values()) / STEPS,
                "static_bytes_per_step": max(a.plan.bytes_per_step
                                             for a in rdma_step.analyses),
                "dynamic_keys": sorted({t.key for a in rdma_step.analyses
                                        for t in a.plan.transfers if t.dynamic})}

    compare(name, make, coordinator, lambda: (iterator,), traffic)


def case_sharded_fixed():
    _sharded_case(
        "sharded_fixed",
        tf.distribute.experimental.partitioners.FixedShardsPartitioner(
            len(PS_TASKS)), vocab=20000, dim=16)


def case_sharded_min_size():
    _sharded_case(
        "sharded_min_size",
        tf.distribute.experimental.partitioners.MinSizePartitioner(
            min_shard_bytes=64 << 10, max_shards=len(PS_TASKS)),
        vocab=20000, dim=16)


#: Real networks in their test size (bench/_harness/networks.py; Keras 2's
#: applications, batch 8): batch normalization (its moving averages updated
#: on the ps), hundreds of variables of mixed sizes, recurrent state,
#: attention with dropout. InceptionV3 is left out: plain PSS itself does not
#: train it the same way twice here (the first copy of it a process trains
#: differs from the later ones at the second step, with or without
#: TF_DETERMINISTIC_OPS), so it cannot be an oracle bit for bit.
APPLICATIONS = ("mobilenet_v2", "resnet50", "vgg16", "lstm", "transformer")
APP_STEPS, APP_BATCH, APP_ROWS = 3, 8, 64


def case_applications():
    """Each of APPLICATIONS, plain and rewritten: one RESULT per model."""
    import tf_keras as keras

    strategy, coordinator = strategy_with()

    def all_rows(name):
        rows = networks.data(np, name, APP_ROWS)
        return lambda: tf.data.Dataset.from_tensors(rows).repeat()

    for name in APPLICATIONS:
        iterator = iter(coordinator.create_per_worker_dataset(all_rows(name)))

        def make(name=name):
            tf.random.set_seed(3)  # dropout: the same op seeds in both copies
            with strategy.scope():
                model = networks.build(name, keras)
                optimizer = keras.optimizers.SGD(0.01, momentum=0.9)
                optimizer.build(model.trainable_variables)
                counter = tf.Variable(0, dtype=tf.int32)

            def batch(x_all, y_all):
                k = counter.assign_add(1, read_value=True) - 1
                rows = tf.range(APP_BATCH) + (k * APP_BATCH) % (APP_ROWS - APP_BATCH)
                return tf.gather(x_all, rows), tf.gather(y_all, rows)

            step = keras_step(strategy, model, optimizer, batch, training=True)
            return step, model.variables + optimizer.variables() + [counter]

        compare(f"app_{name}", make, coordinator, lambda it=iterator: (it,),
                steps=APP_STEPS)


def case_keras_fit():
    """Keras 2 ``fit`` under PSS with tf_rdma.keras.rewrite_fit.

    fit schedules its steps without waiting for each (asynchronously), so
    the losses depend on the order the workers run them: no bit-for-bit
    comparison here, only that it trains on every worker through tf_rdma.
    """
    import tf_keras as keras

    strategy, _ = strategy_with()
    x, y = data()

    def dataset_fn(_):
        return tf.data.Dataset.from_tensor_slices((x, y)).shuffle(
            ROWS, seed=1).repeat().batch(BATCH)

    with strategy.scope():
        model = keras.Sequential([
            keras.layers.Dense(128, activation="relu", input_shape=(FEATURES,)),
            keras.layers.Dense(CLASSES)])
        model.compile(keras.optimizers.Adam(0.01),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    tf_rdma.keras.rewrite_fit(model, timeout=OP_TIMEOUT)
    before = snapshot()
    history = model.fit(keras.utils.experimental.DatasetCreator(dataset_fn),
                        epochs=3, steps_per_epoch=20, verbose=0)
    after = snapshot()
    step = model.train_tf_function
    result({
        "case": "keras_fit", "losses": history.history["loss"],
        "rewritten": isinstance(step, tf_rdma.RewrittenFunction),
        "callers": sorted({a.caller_task for a in step.analyses}),
        "kept": sorted({e.reason for a in step.analyses for e in a.edges
                        if e.kind == "kept"}),
        "sent": moved(before, after),
    })


def case_async():
    """Many steps without join: every worker runs some, nothing mixes.

    Each step also sends a tag made from its own batch through a ps task and
    back (an op placed on the ps), and counts where the echo differs: a
    call that received another call's tensor would show there.
    """
    strategy, coordinator = strategy_with()
    iterator = whole_data_iterator(coordinator)
    rng = np.random.RandomState(3)
    with strategy.scope():
        params = [tf.Variable(rng.normal(size=(FEATURES, 64)).astype(np.float32) * 0.1),
                  tf.Variable(rng.normal(size=(64, CLASSES)).astype(np.float32) * 0.1)]
        counter = tf.Variable(0, dtype=tf.int32)

    def replica_fn(x_all, y_all):
        x, y = batch_at(x_all, y_all, counter)
        tag = tf.reduce_sum(x, axis=1) * 3.0 + 1.0
        with tf.device(PS_TASKS[-1]):
            echo = tf.identity(tag) * 2.0
        mismatches = tf.reduce_sum(tf.cast(tf.not_equal(echo, tag * 2.0), tf.int32))
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                y, tf.nn.relu(x @ params[0]) @ params[1]))
        for v, g in zip(params, tape.gradient(loss, params)):
            v.assign_sub(g * 0.05)
        return loss, mismatches

    @tf.function
    def step(it):
        return strategy.run(replica_fn, args=next(it))

    rdma = tf_rdma.rewrite(step, timeout=OP_TIMEOUT)
    before = snapshot()
    t0 = time.monotonic()
    remotes = [coordinator.schedule(rdma, args=(iterator,))
               for _ in range(ASYNC_STEPS)]
    coordinator.join()
    seconds = time.monotonic() - t0
    after = snapshot()
    values = [r.fetch() for r in remotes]
    losses = [float(v[0]) for v in values]
    tenth = max(1, len(losses) // 10)
    result({
        "case": "async", "steps": len(values),
        "mismatches": int(sum(int(v[1]) for v in values)),
        "first_losses": float(np.mean(losses[:tenth])),
        "last_losses": float(np.mean(losses[-tenth:])),
        "callers": sorted({a.caller_task for a in rdma.analyses}),
        "sent": moved(before, after),
        "received": {t: after[t]["bytes_received"] - before[t]["bytes_received"]
                     for t in after},
        "counter": int(counter.numpy()),
        "seconds": seconds,
    })


CASES = {name[len("case_"):]: fn for name, fn in globals().items()
         if name.startswith("case_")}


def main(names):
    for name in names:
        t0 = time.monotonic()
        try:
            CASES[name]()
        except Exception:  # reported to the test, which fails that case
            result({"case": name, "error": traceback.format_exc()[-4000:]})
        sys.stderr.write(f"ps_cases: {name} took {time.monotonic() - t0:.1f} s\n")


if __name__ == "__main__":
    main(sys.argv[1:])
