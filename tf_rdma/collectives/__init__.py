"""Collectives among tf_rdma tasks: allreduce, broadcast, reduce, allgather.

Every process of the group runs the same program (SPMD) with its tf_rdma
endpoint started (:func:`tf_rdma.start_endpoint`, or
:class:`tf_rdma.distribute.RdmaStrategy`, which does it). A call is one op,
``TfRdmaCollective``, that runs on the engine: the data moves through
preallocated channels between the ranks, block by block, by one of five
algorithms (kernels/engine/collective.cc):

===========  ==========================================================
``lp``       linear pipelining along a chain — cost nearly flat in P
``ring``     reduce-scatter + allgather around a ring
``tree``     binomial tree, pipelined — logarithmic latency
``rhd``      recursive halving + doubling — MPI's bidirectional exchange
``oneshot``  every rank writes straight to every rank in one step — the
             latency path for small messages
===========  ==========================================================

``algorithm="auto"`` picks the cheapest under the α-β-γ model of
:mod:`tf_rdma.collectives.cost`, with the parameters of :func:`calibrate`
if it ran, else the model's defaults; the block size is the model's b*.
Every rank must make the same choice, so the parameters come from rank 0.

Example (in each worker process)::

    tf_rdma.start_endpoint("/job:worker/task:0", cluster)
    grads = tf_rdma.collectives.all_reduce([g1, g2], reduction="mean")

**Naming.** Each call site is a collective *instance*, with its own channels.
Its ``name`` must be the same on every rank, and two collectives that can
run at the same time must have different names. By default the name is made
from the kind, dtype, shapes, algorithm and the call's ordinal in the
current graph (eagerly: in the process), which is the same on every rank of
an SPMD program.

**Shapes.** The rank of every tensor must be known when the op is built; a
dimension may be unknown until run time (``None`` in the static shape),
and then the algorithm and block are chosen for 256 in its place. Every rank
must pass the same shape at run time (``all_gather_v``: the same but the
first dimension), and every call of an instance the same shape as its first
call: the engine refuses a changed one with both layouts' hashes.

Errors: bad arguments raise :class:`tf_rdma.errors.CollectiveError` when the
op is built; a peer that dies or stalls fails the op with a TensorFlow error
(``DeadlineExceededError`` after the timeout, ``UnavailableError`` when its
connection drops) whose message names the collective, its instance, the
algorithm, this rank and the peer.
"""

import math
import threading
import weakref

from tf_rdma import cluster as cluster_lib
from tf_rdma.errors import CollectiveError, EndpointError
from tf_rdma.graph_passes.plan import DTYPE_SIZES

__all__ = ["KINDS", "ALGORITHMS", "REDUCTIONS", "Group", "default_group",
           "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_v",
           "calibrate", "model_params"]

KINDS = ("allreduce", "broadcast", "reduce", "allgather")
ALGORITHMS = ("lp", "ring", "tree", "rhd", "oneshot")
REDUCTIONS = ("sum", "mean", "min", "max", "prod")
DEFAULT_DEPTH = 4

# A planned transfer's dtypes but bool, which has no sum (the op's T attr).
_DTYPES = tuple(d for d in DTYPE_SIZES if d != "bool")


class Group:
    """The ranks of a collective: tasks in rank order, and this process's rank.

    Args:
        tasks: Task names in rank order ("/job:worker/task:0", "worker:1", ...).
        rank: This process's rank; default: the position of the task whose
            endpoint runs in this process.

    Raises:
        CollectiveError: The group is empty, names a task twice, or does not
            contain this process's task.
    """

    def __init__(self, tasks, rank=None):
        self.tasks = tuple(cluster_lib.canonical_task(t) for t in tasks)
        if not self.tasks:
            raise CollectiveError("a collective group needs at least one task")
        if len(set(self.tasks)) != len(self.tasks):
            raise CollectiveError(f"a task appears twice in the group {self.tasks}")
        if rank is None:
            own = _own_task()
            if own not in self.tasks:
                raise CollectiveError(
                    f"this process's endpoint is {own}, which is not in the "
                    f"group {list(self.tasks)}")
            rank = self.tasks.index(own)
        if not isinstance(rank, int) or not 0 <= rank < len(self.tasks):
            raise CollectiveError(f"rank {rank!r} is not in [0, {len(self.tasks)})")
        self.rank = rank

    @property
    def size(self):
        """The number of ranks."""
        return len(self.tasks)

    def __eq__(self, other):
        return (isinstance(other, Group) and self.tasks == other.tasks
                and self.rank == other.rank)

    def __hash__(self):
        return hash((self.tasks, self.rank))

    def __repr__(self):
        return f"Group(tasks={list(self.tasks)!r}, rank={self.rank})"


