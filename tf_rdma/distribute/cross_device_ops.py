"""Data-parallel training over tf_rdma collectives: RdmaStrategy.

:class:`RdmaStrategy` is a ``tf.distribute`` strategy for synchronous
multi-worker data parallelism, one process per worker (SPMD), like
``tf.distribute.MultiWorkerMirroredStrategy``, but with the gradients
all-reduced by tf_rdma's pipelined collectives on preallocated memory, and
without a TensorFlow gRPC server::

    strategy = tf_rdma.distribute.RdmaStrategy()   # cluster from TF_CONFIG
    with strategy.scope():
        model = make_model()
        model.compile(optimizer="sgd", loss=..., metrics=["accuracy"])
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=3)

What it does, and where:

* **Gradients** (:class:`RdmaCrossDeviceOps`). Keras' optimizer (and
  ``ReplicaContext.all_reduce``) hands all the gradients of a step to
  ``CrossDeviceOps.batch_reduce_implementation`` at once, inside the step's
  graph. There a static :class:`~tf_rdma.graph_passes.buckets.BucketPlan`
  groups them, in the order backpropagation produces them, into buckets of
  at most ``bucket_bytes``, and one ``tf_rdma.collectives.all_reduce`` per
  bucket is emitted. A bucket's collective depends on its own gradients only,
  so it starts as soon as the last of them exists, while backpropagation
  still computes the earlier layers' gradients. The plan is made when the
  step is traced; nothing is negotiated per step.
* **Workers**: the cluster comes from ``TF_CONFIG`` or any
  ``tf.distribute.cluster_resolver.ClusterResolver``. The chief (job
  ``chief``, else ``worker`` 0) is rank 0, the workers follow by index.
  Creating the strategy starts this process's tf_rdma endpoint.
* **Replicas**: ``num_replicas_in_sync`` counts every worker's replicas, so
  Keras (and ``tf.nn.compute_average_loss``) scale the loss by the global
  batch, and a SUM of gradients over workers is the gradient of the global
  batch's mean loss.
* **Input**: ``experimental_distribute_dataset`` and
  ``distribute_datasets_from_function`` shard by worker: every worker gets
  1/P of each global batch (the ``InputContext`` says which).
* **Variables** start as the chief's values (a broadcast when each is
  created), ``strategy.reduce`` reduces across workers, and
  ``extended.should_checkpoint`` is true on the chief only.

The private TensorFlow hooks this needs are in :mod:`tf_rdma._tf_private`.
How it fits together and why: docs/strategy.md.
"""

import re
import sys
import threading
import weakref

import tensorflow as tf

from tf_rdma import _tf_private, cluster as cluster_lib
from tf_rdma import collectives
from tf_rdma.errors import CollectiveError, ConfigError
from tf_rdma.graph_passes import buckets as buckets_lib

__all__ = ["RdmaStrategy", "RdmaCrossDeviceOps", "DEFAULT_BUCKET_BYTES",
           "resolve_cluster"]

#: Default largest gradient bucket, in bytes.
DEFAULT_BUCKET_BYTES = buckets_lib.DEFAULT_BUCKET_BYTES

_JOBS = ("chief", "worker")
_NAME_UNSAFE = re.compile(r"[^A-Za-z0-9_.\-/]")


def _check_algorithm(algorithm):
    choices = ("auto",) + tuple(collectives.ALGORITHMS)
    if algorithm not in choices:
        raise ConfigError(
            f"algorithm {algorithm!r} is not one of {', '.join(choices)}")
    return algorithm


def _check_bucket_bytes(bucket_bytes):
    if (not isinstance(bucket_bytes, int) or isinstance(bucket_bytes, bool)
            or bucket_bytes < 1):
        raise ConfigError(
            f"bucket_bytes must be a positive int (bytes), got "
            f"{bucket_bytes!r}")
    return bucket_bytes


def _check_sparse_as_dense(value):
    if not isinstance(value, bool):
        raise ConfigError(f"sparse_as_dense must be True or False, got "
                          f"{value!r}")
    return value


