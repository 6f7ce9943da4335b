"""tf_rdma.distribute.RdmaStrategy in real worker processes.

Process start-ups cost seconds each (TensorFlow's import), so one launch
covers several checks:

- `test_two_workers_match_one_and_mwms`: the same program runs as two
  RdmaStrategy workers, as one RdmaStrategy process without a cluster, and as
  two MultiWorkerMirroredStrategy workers (each with its TensorFlow gRPC
  server), all at once. Each Keras-fits the same MLP on scikit-learn's digits
  (same global batches, no shuffling), evaluates it and reports its weights.
  The two RdmaStrategy workers start from different random seeds, so equal
  weights also show that the chief's initial values were broadcast. The
  RdmaStrategy workers and the single process then run a custom loop
  (`strategy.run` + `strategy.reduce`) on `experimental_distribute_dataset`,
  check `distribute_datasets_from_function`'s sharding, check in the traced
  step that the first gradient bucket's all-reduce does not wait for the
  last bucket's gradients, and write (chief) and read (all) a checkpoint.
  The RdmaStrategy workers run again over verbs (softnic where the host has
  no RDMA port) and are held to the same references.
- `test_stats_callback_logs_rates_and_wait_fractions`: the RdmaStrategy
  workers' fit ran with `tf_rdma.keras.StatsCallback`, whose keys are in
  every epoch of the History with plausible values.
- `test_tensorboard_profile_batch_holds_tf_rdma_events`: the same fit ran
  with `keras.callbacks.TensorBoard(profile_batch=...)`, whose profile holds
  tf_rdma's events of the profiled batches.
- `test_checkpoint_from_two_workers_restores_in_one`: one plain Keras
  process restores that checkpoint and evaluates it.
- `test_killed_worker_fails_fast`: one worker dies (SIGKILL) while the other
  is in a bucket's all-reduce; the survivor fails within TF_RDMA_TIMEOUT with
  an error that names the collective, the bucket and the dead peer.

Tolerances: the two RdmaStrategy workers end with bit-identical weights (every
rank gets the same all-reduce result). Against one process and against
MultiWorkerMirroredStrategy the weights must agree within atol 1e-5 + rtol
1e-4: the gradient of a 64-sample mean computed as two 32-sample halves
rounds differently from one computed at once, and 60 SGD steps carry that
along. Measured (TF 2.21, x86-64): at most 2.7e-7 from one process, and
bit-identical to MultiWorkerMirroredStrategy.
"""

import os
import signal

import numpy as np
import pytest

from conftest import (collect, inside, make_cluster, named, read_xplane_events,
                      run_tasks, spawn_task, transports_used, use_transport)

pytestmark = pytest.mark.timeout(240)

RTOL, ATOL = 1e-4, 1e-5
#: Test accuracy the Keras fit must reach (it reaches about 0.93).
MIN_ACCURACY = 0.9
EPOCHS = 3
GLOBAL_BATCH = 64
N_TRAIN = 1280  # 20 global batches: no partial batch in training
#: The fit's batches (1-based, first epoch) that TensorBoard profiles.
PROFILE_BATCH = (3, 4)

COMMON = """
import keras
from sklearn.datasets import load_digits
MODE = os.environ["MODE"]
x, y = load_digits(return_X_y=True)
x = (x / 16.0).astype("float32"); y = y.astype("int64")
order = np.random.RandomState(0).permutation(len(x))  # the same everywhere
x, y = x[order], y[order]
N = %(n_train)d
GB = %(gb)d
x_train, y_train, x_test, y_test = x[:N], y[:N], x[N:], y[N:]
index = int(task.rsplit(":", 1)[1])

def make_model():
    return keras.Sequential([keras.Input((64,)),
                             keras.layers.Dense(32, activation="relu"),
                             keras.layers.Dense(10)])

def compile_model(model):
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True),
                  metrics=["accuracy"])
""" % {"n_train": N_TRAIN, "gb": GLOBAL_BATCH}

