"""tf_rdma's ops and TensorFlow's automatic control dependencies.

Two hooks into ``tensorflow.python.framework.auto_control_deps``, a private
TensorFlow module, both installed by :func:`register_order_insensitive_ops`,
which the op library's loader (tf_rdma._loader) calls once: the tf_rdma ops
run in any order (below), and the values a function returns are computed
where they are produced (the comment above
``_place_returned_values_with_their_producers``). The strategy's private
hooks are in tf_rdma.distribute (``extended``, ``keras_predict``).

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

#: The point-to-point ops, whose edges the rewrite plans.
TRANSFER_OPS = frozenset(("TfRdmaSend", "TfRdmaRecv"))
#: Every tf_rdma op that meets another task. A collective placed on two
#: tasks of one client-driven function would otherwise wait, in program
#: order, for the other rank's op, which waits for it; collectives that may
#: run together have different instances (tf_rdma.collectives, "Naming").
ORDER_INSENSITIVE_OPS = TRANSFER_OPS | frozenset(
    ("TfRdmaCollective", "TfRdmaAllGatherV"))


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
    _place_returned_values_with_their_producers(auto_control_deps)


# Where a tf.function's return values are computed, when tf_rdma ops are in it.
#
# Automatic control dependencies give every value a tf.function returns a
# control input from the ops that must run (through a NoOp), so that the
# call's side effects are done before its results are used. A send has no
# data path to anything: its only consumer is the recv on the other task,
# which TensorFlow does not see as an edge. So that control input is never
# implied by the data, Grappler keeps it, and the Identity that carries the
# return value, created without a device, is placed on the client. The
# value then travels from the task that computed it to the client and back
# before the client fetches it: two more gRPC messages on every call's
# critical path (seen in the partition graphs of a one-hop function and in
# its call time, docs/benchmarks-history.md, 2026-12-03; TensorFlow's own
# path pays the same for any op that must run, e.g. an assign_add on a
# worker).
#
# So the Identity, and the NoOp, go to the device of the value they return.
# The control edges stay: nothing runs in a different order, and the value
# was already returned on that task (its _Retval was there). One thing the
# round trip did by accident has to be kept on purpose: it made the result a
# copy. A received tensor, or a view of it (a slice, a reshape), aliases its
# slot, and a result the client holds would keep the slot from its sender
# until the client drops it, stalling the next calls. So a plain-data result
# on a CPU is copied where it is computed (DeepCopy: one memcpy, local,
# instead of two gRPC messages). Only top-level tf.function graphs with
# tf_rdma send/recv in them are touched, not while/cond bodies. This is an
# optimisation: if TensorFlow's AutomaticControlDependencies or Operation
# changes shape, it is skipped and the graph is left as TensorFlow built it.

def _place_returned_values_with_their_producers(auto_control_deps):
    cls = getattr(auto_control_deps, "AutomaticControlDependencies", None)
    exit_ = getattr(cls, "__exit__", None)
    if exit_ is None or getattr(exit_, "_tf_rdma_wrapped", False):
        return

    def __exit__(self, exc_type, exc_value, traceback):
        result = exit_(self, exc_type, exc_value, traceback)
        if exc_type is None:
            try:
                _move_return_identities(self)
            except (AttributeError, TypeError, ValueError, ImportError):
                pass  # TensorFlow changed shape: keep its own graph
        return result

    __exit__._tf_rdma_wrapped = True
    cls.__exit__ = __exit__


def _move_return_identities(acd):
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    from tensorflow.python.ops import control_flow_v2_func_graphs  # pylint: disable=g-import-not-at-top
    from tf_rdma.graph_passes.plan import DTYPE_SIZES  # pylint: disable=g-import-not-at-top
    if not any(op.type in TRANSFER_OPS for op in acd.ops_which_must_run):
        return
    if isinstance(acd._graph,  # pylint: disable=protected-access
                  control_flow_v2_func_graphs.ControlFlowFuncGraph):
        return
    returned = acd._returned_tensors  # pylint: disable=protected-access
    for tensor in tf.nest.flatten(list(returned), expand_composites=True):
        op = getattr(tensor, "op", None)
        if (op is None or op.type != "Identity" or op.device
                or not op.control_inputs or len(op.inputs) != 1
                or not op.inputs[0].device):
            continue
        value = op.inputs[0]
        device = value.device
        if (value.dtype.name in DTYPE_SIZES and  # what a slot can hold
                tf.DeviceSpec.from_string(device).device_type in (None, "CPU")):
            with tf.device(device):
                copy = tf.raw_ops.DeepCopy(x=value)
            op._update_input(0, copy)  # pylint: disable=protected-access
        op._set_device(device)  # pylint: disable=protected-access
        for control in op.control_inputs:
            if control.type == "NoOp" and not control.device:
                control._set_device(device)  # pylint: disable=protected-access