def _check_timeout(timeout):
    if timeout is None:
        return None
    try:
        value = float(timeout)
    except (TypeError, ValueError):
        value = None
    if value is None or not value > 0 or value == float("inf"):
        raise ConfigError(
            f"timeout must be a positive number of seconds (or None for "
            f"TF_RDMA_TIMEOUT), got {timeout!r}")
    return value


def resolve_cluster(cluster_resolver=None):
    """Returns this process's place in the cluster.

    Args:
      cluster_resolver: A ``tf.distribute.cluster_resolver.ClusterResolver``
        (``TFConfigClusterResolver``, ``SlurmClusterResolver``,
        ``SimpleClusterResolver``, ...); default: a
        ``TFConfigClusterResolver`` (``TF_CONFIG``).

    Returns:
      ``(cluster, task, tasks)``: the cluster as a dict job -> addresses of
      the jobs that train (``chief`` and ``worker``), this process's task
      (``"/job:worker/task:1"``) and every training task in rank order (the
      chief, then the workers by index). ``({}, None, ())`` when there is no
      cluster at all: one worker, nothing to start.

    Raises:
      ConfigError: The cluster has tasks but names none for this process,
        this process's task does not train (``ps``, ``evaluator``), or the
        cluster has no chief and no worker.
    """
    if cluster_resolver is None:
        cluster_resolver = (
            tf.distribute.cluster_resolver.TFConfigClusterResolver())
    spec = cluster_resolver.cluster_spec()
    spec = spec.as_dict() if hasattr(spec, "as_dict") else dict(spec or {})
    if not spec:
        return {}, None, ()
    cluster = {}
    for job in _JOBS:
        addresses = spec.get(job)
        if not addresses:
            continue
        if isinstance(addresses, dict):  # sparse: {index: address}
            if sorted(int(i) for i in addresses) != list(range(len(addresses))):
                raise ConfigError(
                    f"job {job!r} of the cluster has tasks "
                    f"{sorted(addresses)}; RdmaStrategy needs tasks 0 to "
                    f"{len(addresses) - 1}")
            addresses = [addresses[i] for i in sorted(addresses, key=int)]
        cluster[job] = list(addresses)
    if not cluster:
        raise ConfigError(
            f"the cluster {spec} has no 'chief' and no 'worker' job; "
            f"RdmaStrategy trains on the chief and the workers")
    task_type = cluster_resolver.task_type
    task_id = cluster_resolver.task_id
    if task_type is None or task_id is None:
        raise ConfigError(
            f"the cluster {spec} names no task for this process "
            f"(task_type={task_type!r}, task_id={task_id!r}); RdmaStrategy "
            f"runs one process per worker, each with its own task in "
            f"TF_CONFIG ({{\"cluster\": ..., \"task\": {{\"type\": "
            f"\"worker\", \"index\": 0}}}}) or its cluster resolver. (A "
            f"process started by `tf-rdma launch` is the client: it has no "
            f"task.)")
    if task_type not in cluster:
        raise ConfigError(
            f"this process is task {task_type!r} {task_id!r}, which does not "
            f"train; RdmaStrategy runs on the jobs {list(cluster)} of the "
            f"cluster")
    if not 0 <= int(task_id) < len(cluster[task_type]):
        raise ConfigError(
            f"task index {task_id!r} is not in job {task_type!r}, which has "
            f"{len(cluster[task_type])} tasks")
    task = cluster_lib.canonical_task(task_type, int(task_id))
    tasks = tuple(cluster_lib.canonical_task(job, i)
                  for job in _JOBS for i in range(len(cluster.get(job, ()))))
    return cluster, task, tasks


def _local_values(value):
    """The per-device components of a DistributedValues (or the value)."""
    found = getattr(value, "values", None)
    if isinstance(found, (tuple, list)):
        return tuple(found)
    return (value,)


def _dense(t, shape=None):
    """``t`` as a dense tensor, with its static shape filled in if known."""
    t = tf.convert_to_tensor(t)
    if (not t.shape.is_fully_defined() and shape is not None
            and tf.TensorShape(shape).is_fully_defined()):
        t = tf.ensure_shape(t, shape)
    return t