TRAIN = COMMON + """
if MODE == "single":
    os.environ.pop("TF_CONFIG", None)
else:
    os.environ["TF_CONFIG"] = json.dumps(
        {"cluster": cluster, "task": {"type": "worker", "index": index}})
if MODE == "mwms":
    import mwms_keras
    # Keras 3.15's fit does not run under multi-worker MWMS as is (see
    # patch_mwms_for_keras_fit).
    strategy = mwms_keras.patch_mwms_for_keras_fit(
        tf.distribute.MultiWorkerMirroredStrategy())
    rank = strategy.cluster_resolver.task_id
else:
    import tf_rdma.distribute
    # Small buckets: the MLP's 4 gradients (9.4 KiB) make 2 buckets.
    strategy = tf_rdma.distribute.RdmaStrategy(bucket_bytes=4096)
    rank = strategy.worker_index
out = {"replicas": strategy.num_replicas_in_sync}

# 1. Keras fit + evaluate. Different seeds per worker: the chief's initial
# weights must win.
keras.utils.set_random_seed(1 + rank)
with strategy.scope():
    model = make_model()
    compile_model(model)
callbacks = []
if MODE == "rdma":  # tf_rdma's counters in the epochs' logs
    import tf_rdma.keras
    callbacks.append(tf_rdma.keras.StatsCallback())
    # Keras' own profiling (issue 16): the profile of two batches must hold
    # tf_rdma's events.
    callbacks.append(keras.callbacks.TensorBoard(
        log_dir=os.path.join(os.environ["CKPT_DIR"], "tensorboard", f"worker{rank}"),
        profile_batch=%(profile_batch)r, write_graph=False))
hist = model.fit(x_train, y_train, batch_size=GB, epochs=%(epochs)d,
                 shuffle=False, verbose=0, callbacks=callbacks)
out["history"] = hist.history
out["eval"] = model.evaluate(x_test, y_test, batch_size=GB, verbose=0,
                             return_dict=True)
out["weights"] = [w.numpy().tolist() for w in model.trainable_weights]

if MODE == "mwms":
    result(out)
    sys.exit(0)

# 2. Custom loop: strategy.run + strategy.reduce on a distributed dataset.
keras.utils.set_random_seed(7)
with strategy.scope():
    model2 = make_model()
    opt2 = keras.optimizers.SGD(0.1)
ids = np.arange(N, dtype=np.int64)
ds = tf.data.Dataset.from_tensor_slices((x_train, y_train, ids)).batch(GB)
dist = strategy.experimental_distribute_dataset(ds)

@tf.function
def step(batch):
    def replica_fn(xb, yb, ib):
        with tf.GradientTape() as tape:
            per_sample = keras.losses.sparse_categorical_crossentropy(
                yb, model2(xb, training=True), from_logits=True)
            loss = tf.nn.compute_average_loss(per_sample,
                                              global_batch_size=GB)
        grads = tape.gradient(loss, model2.trainable_variables)
        opt2.apply_gradients(zip(grads, model2.trainable_variables))
        return loss, ib
    loss, ib = strategy.run(replica_fn, args=batch)
    return strategy.reduce("SUM", loss, axis=None), ib

losses, first_ids = [], None
for i, batch in enumerate(dist):
    if i == 10:
        break
    loss, ib = step(batch)
    losses.append(float(loss))
    if first_ids is None:
        first_ids = [int(v) for v in strategy.experimental_local_results(ib)[0]]
        # strategy.gather: every replica's ids, in replica order.
        out["gathered_ids"] = [int(v) for v in strategy.gather(ib, axis=0)]
out["loop_losses"] = losses
out["loop_first_ids"] = first_ids
out["loop_weights"] = [w.numpy().tolist() for w in model2.trainable_weights]

# The traced step: which collectives, and what the first bucket waits for.
graph = step.get_concrete_function(dist.element_spec).graph
colls = {op.get_attr("instance").decode(): op for op in graph.get_operations()
         if op.type == "TfRdmaCollective"}
out["collectives"] = sorted(colls)
buckets = sorted((k for k in colls if ".bucket" in k),
                 key=lambda k: int(k.rsplit("bucket", 1)[1]))
if len(buckets) >= 2:
    def ancestors(op):
        seen, todo = set(), [op]
        while todo:
            o = todo.pop()
            for p in [t.op for t in o.inputs] + list(o.control_inputs):
                if p not in seen:
                    seen.add(p)
                    todo.append(p)
        return seen
    first_deps = ancestors(colls[buckets[0]])
    last_inputs = {t.op for t in colls[buckets[-1]].inputs}
    out["first_bucket_waits_for_last_grads"] = bool(first_deps & last_inputs)
    out["bucket_inputs"] = [len(colls[b].inputs) for b in buckets]

# 3. distribute_datasets_from_function: the InputContext shards by worker.
def dataset_fn(ctx):
    return (tf.data.Dataset.from_tensor_slices(ids)
            .shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
            .batch(ctx.get_per_replica_batch_size(GB)))
first = next(iter(strategy.distribute_datasets_from_function(dataset_fn)))
out["fn_first_ids"] = [int(v) for v in
                       strategy.experimental_local_results(first)[0]]

# 4. Checkpoint: the chief writes, a collective orders it before every read.
ckpt = tf.train.Checkpoint(model=model)
prefix = os.path.join(os.environ["CKPT_DIR"], MODE, "digits")
out["should_checkpoint"] = bool(strategy.extended.should_checkpoint)
if strategy.extended.should_checkpoint:
    ckpt.write(prefix)
strategy.reduce("SUM", tf.constant(1.0), axis=None)  # barrier
before = [w.numpy() for w in model.trainable_weights]
for w in model.trainable_weights:
    w.assign(tf.zeros_like(w))
ckpt.read(prefix).assert_consumed()
out["restored_equal"] = all(np.array_equal(a, w.numpy()) for a, w in
                            zip(before, model.trainable_weights))
out["plans"] = [p.to_json() for p in strategy.bucket_plans]
result(out)
""" % {"epochs": EPOCHS, "profile_batch": PROFILE_BATCH}

