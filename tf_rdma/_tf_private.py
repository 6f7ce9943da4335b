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

from tf_rdma.errors import ConfigError, LibraryError

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


# ---------------------------------------------------------------------------
# tf_rdma.distribute.RdmaStrategy
#
# The strategy is a tf.distribute.MirroredStrategy (so that Keras and every
# other caller treat it as one) whose gradient path goes through a public
# extension point, a tf.distribute.CrossDeviceOps subclass
# (tf_rdma.distribute.RdmaCrossDeviceOps). What has no public hook is the
# multi-worker half of MirroredStrategy's "extended" object: the number of
# replicas in sync across workers, the sharding of datasets by worker, the
# reduction of strategy.reduce() across workers, and the broadcast of initial
# values from the chief. MultiWorkerMirroredStrategy implements exactly these
# in tensorflow/python/distribute/collective_all_reduce_strategy.py; the
# subclass below does the same on top of MirroredExtended, with tf_rdma's
# collectives instead of TensorFlow's. Everything private it touches is
# imported and checked here.
#
# Checked against TensorFlow 2.21 (with Keras 3.15). If a module or method
# used here is missing, creating the strategy fails with an error that names
# it instead of training with a silently wrong reduction.

#: The MirroredExtended methods the strategy overrides or calls.
_EXTENDED_HOOKS = (
    "_use_merge_call", "_get_cross_device_ops", "_reduce_to",
    "_gather_to_implementation", "_experimental_distribute_dataset",
    "_distribute_datasets_from_function",
    "_experimental_distribute_values_from_function",
    "_get_variable_creator_initial_value", "_get_replica_id_in_sync_group",
    "_get_local_replica_id", "_input_workers_with_options",
    "_num_replicas_in_sync", "_in_multi_worker_mode")

_rdma_extended_class = None


def _unsupported(tf, what, error=None):
    detail = f" ({error})" if error is not None else ""
    return LibraryError(
        f"tf_rdma.distribute.RdmaStrategy needs {what}, which TensorFlow "
        f"{tf.__version__} does not have{detail}; the strategy is checked "
        f"against TensorFlow 2.21")