_logged = set()


def _log_once(message):
    """Prints ``tf_rdma: message`` to stderr, once per process."""
    if message not in _logged:
        _logged.add(message)
        print(f"tf_rdma: {message}", file=sys.stderr, flush=True)


def _is_sparse(value):
    return any(isinstance(v, tf.IndexedSlices) for v in _local_values(value))


def _local_slices(value):
    """This worker's replicas' IndexedSlices as one (rows in replica order)."""
    parts = [v if isinstance(v, tf.IndexedSlices)
             else tf.IndexedSlices(tf.convert_to_tensor(v),
                                   tf.range(tf.shape(v)[0]), tf.shape(v))
             for v in _local_values(value)]
    if len(parts) == 1:
        return parts[0]
    with tf.device(parts[0].values.device):
        return tf.IndexedSlices(
            tf.concat([p.values for p in parts], 0),
            tf.concat([tf.cast(p.indices, parts[0].indices.dtype)
                       for p in parts], 0),
            parts[0].dense_shape)


def _divide(t, n):
    if n == 1:
        return t
    if isinstance(t, tf.IndexedSlices):
        return tf.IndexedSlices(_divide(t.values, n), t.indices, t.dense_shape)
    if t.dtype.is_integer:
        return tf.truncatediv(t, tf.cast(n, t.dtype))
    return t / tf.cast(n, t.dtype)


