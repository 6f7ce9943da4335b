#!/usr/bin/env python3
"""Parameter-server training: ParameterServerStrategy over gRPC, through tf_rdma, and its ceiling.

Usage::

    python bench/ps.py [--quick] [--workers 1 2 4] [--ps 1 2]
                       [--models mlp embedding cnn resnet50 ...]
                       [--transport shm]
                       [--json PATH]

What it measures
----------------
TensorFlow 2 trains parameter-server style with
``tf.distribute.experimental.ParameterServerStrategy`` (PSS): the variables
live on the ps tasks, a coordinator program schedules step functions with
``ClusterCoordinator.schedule`` and each step runs on whichever worker is
free, reading the variables from the ps tasks and sending the updates back.
The coordinator does not wait for a step before it schedules the next: many
``schedule`` calls, then ``join``, and every worker runs one step after
another, each with the weights as the ps tasks hold them at that moment
(asynchronous training). That is how this bench drives it.

For each cluster shape (workers x ps tasks) and model it measures three
systems on the same cluster, window by window in turn:

``pss-grpc``
    The step as a plain ``tf.function`` scheduled on the coordinator:
    TensorFlow moves every ps <-> worker tensor over gRPC.
``pss-tf_rdma``
    The same step wrapped in ``tf_rdma.rewrite``: the rewrite traces one plan
    per worker (on the first step each worker runs), and the step's
    ps <-> worker tensors move through tf_rdma's preallocated slots
    (``--transport``, shared memory by default).
``ceiling``
    The same step function on the same model with its variables on the
    worker: every variable is a PSS per-worker variable
    (``tf.Variable(..., per_worker_variable=True)`` in the strategy's
    scope), one copy per worker, which the coordinator hands to the step of
    whichever worker runs it. So the step reads, computes and applies its
    update as under PSS, scheduled and joined the same way, with the same
    dispatch from the coordinator, but in the worker's own memory: no
    tensor crosses tasks. That is the step with its transfers at no cost,
    and with no ps task to involve: what a transport could at best reach.
    With one worker it trains the very trajectory PSS trains (its losses
    have matched pss-grpc's bit for bit: the same arithmetic, step by step);
    with more, each worker trains its own copy.

With one worker the updates come in the order they were scheduled, so the
three systems train the same trajectory, and pss-tf_rdma's losses must be
pss-grpc's bit for bit. Where they are not, the ceiling's say which system
left the common trajectory: if pss-tf_rdma's equal the ceiling's, pss-grpc
did (seen on the embedding model with one ps task: one step a few hundred
steps in, by one unit in the last place; docs/benchmarks.md), and the run
prints a note with the step; otherwise the run fails. With more workers the
order of updates is the scheduler's, and losses are not compared.

The models are raw ``tf.Variable``s with hand-written updates, so that the
same code runs on ps, sharded and per-worker variables (the step reads a
variable through its handle once, takes the gradients of the values read,
and updates through the handle):

``empty``
    Always measured first: one scalar per ps task, read by the worker and
    written back. Nothing to move; what involving the ps tasks costs a step
    by itself. Under PSS the worker runs the step as a multi-task function
    and dispatches each ps task's part to it over gRPC, so its row is the
    reference for what no transport can take off the step.
``mlp``
    An MLP 64-1024-1024-10 (4.3 MiB of weights), batch 32, momentum SGD
    (``ResourceApplyMomentum``, the slots colocated with their weights,
    round robin over the ps tasks). A step moves every weight to the
    worker and every gradient back: 8.6 MiB.
``embedding``
    A table of 131,072 x 64 float32 (32 MiB) sharded over the ps tasks by the
    strategy's ``variable_partitioner`` (``FixedShardsPartitioner(ps)``,
    active only while the table is made: the dense weights stay whole),
    looked up at 16 ids per example for a batch of 512 (8,192 rows), two
    dense layers (1024-256-1) on the rows, a logistic loss. Only the
    looked-up rows cross: each id goes to its shard's ps task, the rows come
    back, and their gradients go back as a scatter (``ResourceScatterSub``,
    plain SGD) on that shard; the dense layers by momentum SGD. With more
    than one ps task the rows per shard change from step to step (dynamic
    transfers, which the plans' static ``bytes_per_step`` leaves out). 6.0
    MiB per step.
``cnn``
    A small CNN on 32x32x3 images, batch 32: two 3x3 convolutions (16 and 32
    channels), each with 2x2 max pooling, a dense layer 2048-512 and 10
    classes; momentum SGD. 4.0 MiB of weights, most of them the dense layer:
    8.1 MiB per step, with more compute per byte than the MLP.

``vgg16``, ``resnet50``, ``inception_v3``, ``mobilenet_v2``, ``lstm``, ``transformer``
    The real networks of ``_harness/networks.py`` (not in the default
    ``--models``; ``bench/models.py`` runs them), Keras 2 layers made in
    the strategy's scope, without dropout, batch 16 (``--quick``: their
    test size, batch 8), momentum SGD by fused updates where each weight
    lives. Their ceiling's variables are per worker through a variable
    creator (``_per_worker_keras_creator``).

The data is synthetic, drawn on the worker from the step number (the one
argument the coordinator sends), so every system trains on the same
batches.

How it is timed
---------------
After a warm-up (every worker traces its steps, tf_rdma's plans and
regions are set up) each system runs ``--runs`` timed windows; a window
schedules N steps and joins them, and its time per step is the window's
wall time over N (so steps/s is the cluster's throughput: all workers
together). N is sized from the warm-up so that a window of the slowest
system lasts about ``--window`` seconds, and is the same for all three
systems. The systems take turns window by window (the order rotated every
run), so that a change in the machine's load falls on all of them.

Around each window the bench reads the CPU time of every process of the
cluster (the coordinator, the launcher and each server, from ``/proc``) and
of the whole machine; around all of tf_rdma's windows it reads the tf_rdma
counters of every task (``tf_rdma.measured.task_report``): what the steps
moved, dynamic transfers included, beside the plans' ``bytes_per_step``.

How to read the table
---------------------
One row per (model, workers, ps): the bytes a step moves (the plans' static
part and what the counters saw), each system's steps/s (median window),
tf_rdma's share of the ceiling (ceiling step time / tf_rdma step time), its
speedup over gRPC (gRPC step time / tf_rdma step time), the CPUs the
cluster kept busy in each system's windows and those other work took. The
goals, printed as check lines and never asserted, are tf_rdma within 10% of
the ceiling and at least 1.5x plain PSS where a step moves more than
4 MiB. A missed goal prints what bounds it on this machine, each from
measured numbers:

- the CPUs: a step cannot take less wall time than its CPU time (all the
  cluster's processes) spread over every CPU of the machine. On a 2-vCPU
  VM the workers, the ps tasks and the coordinator share two CPUs and the
  ceiling alone keeps them busy from two workers on, so whatever CPU a
  tf_rdma step needs beyond the ceiling's (the copies into the slots, the
  ps tasks' part of the step and its dispatch) comes off its throughput:
  tf_rdma reaches at most ceiling / (its CPU per step / CPUs);
- the ceiling: no step beats it, so the speedup is at most gRPC / ceiling;
- the empty step, an estimate: a step that involves the ps tasks costs at
  least the ceiling's step plus what involving them costs with nothing to
  move (tf_rdma's empty step minus the ceiling's): at most
  ceiling / (ceiling + that) of the ceiling, gRPC / (ceiling + that) of
  gRPC.

The servers run unbound (``tf-rdma launch --bind none``). Bound, each task
of a one-worker, one-ps cluster gets one of two CPUs, TensorFlow sizes its
inter-op thread pool to one thread, and ParameterServerStrategy's first
step never finishes (with ``TF_NUM_INTEROP_THREADS=2`` it does); clusters
with more tasks than CPUs are never bound. Every shape's cluster is started
once and serves all its models and systems; a shape that fails or passes
``--timeout`` is reported as failed, and its cluster is torn down.

Each shape runs in a child (``tf-rdma launch ... --coordinator -- python
bench/ps.py --client``): the orchestrator never imports TensorFlow.
``--json PATH`` writes the shape every bench shares; see bench/README.md.
"""