RESTORE = COMMON + """
os.environ.pop("TF_CONFIG", None)
model = make_model()
compile_model(model)
# The model's weights; the optimizer's slots stay in the checkpoint.
tf.train.Checkpoint(model=model).read(
    os.path.join(os.environ["CKPT_DIR"], "rdma", "digits")
).assert_existing_objects_matched()
result({"weights": [w.numpy().tolist() for w in model.trainable_weights],
        "eval": model.evaluate(x_test, y_test, batch_size=GLOBAL_BATCH,
                               verbose=0, return_dict=True)})
""".replace("GLOBAL_BATCH", str(GLOBAL_BATCH))

KILL = COMMON + """
import signal
import tf_rdma.distribute
resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
    tf.train.ClusterSpec(cluster), task_type="worker", task_id=index)
strategy = tf_rdma.distribute.RdmaStrategy(cluster_resolver=resolver,
                                           bucket_bytes=4096)
with strategy.scope():
    model = make_model()
    opt = keras.optimizers.SGD(0.1)
half = GB // 2
xs = x_train[index * half:(index + 1) * half]
ys = y_train[index * half:(index + 1) * half]

@tf.function
def step(xb, yb):
    def replica_fn(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(
                keras.losses.sparse_categorical_crossentropy(
                    yb, model(xb, training=True), from_logits=True),
                global_batch_size=GB)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss
    return strategy.run(replica_fn, args=(xb, yb))

step(xs, ys)
if index == 1:
    time.sleep(1.0)  # worker:0 is waiting in step 2's buckets by now
    os.kill(os.getpid(), signal.SIGKILL)
t0 = time.monotonic()
try:
    step(xs, ys)
    result({"error": None})
except tf.errors.OpError as e:
    result({"error": type(e).__name__, "message": e.message,
            "elapsed_s": time.monotonic() - t0})
"""


def _flat(weights):
    return np.concatenate([np.asarray(w, np.float64).ravel() for w in weights])


# The RdmaStrategy workers train under TF_RDMA_TRANSPORT=auto (shm between
# these processes on one host) in every test, and again under verbs (softnic
# where the host has no RDMA port: conftest.require_verbs) in the tests
# marked @verbs_too: those that compare what crossed the workers' collectives
# (Keras fit and the custom loop against one process and MWMS, gather, two
# local replicas per worker). The bucket plan and the checkpoint do not
# depend on the transport, and test_failures.py already kills a verbs peer
# mid-collective. The verbs run of `trained` starts only the two RdmaStrategy
# workers: the references (one process, MWMS) do not use tf_rdma's transports
# and are the same for both runs.
TRANSPORTS = ("auto", "verbs")


@pytest.fixture(scope="module", params=["auto"])
def transport(request):
    """The RdmaStrategy workers' TF_RDMA_TRANSPORT: "auto" unless a test asks."""
    return request.param


verbs_too = pytest.mark.parametrize("transport", TRANSPORTS, indirect=True)


@pytest.fixture(scope="module")
def references():
    """{"single", "mwms:0", "mwms:1"} -> results, filled by the first `trained`."""
    return {}


@pytest.fixture(scope="module")
def trained(transport, references, tmp_path_factory):
    """Runs the 2 RdmaStrategy workers, and (once) 1 process and 2 MWMS
    workers, at once."""
    ckpt_dir = str(tmp_path_factory.mktemp(f"ckpt_{transport}"))
    env = {"CKPT_DIR": ckpt_dir}
    use_transport(transport)  # before any task starts (it may skip)
    procs = {}
    if not references:  # the references start no endpoint
        mwms = make_cluster(2)
        for i in range(2):
            procs[f"mwms:{i}"] = spawn_task(f"worker:{i}", TRAIN, mwms,
                                            dict(env, MODE="mwms"))
        procs["single"] = spawn_task("worker:0", TRAIN, make_cluster(1),
                                     dict(env, MODE="single"))
    rdma = make_cluster(2)
    rdma_env = dict(env, MODE="rdma")
    if transport != "auto":
        rdma_env["TF_RDMA_TRANSPORT"] = transport
    for i in range(2):
        procs[f"rdma:{i}"] = spawn_task(f"worker:{i}", TRAIN, rdma, rdma_env)
    out = collect(procs, timeout=200)
    bad = [r for r in out.values() if r.returncode != 0]
    if bad:
        pytest.fail("task failed\n" + "\n".join(r.describe() for r in bad))
    res = {k: r.result for k, r in out.items()}
    for k in ("rdma:0", "rdma:1"):
        res[k]["transports_used"] = transports_used(out[k].stderr)
    references.update((k, v) for k, v in res.items() if not k.startswith("rdma"))
    return dict(references, **res), ckpt_dir


