"""Python wrappers of the tf_rdma ops.

``send`` and ``recv`` move one planned tensor between two tasks: place
``send`` on the task that has the tensor and ``recv`` on the task that needs
it (``tf.device``), give both the same :class:`~tf_rdma.graph_passes.Plan`
and key, and the receiving task gets the tensor without a copy::

    plan = tf_rdma.Plan([tf_rdma.Transfer("x", "/job:worker/task:0",
                                          "/job:worker/task:1", "float32",
                                          [1024])])
    with tf.device("/job:worker/task:0"):
        tf_rdma.ops.send(x, plan, "x")
    with tf.device("/job:worker/task:1"):
        y = tf_rdma.ops.recv(plan, "x")

Both ops are stateful; inside a ``tf.function`` TensorFlow runs a ``send``
even though nothing consumes it. Each call is one step: the n-th ``send`` of
a key pairs with the n-th ``recv``. Where one client calls a function that
places both ops (client-driven) and calls may overlap, pass
``match_calls=True`` to both: each write then carries the call's step id and
only that call's ``recv`` takes it (what ``@tf_rdma.rewrite`` does). Within a function, the sends (and the
recvs) of one key run in program order; otherwise tf_rdma ops are not ordered
against other stateful ops, so a ``recv`` may be written before its ``send``
(see tf_rdma/_auto_control_deps.py).
"""

import math
import weakref

import tensorflow as tf

from tf_rdma import _loader, settings
from tf_rdma.errors import PlanError

__all__ = ["send", "recv", "raw_ops"]

# The ops are registered with TensorFlow as soon as anything may use them,
# including graphs that name them (a rewritten function's GraphDef).
_loader.load()


def raw_ops():
    """Returns the generated op module (TfRdmaSend → ``tf_rdma_send``, ...)."""
    return _loader.load().ops


def _planned_shape(shape):
    if shape is None:
        return "any shape (unknown rank)"
    return "[" + ", ".join("None" if d is None else str(d) for d in shape) + "]"


def timeout_to_ms(timeout, error=PlanError):
    """Seconds (None: TF_RDMA_TIMEOUT) as the ops' timeout_ms attribute (-1).

    Raises:
        error: `timeout` is not a number of seconds in (0, a week].
    """
    if timeout is None:
        return -1
    try:
        seconds = float(timeout)
    except (TypeError, ValueError):
        seconds = math.nan
    # Not `not (0 < s <= max)` written otherwise: NaN must fail it too.
    if not 0 < seconds <= settings.MAX_TIMEOUT_S or round(seconds * 1000) <= 0:
        raise error(f"timeout {timeout!r} must be a number of seconds in "
                    f"(0, {settings.MAX_TIMEOUT_S}] (or None for TF_RDMA_TIMEOUT)")
    return int(round(seconds * 1000))


# Per graph: the last send / recv op of each (plan, key), so that the next one
# of the same key runs after it (its step must be the next step).
_last_op = weakref.WeakKeyDictionary()


def _in_step_order(direction, plan, key, build):
    """Runs build() under a control dependency on the previous op of the key."""
    if tf.executing_eagerly():
        return build()
    graph = tf.compat.v1.get_default_graph()
    last = _last_op.setdefault(graph, {})
    previous = last.get((direction, plan.hash, key))
    with tf.control_dependencies([previous] if previous is not None else []):
        result = build()
    op = result if isinstance(result, tf.Operation) else result.op
    last[(direction, plan.hash, key)] = op
    return result


def send(tensor, plan, key, timeout=None, name=None, match_calls=False):
    """Writes `tensor` into its slot on the receiving task.

    Args:
        tensor: The tensor to send; its dtype and shape must be the planned ones.
        plan: The :class:`~tf_rdma.graph_passes.Plan` both tasks use.
        key: The transfer's key in the plan.
        timeout: Seconds to wait for a free slot before failing with
            ``tf.errors.DeadlineExceededError``; None uses ``TF_RDMA_TIMEOUT``.
        name: Optional op name.
        match_calls: Pair by call rather than by order (see the module
            docstring); the ``recv`` must say the same.

    Returns:
        The op (in graph mode) or None (eagerly).

    Raises:
        PlanError: The key is not in the plan, or the tensor's dtype or shape
            is not the planned one.
    """
    slot = plan.slot(key)
    attrs = plan.op_attrs(key, "send", timeout_to_ms(timeout), match_calls)
    tensor = tf.convert_to_tensor(tensor)
    if tensor.dtype != tf.as_dtype(slot.dtype):
        raise PlanError(f"tensor {key!r} has dtype {tensor.dtype.name}, but the "
                        f"plan expects {slot.dtype}")
    if not tensor.shape.is_compatible_with(tf.TensorShape(slot.shape)):
        raise PlanError(f"tensor {key!r} has shape {tensor.shape}, but the plan "
                        f"expects {_planned_shape(slot.shape)}")
    return _in_step_order(
        "send", plan, key,
        lambda: raw_ops().tf_rdma_send(tensor, name=name, **attrs))


def recv(plan, key, timeout=None, name=None, match_calls=False):
    """Returns the tensor the sending task wrote for this step, without a copy.

    Args:
        plan: The :class:`~tf_rdma.graph_passes.Plan` both tasks use.
        key: The transfer's key in the plan.
        timeout: Seconds to wait for the data before failing with
            ``tf.errors.DeadlineExceededError``; None uses ``TF_RDMA_TIMEOUT``.
        name: Optional op name.
        match_calls: Pair by call rather than by order; the ``send`` must
            say the same.

    Returns:
        A tensor of the planned dtype and shape. Its memory is the slot; the
        slot is handed back to the sender when the last reference is dropped.

    Raises:
        PlanError: The key is not in the plan.
    """
    slot = plan.slot(key)
    attrs = plan.op_attrs(key, "recv", timeout_to_ms(timeout), match_calls)
    return _in_step_order(
        "recv", plan, key,
        lambda: raw_ops().tf_rdma_recv(dtype=tf.as_dtype(slot.dtype),
                                       name=name, **attrs))