import argparse
import json
import os
import statistics
import sys
import time

from _harness import networks
from _harness.children import emit_result, launch_command, launch_env, run_child
from _harness.report import Run, print_table, result_entry, verdict
from _harness.units import MiB, human_size, human_time

LOG_PREFIX = "[ps] "
RESULT_PREFIX = "PS_RESULTS "

GRPC, RDMA, CEILING = "pss-grpc", "pss-tf_rdma", "ceiling"
SYSTEMS = (GRPC, RDMA, CEILING)
MODELS = ("mlp", "embedding", "cnn")
#: Every model --models takes: these and the real networks.
ALL_MODELS = MODELS + networks.NAMES
#: The step with nothing to move, measured first in every cluster.
EMPTY = "empty"

# The goals; printed as check lines, never asserted.
TARGET_SHARE = 0.9
TARGET_SPEEDUP = 1.5
TARGET_MIN_BYTES = 4 * MiB

#: Each model's sizes: the default run's and --quick's (a smoke run).
SIZES = {
    "mlp": {"default": {"features": 64, "hidden": [1024, 1024],
                        "classes": 10, "batch": 32},
            "quick": {"features": 64, "hidden": [256, 256], "classes": 10,
                      "batch": 32}},
    "embedding": {"default": {"vocab": 131072, "dim": 64, "ids": 16,
                              "hidden": 256, "batch": 512},
                  "quick": {"vocab": 8192, "dim": 16, "ids": 4,
                            "hidden": 32, "batch": 64}},
    "cnn": {"default": {"image": 32, "channels": [16, 32], "dense": 512,
                        "classes": 10, "batch": 32},
            "quick": {"image": 16, "channels": [4, 8], "dense": 64,
                      "classes": 10, "batch": 16}},
}

LEARNING_RATE = 0.01
MOMENTUM = 0.9

DEFAULT = {"runs": 3, "window": 2.0, "timeout": 900.0}
QUICK = {"runs": 2, "window": 0.4, "timeout": 240.0}


def log(message):
    print(LOG_PREFIX + message, file=sys.stderr, flush=True)


# --- the client: the coordinator of one cluster shape ---


class _TablePartitioner:
    """``FixedShardsPartitioner(shards)`` while ``active``, else one shard.

    The strategy's ``variable_partitioner`` sees every variable created in
    its scope; the dense models' weights stay whole (round robin over the ps
    tasks, as without a partitioner), and only the embedding table, made
    while ``active`` is set, is sharded.
    """

    def __init__(self, tf, shards):
        self._fixed = tf.distribute.experimental.partitioners.FixedShardsPartitioner(shards)
        self.active = False

    def __call__(self, shape, dtype, axis=0):
        if self.active:
            return self._fixed(shape, dtype, axis)
        return [1] * len(shape)


class _ClusterCPU:
    """CPU seconds of this cluster's processes and of the whole machine.

    The cluster is the coordinator (this process), its parent (``tf-rdma
    launch``) and the launcher's other children (the servers), read from
    ``/proc``; the machine's busy time from the first line of
    ``/proc/stat``.
    """

    def __init__(self):
        self.tick = os.sysconf("SC_CLK_TCK")
        launcher = os.getppid()
        self.pids = [os.getpid(), launcher]
        for name in os.listdir("/proc"):
            if name.isdigit() and int(name) not in self.pids:
                stat = self._stat(int(name))
                if stat is not None and int(stat[1]) == launcher:
                    self.pids.append(int(name))

    @staticmethod
    def _stat(pid):
        """The fields of /proc/PID/stat after the command name, or None."""
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            return None

    def read(self):
        """``(cluster CPU s, machine busy CPU s, wall s)`` now."""
        ours = 0
        for pid in self.pids:
            stat = self._stat(pid)
            if stat is not None:
                ours += int(stat[11]) + int(stat[12])  # utime, stime
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:9]]
        busy = sum(fields) - fields[3] - fields[4]  # minus idle, iowait
        return ours / self.tick, busy / self.tick, time.perf_counter()


