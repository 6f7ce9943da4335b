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

* **Gradients** (:class:`RdmaCrossDeviceOps`,
  :mod:`tf_rdma.distribute.cross_device_ops`). Keras' optimizer (and
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

The rest is :class:`RdmaStrategy` (:mod:`tf_rdma.distribute.strategy`: the
cluster, the ranks, the endpoint) on top of a ``MirroredExtended`` subclass
(:mod:`tf_rdma.distribute.extended`: the multi-worker half of
MirroredStrategy, which has no public hook), plus the wrapper that makes
Keras ``predict`` gather every worker's rows
(:mod:`tf_rdma.distribute.keras_predict`). The last two are the private
TensorFlow and Keras hooks the strategy needs; each checks for every module
and method it uses. How it fits together and why: docs/strategy.md.

Importing this package imports TensorFlow.
"""

from tf_rdma.distribute.cross_device_ops import (DEFAULT_BUCKET_BYTES,
                                                 RdmaCrossDeviceOps)
from tf_rdma.distribute.strategy import RdmaStrategy, resolve_cluster

__all__ = ["RdmaStrategy", "RdmaCrossDeviceOps", "DEFAULT_BUCKET_BYTES",
           "resolve_cluster"]