@verbs_too
def test_two_workers_match_one_and_mwms(transport, trained):
    res, _ = trained
    r0, r1, single = res["rdma:0"], res["rdma:1"], res["single"]
    assert r0["replicas"] == r1["replicas"] == 2 and single["replicas"] == 1
    if transport != "auto":  # the workers' pair really used it
        assert r0["transports_used"] == r1["transports_used"] == [transport]
    # The workers stay identical (and started identical: different seeds).
    assert r0["weights"] == r1["weights"]
    w = _flat(r0["weights"])
    np.testing.assert_allclose(w, _flat(single["weights"]), rtol=RTOL,
                               atol=ATOL)
    np.testing.assert_allclose(w, _flat(res["mwms:0"]["weights"]), rtol=RTOL,
                               atol=ATOL)
    np.testing.assert_allclose(r0["history"]["loss"],
                               single["history"]["loss"], rtol=1e-4)
    # Keras reports global metrics on every worker, and the model learns.
    assert r0["eval"] == r1["eval"]
    np.testing.assert_allclose(r0["eval"]["accuracy"],
                               single["eval"]["accuracy"], atol=1e-6)
    assert r0["eval"]["accuracy"] >= MIN_ACCURACY, r0["eval"]


@verbs_too
def test_custom_loop_run_and_reduce(trained):
    res, _ = trained
    r0, r1, single = res["rdma:0"], res["rdma:1"], res["single"]
    # strategy.reduce(SUM) over workers of losses scaled by the global batch
    # is the global batch's mean loss, as one process computes it.
    assert r0["loop_losses"] == r1["loop_losses"]
    np.testing.assert_allclose(r0["loop_losses"], single["loop_losses"],
                               rtol=RTOL, atol=ATOL)
    assert r0["loop_weights"] == r1["loop_weights"]
    np.testing.assert_allclose(_flat(r0["loop_weights"]),
                               _flat(single["loop_weights"]), rtol=RTOL,
                               atol=ATOL)


@verbs_too
def test_datasets_are_sharded_by_worker(trained):
    res, _ = trained
    r0, r1, single = res["rdma:0"], res["rdma:1"], res["single"]
    half = GLOBAL_BATCH // 2
    # experimental_distribute_dataset: each worker gets half of each global
    # batch, together exactly the global batch.
    assert len(r0["loop_first_ids"]) == len(r1["loop_first_ids"]) == half
    assert sorted(r0["loop_first_ids"] + r1["loop_first_ids"]) == list(
        range(GLOBAL_BATCH))
    assert single["loop_first_ids"] == list(range(GLOBAL_BATCH))
    # strategy.gather across workers, in replica (= rank) order.
    assert r0["gathered_ids"] == r1["gathered_ids"] == (
        r0["loop_first_ids"] + r1["loop_first_ids"])
    assert single["gathered_ids"] == list(range(GLOBAL_BATCH))
    # distribute_datasets_from_function: the InputContext's shard and
    # per-replica batch size.
    assert r0["fn_first_ids"] == list(range(0, GLOBAL_BATCH, 2))
    assert r1["fn_first_ids"] == list(range(1, GLOBAL_BATCH, 2))
    assert single["fn_first_ids"] == list(range(GLOBAL_BATCH))


def test_gradients_go_in_static_buckets(trained):
    res, _ = trained
    r0, r1 = res["rdma:0"], res["rdma:1"]
    from tf_rdma.graph_passes.buckets import BucketPlan
    plans = [BucketPlan.from_json(p) for p in r0["plans"]]
    assert plans and [p.to_json() for p in plans] == r1["plans"]
    # The MLP's gradients: [10], [32, 10], [32] in bucket 0 (4 KiB),
    # the [64, 32] kernel alone in bucket 1.
    plan = next(p for p in plans if len(p.gradients) == 4)
    assert [len(b.indices) for b in plan.buckets] == [3, 1]
    step_buckets = [n for n in r0["collectives"] if ".bucket" in n]
    assert len(step_buckets) == 2, r0["collectives"]
    assert r0["bucket_inputs"] == [3, 1]
    # Bucket 0's all-reduce does not wait for bucket 1's gradient.
    assert r0["first_bucket_waits_for_last_grads"] is False