class RdmaCrossDeviceOps(tf.distribute.CrossDeviceOps):
    """Reduces across the workers of a cluster with tf_rdma collectives.

    The ``tf.distribute.CrossDeviceOps`` of :class:`RdmaStrategy`. Each call
    first sums this worker's replicas (one per local device), then reduces
    across workers with ``tf_rdma.collectives``:

    * ``batch_reduce`` (all the gradients of a step): one
      :class:`~tf_rdma.graph_passes.buckets.BucketPlan` per distinct list of
      gradient shapes, made when the step is traced, and one
      ``all_reduce`` per bucket, named
      ``"rdma.batch.<k>.<plan hash>.bucket<i>"`` (``k``: the call's ordinal
      in the graph, ``eager`` outside one).
    * ``reduce``: one ``all_reduce``; ``_gather``: one ``all_gather``;
      the initial value of a variable: one ``broadcast`` from the chief.
      These keep the collectives' default names (kind, dtype, shape and
      the call's ordinal in the graph).

    ``tf.distribute.experimental.CommunicationOptions`` passed to a call
    (``strategy.reduce(..., options=)``, ``ReplicaContext.all_reduce``,
    Keras' ``optimizer.apply_gradients``) are honoured: ``timeout_seconds``
    bounds that call's collectives instead of ``timeout``,
    ``bytes_per_pack`` (> 0) is its largest gradient bucket instead of
    ``bucket_bytes``, and an ``implementation`` other than ``AUTO`` (RING,
    NCCL) is logged once: tf_rdma chooses its own algorithm (``algorithm``).

    Args:
      group: The ``tf_rdma.collectives.Group`` of the workers, or None for a
        single worker (then nothing crosses workers).
      algorithm: ``"auto"``, ``"lp"``, ``"ring"``, ``"tree"`` or ``"rhd"``.
      bucket_bytes: Largest gradient bucket, in bytes.
      timeout: Seconds a collective waits for a peer; None for
        ``TF_RDMA_TIMEOUT``.
      block_bytes: Pipelining block of the collectives; None for the cost
        model's choice.
      depth: Blocks in flight per channel; None for the default.
      sparse_as_dense: False (the default, as MultiWorkerMirroredStrategy):
        ``IndexedSlices`` gradients (embeddings) stay sparse: every worker's
        rows and indices are all-gathered (``all_gather_v``) and returned as
        one ``IndexedSlices``, rows in replica order. True: they are made
        dense and reduced in the buckets with the dense gradients.

    Raises:
      ConfigError: An argument is invalid (the message names it).
    """

    def __init__(self, group=None, algorithm="auto",
                 bucket_bytes=DEFAULT_BUCKET_BYTES, timeout=None,
                 block_bytes=None, depth=None, sparse_as_dense=False):
        super().__init__()
        self._sparse_as_dense = _check_sparse_as_dense(sparse_as_dense)
        self._group = group
        self._algorithm = _check_algorithm(algorithm)
        self._bucket_bytes = _check_bucket_bytes(bucket_bytes)
        self._timeout = _check_timeout(timeout)
        self._block_bytes = block_bytes
        self._depth = depth
        self._plans = {}
        self._ordinals = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    # -- facts -----------------------------------------------------------------

    @property
    def _num_between_graph_workers(self):
        # Read by CrossDeviceOps.reduce/batch_reduce: above 1, they never
        # short-cut a single local replica to an identity.
        return 1 if self._group is None else self._group.size

    @property
    def num_workers(self):
        """Number of workers the reductions span."""
        return self._num_between_graph_workers

    @property
    def bucket_bytes(self):
        """Largest gradient bucket, in bytes."""
        return self._bucket_bytes

    @property
    def algorithm(self):
        """The collectives' algorithm (``"auto"`` or a name)."""
        return self._algorithm

    @property
    def bucket_plans(self):
        """The bucket plans made so far (one per distinct gradient list)."""
        with self._lock:
            return list(self._plans.values())

    # -- helpers ---------------------------------------------------------------

    def _kwargs(self, options=None):
        timeout = self._timeout
        if options is not None:
            if options.timeout_seconds is not None:
                timeout = _check_timeout(options.timeout_seconds)
            implementation = getattr(options.implementation, "value",
                                     options.implementation)
            if str(implementation).upper() != "AUTO":
                _log_once(
                    f"CommunicationOptions(implementation={implementation}) "
                    f"is not used: tf_rdma chooses its own collective "
                    f"algorithm (RdmaStrategy algorithm={self._algorithm!r})")
        return dict(algorithm=self._algorithm, group=self._group,
                    block_bytes=self._block_bytes, depth=self._depth,
                    timeout=timeout)

    def _bucket_bytes_for(self, options):
        pack = getattr(options, "bytes_per_pack", 0) if options else 0
        if pack:
            return _check_bucket_bytes(pack)
        return self._bucket_bytes

    def _ordinal(self, kind):
        """The call's ordinal among calls of ``kind`` in the current graph.

        Collectives that can run at the same time need different names, and
        every worker traces the same calls in the same order. Eager calls run
        one after another and reuse one name.
        """
        if tf.executing_eagerly():
            return "eager"
        graph = tf.compat.v1.get_default_graph()
        with self._lock:
            counts = self._ordinals.setdefault(graph, {})
            n = counts.get(kind, 0)
            counts[kind] = n + 1
        return str(n)

    def _plan(self, tensors, keys, ordinal, bucket_bytes):
        grads = [buckets_lib.Gradient(k, t.dtype.name, t.shape.as_list())
                 for k, t in zip(keys, tensors)]
        signature = (ordinal, bucket_bytes,
                     tuple((g.key, g.dtype, g.shape) for g in grads))
        with self._lock:
            plan = self._plans.get(signature)
            if plan is None:
                plan = buckets_lib.BucketPlan(
                    grads, bucket_bytes=bucket_bytes,
                    name=f"rdma.batch.{ordinal}")
                self._plans[signature] = plan
        return plan

    @staticmethod
    def _local_sum(value, shape=None):
        parts = [_dense(v, shape) for v in _local_values(value)]
        if len(parts) == 1:
            return parts[0], 1
        with tf.device(parts[0].device):
            return tf.add_n(parts), len(parts)

    # -- CrossDeviceOps --------------------------------------------------------

    def reduce_implementation(self, reduce_op, per_replica_value, destinations,
                              options):
        """Reduces one value over every replica of every worker."""
        if _is_sparse(per_replica_value) and not self._sparse_as_dense:
            (reduced,) = self._reduce_sparse(reduce_op, [per_replica_value],
                                             options)
            return self.broadcast_implementation(reduced, destinations)
        local, count = self._local_sum(per_replica_value)
        if self._group is not None and self._group.size > 1:
            with tf.device("/device:CPU:0"):
                local = collectives.all_reduce(local, reduction="sum",
                                               **self._kwargs(options))
            count *= self._group.size
        if reduce_op == tf.distribute.ReduceOp.MEAN:
            local = _divide(local, count)
        return self.broadcast_implementation(local, destinations)

    def batch_reduce_implementation(self, reduce_op, value_destination_pairs,
                                    options):
        """Reduces a list of values (a step's gradients) in static buckets."""
        if not value_destination_pairs:
            return []
        sparse = [i for i, (value, _) in enumerate(value_destination_pairs)
                  if _is_sparse(value) and not self._sparse_as_dense]
        if sparse:
            # IndexedSlices are all-gathered, the rest go in buckets.
            dense = [i for i in range(len(value_destination_pairs))
                     if i not in sparse]
            out = dict(zip(dense, self.batch_reduce_implementation(
                reduce_op, [value_destination_pairs[i] for i in dense],
                options)))
            gathered = self._reduce_sparse(
                reduce_op, [value_destination_pairs[i][0] for i in sparse],
                options)
            for i, reduced in zip(sparse, gathered):
                out[i] = self.broadcast_implementation(
                    reduced, value_destination_pairs[i][1])
            return [out[i] for i in range(len(value_destination_pairs))]
        tensors, keys, count = [], [], 1
        for i, (value, dest) in enumerate(value_destination_pairs):
            shape = getattr(dest, "shape", None)
            local, count = self._local_sum(value, shape)
            tensors.append(local)
            label = getattr(dest, "name", None) or "grad"
            keys.append(f"{i}:{_NAME_UNSAFE.sub('_', str(label))}")
        if self._group is not None and self._group.size > 1:
            plan = self._plan(tensors, keys, self._ordinal("batch"),
                              self._bucket_bytes_for(options))
            reduced = []
            kwargs = self._kwargs(options)
            with tf.device("/device:CPU:0"):
                for b, bucket in enumerate(plan.split(tensors)):
                    reduced.append(collectives.all_reduce(
                        bucket, reduction="sum",
                        name=plan.collective_name(b), **kwargs))
            tensors = plan.merge(reduced)
            count *= self._group.size
        if reduce_op == tf.distribute.ReduceOp.MEAN:
            tensors = [_divide(t, count) for t in tensors]
        return [self.broadcast_implementation(t, dest)
                for t, (_, dest) in zip(tensors, value_destination_pairs)]

    def _reduce_sparse(self, reduce_op, values, options):
        """All-gathers IndexedSlices values: what MWMS returns for them.

        Every worker's rows and indices (its replicas' concatenated) are
        concatenated in rank order, so the rows come in global replica
        order, as MultiWorkerMirroredStrategy's all-gather of IndexedSlices
        orders them (the optimizers' handling of duplicate indices then sees
        the same input). MEAN divides the rows by the number of replicas.
        """
        ordinal = self._ordinal("sparse")
        out = []
        for i, value in enumerate(values):
            local = _local_slices(value)
            count = len(_local_values(value))
            if self._group is not None and self._group.size > 1:
                kwargs = self._kwargs(options)
                name = f"rdma.sparse.{ordinal}.{i}"
                with tf.device("/device:CPU:0"):
                    rows = collectives.all_gather_v(
                        local.values, name=name + ".values", **kwargs)
                    indices = collectives.all_gather_v(
                        local.indices, name=name + ".indices", **kwargs)
                local = tf.IndexedSlices(rows, indices, local.dense_shape)
                count *= self._group.size
            if reduce_op == tf.distribute.ReduceOp.MEAN:
                local = _divide(local, count)
            out.append(local)
        return out

    def _gather_implementation(self, per_replica_value, destinations, axis,
                               options):
        """Concatenates every replica's value along ``axis``, in replica order."""
        parts = [_dense(v) for v in _local_values(per_replica_value)]
        local = parts[0] if len(parts) == 1 else tf.concat(parts, axis)
        if self._group is not None and self._group.size > 1:
            rank = local.shape.rank
            if rank is None or rank == 0:
                raise ValueError(
                    f"RdmaStrategy.gather needs a value of known rank >= 1, "
                    f"got shape {local.shape}")
            axis = axis % rank
            perm = [axis] + [d for d in range(rank) if d != axis]
            moved = tf.transpose(local, perm) if axis else local
            with tf.device("/device:CPU:0"):
                # all_gather_v: the workers' first dimensions may differ (a
                # last, smaller batch that splits unevenly).
                moved = collectives.all_gather_v(moved,
                                                 **self._kwargs(options))
            inverse = [perm.index(d) for d in range(rank)]
            local = tf.transpose(moved, inverse) if axis else moved
        return self.broadcast_implementation(local, destinations)

    def broadcast_initial_value(self, value, name):
        """Returns the chief's ``value`` (every worker passes its own)."""
        if self._group is None or self._group.size == 1:
            return value
        del name  # the default name: eager calls of one shape share channels
        is_bool = value.dtype == tf.bool
        try:
            with tf.device("/device:CPU:0"):
                out = collectives.broadcast(
                    tf.cast(value, tf.uint8) if is_bool else value, root=0,
                    **self._kwargs())
        except CollectiveError:
            if value.dtype.is_numpy_compatible and value.dtype != tf.string:
                raise
            return value  # strings, resources, variants: kept as they are
        return tf.cast(out, tf.bool) if is_bool else tf.identity(out)


