"""Keras integration: ``StatsCallback`` and ``rewrite_fit``.

Importing this module imports Keras (and TensorFlow); ``import tf_rdma``
does not import it until ``tf_rdma.keras`` is used.
"""

import keras

from tf_rdma import counters
from tf_rdma.errors import PlanError

__all__ = ["StatsCallback", "rewrite_fit"]

#: The log keys StatsCallback adds (after its prefix), each a float.
LOG_KEYS = ("sent_MBps", "received_MBps", "credit_wait_fraction",
            "data_wait_fraction")


class StatsCallback(keras.callbacks.Callback):
    """Adds tf_rdma's transfer rates and wait fractions to each epoch's logs.

    At the end of every epoch, adds to the epoch's logs (so ``History``,
    ``TensorBoard``, ``CSVLogger`` ... see them), from this process's
    counters (:func:`tf_rdma.stats`) over the epoch:

    - ``tf_rdma_sent_MBps``, ``tf_rdma_received_MBps``: payload megabytes
      (10**6 bytes) sent to / received from all peers per second of the
      epoch's wall time;
    - ``tf_rdma_credit_wait_fraction``, ``tf_rdma_data_wait_fraction``: the
      fraction of the epoch's wall time during which at least one op of this
      process waited for a credit (its reader had not released the copy) /
      for data (its writer had not written yet); between 0 and 1.

    Each worker logs its own process's numbers. Keras hands one logs dict
    to the callbacks in list order, so put this callback *before*
    ``TensorBoard`` (or ``CSVLogger``) in ``callbacks=[...]``:
    ``model.fit(..., callbacks=[tf_rdma.keras.StatsCallback(),
    keras.callbacks.TensorBoard(logdir)])``.

    Args:
        prefix: What the log keys start with (default ``"tf_rdma_"``).
    """

    def __init__(self, prefix="tf_rdma_"):
        super().__init__()
        self.prefix = prefix
        self._start = None

    def on_epoch_begin(self, epoch, logs=None):
        self._start = counters.stats()

    def on_epoch_end(self, epoch, logs=None):
        if logs is None or self._start is None:
            return
        logs.update(self.epoch_logs(counters.difference(counters.stats(),
                                                         self._start)))

    def epoch_logs(self, delta):
        """The log entries for counters that grew by ``delta``.

        Args:
            delta: A :func:`tf_rdma.counters.difference` of two snapshots.

        Returns:
            ``{prefix + key: float}`` for every key of :data:`LOG_KEYS`.
        """
        seconds = delta["elapsed_seconds"]
        if seconds <= 0:
            rates = dict.fromkeys(LOG_KEYS, 0.0)
        else:
            total = delta["total"]
            rates = {
                "sent_MBps": total["bytes_sent"] / 1e6 / seconds,
                "received_MBps": total["bytes_received"] / 1e6 / seconds,
                "credit_wait_fraction": min(
                    1.0, delta["credit_wait_busy_seconds"] / seconds),
                "data_wait_fraction": min(
                    1.0, delta["data_wait_busy_seconds"] / seconds),
            }
        return {self.prefix + k: float(v) for k, v in rates.items()}


def rewrite_fit(model, depth=2, timeout=None):
    """Makes a Keras 2 model's ``fit`` run its steps through ``tf_rdma.rewrite``.

    For ``tf_keras`` (Keras 2) models trained with ``fit`` under
    ``ParameterServerStrategy`` (``model.fit(DatasetCreator(...),
    steps_per_epoch=...)``): Keras schedules each step, a ``tf.function``
    it builds in ``make_train_function``, on the strategy's
    ``ClusterCoordinator``. This wraps the model's ``make_train_function``
    so that the coordinator gets that function through
    :func:`tf_rdma.rewrite` instead: each step runs on the worker the
    coordinator picked, with its ps<->worker tensors in slots of that
    worker's plan. Without a coordinator the rewritten step is called
    directly. Call it after ``compile`` (which resets the step function);
    it returns the model. The rewritten function is ``model.train_tf_function``
    after the first ``fit``, for ``explain()`` and its plans.

    Keras 3 has no ``fit`` under ParameterServerStrategy: write the step as a
    ``tf.function`` and schedule it (docs/parameter-server.md).

    Args:
      model: A compiled ``tf_keras`` model.
      depth, timeout: As for :func:`tf_rdma.rewrite`.

    Returns:
      ``model``.

    Raises:
      PlanError: The model runs eagerly, or runs several steps per call
        (``steps_per_execution`` > 1: its steps are a loop whose body spans
        tasks, which tf_rdma cannot plan).
    """
    from tf_rdma.decorator import rewrite  # pylint: disable=import-outside-toplevel

    original = model.make_train_function
    if not hasattr(model, "train_tf_function"):
        raise PlanError(
            f"tf_rdma.keras.rewrite_fit needs a tf_keras (Keras 2) model, got "
            f"{type(model).__module__}.{type(model).__name__}: Keras 3 has no "
            f"fit under ParameterServerStrategy (docs/parameter-server.md "
            f"has the custom-loop recipe)")

    def make_train_function(force=False):
        if model.train_function is not None and not force:
            return model.train_function
        if model.run_eagerly:
            raise PlanError("tf_rdma.keras.rewrite_fit: the model runs eagerly "
                            "(run_eagerly=True); tf_rdma rewrites tf.functions")
        steps = model._steps_per_execution  # pylint: disable=protected-access
        if steps is not None and int(steps.numpy()) != 1:
            raise PlanError(
                f"tf_rdma.keras.rewrite_fit: steps_per_execution="
                f"{int(steps.numpy())}; tf_rdma plans one step per call (several "
                f"steps are a loop whose body spans tasks, which stays on "
                f"gRPC): compile with steps_per_execution=1")
        original(force=True)
        step = rewrite(model.train_tf_function, depth=depth, timeout=timeout)
        model.train_tf_function = step
        coordinator = model._cluster_coordinator  # pylint: disable=protected-access
        if coordinator is None:
            model.train_function = step
        else:
            model.train_function = lambda it: coordinator.schedule(step, args=(it,))
        return model.train_function

    model.make_train_function = make_train_function
    model.train_function = None
    return model
