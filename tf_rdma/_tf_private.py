"""The one place where tf_rdma relies on a private TensorFlow module.

Inside a ``tf.function``, TensorFlow's automatic control dependencies run
stateful ops that touch no resource in program order, *across devices*. For
TfRdmaSend / TfRdmaRecv that is wrong twice over: every such edge between
two tasks becomes a gRPC message per step (the very traffic tf_rdma removes),
and a ``recv`` written before its ``send`` would wait for an op that waits for
it (a deadlock, ended only by the timeout). TensorFlow's own Send/Recv are
exempt; this registers ours the same way, as ops that must run but in any
order (``MUST_RUN_ORDER_INSENSITIVE_STATEFUL_OPS``). The order that does
matter — successive steps of one tensor — is kept by tf_rdma.ops itself, with
control edges on the same task.

Checked against TensorFlow 2.16–2.21; if the module changes shape, import
fails with an error that says so instead of silently ordering the ops.
"""

from tf_rdma.errors import LibraryError

ORDER_INSENSITIVE_OPS = frozenset(("TfRdmaSend", "TfRdmaRecv"))


def register_order_insensitive_ops():
    """Exempts the tf_rdma ops from program-order control dependencies."""
    try:
        from tensorflow.python.framework import auto_control_deps  # pylint: disable=g-import-not-at-top
    except ImportError as e:
        raise LibraryError(
            "tf_rdma needs tensorflow.python.framework.auto_control_deps, "
            f"which this TensorFlow does not have ({e})") from e
    current = getattr(auto_control_deps,
                      "MUST_RUN_ORDER_INSENSITIVE_STATEFUL_OPS", None)
    if not isinstance(current, frozenset):
        import tensorflow as tf  # pylint: disable=g-import-not-at-top
        raise LibraryError(
            "tf_rdma cannot register its ops with TensorFlow "
            f"{tf.__version__}'s automatic control dependencies "
            "(auto_control_deps.MUST_RUN_ORDER_INSENSITIVE_STATEFUL_OPS is "
            "missing); this TensorFlow version is not supported yet")
    auto_control_deps.MUST_RUN_ORDER_INSENSITIVE_STATEFUL_OPS = (
        current | ORDER_INSENSITIVE_OPS)