class RdmaStrategy(tf.distribute.MirroredStrategy):
    """Synchronous data parallelism across workers, over tf_rdma collectives.

    One process per worker runs the same program. Each worker mirrors the
    variables on its local devices (all local GPUs, else the CPU) and reads
    its 1/P share of each global batch; the gradients are summed over every
    replica of every worker by :class:`RdmaCrossDeviceOps` in statically
    planned buckets. Use it as any ``tf.distribute`` strategy: Keras
    ``compile``/``fit``/``evaluate`` under ``strategy.scope()``, or custom
    loops with ``strategy.run`` and ``strategy.reduce``.

    Args:
      algorithm: The collectives' algorithm: ``"auto"`` (the cost model picks
        per size), ``"lp"``, ``"ring"``, ``"tree"`` or ``"rhd"``.
      bucket_bytes: Largest gradient bucket, in bytes (a larger gradient gets
        a bucket of its own). Default :data:`DEFAULT_BUCKET_BYTES`.
      cluster_resolver: A ``tf.distribute.cluster_resolver.ClusterResolver``;
        default ``TFConfigClusterResolver`` (``TF_CONFIG``). Without any
        cluster the strategy runs one worker and starts nothing.
      devices: This worker's devices; default all local GPUs, else the CPU.
      timeout: Seconds a collective waits for a peer before it fails; default
        ``TF_RDMA_TIMEOUT`` (60).
      block_bytes: Pipelining block of the collectives; default the cost
        model's choice per collective.
      depth: Blocks in flight per channel; default 4.
      secret: The job secret; default ``TF_RDMA_SECRET``.
      transport: ``"auto"`` or a comma-separated list of ``"verbs"``,
        ``"shm"``, ``"tcp"`` in order of preference; default
        ``TF_RDMA_TRANSPORT``.
      calibrate: With ``algorithm="auto"`` and several workers, measure the
        cost model's α, β, γ, δ at start-up (``tf_rdma.collectives.calibrate``:
        short probes between the first two workers, rank 0's numbers used
        by all, well under a second) so that "auto" chooses for this
        machine; False uses the model's defaults.
      sparse_as_dense: Make ``IndexedSlices`` gradients (embeddings) dense
        and reduce them with the others, instead of all-gathering their rows
        as MultiWorkerMirroredStrategy does (the default, False). Dense costs
        a whole table per step; it can pay where a batch touches most rows.

    Raises:
      ConfigError: An argument or the cluster is invalid (the message names
        the value).
      EndpointError: The tf_rdma endpoint could not start.
      LibraryError: This TensorFlow lacks an internal the strategy needs.
    """

    def __init__(self, algorithm="auto", bucket_bytes=DEFAULT_BUCKET_BYTES,
                 cluster_resolver=None, devices=None, timeout=None,
                 block_bytes=None, depth=None, secret=None, transport=None,
                 calibrate=True, sparse_as_dense=False):
        _check_algorithm(algorithm)
        _check_bucket_bytes(bucket_bytes)
        _check_timeout(timeout)
        _check_sparse_as_dense(sparse_as_dense)
        extended_class = _tf_private.rdma_extended_class()
        cluster, task, tasks = resolve_cluster(cluster_resolver)
        self._rdma_cluster = cluster
        self._rdma_task = task
        self._rdma_tasks = tasks
        group = None
        if task is not None:
            from tf_rdma import server  # pylint: disable=g-import-not-at-top
            self._rdma_endpoint = server.start_endpoint(
                task, cluster, secret=secret, transport=transport,
                timeout=timeout)
            if len(tasks) > 1:
                group = collectives.Group(tasks, rank=tasks.index(task))
                if calibrate and algorithm == "auto":
                    collectives.calibrate(group, timeout=timeout)
        else:
            self._rdma_endpoint = None
        self._rdma_group = group
        rank = 0 if group is None else group.rank
        num_workers = 1 if group is None else group.size
        cross_device_ops = RdmaCrossDeviceOps(
            group=group, algorithm=algorithm, bucket_bytes=bucket_bytes,
            timeout=timeout, block_bytes=block_bytes, depth=depth,
            sparse_as_dense=sparse_as_dense)
        extended = extended_class(
            self, devices=devices, cross_device_ops=cross_device_ops,
            num_workers=num_workers, rank=rank, is_chief=(rank == 0),
            broadcast_initial_value=cross_device_ops.broadcast_initial_value)
        # MirroredStrategy.__init__ would build a plain MirroredExtended.
        super(tf.distribute.MirroredStrategy, self).__init__(extended)
        if num_workers > 1:
            _tf_private.patch_keras_predict_for_rdma()
        gpus = [d for d in extended.worker_devices if "GPU" in d.upper()]
        if gpus:
            _log_once(
                f"RdmaStrategy: {len(gpus)} replica(s) on GPUs "
                f"({', '.join(gpus)}): GPU gradients are summed over this "
                f"worker's replicas on the first GPU, then staged through "
                f"host memory, where the tf_rdma collectives run across "
                f"workers")

    @property
    def task(self):
        """This process's task (``"/job:worker/task:0"``), or None alone."""
        return self._rdma_task

    @property
    def tasks(self):
        """Every training task, in rank order (chief first)."""
        return self._rdma_tasks

    @property
    def num_workers(self):
        """Number of worker processes (P)."""
        return 1 if self._rdma_group is None else self._rdma_group.size

    @property
    def worker_index(self):
        """This worker's rank: 0 for the chief."""
        return 0 if self._rdma_group is None else self._rdma_group.rank

    @property
    def is_chief(self):
        """True on the chief (rank 0), which should write checkpoints."""
        return self.worker_index == 0

    @property
    def cross_device_ops(self):
        """The strategy's :class:`RdmaCrossDeviceOps`."""
        return self.extended._cross_device_ops  # pylint: disable=protected-access

    @property
    def bucket_plans(self):
        """The gradient bucket plans made so far (see :class:`RdmaCrossDeviceOps`)."""
        return self.cross_device_ops.bucket_plans

    def __repr__(self):
        return (f"RdmaStrategy(task={self._rdma_task!r}, "
                f"workers={self.num_workers}, "
                f"replicas={self.num_replicas_in_sync}, "
                f"algorithm={self.cross_device_ops.algorithm!r}, "
                f"bucket_bytes={self.cross_device_ops.bucket_bytes})")