def test_stats_callback_logs_rates_and_wait_fractions(trained):
    res, _ = trained
    for worker in ("rdma:0", "rdma:1"):
        history = res[worker]["history"]
        for key in ("tf_rdma_sent_MBps", "tf_rdma_received_MBps",
                    "tf_rdma_credit_wait_fraction",
                    "tf_rdma_data_wait_fraction"):
            assert len(history.get(key, [])) == EPOCHS, (worker, key, history)
        # Every epoch all-reduces 20 batches of 9.4 KiB of gradients (plus the
        # metrics) with the other worker: both directions move bytes, at far
        # less than 100 GB/s.
        for key in ("tf_rdma_sent_MBps", "tf_rdma_received_MBps"):
            assert all(0 < v < 1e5 for v in history[key]), (worker, key, history[key])
        for key in ("tf_rdma_credit_wait_fraction", "tf_rdma_data_wait_fraction"):
            assert all(0 <= v <= 1 for v in history[key]), (worker, key, history[key])
        # Collectives wait for the peer's blocks: some data wait in the fit.
        assert max(history["tf_rdma_data_wait_fraction"]) > 0, history
    # The single process has no peers and ran without the callback.
    assert "tf_rdma_sent_MBps" not in res["single"]["history"]


def test_tensorboard_profile_batch_holds_tf_rdma_events(trained):
    """keras.callbacks.TensorBoard(profile_batch=...) in the RdmaStrategy
    workers' fit (issue 16): the XPlane it wrote for the chief (read as
    tests/test_profiler.py reads tf.profiler's) holds each gradient bucket's
    all-reduce with its key, bytes and peers, for the profiled batches only,
    and each call's phases, inside it."""
    res, ckpt_dir = trained
    from tf_rdma.graph_passes.buckets import BucketPlan
    plan = next(p for p in map(BucketPlan.from_json, res["rdma:0"]["plans"])
                if len(p.gradients) == 4)
    events = read_xplane_events(os.path.join(ckpt_dir, "tensorboard", "worker0",
                                             "train"), prefix="tf_rdma.")
    calls = [e for e in named(events, "tf_rdma.collective")
             if ".bucket" in e["stats"]["key"]]
    keys = sorted({e["stats"]["key"] for e in calls})
    assert len(keys) == len(plan.buckets) == 2, (
        keys, sorted({e["name"] for e in events if "tf_rdma" in e["name"]}))
    profiled = set(range(PROFILE_BATCH[0], PROFILE_BATCH[1] + 1))
    for key in keys:
        # "rdma.batch.<k>.<plan hash>.bucket<i>"
        bucket = plan.buckets[int(key.rsplit("bucket", 1)[1])]
        mine = named(calls, "tf_rdma.collective", key)
        assert sorted(e["stats"]["step"] for e in mine) == sorted(profiled), mine
        for call in mine:
            assert call["stats"]["kind"] == "allreduce", call
            assert call["stats"]["bytes"] == bucket.nbytes, (call, bucket)
            assert call["stats"]["peer"] == "/job:worker/task:0 /job:worker/task:1", call
            phases = [e for e in named(events, None, key)
                      if e["name"] != "tf_rdma.collective" and inside(e, call)]
            assert {"tf_rdma.credit_wait", "tf_rdma.write", "tf_rdma.data_wait",
                    "tf_rdma.reduce", "tf_rdma.release"} <= {
                        e["name"] for e in phases}, (call, phases)
            assert all(e["stats"]["peer"] == "/job:worker/task:1"
                       for e in phases), phases
        # Every phase of the bucket's all-reduce lies inside one of its calls.
        for e in named(events, None, key):
            assert any(inside(e, call) for call in mine), e


def test_checkpoint_from_two_workers_restores_in_one(trained):
    res, ckpt_dir = trained
    r0, r1 = res["rdma:0"], res["rdma:1"]
    assert r0["should_checkpoint"] is True and r1["should_checkpoint"] is False
    assert r0["restored_equal"] and r1["restored_equal"]
    out = run_tasks({"worker:0": RESTORE},
                    env={"MODE": "restore", "CKPT_DIR": ckpt_dir}, timeout=60)
    restored = out["worker:0"].result
    assert restored["weights"] == r0["weights"]
    # Evaluated alone on the whole test set: the same accuracy as the two
    # workers' evaluate (each on half of it, metrics summed over workers).
    np.testing.assert_allclose(restored["eval"]["accuracy"],
                               r0["eval"]["accuracy"], atol=1e-6)


def test_killed_worker_fails_fast():
    out = run_tasks({"worker:0": KILL, "worker:1": KILL},
                    env={"MODE": "kill", "TF_RDMA_TIMEOUT": "5"}, timeout=90,
                    check=False)
    dead, survivor = out["worker:1"], out["worker:0"]
    assert dead.returncode == -signal.SIGKILL, dead.describe()
    assert survivor.returncode == 0, survivor.describe()
    err = survivor.result
    # Inside a tf.function TensorFlow turns an UnavailableError of an op it
    # does not know as a communication op into an InternalError that quotes
    # it.
    assert err["error"] in ("UnavailableError", "DeadlineExceededError",
                            "InternalError"), err
    assert err["elapsed_s"] < 5 + 5, err
    # Both buckets wait for the dead peer (collectives are not run in
    # program order: tf_rdma/_auto_control_deps.py); either may report first.
    for part in ("allreduce", ".bucket", "/job:worker/task:1"):
        assert part in err["message"], (part, err)