def rdma_extended_class():
    """Returns the MirroredExtended subclass behind RdmaStrategy.

    The class is built once, on first use. Its constructor takes
    ``(container_strategy, devices, cross_device_ops, num_workers, rank,
    is_chief, broadcast_initial_value)``: ``broadcast_initial_value(tensor,
    name)`` returns the chief's value of a variable's initial value.

    Raises:
      LibraryError: This TensorFlow lacks a private module or method the
        strategy relies on.
    """
    global _rdma_extended_class
    if _rdma_extended_class is not None:
        return _rdma_extended_class
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    try:
        # pylint: disable=g-import-not-at-top
        from tensorflow.python.distribute import collective_util
        from tensorflow.python.distribute import cross_device_ops as cdo
        from tensorflow.python.distribute import distribute_lib
        from tensorflow.python.distribute import input_util
        from tensorflow.python.distribute import mirrored_strategy
        from tensorflow.python.distribute import values as values_lib
        from tensorflow.python.distribute import distribute_utils
        # pylint: enable=g-import-not-at-top
    except ImportError as e:
        raise _unsupported(tf, "tensorflow.python.distribute's modules",
                           e) from e
    base = getattr(mirrored_strategy, "MirroredExtended", None)
    if base is None:
        raise _unsupported(tf, "mirrored_strategy.MirroredExtended")
    for hook in _EXTENDED_HOOKS:
        if not hasattr(base, hook):
            raise _unsupported(tf, f"MirroredExtended.{hook}")
    for module, name in ((input_util, "get_distributed_dataset"),
                         (input_util, "get_distributed_datasets_from_function"),
                         (cdo, "reduce_non_distributed_value"),
                         (distribute_utils, "regroup"),
                         (values_lib, "Mirrored"),
                         (values_lib, "DistributedValues"),
                         (distribute_lib, "InputReplicationMode")):
        if not hasattr(module, name):
            raise _unsupported(tf, f"{module.__name__}.{name}")
    per_replica_mode = distribute_lib.InputReplicationMode.PER_REPLICA

    class RdmaExtended(base):
        """MirroredExtended across the workers of a tf_rdma cluster."""

        def __init__(self, container_strategy, devices, cross_device_ops,
                     num_workers, rank, is_chief, broadcast_initial_value):
            self._rdma_num_workers = num_workers
            self._rdma_rank = rank
            self._rdma_is_chief = is_chief
            self._rdma_broadcast = broadcast_initial_value
            self._rdma_init_count = 0
            super().__init__(container_strategy, devices=devices,
                             cross_device_ops=cross_device_ops)
            # MirroredExtended merges its own default (NCCL, or RING on
            # CPUs) into every call's CommunicationOptions; without it the
            # cross-device ops see only what the caller asked for.
            self._communication_options = collective_util.Options()

        # The reduction always goes through merge_call and the tf_rdma
        # CrossDeviceOps: never XLA's path, never ReductionToOneDevice (which
        # MirroredExtended picks for int32 and for values on the CPU, and
        # which would reduce this worker's replicas only).
        def _use_merge_call(self):
            return True

        def _get_cross_device_ops(self, value):
            del value
            return self._cross_device_ops

        @property
        def _num_replicas_in_sync(self):
            return len(self._devices) * self._rdma_num_workers

        def _get_replica_id_in_sync_group(self, replica_id):
            return self._rdma_rank * len(self._devices) + replica_id

        def _get_local_replica_id(self, replica_id_in_sync_group):
            return replica_id_in_sync_group - self._rdma_rank * len(
                self._devices)

        def _in_multi_worker_mode(self):
            return self._rdma_num_workers > 1

        @property
        def experimental_between_graph(self):
            return True

        @property
        def experimental_should_init(self):
            return True

        @property
        def should_checkpoint(self):
            return self._rdma_is_chief

        @property
        def should_save_summary(self):
            return self._rdma_is_chief

        @property
        def _global_batch_size(self):
            return True

        # Input: every worker reads the same dataset and keeps its shard (a
        # 1/P slice of each global batch), as MultiWorkerMirroredStrategy.
        def _make_input_context(self):
            return distribute_lib.InputContext(
                num_input_pipelines=self._rdma_num_workers,
                input_pipeline_id=self._rdma_rank,
                num_replicas_in_sync=self._num_replicas_in_sync)

        def _check_input_options(self, options):
            if (options is not None and
                    options.experimental_replication_mode == per_replica_mode):
                raise NotImplementedError(
                    "tf_rdma.distribute.RdmaStrategy does not support "
                    "InputReplicationMode.PER_REPLICA; use PER_WORKER (the "
                    "default)")

        def _experimental_distribute_dataset(self, dataset, options):
            self._check_input_options(options)
            return input_util.get_distributed_dataset(
                dataset,
                self._input_workers_with_options(options),
                self._container_strategy(),
                num_replicas_in_sync=self._num_replicas_in_sync,
                input_context=self._make_input_context(),
                options=options)

        def _distribute_datasets_from_function(self, dataset_fn, options):
            self._check_input_options(options)
            return input_util.get_distributed_datasets_from_function(
                dataset_fn=dataset_fn,
                input_workers=self._input_workers_with_options(options),
                input_contexts=[self._make_input_context()],
                strategy=self._container_strategy(),
                options=options)

        def _experimental_distribute_values_from_function(self, value_fn):
            per_replica = []
            for local_id in range(len(self._devices)):
                replica_id = self._get_replica_id_in_sync_group(local_id)
                per_replica.append(value_fn(distribute_lib.ValueContext(
                    replica_id, self._num_replicas_in_sync)))
            return distribute_utils.regroup(per_replica, always_wrap=True)

        # strategy.reduce() and synchronized variables: across workers.
        def _reduce_to(self, reduce_op, value, destinations, options):

            def reduce_one(value):
                if (isinstance(value, values_lib.Mirrored) and
                        reduce_op == tf.distribute.ReduceOp.MEAN):
                    return value
                if (not isinstance(value, values_lib.DistributedValues) and
                        self._rdma_num_workers == 1):
                    return cdo.reduce_non_distributed_value(
                        reduce_op, value, destinations, len(self._devices))
                return self._cross_device_ops.reduce(
                    reduce_op, value, destinations=destinations,
                    options=options)

            # Keras reduces whole (x, y) batches: a structure of values.
            return tf.nest.map_structure(reduce_one, value)

        def _gather_to_implementation(self, value, destinations, axis,
                                      options):
            return self._cross_device_ops._gather(  # pylint: disable=protected-access
                value, destinations=destinations, axis=axis, options=options)

        # Every worker starts from the chief's initial values.
        def _get_variable_creator_initial_value(self, replica_id, device,
                                                primary_var, **kwargs):
            # "<layer path>_gradient_accumulator", one per trainable variable
            if "gradient_accumulator" in str(kwargs.get("name") or ""):
                # Keras 3 creates these for gradient_accumulation_steps, and
                # then applies the update inside a cond, where no
                # MirroredStrategy can merge_call (MWMS fails the same way,
                # with TensorFlow's RuntimeError about merge_call).
                raise ConfigError(
                    "optimizer.gradient_accumulation_steps is not supported "
                    "under RdmaStrategy (nor under MultiWorkerMirroredStrategy "
                    "with Keras 3.15: the update runs in a cond, where a "
                    "cross-replica merge_call is not allowed); accumulate the "
                    "gradients in a custom training loop, or use a larger "
                    "global batch")
            if replica_id != 0 or self._rdma_num_workers == 1:
                return super()._get_variable_creator_initial_value(
                    replica_id=replica_id, device=device,
                    primary_var=primary_var, **kwargs)
            ordinal = self._rdma_init_count
            self._rdma_init_count += 1
            name = f"{ordinal}.{kwargs.get('name') or 'variable'}"

            def initial_value_fn():
                with tf.device(device):
                    value = kwargs["initial_value"]
                    if callable(value):
                        value = value()
                    # A CheckpointInitialValue (restore on create) wraps the
                    # restored tensor.
                    value = getattr(value, "wrapped_value", value)
                    value = tf.convert_to_tensor(value,
                                                 dtype=kwargs.get("dtype"))
                    return self._rdma_broadcast(value, name)

            return initial_value_fn

    _rdma_extended_class = RdmaExtended
    return RdmaExtended


# ---------------------------------------------------------------------------
# Keras predict under RdmaStrategy

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

