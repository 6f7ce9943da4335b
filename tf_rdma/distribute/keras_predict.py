"""Keras ``predict`` under RdmaStrategy: every worker gets every row.

Keras concatenates the replicas' predictions across workers only for
MultiWorkerMirroredStrategy (it checks the class);
:func:`patch_keras_predict_for_rdma` makes it do so under RdmaStrategy too.
A private Keras hook: a Keras without it fails at start-up with
``LibraryError``.
"""

from tf_rdma.errors import LibraryError

__all__ = ["patch_keras_predict_for_rdma"]


def patch_keras_predict_for_rdma():
    """Makes Keras 3 ``predict`` gather every worker's rows under RdmaStrategy.

    Keras concatenates the replicas' predictions across workers only for
    MultiWorkerMirroredStrategy (``trainer._collective_all_reduce_multi_worker``
    checks the class); under any other strategy it returns this worker's
    replicas' rows, so ``predict`` under RdmaStrategy would silently return a
    share of the rows. This wraps ``trainer.reduce_per_replica`` so that its
    ``"concat"`` reduction (predict's, and only predict's) uses Keras' own
    multi-worker concatenation (``strategy.gather``, which RdmaStrategy does
    with ``all_gather_v``, so the last, smaller batch may split unevenly)
    whenever the strategy spans several RdmaStrategy workers. Idempotent.

    Raises:
      LibraryError: This Keras lacks what the patch wraps.
    """
    try:
        from keras.src.backend.tensorflow import trainer  # pylint: disable=g-import-not-at-top
    except ImportError as e:
        raise LibraryError(
            f"RdmaStrategy's predict needs keras.src.backend.tensorflow."
            f"trainer ({e})") from e
    original = getattr(trainer, "reduce_per_replica", None)
    concat = getattr(trainer, "_multi_worker_concat", None)
    if original is None or concat is None:
        raise LibraryError(
            "RdmaStrategy's predict needs keras.src.backend.tensorflow."
            "trainer.reduce_per_replica and _multi_worker_concat, which this "
            "Keras does not have")
    if getattr(original, "_tf_rdma_wrapped", False):
        return

    def reduce_per_replica(values, strategy, reduction):
        workers = getattr(strategy.extended, "_rdma_num_workers", 1)
        if reduction == "concat" and workers > 1:
            import tensorflow as tf  # pylint: disable=g-import-not-at-top
            # A PerReplica, or a plain tensor with one replica per worker.
            return tf.nest.map_structure(lambda v: concat(v, strategy),
                                         values)
        return original(values, strategy, reduction)

    reduce_per_replica._tf_rdma_wrapped = True
    trainer.reduce_per_replica = reduce_per_replica