# CommunicationOptions reach the collectives: bytes_per_pack sets the bucket
# size of that call, implementation=RING is logged once and ignored, and
# timeout_seconds bounds the call (worker:1 never joins the second reduce;
# TF_RDMA_TIMEOUT is 60 s, the option 2 s).
OPTIONS = """
import tf_rdma.distribute
from tf_rdma.graph_passes.buckets import BucketPlan
CO = tf.distribute.experimental.CommunicationOptions
index = int(task.rsplit(":", 1)[1])
resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
    tf.train.ClusterSpec(cluster), task_type="worker", task_id=index)
strategy = tf_rdma.distribute.RdmaStrategy(cluster_resolver=resolver)
grads = [tf.fill([1000], float(index + 1)), tf.fill([1000], 2.0)]
ring = CO(bytes_per_pack=4096,
          implementation=tf.distribute.experimental.CommunicationImplementation.RING)

@tf.function
def reduce_with(options):
    ctx = lambda: tf.distribute.get_replica_context().all_reduce(
        "SUM", grads, options=options)
    return strategy.run(ctx)

out = reduce_with(ring)
sums = [float(t[0]) for t in out]
plans = [BucketPlan.from_json(p.to_json()) for p in strategy.bucket_plans]
res = {"sums": sums, "buckets": [len(p.buckets) for p in plans],
       "bucket_bytes": [p.bucket_bytes for p in plans]}
if index == 0:
    t0 = time.monotonic()
    try:
        reduce_with(CO(timeout_seconds=2))
        res["error"] = None
    except tf.errors.OpError as e:
        res["error"] = type(e).__name__
        res["elapsed_s"] = time.monotonic() - t0
    touch("done")
else:
    wait_file("done")
result(res)
"""


def test_communication_options_are_honoured(tmp_path):
    out = run_tasks({"worker:0": OPTIONS, "worker:1": OPTIONS},
                    env={"TF_RDMA_TIMEOUT": "60",
                         "TEST_SYNC_DIR": str(tmp_path)}, timeout=150)
    r0, r1 = out["worker:0"].result, out["worker:1"].result
    assert r0["sums"] == r1["sums"] == [3.0, 4.0]
    # 4,000 bytes each: two buckets of at most 4 KiB, not one of the default.
    assert r0["buckets"] == [2] and r0["bucket_bytes"] == [4096]
    assert r0["error"] == "DeadlineExceededError", r0
    assert 2 <= r0["elapsed_s"] < 10, r0
    err = out["worker:0"].stderr
    assert err.count("CommunicationOptions(implementation=RING) is not used") == 1


# Two replicas per worker (two logical CPU devices, standing in for GPUs):
# the local replicas are summed before the cross-worker collective, replica
# ids run worker-major, sparse rows come in global replica order, and Keras
# fit trains what one process trains with the global batch.
LOCAL_REPLICAS = COMMON + """
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
if MODE == "single":
    strategy = tf.distribute.get_strategy()
else:
    import tf_rdma.distribute
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(cluster), task_type="worker", task_id=index)
    strategy = tf_rdma.distribute.RdmaStrategy(
        cluster_resolver=resolver, devices=["/cpu:0", "/cpu:1"])
out = {"replicas": strategy.num_replicas_in_sync}
if MODE != "single":
    @tf.function
    def reduce_ids():
        def fn():
            ctx = tf.distribute.get_replica_context()
            rid = tf.cast(ctx.replica_id_in_sync_group, tf.float32)
            dense = ctx.all_reduce("SUM", rid + 1.0)
            mean = ctx.all_reduce("MEAN", rid + 1.0)
            rows = tf.IndexedSlices(tf.fill([1, 2], rid),
                                    tf.reshape(tf.cast(rid, tf.int64) * 10, [1]),
                                    tf.constant([40, 2], tf.int64))
            sparse = ctx.all_reduce("SUM", rows)
            return dense, mean, sparse.values[:, 0], sparse.indices
        return strategy.run(fn)
    dense, mean, values, indices = reduce_ids()
    local = strategy.experimental_local_results
    out["sum"] = [float(v) for v in local(dense)]
    out["mean"] = [float(v) for v in local(mean)]
    out["sparse_values"] = [v.numpy().tolist() for v in local(values)]
    out["sparse_indices"] = [v.numpy().tolist() for v in local(indices)]
keras.utils.set_random_seed(3)
with strategy.scope():
    model = make_model()
    compile_model(model)
model.fit(x_train[:256], y_train[:256], batch_size=GB, epochs=1,
          shuffle=False, verbose=0)
out["weights"] = [w.numpy().tolist() for w in model.trainable_weights]
result(out)
"""


