"""Transfer discovery: every edge that crosses a task boundary, classified.

Once every node has a task (placement.py), an edge crosses when its producer
and its consumer run on different tasks. Several consumers of one tensor on
one task share a single transfer (one slot, one write per step); the same
tensor going to two tasks is two transfers. Each transfer gets a *kind*:

``static``
    dtype memcpy-able and shape fully known at trace time: a fixed slot.
``dynamic``
    memcpy-able, but some dimension (or the rank) is only known at run time:
    the dynamic path (design.md §3).
``control``
    a control edge between tasks: a zero-byte transfer whose arrival orders
    the consumer after the producer, as the control edge did.
``kept``
    stays on TensorFlow's own path, with the reason: strings, variants and
    resource handles are not memcpy-able; a task without a tf_rdma endpoint
    (the client, usually) cannot take a one-sided write; a function call or
    loop whose body spans tasks, or TensorFlow 1 control flow, has edges the
    pass cannot see through. Keeping an edge is always correct, only slower.

Keys name the tensor and the destination, ``producer:index>job:task`` (or
``^producer>job:task`` for control), so they are stable across traces of the
same graph and readable in ``tf-rdma inspect``.
"""

import dataclasses
import math

from tf_rdma.graph_passes.graph import V1_CONTROL_FLOW_OPS, task_of
from tf_rdma.graph_passes.plan import DTYPE_SIZES

STATIC = "static"
DYNAMIC = "dynamic"
CONTROL = "control"
KEPT = "kept"
KINDS = (STATIC, DYNAMIC, CONTROL, KEPT)
# TensorFlow's name for the job of a client that connected to a cluster: it
# runs no tf_rdma endpoint unless the caller says so (endpoint_tasks).
CLIENT_JOB_PREFIX = "/job:localhost/"
# The reason of an edge kept because one of its tasks runs no endpoint
# (after the task's name).
NO_ENDPOINT_REASON = "has no tf_rdma endpoint"


@dataclasses.dataclass(frozen=True)
class Edge:
    """A tensor (or a control edge) that crosses from one task to another.

    Attributes:
      key: Unique name, ``producer:index>job:task`` or ``^producer>job:task``.
      producer: The producing node.
      index: The producer's output index; -1 for a control edge.
      src: The producer's task.
      dst: The consumers' task.
      consumers: ``((node, input slot), ...)`` on ``dst``, sorted.
      dtype: The dtype name, or None if unknown (control: None).
      shape: The shape as a tuple (None for an unknown dim), or None when the
        rank is unknown.
      kind: One of :data:`KINDS`.
      reason: Why the edge is ``dynamic`` or ``kept``; empty otherwise.
    """

    key: str
    producer: str
    index: int
    src: str
    dst: str
    consumers: tuple
    dtype: object
    shape: object
    kind: str
    reason: str = ""

    @property
    def nbytes(self):
        """Bytes per step: 0 for control, None when not known statically."""
        if self.kind == CONTROL:
            return 0
        if self.shape is None or None in self.shape or self.dtype not in DTYPE_SIZES:
            return None
        return DTYPE_SIZES[self.dtype] * math.prod(self.shape)

    @property
    def tensor(self):
        return f"^{self.producer}" if self.index < 0 else f"{self.producer}:{self.index}"

    def to_dict(self):
        return {"key": self.key, "producer": self.producer, "index": self.index,
                "src": self.src, "dst": self.dst,
                "consumers": [list(c) for c in self.consumers],
                "dtype": self.dtype,
                "shape": None if self.shape is None else list(self.shape),
                "nbytes": self.nbytes, "kind": self.kind, "reason": self.reason}


def short_task(task):
    """``"/job:worker/task:1"`` -> ``"worker:1"``."""
    return task[len("/job:"):].replace("/task:", ":")


def spanning_calls(view, placements):
    """``{node: reason}`` for calls / loops whose bodies run on other tasks."""
    reasons = {}
    for name in view.nodes:
        if not view.is_function_call(name):
            continue
        here = placements[name].task
        for fname in view.called_functions(name):
            for body_node in view.functions[fname].node_def:
                task = task_of(body_node.device)
                if task is not None and task != here:
                    reasons[name] = (
                        f"{name!r} calls {fname!r}, whose node "
                        f"{body_node.name!r} is placed on {task} while the "
                        f"call runs on {here}")
                    break
            if name in reasons:
                break
        if name not in reasons:
            for inp in view.inputs[name]:
                if inp.is_control or placements[inp.producer].task == here:
                    continue
                if view.output_dtype(inp.producer, inp.index) == "resource":
                    reasons[name] = (
                        f"{name!r} takes the resource {inp.producer!r} from "
                        f"{placements[inp.producer].task}; its body reads it "
                        f"remotely")
                    break
    return reasons


