"""The tf_rdma error hierarchy.

Every error that tf_rdma raises from Python derives from :class:`TfRdmaError`.
Errors that come out of an op at run time are TensorFlow errors instead
(``tf.errors.DeadlineExceededError`` for a timeout, ``tf.errors.UnavailableError``
for a peer that went away, ``tf.errors.InvalidArgumentError`` for input that
does not match the plan), because that is what TensorFlow users catch around a
``tf.function`` call.

Each class also derives from the closest built-in exception, so code that
catches ``ValueError`` or ``ImportError`` keeps working.
"""


class TfRdmaError(Exception):
    """Base class of every tf_rdma error raised from Python."""


class ConfigError(TfRdmaError, ValueError):
    """A setting (argument or environment variable) has a value tf_rdma cannot use."""


class PlanError(TfRdmaError, ValueError):
    """A plan, transfer or tensor does not fit together."""


class LibraryError(TfRdmaError, ImportError):
    """The op library is missing, or was built for another TensorFlow."""


class EndpointError(TfRdmaError, RuntimeError):
    """The tf_rdma endpoint of this process could not start or was used wrongly."""


class CollectiveError(TfRdmaError, ValueError):
    """A collective was called with arguments that cannot work (group, root, dtype, ...)."""