def _own_task():
    from tf_rdma import server  # pylint: disable=g-import-not-at-top

    endpoint = server._endpoint  # pylint: disable=protected-access
    if endpoint is None:
        raise EndpointError(
            "the tf_rdma endpoint is not running in this process; call "
            "tf_rdma.start_endpoint(task, cluster) (or use "
            "tf_rdma.distribute.RdmaStrategy) before a collective")
    return endpoint.task


def _task_order(task):
    job, index = cluster_lib.parse_task(task)
    return ({"chief": 0, "worker": 1}.get(job, 2), job, index)


def default_group():
    """The group of the running endpoint's cluster: chief (if any), then workers.

    Raises:
        EndpointError: No endpoint runs in this process.
        CollectiveError: This process is neither the chief nor a worker.
    """
    from tf_rdma import server  # pylint: disable=g-import-not-at-top

    own = _own_task()
    endpoint = server._endpoint  # pylint: disable=protected-access
    tasks = [t for t in [own] + list(endpoint.peers)
             if cluster_lib.parse_task(t)[0] in ("chief", "worker")]
    if own not in tasks:
        raise CollectiveError(
            f"{own} is neither a chief nor a worker; pass group= with the "
            f"tasks that take part")
    return Group(sorted(tasks, key=_task_order))


# ---------------------------------------------------------------------------
# The cost model's parameters every rank uses for "auto".

_params = None
_params_lock = threading.Lock()


def model_params():
    """The α-β-γ parameters "auto" uses: calibrated, else the model's defaults."""
    from tf_rdma.collectives import cost  # pylint: disable=g-import-not-at-top

    return _params if _params is not None else cost.DEFAULT_PARAMS


