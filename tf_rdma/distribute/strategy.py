"""RdmaStrategy: the ``tf.distribute`` strategy, and the cluster it spans.

* **Workers** (:func:`resolve_cluster`): the cluster comes from
  ``TF_CONFIG`` or any ``tf.distribute.cluster_resolver.ClusterResolver``.
  The chief (job ``chief``, else ``worker`` 0) is rank 0, the workers follow
  by index. Creating the strategy starts this process's tf_rdma endpoint.
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

The last three are the strategy's ``extended`` object
(:mod:`tf_rdma.distribute.extended`); the gradients go through
:class:`~tf_rdma.distribute.cross_device_ops.RdmaCrossDeviceOps`.
"""

import tensorflow as tf

from tf_rdma import cluster as cluster_lib
from tf_rdma import collectives
from tf_rdma.distribute.cross_device_ops import (DEFAULT_BUCKET_BYTES,
                                                 RdmaCrossDeviceOps,
                                                 check_algorithm,
                                                 check_bucket_bytes,
                                                 check_sparse_as_dense,
                                                 check_timeout, log_once)
from tf_rdma.distribute.extended import rdma_extended_class
from tf_rdma.distribute.keras_predict import patch_keras_predict_for_rdma
from tf_rdma.errors import ConfigError

__all__ = ["RdmaStrategy", "resolve_cluster"]

_JOBS = ("chief", "worker")


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
        per size), ``"lp"``, ``"ring"``, ``"tree"``, ``"rhd"`` or ``"oneshot"``.
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
        check_algorithm(algorithm)
        check_bucket_bytes(bucket_bytes)
        check_timeout(timeout)
        check_sparse_as_dense(sparse_as_dense)
        extended_class = rdma_extended_class()
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
            patch_keras_predict_for_rdma()
        gpus = [d for d in extended.worker_devices if "GPU" in d.upper()]
        if gpus:
            log_once(
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