# Control edges between tasks that another input already implies.
#
# A tf.function's automatic control dependencies give its final NoOp a
# control input from every op that must run, and every op that touches a
# resource one from the op before it on that resource. Under parameter-server
# training most of those ops run on the ps tasks and the NoOp on the worker,
# so a step of an n-variable model would cross with about 2n control edges
# (each variable's read and its update) although the update already runs
# after the read. A control edge P -> C adds nothing when another input of C
# has P as an ancestor: C cannot run before that input's producer, which
# cannot run before P, and the rewrite keeps every ordering it moves (a recv
# completes after its send, a send after its producer). The rewrite drops
# such a control input instead of moving it (left in the graph, TensorFlow
# would send it over gRPC). Nothing runs in another order and nothing is
# pruned: P stays an ancestor of C. (The other input may be dropped too, for
# a third that runs after it in turn; acyclic, such a chain ends at an input
# that stays.) Finding them needs, for every node, which
# producers of cross-task control edges are its ancestors: one pass in
# topological order over bit sets as wide as the number of such producers.
def implied_control_inputs(view, placements):
    """Cross-task control inputs that another input of their consumer implies.

    Returns:
      ``{(consumer, producer): other}``: the control input ``^producer`` of
      ``consumer`` crosses tasks, and ``other``, another input of
      ``consumer``, runs after ``producer``.
    """
    from tf_rdma.graph_passes.placement import topological_order  # pylint: disable=g-import-not-at-top

    crossing = [(name, inp.producer) for name in view.nodes
                for inp in view.inputs[name]
                if inp.is_control and placements[inp.producer].task
                != placements[name].task]
    if not crossing:
        return {}
    bit_of = {}
    for _, producer in crossing:
        bit_of.setdefault(producer, 1 << len(bit_of))
    reach = {}  # node -> bits of the producers that are it or run before it
    for n in topological_order(view):
        bits = bit_of.get(n, 0)
        for inp in view.inputs[n]:
            bits |= reach[inp.producer]
        reach[n] = bits
    implied = {}
    for consumer, producer in sorted(crossing):
        bit = bit_of[producer]
        for inp in view.inputs[consumer]:
            if inp.is_control and inp.producer == producer:
                continue
            if reach[inp.producer] & bit:
                implied[(consumer, producer)] = inp.producer
                break
    return implied


def discover_transfers(view, placements, endpoint_tasks=None, client_task=None,
                       spanning=None, implied=None):
    """Returns every cross-task edge of ``view`` as a sorted list of :class:`Edge`.

    Args:
      view: A :class:`~tf_rdma.graph_passes.graph.GraphView`.
      placements: ``{node: Placement}`` from
        :func:`~tf_rdma.graph_passes.placement.resolve_devices`.
      endpoint_tasks: Tasks that run a tf_rdma endpoint; an edge to or from
        any other task is kept. None means every task except ``client_task``
        and the tasks of job ``localhost`` (the client's).
      client_task: The task of the program that calls the function (used
        when ``endpoint_tasks`` is None).
      spanning: ``{node: reason}`` from :func:`spanning_calls`, if already
        computed.
      implied: ``{(consumer, producer): other}`` from
        :func:`implied_control_inputs`, if already computed: control inputs
        that are no edge (the rewrite drops them).
    """
    if spanning is None:
        spanning = spanning_calls(view, placements)
    if implied is None:
        implied = implied_control_inputs(view, placements)
    grouped = {}
    for name in view.nodes:
        dst = placements[name].task
        for inp in view.inputs[name]:
            src = placements[inp.producer].task
            if src == dst or (inp.is_control and (name, inp.producer) in implied):
                continue
            group = grouped.setdefault((inp.producer, inp.index, dst), [])
            group.append((name, inp.slot))

    edges = []
    for (producer, index, dst), consumers in grouped.items():
        src = placements[producer].task
        consumers = tuple(sorted(consumers))
        control = index < 0
        target = short_task(dst)
        key = f"^{producer}>{target}" if control else f"{producer}:{index}>{target}"
        dtype = None if control else view.output_dtype(producer, index)
        shape = None if control else view.output_shape(producer, index)
        kind, reason = _classify(view, producer, consumers, src, dst, dtype,
                                 shape, control, spanning, endpoint_tasks,
                                 client_task)
        edges.append(Edge(key, producer, index, src, dst, consumers, dtype,
                          shape, kind, reason))
    edges.sort(key=lambda e: e.key)
    return edges


def _classify(view, producer, consumers, src, dst, dtype, shape, control,
              spanning, endpoint_tasks, client_task):
    for task in (src, dst):
        has_endpoint = (task in endpoint_tasks if endpoint_tasks is not None
                        else task != client_task
                        and not task.startswith(CLIENT_JOB_PREFIX))
        if not has_endpoint:
            return KEPT, f"{task} {NO_ENDPOINT_REASON}"
    for node in (producer,) + tuple(c for c, _ in consumers):
        if node in spanning:
            return KEPT, f"function body spans tasks: {spanning[node]}"
        if view.nodes[node].op in V1_CONTROL_FLOW_OPS:
            return KEPT, (f"{node!r} is TensorFlow 1 control flow "
                          f"({view.nodes[node].op}), whose tensors may be dead")
    if control:
        return CONTROL, ""
    if dtype is None:
        return KEPT, (f"the output dtype of {producer!r} "
                      f"({view.nodes[producer].op}) is not known")
    if dtype not in DTYPE_SIZES:
        return KEPT, f"{dtype} tensors are not memcpy-able"
    if shape is None:
        return DYNAMIC, "rank unknown at trace time"
    if None in shape:
        dims = ", ".join("None" if d is None else str(d) for d in shape)
        return DYNAMIC, f"shape [{dims}] not fully known at trace time"
    return STATIC, ""