@verbs_too
def test_two_replicas_per_worker_sum_locally_first(transport):
    use_transport(transport)
    env = {"MODE": "rdma"}
    if transport != "auto":
        env["TF_RDMA_TRANSPORT"] = transport
    rdma = make_cluster(2)
    procs = {f"rdma:{i}": spawn_task(f"worker:{i}", LOCAL_REPLICAS, rdma, env)
             for i in range(2)}
    procs["single"] = spawn_task("worker:0", LOCAL_REPLICAS, make_cluster(1),
                                 {"MODE": "single"})
    out = collect(procs, timeout=200)
    bad = [r for r in out.values() if r.returncode != 0]
    if bad:
        pytest.fail("task failed\n" + "\n".join(r.describe() for r in bad))
    single = out["single"].result
    for i in range(2):
        r = out[f"rdma:{i}"].result
        if transport != "auto":  # the workers' pair really used it
            assert transports_used(out[f"rdma:{i}"].stderr) == [transport]
        assert r["replicas"] == 4
        assert r["sum"] == [10.0, 10.0] and r["mean"] == [2.5, 2.5]
        # Every replica gets the rows of replicas 0, 1 (worker 0), 2, 3.
        assert r["sparse_values"] == [[0.0, 1.0, 2.0, 3.0]] * 2
        assert r["sparse_indices"] == [[0, 10, 20, 30]] * 2
        np.testing.assert_allclose(_flat(r["weights"]),
                                   _flat(single["weights"]), rtol=RTOL,
                                   atol=ATOL)


# Fault tolerance with Keras' own callbacks: BackupAndRestore (one backup
# directory per worker: Keras 3 writes it from every worker) and
# ModelCheckpoint. Run "killed": worker 1 SIGKILLs itself in the middle of
# epoch 2; worker 0's next collective fails and it exits. Run "resumed":
# both restart and BackupAndRestore resumes from the end of epoch 1. Run
# "whole": the same training uninterrupted. Plain SGD: the backup holds the
# model's weights, and SGD has no other state.
FAULT = COMMON + """
import signal
import tf_rdma.distribute
RUN, DIR = os.environ["RUN"], os.environ["FT_DIR"]
resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
    tf.train.ClusterSpec(cluster), task_type="worker", task_id=index)
strategy = tf_rdma.distribute.RdmaStrategy(cluster_resolver=resolver,
                                           bucket_bytes=4096)
assert strategy.num_workers == 2
keras.utils.set_random_seed(5)
with strategy.scope():
    model = make_model()
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True))

class KillMidEpoch(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch
    def on_train_batch_end(self, batch, logs=None):
        if RUN == "killed" and index == 1 and self.epoch == 1 and batch == 5:
            os.kill(os.getpid(), signal.SIGKILL)

run_dir = "whole" if RUN == "whole" else "restarted"
callbacks = [
    keras.callbacks.BackupAndRestore(
        os.path.join(DIR, run_dir, f"backup{index}")),
    keras.callbacks.ModelCheckpoint(
        os.path.join(DIR, run_dir, f"ckpt{index}", "e{epoch}.weights.h5"),
        save_weights_only=True),
    KillMidEpoch()]
try:
    hist = model.fit(x_train, y_train, batch_size=GB, epochs=3, shuffle=False,
                     verbose=0, callbacks=callbacks)
except Exception as e:
    result({"error": type(e).__name__, "message": str(e)[:2000]})
    sys.exit(0)
result({"weights": [w.numpy().tolist() for w in model.trainable_weights],
        "epochs_run": len(hist.history["loss"]),
        "checkpoints": sorted(os.listdir(
            os.path.join(DIR, run_dir, f"ckpt{index}")))})
"""


def test_backup_and_restore_resumes_after_a_killed_worker(tmp_path):
    env = {"MODE": "rdma", "FT_DIR": str(tmp_path), "TF_RDMA_TIMEOUT": "10"}
    procs = {}
    for run in ("killed", "whole"):
        cluster = make_cluster(2)
        for i in range(2):
            procs[f"{run}:{i}"] = spawn_task(f"worker:{i}", FAULT, cluster,
                                             dict(env, RUN=run))
    out = collect(procs, timeout=200)
    assert out["killed:1"].returncode == -signal.SIGKILL, \
        out["killed:1"].describe()
    survivor = out["killed:0"].result
    assert survivor and survivor.get("error"), out["killed:0"].describe()
    assert "/job:worker/task:1" in survivor["message"], survivor
    whole = out["whole:0"].result
    assert whole["epochs_run"] == 3, out["whole:0"].describe()

    cluster = make_cluster(2)
    resumed = collect({i: spawn_task(f"worker:{i}", FAULT, cluster,
                                     dict(env, RUN="resumed"))
                       for i in range(2)}, timeout=200)
    for i in range(2):
        r = resumed[i].result
        assert r and "weights" in r, resumed[i].describe()
        # Epochs 2 and 3 only: epoch 1 came from the backup.
        assert r["epochs_run"] == 2, r
        assert r["checkpoints"] == ["e1.weights.h5", "e2.weights.h5",
                                    "e3.weights.h5"]
        np.testing.assert_allclose(_flat(r["weights"]),
                                   _flat(whole["weights"]), rtol=RTOL,
                                   atol=ATOL)


