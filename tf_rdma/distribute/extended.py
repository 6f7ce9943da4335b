"""The multi-worker half of RdmaStrategy: a ``MirroredExtended`` subclass.

The strategy is a tf.distribute.MirroredStrategy (so that Keras and every
other caller treat it as one) whose gradient path goes through a public
extension point, a tf.distribute.CrossDeviceOps subclass
(tf_rdma.distribute.RdmaCrossDeviceOps). What has no public hook is the
multi-worker half of MirroredStrategy's "extended" object: the number of
replicas in sync across workers, the sharding of datasets by worker, the
reduction of strategy.reduce() across workers, and the broadcast of initial
values from the chief. MultiWorkerMirroredStrategy implements exactly these
in tensorflow/python/distribute/collective_all_reduce_strategy.py; the
subclass built here does the same on top of MirroredExtended, with tf_rdma's
collectives instead of TensorFlow's. Everything private it touches is
imported and checked here.

Checked against TensorFlow 2.21 (with Keras 3.15). If a module or method
used here is missing, creating the strategy fails with an error that names
it instead of training with a silently wrong reduction.
"""

from tf_rdma.errors import ConfigError, LibraryError

__all__ = ["rdma_extended_class"]

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
                         (distribute_lib, "InputReplicationMode"),
                         (distribute_lib, "InputOptions")):
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

        # Input options. TensorFlow's MultiDeviceIterator, behind every
        # distributed iterator, keeps a per-replica buffer that a background
        # thread refills after each step. Freed while that thread is inside
        # its dataset's GetNext, the iterator releases the dataset before it
        # stops the thread, and the process dies (SIGSEGV, or "terminate
        # called without an active exception"). Keras drops each epoch's
        # iterator when the epoch ends, whatever that thread is doing, so
        # training several models in one process crashes now and then:
        # under MirroredStrategy and MultiWorkerMirroredStrategy too, more
        # often on a busy CPU. With
        # experimental_per_replica_buffer_size=0 the thread fetches only
        # while a step waits for the element (and holds the iterator), so
        # none is freed in the middle of a fetch. The input pipeline's own
        # prefetching stays; what is given up is the copy of the next batch
        # to a GPU overlapping the step. Options the caller passes are used
        # as they are (docs/strategy.md, "Input buffers").
        def _input_options(self, options):
            if options is None:
                return distribute_lib.InputOptions(
                    experimental_per_replica_buffer_size=0)
            if options.experimental_replication_mode == per_replica_mode:
                raise NotImplementedError(
                    "tf_rdma.distribute.RdmaStrategy does not support "
                    "InputReplicationMode.PER_REPLICA; use PER_WORKER (the "
                    "default)")
            return options

        def _experimental_distribute_dataset(self, dataset, options):
            options = self._input_options(options)
            return input_util.get_distributed_dataset(
                dataset,
                self._input_workers_with_options(options),
                self._container_strategy(),
                num_replicas_in_sync=self._num_replicas_in_sync,
                input_context=self._make_input_context(),
                options=options)

        def _distribute_datasets_from_function(self, dataset_fn, options):
            options = self._input_options(options)
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
