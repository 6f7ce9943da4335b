"""Keras integration: ``tf_rdma.keras.StatsCallback``.

Importing this module imports Keras (and TensorFlow); ``import tf_rdma``
does not import it until ``tf_rdma.keras`` is used.
"""

import keras

from tf_rdma import counters

__all__ = ["StatsCallback"]

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