# ---------------------------------------------------------------------------
# In this process: the cluster a strategy sees, and the errors it raises
# before it starts anything.


def _resolver(cluster, task_type, task_id):
    import tensorflow as tf
    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(cluster), task_type=task_type, task_id=task_id)


def test_resolve_cluster_orders_chief_then_workers():
    from tf_rdma.distribute import resolve_cluster
    cluster = {"worker": ["h1:1", "h2:1"], "chief": ["h0:1"], "ps": ["h3:1"]}
    got, task, tasks = resolve_cluster(_resolver(cluster, "worker", 1))
    assert got == {"chief": ["h0:1"], "worker": ["h1:1", "h2:1"]}
    assert task == "/job:worker/task:1"
    assert tasks == ("/job:chief/task:0", "/job:worker/task:0",
                     "/job:worker/task:1")


@pytest.mark.parametrize("kwargs, match", [
    (dict(algorithm="fast"), "algorithm 'fast' is not one of auto, lp"),
    (dict(bucket_bytes=0), "bucket_bytes must be a positive int.*got 0"),
    (dict(bucket_bytes=2.5), "bucket_bytes must be a positive int.*got 2.5"),
    (dict(timeout=-1), "timeout must be a positive number.*got -1"),
    (dict(cluster_resolver=("no task",)), "names no task for this process"),
    (dict(cluster_resolver=("ps", 0)), "task 'ps' 0, which does not train"),
    (dict(cluster_resolver=("worker", 5)),
     "task index 5 is not in job 'worker', which has 2 tasks"),
])
def test_config_errors_name_the_value(kwargs, match):
    from tf_rdma.distribute import RdmaStrategy
    from tf_rdma.errors import ConfigError
    spec = kwargs.get("cluster_resolver")
    if spec is not None:
        cluster = {"worker": ["127.0.0.1:1", "127.0.0.1:2"],
                   "ps": ["127.0.0.1:3"]}
        kwargs = dict(cluster_resolver=_resolver(
            cluster, *(spec if len(spec) == 2 else (None, None))))
    with pytest.raises(ConfigError, match=match):
        RdmaStrategy(**kwargs)


def test_one_worker_without_cluster(monkeypatch):
    import tensorflow as tf
    from tf_rdma.distribute import RdmaStrategy
    monkeypatch.delenv("TF_CONFIG", raising=False)
    strategy = RdmaStrategy()
    assert (strategy.task, strategy.num_workers, strategy.worker_index,
            strategy.num_replicas_in_sync) == (None, 1, 0, 1)
    assert strategy.is_chief and strategy.extended.should_checkpoint
    assert float(strategy.reduce("SUM", tf.constant(2.0), axis=None)) == 2.0
    assert "workers=1" in repr(strategy)


def test_input_is_not_fetched_ahead_by_default(monkeypatch):
    """No per-replica buffer unless the caller asks for one.

    TensorFlow's MultiDeviceIterator crashes the process when it is freed
    while its prefetch thread is inside GetNext, and Keras drops each epoch's
    iterator when the epoch ends, whatever that thread is doing
    (tf_rdma/distribute/extended.py). Both dataset APIs get a buffer of
    0 unless the caller passes options; the fetching it saves shows in a map
    function that counts the elements it produced.
    """
    import time

    import tensorflow as tf
    from tf_rdma.distribute import RdmaStrategy
    monkeypatch.delenv("TF_CONFIG", raising=False)
    strategy = RdmaStrategy()
    fetched = []

    def count(x):
        fetched.append(int(x))
        return x

    def dataset(ctx=None):
        return tf.data.Dataset.range(100).map(
            lambda x: tf.py_function(count, [x], tf.int64)).batch(2)

    distributed = (strategy.experimental_distribute_dataset(dataset()),
                   strategy.distribute_datasets_from_function(dataset))
    for d in distributed:  # private: where input_lib keeps its options
        assert d._options.experimental_per_replica_buffer_size == 0

    def fetched_after_one_step(d):
        iterator = iter(d)
        assert int(next(iterator)[0]) == 0
        time.sleep(1.0)
        n = len(fetched)
        del fetched[:], iterator
        return n

    by_default = fetched_after_one_step(distributed[0])
    # The caller's options stand: TensorFlow's buffer of one batch fetches
    # further ahead (which also shows the count could fail).
    buffered = fetched_after_one_step(strategy.experimental_distribute_dataset(
        dataset(), tf.distribute.InputOptions(
            experimental_per_replica_buffer_size=1)))
    assert by_default < buffered, (by_default, buffered)