def calibrate(group=None, probe_bytes=1 << 20, repeats=5, timeout=None):
    """Measures α, β, γ and δ for this group and makes every rank use rank 0's.

    α is the time of a one-element broadcast between rank 0 and rank 1; a
    ``probe_bytes`` broadcast between them (one block) costs α + n·(β + δ);
    γ is the per-byte time of a local reduction out of place (numpy add into
    a third array, as a receiver reduces its input and a block in its
    channel into its buffer) and δ that of a local copy (what a receiver
    pays to copy a block out of its channel), so β = bandwidth term − δ.
    Rank 0's numbers are broadcast so that "auto" makes the same choice on
    every rank. Call it on every rank, after the
    endpoint started. With one rank it measures only γ and δ.

    Each probe (both sizes, both roots) is called once before it is timed
    (the first call of a collective sets up its channels), and the small
    and large probes alternate, so that a burst of load on a shared machine
    falls on both: their difference gives the bandwidth term. α is a call's
    whole time, the dispatch included, so on a busy machine it can come out
    larger than a large probe's; the bandwidth term is then taken to be at
    least the receiver's copy (δ), and β at least a tenth of it, never the
    "free bandwidth" that would make ``auto`` pick by α alone.

    Returns:
        The :class:`tf_rdma.collectives.cost.Params` now in use.
    """
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    import time  # pylint: disable=g-import-not-at-top

    import numpy as np  # pylint: disable=g-import-not-at-top

    from tf_rdma.collectives import cost  # pylint: disable=g-import-not-at-top

    global _params
    group = group or default_group()
    a = np.ones(probe_bytes // 4, np.float32)
    b = np.ones_like(a)
    # In place (out=a) the add touches two arrays, not three: it measured
    # like a copy (1 MiB, Intel VM, 2026-12-06: 0.039 ns a byte in place,
    # 0.096 out of place, a copy 0.030), and "auto" then took oneshot, which
    # reduces all n bytes, over ring, which reduces n/P, up to 256 MiB at
    # P = 2, where ring was 21 to 26% faster.
    reduced = np.empty_like(a)
    start = time.perf_counter()
    for _ in range(repeats):
        np.add(a, b, out=reduced)
    gamma = (time.perf_counter() - start) / repeats / a.nbytes
    start = time.perf_counter()
    for _ in range(repeats):
        np.copyto(b, a)
    delta = (time.perf_counter() - start) / repeats / a.nbytes
    alpha, beta = cost.DEFAULT_PARAMS.alpha, cost.DEFAULT_PARAMS.beta
    if group.size > 1:
        pair = Group(group.tasks[:2], rank=min(group.rank, 1)) \
            if group.rank < 2 else None
        if pair is not None:
            probes = {"small": tf.zeros([1], tf.float32),
                      "large": tf.zeros([probe_bytes // 4], tf.float32)}
            times = {"small": [], "large": []}
            # Rounds 0 and 1 set up each probe's channels (both roots).
            for i in range(2 + 2 * repeats):
                for label, t in probes.items():
                    begin = time.perf_counter()
                    broadcast(t, root=i % 2, group=pair, algorithm="lp",
                              block_bytes=max(64, t.shape[0] * 4),
                              name=f"calibrate/{label}/{i % 2}",
                              timeout=timeout)
                    if i >= 2:
                        times[label].append(time.perf_counter() - begin)
            alpha = max(1e-7, float(np.median(times["small"])))
            per_byte = max(delta, (float(np.median(times["large"])) - alpha)
                           / probe_bytes)
            beta = max(per_byte - delta, 0.1 * per_byte)
    measured = tf.constant([alpha, beta, gamma, delta], tf.float64)
    agreed = broadcast(measured, root=0, group=group, algorithm="tree",
                       block_bytes=64, name="calibrate/params",
                       timeout=timeout).numpy()
    with _params_lock:
        _params = cost.Params(alpha=float(agreed[0]), beta=float(agreed[1]),
                              gamma=float(agreed[2]), delta=float(agreed[3]))
    return _params


# ---------------------------------------------------------------------------
# The ops.

_ordinals = weakref.WeakKeyDictionary()  # graph -> {signature: next ordinal}
_ordinals_lock = threading.Lock()


def _default_name(signature):
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    with _ordinals_lock:
        if tf.executing_eagerly():
            # Eager calls run one after another: the same signature reuses
            # its channels.
            return signature
        counts = _ordinals.setdefault(tf.compat.v1.get_default_graph(), {})
        ordinal = counts.get(signature, 0)
        counts[signature] = ordinal + 1
    return f"{signature}#{ordinal}"


def _nominal_elements(shape):
    """Elements of ``shape``, a dimension unknown at trace time counted 256.

    The algorithm and block are chosen when the op is built, and every rank
    must choose the same: a dimension known only at run time (a gradient
    whose static shape TensorFlow lost, say) is given the same nominal
    size on every rank. The op itself moves what it is given at run time.
    """
    return math.prod(256 if d is None else d for d in shape.as_list())


def _collective(kind, tensors, reduction="sum", root=0, algorithm="auto",
                group=None, name=None, block_bytes=None, depth=None,
                timeout=None):
    # TensorFlow and the op library load at the first collective, not when
    # this package is imported (tf-rdma simulate and cost live in it).
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    from tf_rdma import ops  # pylint: disable=import-outside-toplevel

    single = not isinstance(tensors, (list, tuple))
    tensors = [tf.convert_to_tensor(t) for t in
               ([tensors] if single else tensors)]
    if not tensors:
        raise CollectiveError(f"{kind} of an empty list")
    dtype = tensors[0].dtype
    if dtype.name not in _DTYPES:
        raise CollectiveError(
            f"{kind} of dtype {dtype.name}: tf_rdma collectives take "
            f"{', '.join(_DTYPES)}")
    for t in tensors[1:]:
        if t.dtype != dtype:
            raise CollectiveError(
                f"{kind} of a list mixes {dtype.name} and {t.dtype.name}; "
                f"one call takes one dtype")
    if reduction not in REDUCTIONS:
        raise CollectiveError(f"reduction {reduction!r} is not one of "
                              f"{', '.join(REDUCTIONS)}")
    if reduction in ("min", "max") and dtype.is_complex:
        raise CollectiveError(f"reduction {reduction!r} needs ordered values; "
                              f"{dtype.name} has no order")
    gather = kind in ("allgather", "allgatherv")
    if gather and len(tensors) != 1:
        raise CollectiveError(f"{kind} takes one tensor")
    group = group or default_group()
    if not isinstance(group, Group):
        raise CollectiveError(f"group must be a tf_rdma.collectives.Group, "
                              f"got {group!r}")
    if not isinstance(root, int) or not 0 <= root < group.size:
        raise CollectiveError(f"root {root!r} is not a rank of the group "
                              f"(0 to {group.size - 1})")
    for t in tensors:
        if t.shape.rank is None:
            raise CollectiveError(
                f"{kind} of a tensor of unknown rank: collectives need the "
                f"rank when the function is traced")
        if kind == "allgatherv" and not t.shape[1:].is_fully_defined():
            raise CollectiveError(
                f"{kind} of a tensor of shape {t.shape}: all but the first "
                f"dimension must be known when the function is traced")
    if gather and tensors[0].shape.rank == 0:
        raise CollectiveError(f"{kind} concatenates along axis 0; a scalar "
                              f"has none")
    if kind == "allgatherv":
        # The rows vary by rank and by call, so the algorithm and block are
        # chosen for a nominal 256 rows: every rank must choose the same, and
        # the first dimension, where known, is only this rank's (a block that
        # follows it gives each rank a different plan).
        nbytes = 256 * tensors[0].shape[1:].num_elements() * dtype.size
    else:
        # As the op lays a bucket out: each tensor 64-byte aligned (a block
        # chosen for the bare sum could miss the padding by a few bytes and
        # split a small bucket in two).
        unit = max(1, 64 // dtype.size) if len(tensors) > 1 else 1
        nbytes = sum(-(-_nominal_elements(t.shape) // unit) * unit
                     for t in tensors) * dtype.size
    if algorithm != "auto" and algorithm not in ALGORITHMS:
        raise CollectiveError(f"algorithm {algorithm!r} is not one of auto, "
                              f"{', '.join(ALGORITHMS)}")
    if algorithm == "auto" or block_bytes is None:
        from tf_rdma.collectives import cost  # pylint: disable=g-import-not-at-top

        if algorithm == "auto":
            algorithm, chosen = cost.choose(
                "allgather" if gather else kind, nbytes, group.size,
                model_params())
        else:
            # (as choose() does: an allgather moves P pieces down a chain)
            whole = nbytes * (group.size if gather else 1)
            chosen = cost.block_size(whole, group.size, model_params())
        if block_bytes is None:
            block_bytes = chosen
    if not isinstance(block_bytes, int) or block_bytes < dtype.size:
        raise CollectiveError(f"block_bytes {block_bytes!r} must be an integer "
                              f">= the element size ({dtype.size})")
    depth = DEFAULT_DEPTH if depth is None else depth
    if not isinstance(depth, int) or depth < 1:
        raise CollectiveError(f"depth {depth!r} must be an integer >= 1")
    if name is None:
        def dims(t):
            # An allgatherv's first dimension is this rank's own: every rank
            # must derive the same name.
            d = [str(n) for n in t.shape]
            return ["?"] + d[1:] if kind == "allgatherv" else d
        shapes = ",".join("x".join(dims(t)) for t in tensors)
        name = _default_name(f"{kind}:{dtype.name}:[{shapes}]:{algorithm}:"
                             f"{reduction}:{root}:{'|'.join(group.tasks)}")
    if kind == "allgatherv":
        return ops.raw_ops().tf_rdma_all_gather_v(
            input=tensors[0], algorithm=algorithm, group=list(group.tasks),
            rank=group.rank, instance=name, block_bytes=int(block_bytes),
            depth=depth, timeout_ms=ops.timeout_to_ms(timeout, CollectiveError))
    outputs = ops.raw_ops().tf_rdma_collective(
        inputs=tensors, kind=kind, reduction=reduction, algorithm=algorithm,
        group=list(group.tasks), rank=group.rank, root=root, instance=name,
        block_bytes=int(block_bytes), depth=depth,
        timeout_ms=ops.timeout_to_ms(timeout, CollectiveError))
    return outputs[0] if single else list(outputs)


def all_reduce(tensors, reduction="sum", algorithm="auto", group=None,
               name=None, block_bytes=None, depth=None, timeout=None):
    """Reduces tensors over every rank; every rank gets the result.

    Args:
        tensors: A tensor, or a list of tensors of one dtype (a bucket: one
            collective over all of them, laid out at fixed offsets).
        reduction: "sum", "mean", "min", "max" or "prod". Mean of integers
            divides with truncation toward zero.
        algorithm: "auto", "lp", "ring", "tree", "rhd" or "oneshot".
        group: The :class:`Group`; default :func:`default_group`.
        name: The instance name (see the module doc); default derived.
        block_bytes: The pipelining block; default the model's b*.
        depth: Blocks in flight per channel (default 4).
        timeout: Seconds any wait may take; default TF_RDMA_TIMEOUT.

    Returns:
        The reduced tensor, or list of tensors, like `tensors`.
    """
    return _collective("allreduce", tensors, reduction=reduction,
                       algorithm=algorithm, group=group, name=name,
                       block_bytes=block_bytes, depth=depth, timeout=timeout)


def broadcast(tensors, root=0, algorithm="auto", group=None, name=None,
              block_bytes=None, depth=None, timeout=None):
    """Every rank gets the root's tensors (the others' inputs give the shapes).

    Args: as :func:`all_reduce`, plus `root`, the rank whose tensors win.
    """
    return _collective("broadcast", tensors, root=root, algorithm=algorithm,
                       group=group, name=name, block_bytes=block_bytes,
                       depth=depth, timeout=timeout)


def reduce(tensors, root=0, reduction="sum", algorithm="auto", group=None,
           name=None, block_bytes=None, depth=None, timeout=None):
    """The root gets the reduction over every rank; the others their inputs.

    Args: as :func:`all_reduce`, plus `root`, the rank that gets the result.
    """
    return _collective("reduce", tensors, reduction=reduction, root=root,
                       algorithm=algorithm, group=group, name=name,
                       block_bytes=block_bytes, depth=depth, timeout=timeout)


def all_gather(tensor, algorithm="auto", group=None, name=None,
               block_bytes=None, depth=None, timeout=None):
    """Concatenates every rank's tensor along axis 0, in rank order.

    Every rank's tensor must have the same shape.
    Args: as :func:`all_reduce`, for one tensor.
    """
    return _collective("allgather", tensor, algorithm=algorithm, group=group,
                       name=name, block_bytes=block_bytes, depth=depth,
                       timeout=timeout)


def all_gather_v(tensor, algorithm="auto", group=None, name=None,
                 block_bytes=None, depth=None, timeout=None):
    """Concatenates every rank's tensor along axis 0, in rank order.

    The first dimension may differ from rank to rank (and from call to call):
    the rows of a sparse gradient, say. The other dimensions and the dtype
    must be the same everywhere; a rank that differs fails every rank with
    both values. Costs one small header exchange more than
    :func:`all_gather`, and moves every rank's rows padded to the largest
    count (kernels/ops/collective_ops.cc, TfRdmaAllGatherV).

    Args: as :func:`all_reduce`, for one tensor.
    """
    return _collective("allgatherv", tensor, algorithm=algorithm, group=group,
                       name=name, block_bytes=block_bytes, depth=depth,
                       timeout=timeout)
