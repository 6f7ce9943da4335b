"""The MultiWorkerMirroredStrategy baseline under Keras fit.

The example (examples/keras_digits.py) and the tests (tests/test_strategy.py,
tests/test_parity.py) compare RdmaStrategy with TensorFlow's own
MultiWorkerMirroredStrategy under the same Keras `fit`. With more than one
worker, Keras 3.15's fit does not run under MWMS of TensorFlow 2.21, for two
reasons outside tf_rdma: its first step reduces a whole (x, y) batch with
one `strategy.reduce` call, which MWMS's `_reduce_to` cannot take (it
reduces one value at a time); and its `reduce_per_replica` calls
`strategy.reduce("MEAN", metric, axis=0)` on scalar metrics under MWMS,
which fails on the missing axis. This patches both, on the one strategy
object and in Keras' TensorFlow trainer, so that the baseline trains
exactly as `fit` intends. It also gives the baseline's datasets the input
options RdmaStrategy uses by default (no per-replica buffer:
docs/strategy.md, "Input buffers"), so that both get their batches the same
way and neither process dies of TensorFlow's MultiDeviceIterator crash. It
is used for the comparison only; RdmaStrategy needs none of this, and it is
not part of tf_rdma.

Imported as ``mwms_keras``: by keras_digits.py from this directory, and by
the tests' task processes, whose path tests/conftest.py extends with
examples/.
"""

from tf_rdma.errors import LibraryError

__all__ = ["patch_mwms_for_keras_fit"]


def patch_mwms_for_keras_fit(strategy):
    """Lets Keras 3 ``fit`` run under a multi-worker MWMS ``strategy``.

    Args:
      strategy: A ``tf.distribute.MultiWorkerMirroredStrategy``.

    Returns:
      ``strategy``, patched.

    Raises:
      LibraryError: This TensorFlow or Keras lacks what the patch replaces.
    """
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    extended = strategy.extended
    reduce_to = getattr(extended, "_reduce_to", None)
    if reduce_to is None:
        raise LibraryError(
            f"patching Keras fit for MultiWorkerMirroredStrategy needs its "
            f"extended._reduce_to, which TensorFlow {tf.__version__} does not "
            f"have")
    try:
        from keras.src.backend.tensorflow import trainer  # pylint: disable=g-import-not-at-top
    except ImportError as e:
        raise LibraryError(
            f"patching Keras fit for MultiWorkerMirroredStrategy needs "
            f"keras.src.backend.tensorflow.trainer ({e})") from e
    if not hasattr(trainer, "_collective_all_reduce_multi_worker"):
        raise LibraryError(
            "patching Keras fit for MultiWorkerMirroredStrategy needs "
            "keras.src.backend.tensorflow.trainer."
            "_collective_all_reduce_multi_worker, which this Keras does not "
            "have")

    def reduce_each(reduce_op, value, destinations, options):
        return tf.nest.map_structure(
            lambda v: reduce_to(reduce_op, v, destinations, options), value)

    extended._reduce_to = reduce_each  # pylint: disable=protected-access
    no_buffer = tf.distribute.InputOptions(
        experimental_per_replica_buffer_size=0)
    for name in ("_experimental_distribute_dataset",
                 "_distribute_datasets_from_function"):
        distribute = getattr(extended, name)
        setattr(extended, name,
                lambda data, options, distribute=distribute: distribute(
                    data, no_buffer if options is None else options))
    # Metrics are per worker in the step's logs, as under MirroredStrategy;
    # the epoch's logs and evaluate() read the synchronized metric variables.
    trainer._collective_all_reduce_multi_worker = lambda strategy: False  # pylint: disable=protected-access
    return strategy