def _split_rows(rows, shards):
    """Rows per shard as TensorFlow's partitioners split them: the first
    ``rows % shards`` shards get one more."""
    return [rows // shards + (i < rows % shards) for i in range(shards)]


def _momentum_slot(tf, strategy, variable, per_worker):
    """A zero momentum slot for ``variable``, made in the strategy's scope:
    on the variable's ps task, or one copy per worker."""
    import contextlib

    near = (contextlib.nullcontext() if per_worker else
            strategy.extended.colocate_vars_with(variable))
    with near:
        return tf.Variable(tf.zeros(variable.shape, variable.dtype),
                           per_worker_variable=per_worker, trainable=False)


class _Dense:
    """A model's variables and momentum slots, made in the strategy's scope.

    On the ps tasks (round robin, each slot colocated with its variable) or,
    with ``per_worker``, one copy per worker. The step uses them only through
    their handles, taken once per trace. ``table`` holds the shards of an
    embedding table (updated by scatter, without slots), if the model has
    one.
    """

    def __init__(self, tf, strategy, arrays, per_worker, slots=True):
        self.vars, self.slots, self.table = [], [], []
        with strategy.scope():
            for a in arrays:
                v = tf.Variable(a, per_worker_variable=per_worker)
                self.vars.append(v)
                if slots:
                    self.slots.append(
                        _momentum_slot(tf, strategy, v, per_worker))
        self.nbytes = sum(a.nbytes for a in arrays)

    def read(self, tf):
        """Reads every variable (where it lives); returns (handles, values)."""
        handles = [v.handle for v in self.vars]
        return handles, [tf.raw_ops.ReadVariableOp(resource=h, dtype=tf.float32)
                         for h in handles]

    def apply(self, tf, handles, grads):
        """Momentum SGD, one fused in-place update per variable (on its task)."""
        for h, s, g in zip(handles, self.slots, grads):
            tf.raw_ops.ResourceApplyMomentum(
                var=h, accum=s.handle, lr=tf.constant(LEARNING_RATE), grad=g,
                momentum=tf.constant(MOMENTUM))


def _glorot(np, rng, shape):
    fan_in, fan_out = int(np.prod(shape[:-1])), shape[-1]
    limit = np.sqrt(6.0 / (fan_in + fan_out))
    return rng.uniform(-limit, limit, shape).astype(np.float32)


class _Empty:
    """One scalar per ps task, read and rewritten by every step.

    The step of the other models with nothing to move: each ps task sends
    its scalar to the worker, the worker computes one number from them and
    each ps task stores it. What involving the ps tasks in a step costs by
    itself (their part of the function dispatched with the worker's, the
    round trip of the step's first reads and last writes); the reference the
    check lines estimate the other models' bound with.
    """

    def __init__(self, tf, np, shards):
        self.tf, self.sizes = tf, {"scalars": shards}
        self.arrays = [np.zeros([], np.float32) for _ in range(shards)]
        self.describe = (f"one scalar on each ps task ({shards}), read and "
                         f"written back by every step: nothing to move")

    def build(self, strategy, per_worker):
        return _Dense(self.tf, strategy, self.arrays, per_worker, slots=False)

    def step(self, params, s):
        tf = self.tf
        handles, values = params.read(tf)
        total = tf.add_n(values) * 0.5 + tf.cast(s, tf.float32)
        for h in handles:
            tf.raw_ops.AssignVariableOp(resource=h, value=total)
        return total


class _Classifier:
    """A dense model on images or features, softmax cross-entropy, momentum SGD.

    Subclasses give ``arrays`` (the initial weights), ``shape`` (one
    example's) and ``forward``; a step draws its batch and labels from the
    step number on the worker, reads the weights, and applies one fused
    momentum update per weight where it lives.
    """

    def build(self, strategy, per_worker):
        return _Dense(self.tf, strategy, self.arrays, per_worker)

    def step(self, params, s):
        tf, z = self.tf, self.sizes
        x = tf.random.stateless_normal([z["batch"], *self.shape],
                                       seed=tf.stack([s, 0]))
        y = tf.random.stateless_uniform([z["batch"]], seed=tf.stack([s, 1]),
                                        maxval=z["classes"], dtype=tf.int32)
        handles, w = params.read(tf)
        with tf.GradientTape() as tape:
            tape.watch(w)
            loss = tf.reduce_mean(
                tf.nn.sparse_softmax_cross_entropy_with_logits(
                    labels=y, logits=self.forward(w, x)))
        params.apply(tf, handles, tape.gradient(loss, w))
        return loss


class _MLP(_Classifier):
    """features - hidden... - classes, ReLU."""

    def __init__(self, tf, np, sizes):
        self.tf, self.sizes = tf, sizes
        self.shape = [sizes["features"]]
        widths = [sizes["features"]] + list(sizes["hidden"]) + [sizes["classes"]]
        rng = np.random.RandomState(0)
        self.arrays = []
        for a, b in zip(widths[:-1], widths[1:]):
            self.arrays += [_glorot(np, rng, (a, b)), np.zeros([b], np.float32)]
        self.describe = (f"MLP {'-'.join(map(str, widths))}, batch "
                         f"{sizes['batch']}, momentum SGD")

    def forward(self, w, x):
        tf = self.tf
        for i in range(0, len(w), 2):
            x = tf.matmul(x, w[i]) + w[i + 1]
            if i + 2 < len(w):
                x = tf.nn.relu(x)
        return x


class _CNN(_Classifier):
    """Two 3x3 convolutions with 2x2 max pooling, a dense layer, classes."""

    def __init__(self, tf, np, sizes):
        self.tf, self.sizes = tf, sizes
        self.shape = [sizes["image"], sizes["image"], 3]
        rng = np.random.RandomState(0)
        c1, c2 = sizes["channels"]
        flat = (sizes["image"] // 4) ** 2 * c2
        self.arrays = [
            _glorot(np, rng, (3, 3, 3, c1)), np.zeros([c1], np.float32),
            _glorot(np, rng, (3, 3, c1, c2)), np.zeros([c2], np.float32),
            _glorot(np, rng, (flat, sizes["dense"])),
            np.zeros([sizes["dense"]], np.float32),
            _glorot(np, rng, (sizes["dense"], sizes["classes"])),
            np.zeros([sizes["classes"]], np.float32)]
        self.describe = (f"CNN {sizes['image']}x{sizes['image']}x3, conv "
                         f"3x3x{c1}, pool, conv 3x3x{c2}, pool, dense "
                         f"{flat}-{sizes['dense']}-{sizes['classes']}, batch "
                         f"{sizes['batch']}, momentum SGD")

    def forward(self, w, x):
        tf = self.tf
        for i in (0, 2):
            x = tf.nn.relu(tf.nn.conv2d(x, w[i], 1, "SAME") + w[i + 1])
            x = tf.nn.max_pool2d(x, 2, 2, "VALID")
        x = tf.reshape(x, [self.sizes["batch"], -1])
        x = tf.nn.relu(tf.matmul(x, w[4]) + w[5])
        return tf.matmul(x, w[6]) + w[7]


class _Embedding:
    """A sharded table looked up by a batch of ids, two dense layers on it.

    ``build`` makes the table's shards: under PSS the strategy's partitioner
    shards it over the ps tasks (``FixedShardsPartitioner``); per worker,
    the same number of shards of the same rows, all on the worker. The step
    sends each id to its shard (``dynamic_partition``), gathers the rows
    there, and scatters the rows' gradients back into the same shard.
    """

    def __init__(self, tf, np, sizes, partitioner, shards):
        self.tf, self.sizes = tf, sizes
        self.partitioner, self.shards = partitioner, shards
        rng = np.random.RandomState(0)
        self.table = (rng.standard_normal((sizes["vocab"], sizes["dim"]))
                      * 0.05).astype(np.float32)
        width = sizes["ids"] * sizes["dim"]
        self.arrays = [_glorot(np, rng, (width, sizes["hidden"])),
                       np.zeros([sizes["hidden"]], np.float32),
                       _glorot(np, rng, (sizes["hidden"], 1)),
                       np.zeros([1], np.float32)]
        self.describe = (f"embedding {sizes['vocab']}x{sizes['dim']} in "
                         f"{shards} shard(s), {sizes['ids']} ids per example, "
                         f"dense {width}-{sizes['hidden']}-1, batch "
                         f"{sizes['batch']}; the table by sparse SGD "
                         f"(scatter), the dense layers by momentum SGD")

    def build(self, strategy, per_worker):
        tf = self.tf
        dense = _Dense(tf, strategy, self.arrays, per_worker)
        if per_worker:
            rows = _split_rows(self.sizes["vocab"], self.shards)
            starts = [sum(rows[:i]) for i in range(len(rows))]
            with strategy.scope():
                table = [tf.Variable(self.table[a:a + n],
                                     per_worker_variable=True)
                         for a, n in zip(starts, rows)]
        else:
            self.partitioner.active = True
            try:
                with strategy.scope():
                    made = tf.Variable(self.table)
            finally:
                self.partitioner.active = False
            table = list(getattr(made, "variables", None) or [made])
        dense.table = table
        dense.nbytes += self.table.nbytes
        return dense

    def step(self, params, s):
        tf, z = self.tf, self.sizes
        n = z["batch"] * z["ids"]
        ids = tf.random.stateless_uniform([n], seed=tf.stack([s, 0]),
                                          maxval=z["vocab"], dtype=tf.int32)
        y = tf.cast(tf.random.stateless_uniform(
            [z["batch"], 1], seed=tf.stack([s, 1]), maxval=2,
            dtype=tf.int32), tf.float32)
        table = params.table
        handles = [t.handle for t in table]
        if len(table) == 1:
            local, positions = [ids], None
        else:
            rows = [int(t.shape[0]) for t in table]
            ends = tf.constant([sum(rows[:i + 1]) for i in range(len(rows))],
                               tf.int32)
            shard = tf.searchsorted(ends, ids, side="right")
            starts = [sum(rows[:i]) for i in range(len(rows))]
            local = [p - start for p, start in zip(
                tf.dynamic_partition(ids, shard, len(table)), starts)]
            positions = tf.dynamic_partition(tf.range(n), shard, len(table))
        # ResourceGather runs with its shard: only the looked-up rows cross.
        gathered = [tf.raw_ops.ResourceGather(resource=h, indices=i,
                                              dtype=tf.float32)
                    for h, i in zip(handles, local)]
        dense_handles, w = params.read(tf)
        with tf.GradientTape() as tape:
            tape.watch(gathered + w)
            rows_all = (gathered[0] if positions is None else
                        tf.dynamic_stitch(positions, gathered))
            h = tf.reshape(rows_all, [z["batch"], z["ids"] * z["dim"]])
            h = tf.nn.relu(tf.matmul(h, w[0]) + w[1])
            logits = tf.matmul(h, w[2]) + w[3]
            loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(
                labels=y, logits=logits))
        grads = tape.gradient(loss, gathered + w)
        for h, i, g in zip(handles, local, grads[:len(gathered)]):
            tf.raw_ops.ResourceScatterSub(resource=h, indices=i,
                                          updates=LEARNING_RATE * g)
        params.apply(tf, dense_handles, grads[len(gathered):])
        return loss


def _per_worker_keras_creator(tf):
    """A variable creator that makes Keras layers' variables per worker.

    The ceiling of a real network: its Keras layers make their variables
    in the strategy's scope, and this creator, inside it, asks for PSS
    per-worker variables instead. Two things TensorFlow's
    ``PerWorkerVariable`` (2.21) lacks for Keras' layers and ``GradientTape``
    are added here: it keeps the ``trainable`` it was made with (the
    tape watches only trainable variables), and within one graph its
    ``handle`` is one captured placeholder (``capture_call_time_value``
    with a key; unkeyed, each read captures a new one, and the tape finds
    no path from the loss to the handle it is asked about).
    """
    from tensorflow.python.distribute import ps_values  # pylint: disable=import-outside-toplevel
    from tensorflow.python.framework import ops  # pylint: disable=import-outside-toplevel

    class KerasPerWorkerVariable(ps_values.PerWorkerVariable):
        @property
        def handle(self):
            if tf.executing_eagerly():
                return super().handle
            self._maybe_create_per_worker_vars()
            closure, spec = self.handle_call_time_value()
            return ops.get_default_graph().capture_call_time_value(
                closure, spec, key=("per-worker handle", id(self)))

    def creator(next_creator, **kwargs):
        kwargs["per_worker_variable"] = True
        variable = next_creator(**kwargs)
        trainable = kwargs.get("trainable")
        variable._trainable = True if trainable is None else trainable  # pylint: disable=protected-access
        variable.__class__ = KerasPerWorkerVariable
        return variable

    return creator


class _KerasParams:
    """A network built in the strategy's scope, and its momentum slots."""

    def __init__(self, tf, strategy, model, per_worker):
        self.model = model
        self.vars = model.trainable_variables
        with strategy.scope():
            self.slots = [_momentum_slot(tf, strategy, v, per_worker)
                          for v in self.vars]
        self.nbytes = sum(v.shape.num_elements() * v.dtype.size
                          for v in model.variables)


class _Network:
    """A real network (bench/_harness/networks.py), Keras 2 layers, PSS.

    Built with ``tf_keras`` (Keras 2: its layers make ``tf.Variable``s in
    the strategy's scope; Keras 3 has no ParameterServerStrategy support),
    without dropout (a dropout mask drawn from a stateful generator would
    differ between the three systems' copies, and their losses could not
    be compared), each copy from the same seed. The step draws its batch
    from the step number, runs the model (batch normalization updates its
    moving statistics where they live), and applies momentum SGD where each
    weight lives: one fused update per dense gradient, a sparse one
    (``ResourceSparseApplyMomentum``) for an embedding's rows.
    """

    def __init__(self, tf, name, size, batch):
        import tf_keras  # pylint: disable=import-outside-toplevel

        self.tf, self.keras, self.name = tf, tf_keras, name
        self.shape = list(networks.input_shape(name, size))
        self.sizes = {"size": size, "batch": batch, "input": self.shape,
                      "classes": networks.CLASSES}
        self.describe = (f"{name} ({size} size, input "
                         f"{'x'.join(map(str, self.shape))}, batch {batch}),"
                         f" no dropout, momentum SGD")

    def build(self, strategy, per_worker):
        import contextlib

        tf = self.tf
        self.keras.utils.set_random_seed(1)  # the same weights in every copy
        creator = (tf.variable_creator_scope(_per_worker_keras_creator(tf))
                   if per_worker else contextlib.nullcontext())
        with strategy.scope(), creator:
            model = networks.build(self.name, self.keras,
                                   self.sizes["size"], dropout=0.0)
        return _KerasParams(tf, strategy, model, per_worker)

    def step(self, params, s):
        tf, z = self.tf, self.sizes
        if networks.takes_tokens(self.name):
            x = tf.random.stateless_uniform(
                [z["batch"], *self.shape], seed=tf.stack([s, 0]),
                maxval=networks.vocabulary(z["size"]), dtype=tf.int32)
        else:
            x = tf.random.stateless_normal([z["batch"], *self.shape],
                                           seed=tf.stack([s, 0]))
        y = tf.random.stateless_uniform([z["batch"]], seed=tf.stack([s, 1]),
                                        maxval=z["classes"], dtype=tf.int32)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(
                tf.nn.sparse_softmax_cross_entropy_with_logits(
                    labels=y, logits=params.model(x, training=True)))
        grads = tape.gradient(loss, params.vars)
        lr, momentum = tf.constant(LEARNING_RATE), tf.constant(MOMENTUM)
        for v, slot, g in zip(params.vars, params.slots, grads):
            if isinstance(g, tf.IndexedSlices):
                tf.raw_ops.ResourceSparseApplyMomentum(
                    var=v.handle, accum=slot.handle, lr=lr, grad=g.values,
                    indices=g.indices, momentum=momentum)
            else:
                tf.raw_ops.ResourceApplyMomentum(
                    var=v.handle, accum=slot.handle, lr=lr, grad=g,
                    momentum=momentum)
        return loss


def _tasks(cluster):
    return [f"/job:{job}/task:{i}" for job in ("worker", "ps")
            for i in range(len(cluster.get(job, [])))]


def _moved(tf_rdma_report, tasks):
    """Bytes each task has sent through tf_rdma so far: {task: bytes}."""
    out = {}
    for task in tasks:
        report = tf_rdma_report("stats", task)
        out[task] = sum(int(p["bytes_sent"]) for p in report["peers"])
    return out


def _first_difference(losses):
    """Where pss-tf_rdma's losses first differ from pss-grpc's: the step and
    every system's loss there, exactly (the ceiling's says which of the two
    left the common trajectory), or None."""
    grpc, rdma = losses[GRPC], losses[RDMA]
    for step, (a, b) in enumerate(zip(grpc, rdma)):
        if a != b:
            at = {s: (repr(v[step]) if step < len(v) else "-")
                  for s, v in losses.items()}
            return f"step {step}: " + ", ".join(f"{s} {at[s]}" for s in SYSTEMS)
    if len(grpc) != len(rdma):
        return f"{len(grpc)} steps of {GRPC} against {len(rdma)}"
    return None


def _measure_model(name, model, ctx, args):
    """Warms up and times the three systems on one model; its report."""
    tf, strategy, coordinator = ctx["tf"], ctx["strategy"], ctx["coordinator"]
    workers = ctx["workers"]
    params = {GRPC: model.build(strategy, False),
              RDMA: model.build(strategy, False),
              CEILING: model.build(strategy, True)}

    def make_step(p):
        @tf.function
        def step(s):
            return strategy.run(lambda s: model.step(p, s), args=(s,))
        return step

    steps = {GRPC: make_step(params[GRPC]),
             RDMA: ctx["rewrite"](make_step(params[RDMA]), name=f"{name}_step"),
             CEILING: make_step(params[CEILING])}
    losses = {s: [] for s in SYSTEMS}
    next_step = {s: 0 for s in SYSTEMS}

    def run(system, n):
        """Schedules n steps of `system`, joins; returns the wall seconds."""
        first = next_step[system]
        numbers = [tf.constant(first + k, tf.int32) for k in range(n)]
        next_step[system] += n
        t0 = time.perf_counter()
        remote = [coordinator.schedule(steps[system], args=(k,))
                  for k in numbers]
        coordinator.join()
        wall = time.perf_counter() - t0
        losses[system].extend(float(r.fetch()) for r in remote)
        return wall

    # Warm-up: every worker traces its step (and tf_rdma its plan) in the
    # first part; the second part sizes the timed windows.
    window = args.window / 2 if name == EMPTY else args.window
    warm = max(2, args.warmup) * workers
    warm_s = {}
    for system in SYSTEMS:
        t0 = time.perf_counter()
        run(system, warm)
        if system == RDMA:
            # A worker the coordinator gave no step would trace its plan in
            # a timed window: more steps until every worker has one.
            for _ in range(5):
                if len(steps[RDMA].plans) >= workers:
                    break
                run(system, workers)
        warm_s[system] = time.perf_counter() - t0
    per_step = max(run(system, 2 * workers) / (2 * workers)
                   for system in SYSTEMS)
    n = max(2 * workers, int(window / per_step) // workers * workers)
    log(f"  {name}: warm-up {', '.join(f'{s} {warm_s[s]:.1f} s' for s in SYSTEMS)}"
        f"; windows of {n} steps (slowest {human_time(per_step)}/step)")

    warmed = dict(next_step)
    tasks = _tasks(ctx["cluster"])
    before = _moved(ctx["report"], tasks)
    windows = {s: [] for s in SYSTEMS}
    for r in range(args.runs):
        order = SYSTEMS[r % 3:] + SYSTEMS[:r % 3]
        for system in order:
            c0 = ctx["cpu"].read()
            wall = run(system, n)
            c1 = ctx["cpu"].read()
            windows[system].append({
                "step_s": wall / n, "cpu_per_step_s": (c1[0] - c0[0]) / n,
                "others_cpus": max(0.0, (c1[1] - c0[1]) - (c1[0] - c0[0]))
                / (c1[2] - c0[2]),
                "busy_cpus": (c1[0] - c0[0]) / (c1[2] - c0[2])})
        log(f"  {name}: run {r + 1}/{args.runs}: " + ", ".join(
            f"{s} {1 / windows[s][-1]['step_s']:.1f} steps/s" for s in SYSTEMS))
    after = _moved(ctx["report"], tasks)
    timed = args.runs * n
    sent = {t: after[t] - before[t] for t in tasks}

    plans = steps[RDMA].plans
    plan_bytes = statistics.median(p.bytes_per_step for p in plans) if plans else 0
    edges = [e for a in steps[RDMA].analyses for e in a.edges]
    kept = sorted({f"{e.src} -> {e.dst}: {e.reason}" for e in edges
                   if e.kind == "kept"})
    comparable = workers == 1
    out = {"model": name, "describe": model.describe,
           "sizes": model.sizes, "weight_bytes": params[GRPC].nbytes,
           "window_steps": n, "warmup_steps": warmed,
           "warmup_s": {s: round(v, 2) for s, v in warm_s.items()},
           "plan_bytes_per_step": plan_bytes,
           "plans": len(plans),
           "plan_bytes": [p.bytes_per_step for p in plans],
           "dynamic_transfers": sum(1 for e in edges if e.kind == "dynamic"),
           "kept": kept,
           "moved_bytes_per_step": sum(sent.values()) / timed,
           "sent_bytes_per_step": {t: v / timed for t, v in sent.items()},
           "windows": windows,
           "losses": {s: v for s, v in losses.items()},
           "losses_comparable": comparable,
           "losses_identical": (losses[GRPC] == losses[RDMA]
                                if comparable else None),
           "ceiling_losses_identical": (losses[GRPC] == losses[CEILING]
                                        if comparable else None),
           "tf_rdma_ceiling_identical": (losses[RDMA] == losses[CEILING]
                                         if comparable else None),
           "first_difference": (_first_difference(losses)
                                if comparable else None)}
    # Let the variables go (their tasks free them); the plans' regions stay
    # in the servers until they exit.
    del params, steps
    return out


def client(args):
    """Runs inside a ``tf-rdma launch --coordinator`` cluster; one result line."""
    import numpy as np
    import tensorflow as tf

    import tf_rdma
    from tf_rdma import measured

    cluster = json.loads(os.environ["TF_CONFIG"])["cluster"]
    workers, ps = len(cluster["worker"]), len(cluster.get("ps", []))
    partitioner = _TablePartitioner(tf, ps)
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    strategy = tf.distribute.experimental.ParameterServerStrategy(
        resolver, variable_partitioner=partitioner)
    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(
        strategy)
    ctx = {"tf": tf, "rewrite": tf_rdma.rewrite, "strategy": strategy,
           "coordinator": coordinator, "cluster": cluster,
           "workers": workers, "report": measured.task_report,
           "cpu": _ClusterCPU()}
    kind = "quick" if args.quick else "default"
    out = {"workers": workers, "ps": ps, "models": [],
           "cpus": len(os.sched_getaffinity(0)),
           "cluster_pids": ctx["cpu"].pids,
           "transport": os.environ.get("TF_RDMA_TRANSPORT", "auto"),
           "tensorflow": tf.__version__}
    for name in [EMPTY] + list(args.models):
        sizes = SIZES.get(name, {}).get(kind)
        if name == EMPTY:
            model = _Empty(tf, np, ps)
        elif name == "mlp":
            model = _MLP(tf, np, sizes)
        elif name == "cnn":
            model = _CNN(tf, np, sizes)
        elif name in networks.NAMES:
            size = "test" if args.quick else "bench"
            model = _Network(tf, name, size, networks.BATCH[size])
        else:
            model = _Embedding(tf, np, sizes, partitioner, ps)
        log(f"{workers} worker(s), {ps} ps: {name}: {model.describe}")
        out["models"].append(_measure_model(name, model, ctx, args))
    emit_result(RESULT_PREFIX, out)
    return 0


# --- the orchestrator ---


def run_shape(workers, ps, args):
    """Starts a cluster of `workers` and `ps` tasks, runs the client; its JSON."""
    label = f"{workers}w{ps}ps"
    client_cmd = [sys.executable, os.path.abspath(__file__), "--client",
                  "--runs", str(args.runs), "--window", str(args.window),
                  "--warmup", str(args.warmup), "--models", *args.models]
    if args.quick:
        client_cmd.append("--quick")
    cmd = launch_command(client_cmd, workers, ps=ps, coordinator=True,
                         bind="none", timeout_start=args.timeout)
    log(f"{label}: starting {workers} worker(s), {ps} ps task(s) and the "
        f"coordinator (TF_RDMA_TRANSPORT={args.transport})")
    t0 = time.perf_counter()
    _, out = run_child(label, cmd, launch_env(args.transport),
                       timeout=args.timeout, verbose=args.verbose, log=log,
                       log_prefix=LOG_PREFIX, result_prefix=RESULT_PREFIX)
    if out is not None:
        log(f"{label}: done in {time.perf_counter() - t0:.1f} s")
    return out


def _median(windows, key):
    return statistics.median(w[key] for w in windows)


def _order(key):
    """Rows in the order of the table: empty first, then --models' order,
    then by workers and ps tasks."""
    model, workers, ps = key
    return (-1 if model == EMPTY else ALL_MODELS.index(model), workers, ps)


def shape_results(shape):
    """The JSON ``results`` of one shape's client report.

    ``size_bytes`` is what a step moved through tf_rdma (the counters of
    every task over the timed windows, per step): the step's ps <-> worker
    tensors, which PSS moves over gRPC and the ceiling not at all; the
    plan's static part is ``plan_bytes_per_step``.
    """
    results = []
    for m in shape["models"]:
        t = {s: _median(m["windows"][s], "step_s") for s in SYSTEMS}
        size = round(m["moved_bytes_per_step"]) or m["plan_bytes_per_step"]
        for s in SYSTEMS:
            ws = m["windows"][s]
            extra = {"ps": shape["ps"], "model": m["model"],
                     "steps_per_s": 1 / t[s],
                     "window_steps": m["window_steps"],
                     "cpu_per_step_s": _median(ws, "cpu_per_step_s"),
                     "busy_cpus": _median(ws, "busy_cpus"),
                     "others_cpus": _median(ws, "others_cpus")}
            if s == RDMA:
                extra.update(plan_bytes_per_step=m["plan_bytes_per_step"],
                             moved_bytes_per_step=m["moved_bytes_per_step"],
                             share_of_ceiling=t[CEILING] / t[RDMA],
                             speedup_vs_grpc=t[GRPC] / t[RDMA],
                             losses_identical=m["losses_identical"],
                             ceiling_losses_identical=m[
                                 "ceiling_losses_identical"],
                             tf_rdma_ceiling_identical=m[
                                 "tf_rdma_ceiling_identical"])
            results.append(result_entry(
                s, f"{m['model']}-step", size, [w["step_s"] for w in ws],
                shape["workers"], **extra))
    return results


def _by_row(results):
    """``{(model, workers, ps): {system: result}}`` of the complete rows."""
    rows = {}
    for r in results:
        rows.setdefault((r["model"], r["P"], r["ps"]), {})[r["system"]] = r
    return {k: v for k, v in sorted(rows.items(), key=lambda kv: _order(kv[0]))
            if all(s in v for s in SYSTEMS)}


def bounds(row, empty, cpus):
    """What this machine allows tf_rdma on one row, from measured numbers.

    Args:
      row: ``{system: result}`` of one (model, workers, ps).
      empty: The same shape's empty-step row, or None.
      cpus: The machine's CPUs.

    Returns:
      A dict: ``share_cpu`` (the most of the ceiling that tf_rdma's CPU per
      step lets it reach on ``cpus`` CPUs), ``speedup_ceiling`` (pss-grpc
      over the ceiling: no step beats the ceiling's), ``dispatch_s`` (what
      the empty step says involving the ps tasks costs a step: tf_rdma's
      empty step minus the ceiling's) and, from it, ``share_dispatch`` and
      ``speedup_dispatch`` (estimates: the ceiling's step plus that cost);
      None where not measured.
    """
    g, t, c = (row[s]["median_s"] for s in SYSTEMS)
    cpu = row[RDMA]["cpu_per_step_s"]
    out = {"share_cpu": c * cpus / cpu if cpu > 0 else None,
           "speedup_ceiling": g / c, "dispatch_s": None,
           "share_dispatch": None, "speedup_dispatch": None}
    if empty is not None:
        extra = max(0.0, empty[RDMA]["median_s"] - empty[CEILING]["median_s"])
        out.update(dispatch_s=extra, share_dispatch=c / (c + extra),
                   speedup_dispatch=g / (c + extra))
    return out


def _reach(goal, target, why, *bounds):
    """The note of a missed goal: out of reach where a bound (None: not
    measured) is under its target, and why."""
    low = min(b for b in bounds if b is not None)
    return (f"{goal} {'out of reach' if low < target else 'not bound'} "
            f"here: " + "; ".join(why))


def check(row, empty, cpus):
    """The goals for one (model, workers, ps): a dict with its line.

    A goal that is missed is "out of reach here" when a bound from
    :func:`bounds` is below its target: for the share the CPU bound or the
    empty step's estimate, for the speedup pss-grpc / ceiling or the
    estimate.
    """
    g, t, c = (row[s] for s in SYSTEMS)
    model, workers, ps = t["model"], t["P"], t["ps"]
    size = t["size_bytes"]
    share, speedup = t["share_of_ceiling"], t["speedup_vs_grpc"]
    b = bounds(row, empty, cpus)
    out = {"model": model, "P": workers, "ps": ps, "size_bytes": size,
           "share": share, "speedup": speedup,
           "targets": {"share": TARGET_SHARE, "speedup": TARGET_SPEEDUP},
           "measured": {"grpc_s": g["median_s"], "tf_rdma_s": t["median_s"],
                        "ceiling_s": c["median_s"],
                        "tf_rdma_cpu_per_step_s": t["cpu_per_step_s"],
                        "ceiling_cpu_per_step_s": c["cpu_per_step_s"],
                        "ceiling_busy_cpus": c["busy_cpus"],
                        "others_cpus": c["others_cpus"], "cpus": cpus},
           "bound": b}
    head = (f"{model}, {workers} worker(s), {ps} ps "
            f"({human_size(size, exact=False)}/step): tf_rdma {share:.0%} of "
            f"the ceiling, {speedup:.2f}x pss-grpc")
    if size <= TARGET_MIN_BYTES:
        out.update(verdict="not applicable",
                   line=f"{head}: the goals apply above "
                        f"{human_size(TARGET_MIN_BYTES)} a step")
        return out
    ok_share, ok_speed = share >= TARGET_SHARE, speedup >= TARGET_SPEEDUP
    parts = [f"share (target >= {TARGET_SHARE:.0%}) {verdict(ok_share)}",
             f"speedup (target >= {TARGET_SPEEDUP:g}x) {verdict(ok_speed)}"]
    notes = []
    dispatch = (f"the empty step: involving the ps tasks costs "
                f"{human_time(b['dispatch_s'])} a step with nothing to move"
                if b["dispatch_s"] is not None else None)
    if not ok_share:
        least = t["cpu_per_step_s"] / cpus
        why = [f"tf_rdma's step takes {human_time(t['cpu_per_step_s'])} of "
               f"CPU in the cluster's processes (the ceiling's "
               f"{human_time(c['cpu_per_step_s'])}, which kept "
               f"{c['busy_cpus']:.2f} of {cpus} CPUs busy; other work "
               f"{c['others_cpus']:.2f}), at least {human_time(least)} on "
               f"{cpus} CPUs: at most {b['share_cpu']:.0%}"]
        if dispatch:
            why.append(f"{dispatch}: about {b['share_dispatch']:.0%}")
        notes.append(_reach("share", TARGET_SHARE, why, b["share_cpu"],
                            b["share_dispatch"]))
    if not ok_speed:
        why = [f"no step beats the ceiling's {human_time(c['median_s'])}: "
               f"at most pss-grpc / ceiling = {human_time(g['median_s'])} / "
               f"{human_time(c['median_s'])} = {b['speedup_ceiling']:.2f}x"]
        if dispatch:
            why.append(f"{dispatch}: about {b['speedup_dispatch']:.2f}x")
        notes.append(_reach("speedup", TARGET_SPEEDUP, why,
                            b["speedup_ceiling"], b["speedup_dispatch"]))
    line = f"{head}: " + "; ".join(parts)
    if notes:
        line += ". " + ". ".join(notes)
    out.update(verdict=verdict(ok_share and ok_speed), line=line)
    return out


def print_report(rows):
    """The table: one line per (model, workers, ps)."""
    header = ["model", "workers", "ps", "plan/step", "moved/step",
              "grpc steps/s", "tf_rdma steps/s", "ceiling steps/s",
              "% ceiling", "vs grpc", "busy g/t/c", "others", "losses"]
    table = []
    for (model, workers, ps), row in rows.items():
        g, t, c = (row[s] for s in SYSTEMS)
        same = t.get("losses_identical")
        if same is None:
            losses = "async"
        elif same:
            losses = ("all 3 identical" if t.get("ceiling_losses_identical")
                      else "identical")
        else:
            losses = ("gRPC differs" if t.get("tf_rdma_ceiling_identical")
                      else "DIFFER")
        table.append([
            model, str(workers), str(ps),
            human_size(t["plan_bytes_per_step"], exact=False),
            human_size(t["size_bytes"], exact=False),
            f"{g['steps_per_s']:.1f}", f"{t['steps_per_s']:.1f}",
            f"{c['steps_per_s']:.1f}", f"{t['share_of_ceiling']:.0%}",
            f"{t['speedup_vs_grpc']:.2f}x",
            f"{g['busy_cpus']:.1f}/{t['busy_cpus']:.1f}/{c['busy_cpus']:.1f}",
            f"{statistics.median(r['others_cpus'] for r in row.values()):.1f}",
            losses])
    print_table(header, table)


def orchestrate(args):
    run = Run("ps", log)
    shapes, failed = [], []
    for workers in args.workers:
        for ps in args.ps:
            out = run_shape(workers, ps, args)
            if out is None:
                failed.append(f"{workers} worker(s), {ps} ps")
                continue
            shapes.append(out)
            run.machine.setdefault("tensorflow", out.get("tensorflow"))
    results = [r for shape in shapes for r in shape_results(shape)]
    rows = _by_row(results)
    cpus = os.cpu_count() or 1
    print()
    print(f"{run.headline('parameter-server benchmark')}; "
          f"TF_RDMA_TRANSPORT={args.transport}; {args.runs} windows of about "
          f"{args.window:g} s per system")
    described = {}
    for shape in shapes:
        for m in shape["models"]:
            described.setdefault(m["model"], m["describe"])
    for model, text in described.items():
        print(f"  {model}: {text}")
    print("steps/s: all workers together, the median window; % ceiling = "
          "ceiling step / tf_rdma step; busy: CPUs the cluster's processes "
          "used (grpc/tf_rdma/ceiling), others: CPUs other work used")
    if rows:
        print_report(rows)
    else:
        print("no results: no cluster shape finished")
    print()
    checks = []
    for key, row in rows.items():
        if key[0] == EMPTY:
            continue
        c = check(row, rows.get((EMPTY, key[1], key[2])), cpus)
        checks.append(c)
        print("check: " + c["line"])
    # pss-tf_rdma must train pss-grpc's trajectory; where pss-grpc's own
    # losses leave the one that pss-tf_rdma and the ceiling (no transfers)
    # share, that is TensorFlow's gRPC path, reported but not failed.
    differ, grpc_differs = [], []
    for s in shapes:
        for m in s["models"]:
            if m["losses_identical"] is not False:
                continue
            where = (f"{m['model']} ({s['workers']} worker(s), {s['ps']} ps; "
                     f"{m['first_difference']})")
            (grpc_differs if m["tf_rdma_ceiling_identical"] else
             differ).append(where)
    for where in grpc_differs:
        print(f"note: pss-grpc's losses leave the trajectory that pss-tf_rdma "
              f"and the ceiling share, bit for bit: {where}")
    if differ:
        failed.append("losses of pss-tf_rdma differ from pss-grpc's and the "
                      "ceiling's: " + ", ".join(differ))
    run.finish()
    if args.json:
        config = {"workers": args.workers, "ps": args.ps,
                  "models": args.models, "quick": args.quick,
                  "runs": args.runs, "window_s": args.window,
                  "warmup": args.warmup, "transport": args.transport,
                  "systems": list(SYSTEMS), "cpus": cpus,
                  "timing": "per window: the wall time of N scheduled steps "
                            "and their join, over N; median over windows",
                  "targets": {"share_of_ceiling": TARGET_SHARE,
                              "speedup_vs_grpc": TARGET_SPEEDUP,
                              "above_bytes": TARGET_MIN_BYTES},
                  "shapes": shapes, "failed": failed, **run.timing()}
        run.save(args.json, config, results, checks=checks)
    if failed:
        print(f"FAILED: {'; '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def build_parser():
    parser = argparse.ArgumentParser(
        prog="python bench/ps.py",
        description="ParameterServerStrategy training steps/s: plain "
                    "(gRPC), through tf_rdma.rewrite, and the ceiling (the "
                    "same step with per-worker variables), for several "
                    "cluster shapes and models.",
        epilog="See bench/README.md and this script's docstring.")
    parser.add_argument("--json", metavar="PATH",
                        help="also write the results as JSON to PATH")
    parser.add_argument("--quick", action="store_true",
                        help="small models, 2 windows of 0.4 s (a smoke "
                             "run, as the test uses)")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4],
                        metavar="N", help="worker counts (default 1 2 4)")
    parser.add_argument("--ps", type=int, nargs="+", default=[1, 2],
                        metavar="N", help="ps task counts (default 1 2)")
    parser.add_argument("--models", nargs="+", choices=ALL_MODELS,
                        default=list(MODELS),
                        help="models (default: mlp embedding cnn)")
    parser.add_argument("--transport", default="shm",
                        choices=("shm", "tcp", "verbs", "auto"),
                        help="TF_RDMA_TRANSPORT of the servers (default shm)")
    parser.add_argument("--runs", type=int, metavar="N",
                        help=f"timed windows per system (default "
                             f"{DEFAULT['runs']}; --quick {QUICK['runs']})")
    parser.add_argument("--window", type=float, metavar="S",
                        help=f"seconds a window of the slowest system lasts "
                             f"(default {DEFAULT['window']:g}; --quick "
                             f"{QUICK['window']:g})")
    parser.add_argument("--warmup", type=int, default=3, metavar="N",
                        help="warm-up steps per worker and system before the "
                             "sizing steps (default 3)")
    parser.add_argument("--timeout", type=float, metavar="S",
                        help=f"hard limit per cluster shape in seconds "
                             f"(default {DEFAULT['timeout']:g}; --quick "
                             f"{QUICK['timeout']:g})")
    parser.add_argument("--verbose", action="store_true",
                        help="show the servers' and the launcher's output")
    parser.add_argument("--client", action="store_true",
                        help=argparse.SUPPRESS)
    return parser


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    base = QUICK if args.quick else DEFAULT
    for key in ("runs", "window", "timeout"):
        if getattr(args, key) is None:
            setattr(args, key, base[key])
    if args.runs < 1 or args.window <= 0 or args.warmup < 1:
        parser.error("--runs and --warmup must be >= 1 and --window > 0")
    if min(args.workers) < 1 or min(args.ps) < 1:
        parser.error("--workers and --ps must be >= 1")
    if args.client:
        return client(args)
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
