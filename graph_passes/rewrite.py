"""The rewrite pass: from a function's GraphDef to a Plan and a rewritten graph.

:func:`analyze` runs the passes in order — resolve every node's task
(placement.py), find and classify the edges that cross tasks (transfers.py),
lay the rewritable ones out in a :class:`~tf_rdma.graph_passes.plan.Plan` —
and returns an :class:`Analysis`. :func:`rewrite_graph` then swaps each
planned edge for the tf_rdma ops:

* a ``TfRdmaSend`` on the producer's task takes the tensor and writes it into
  its slot on the consumers' task; a ``TfRdmaRecv`` there hands the slot to
  every consumer that used to read the tensor (their inputs are re-pointed,
  nothing else about them changes);
* a control edge between tasks becomes a send of an empty ``int8`` tensor
  (an Identity of an empty Const, with the control input on the Identity)
  that runs after the producer, and a recv the consumers wait for;
* a recv starts after the sends of its own task that its tensor waits for
  (control inputs; see :func:`_recv_start_after`);
* every node gets the task placement.py chose, written into its device, so
  that TensorFlow's placer cannot put a producer somewhere the plan did not
  expect (which would add a gRPC hop in front of the send).

Dynamic edges (shapes known only at run time) use the same ops with
``dynamic=True``: the slot carries the shape, the bytes go to a payload area
that grows on demand (kernels/engine/engine.h). Edges the pass keeps (see
transfers.py) stay exactly as they were: TensorFlow still moves them. After the
rewrite no planned data edge crosses tasks, so each task's partition runs on
its own and meets the others only in the slots.

The step contract: every call of the rewritten function is one step, in
which each planned send and recv runs exactly once (both ops are stateful
and must run, so TensorFlow never prunes one side of a pair). The ops match
by call (``match_calls``): a send tags its write with the step id that
TensorFlow gives every component of one call, and only that call's recv
takes it, so calls that overlap never exchange tensors.
"""

import contextlib
import dataclasses
import gc
import hashlib
import json
import re

from tensorflow.core.framework import attr_value_pb2, graph_pb2, tensor_pb2
from tensorflow.core.framework import tensor_shape_pb2, types_pb2

from tf_rdma.errors import PlanError
from tf_rdma.graph_passes.graph import (
    DTYPE_ENUMS, GraphView, input_string, task_of)
from tf_rdma.graph_passes.placement import (
    DEFAULT_CALLER_DEVICE, resolve_devices, topological_order)
from tf_rdma.graph_passes.plan import Plan, Transfer, canonical_task
from tf_rdma.graph_passes.transfers import (
    CONTROL, DYNAMIC, KEPT, NO_ENDPOINT_REASON, STATIC, discover_transfers,
    implied_control_inputs, spanning_calls)

CONTROL_TOKEN_DTYPE = "int8"
# Ops that compute nothing (client_computes leaves them out).
_PASS_THROUGH_OPS = frozenset(
    {"Placeholder", "Const", "Identity", "IdentityN", "NoOp"})
_NODE_NAME_BAD = re.compile(r"[^A-Za-z0-9_.\-/]")


@dataclasses.dataclass(frozen=True)
class Analysis:
    """What the passes found in one graph.

    Attributes:
      graph_def: The analysed GraphDef (not modified).
      plan: The :class:`Plan` of the static and control edges.
      edges: Every cross-task :class:`~tf_rdma.graph_passes.transfers.Edge`,
        sorted by key, kept and dynamic ones included.
      placements: ``{node: Placement}``.
      caller_task: The task the function is called from: where the nodes
        that nobody placed run.
      client_task: The task of the program that calls the function (the
        caller's, unless the call runs on another task, as the calls of a
        ``ClusterCoordinator`` do on its workers).
      notes: Things the pass could not plan that are not edges of the top
        level: function calls and loops whose bodies run ops on other tasks
        (their traffic stays on TensorFlow's path, even when no edge of the
        call itself crosses tasks).
      view: The :class:`~tf_rdma.graph_passes.graph.GraphView` of
        ``graph_def`` that the passes built (the rewrite reuses it).
      implied: ``(consumer, producer, other)`` for every control input
        ``^producer`` of ``consumer`` that crosses tasks but is no edge:
        ``other``, another input of ``consumer``, runs after ``producer``,
        so the rewrite drops it (transfers.py, implied_control_inputs).
    """

    graph_def: object
    plan: Plan
    edges: tuple
    placements: dict
    caller_task: str
    client_task: str
    notes: tuple = ()
    view: object = dataclasses.field(default=None, repr=False, compare=False)
    implied: tuple = ()

    def edges_of_kind(self, *kinds):
        return [e for e in self.edges if e.kind in kinds]

    @property
    def planned(self):
        """Edges that the rewrite moves through tf_rdma."""
        return self.edges_of_kind(STATIC, DYNAMIC, CONTROL)

    def client_computes(self):
        """Ops that compute on the program's own task, sending on gRPC.

        The nodes that run on the client's task (nobody placed them, or they
        use a variable that lives there), when tensors cross between it and
        other tasks on TensorFlow's path because it has no tf_rdma endpoint;
        sorted. Empty when the client only passes arguments and takes
        results, or when nothing crosses.
        """
        crosses = any(e.kind == KEPT and self.client_task in (e.src, e.dst)
                      and e.reason.endswith(NO_ENDPOINT_REASON)
                      for e in self.edges)
        if not crosses:
            return []
        return sorted(
            name for name, p in self.placements.items()
            if p.task == self.client_task and p.inferred
            and self.view.nodes[name].op not in _PASS_THROUGH_OPS)

    def to_dict(self):
        """Everything found, as a JSON-ready dict (``tf-rdma inspect --format json``)."""
        return {
            "plan": self.plan.to_dict(),
            "plan_hash": self.plan.hash,
            "caller_task": self.caller_task,
            "client_task": self.client_task,
            "edges": [e.to_dict() for e in self.edges],
            "notes": list(self.notes),
            "implied_control": [{"consumer": c, "producer": p, "after": o}
                                for c, p, o in self.implied],
            "placements": {n: dataclasses.asdict(p)
                           for n, p in sorted(self.placements.items())},
        }

    def summary(self):
        """A readable multi-line report: the plan, then what stays and why."""
        lines = [self.plan.summary()]
        if self.caller_task != self.client_task:
            lines.append(f"called on {self.caller_task} (for the program on "
                         f"{self.client_task})")
        counts = {k: len(self.edges_of_kind(k))
                  for k in (STATIC, DYNAMIC, CONTROL, KEPT)}
        lines.append(
            f"cross-task edges: {len(self.edges)} ({counts[STATIC]} static, "
            f"{counts[DYNAMIC]} dynamic, {counts[CONTROL]} control, "
            f"{counts[KEPT]} kept on TensorFlow's path)")
        if self.implied:
            lines.append(
                f"control inputs not moved: {len(self.implied)} (another "
                f"input of the same op runs after their producer)")
        for e in self.edges_of_kind(DYNAMIC, KEPT):
            lines.append(f"  {e.kind}: {e.key} ({e.src} -> {e.dst}): {e.reason}")
        for note in self.notes:
            lines.append(f"  note: {note}; its traffic stays on TensorFlow's path")
        return "\n".join(lines)


@contextlib.contextmanager
def _gc_paused():
    """Pauses Python's cyclic garbage collector.

    The passes allocate on the order of ten objects per node, none of them
    cyclic; with TensorFlow's few hundred thousand objects alive, those
    allocations set off full collections that cost as much as the passes
    themselves (measured on a 10,000-node graph: about 0.3-0.6 s of 1.2 s).
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def plan_name(base, transfers, depth):
    """A plan name from ``base`` and a fingerprint of what the plan lays out.

    Regions are named after the plan, so two plans with another layout must
    never share a name, while the same function traced again (in this process
    or another) gets the same one. The fingerprint covers the transfers and
    the depth, which is everything the layout depends on.
    """
    base = re.sub(r"[^A-Za-z0-9_.\-]", "_", base or "graph").strip("._-")
    content = json.dumps([[t.to_dict() for t in sorted(transfers, key=lambda t: t.key)],
                          depth], sort_keys=True)
    digest = hashlib.sha256(content.encode("utf-8")).hexdigest()[:10]
    return f"{(base or 'graph')[:60]}.{digest}"


def analyze(graph_def, caller_device=DEFAULT_CALLER_DEVICE, arg_devices=None,
            endpoint_tasks=None, depth=2, name=None, client_device=None):
    """Runs device resolution, transfer discovery and layout on a GraphDef.

    Args:
      graph_def: The function's GraphDef, ideally exported with
        ``add_shapes=True`` (without shapes every edge is dynamic).
      caller_device: The device the function is called on: the nodes that
        nobody placed run there.
      arg_devices: ``{placeholder: device}`` of arguments with a known device.
      endpoint_tasks: Tasks with a tf_rdma endpoint (None: every task except
        the client's and those of job ``localhost``, TensorFlow's name for
        the client's own job).
      depth: Copies per slot in the plan.
      name: Base of the plan's name (a fingerprint of the graph is appended).
      client_device: A device of the program that calls the function, when
        that is not the caller's device (a ``ClusterCoordinator`` runs the
        calls of its program on a worker); None: the caller's.

    Returns:
      An :class:`Analysis`.

    Raises:
      PlanError: If the graph is malformed or an argument is invalid.
    """
    if not isinstance(graph_def, graph_pb2.GraphDef):
        raise PlanError(
            f"expected a GraphDef, got {type(graph_def).__name__}")
    with _gc_paused():
        return _analyze(graph_def, caller_device, arg_devices, endpoint_tasks,
                        depth, name, client_device)


def _analyze(graph_def, caller_device, arg_devices, endpoint_tasks, depth,
             name, client_device):
    view = GraphView(graph_def)
    placements = resolve_devices(view, caller_device, arg_devices)
    caller_task = task_of(caller_device)
    client_task = caller_task if client_device is None else task_of(client_device)
    if client_task is None:
        raise PlanError(f"client device {client_device!r} names no job; "
                        f"expected e.g. {DEFAULT_CALLER_DEVICE!r}")
    if endpoint_tasks is not None:
        if isinstance(endpoint_tasks, str):
            endpoint_tasks = [endpoint_tasks]
        endpoint_tasks = {canonical_task(t) for t in endpoint_tasks}
    spanning = spanning_calls(view, placements)
    implied = implied_control_inputs(view, placements)
    edges = discover_transfers(view, placements, endpoint_tasks, client_task,
                               spanning, implied)
    transfers = []
    for e in edges:
        if e.kind == STATIC:
            transfers.append(Transfer(e.key, e.src, e.dst, e.dtype, e.shape))
        elif e.kind == DYNAMIC:
            transfers.append(Transfer(e.key, e.src, e.dst, e.dtype, e.shape,
                                      dynamic=True))
        elif e.kind == CONTROL:
            transfers.append(
                Transfer(e.key, e.src, e.dst, CONTROL_TOKEN_DTYPE, [0]))
    plan = Plan(transfers, name=plan_name(name, transfers, depth), depth=depth)
    notes = tuple(reason for _, reason in sorted(spanning.items()))
    return Analysis(graph_def, plan, tuple(edges), placements, caller_task,
                    client_task, notes, view,
                    tuple((c, p, o) for (c, p), o in sorted(implied.items())))


def _attr(value):
    if isinstance(value, bool):
        return attr_value_pb2.AttrValue(b=value)
    if isinstance(value, int):
        return attr_value_pb2.AttrValue(i=value)
    if isinstance(value, str):
        return attr_value_pb2.AttrValue(s=value.encode("utf-8"))
    raise TypeError(f"no AttrValue for {value!r}")


def _shape_attr(dims):
    if dims is None:
        return attr_value_pb2.AttrValue(
            shape=tensor_shape_pb2.TensorShapeProto(unknown_rank=True))
    return attr_value_pb2.AttrValue(shape=tensor_shape_pb2.TensorShapeProto(
        dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=-1 if d is None else d)
             for d in dims]))


def _op_node(graph, name, op, device, dtype_attr, dtype, attrs, inputs=()):
    node = graph.node.add(name=name, op=op, device=device)
    node.input.extend(inputs)
    node.attr[dtype_attr].type = DTYPE_ENUMS[dtype]
    for k, v in attrs.items():
        node.attr[k].CopyFrom(_shape_attr(v) if k == "shape" else _attr(v))
    return node


def _task_device(task):
    return task.replace("/task:", "/replica:0/task:")


# When a recv starts. A recv has no data inputs, so TensorFlow starts every
# recv of a task as soon as the step begins, in the order of its own ready
# queue. In a chain of hops between two tasks (a pipeline's stages, a
# parameter server's pull after its push) that puts the start of all of a
# task's recvs, each a claim, a poll and a registered wait (2 to 10 us on a
# busy core), in front of the first answer, which often arrives while the
# recv that takes it is still queued behind the others (bench/p2p.py: with
# 32 recvs per task, the first two hops of a call took 195 to 340 us).
#
# A recv whose producer (on the other task) depends on data this task sends
# cannot complete before that send has written. Starting it after that send
# loses nothing and costs nothing: it is started by the thread that just
# finished the send, about when the answer can come, and one recv is in
# flight per pair instead of all of them. The control inputs cannot close a
# cycle: the send is an ancestor of the recv's producer, so it cannot depend
# on the recv's output. Only the latest such sends are kept (one that
# another such send waits for in turn adds nothing), so a chain gets one
# control input per recv. Cost of the analysis: one pass over the graph in
# topological order with a bit set of planned edges per node.
def _recv_start_after(analysis):
    """{edge key: [keys of the edges whose send the edge's recv waits for]}.

    For the recv of each planned edge: the planned edges sent from the
    recv's own task that the edge's producer depends on (through a consumer
    of theirs), minus those that another of them depends on.
    """
    view = analysis.view
    planned = analysis.planned
    bit_of = {e.key: 1 << i for i, e in enumerate(planned)}
    consumed = {}  # node -> bits of the planned edges it consumes
    for e in planned:
        for consumer, _ in e.consumers:
            consumed[consumer] = consumed.get(consumer, 0) | bit_of[e.key]
    # behind[n]: the planned edges some consumer of which is n or runs
    # before n (analyze() has already refused a graph with a cycle).
    behind = {}
    for n in topological_order(view):
        bits = consumed.get(n, 0)
        for inp in view.inputs[n]:
            bits |= behind[inp.producer]
        behind[n] = bits
    sent_from = {}  # task -> bits of the planned edges it sends
    for e in planned:
        sent_from[e.src] = sent_from.get(e.src, 0) | bit_of[e.key]
    after = {}
    for e in planned:
        before = behind[e.producer] & sent_from.get(e.dst, 0)
        later = 0  # what the sends in `before` wait for themselves
        for i in _bits(before):
            later |= behind[planned[i].producer]
        after[e.key] = [planned[i].key for i in _bits(before & ~later)]
    return after


def _bits(mask):
    """The positions of the set bits of ``mask``, lowest first."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


def rewrite_graph(analysis, timeout_ms=-1):
    """Returns a new GraphDef with every planned edge moved to tf_rdma ops.

    Args:
      analysis: An :class:`Analysis` from :func:`analyze`.
      timeout_ms: Per-op wait bound in ms, or -1 for TF_RDMA_TIMEOUT on the
        task that runs the op.
    """
    with _gc_paused():
        return _rewrite_graph(analysis, timeout_ms)


def _rewrite_graph(analysis, timeout_ms):
    plan = analysis.plan
    out = graph_pb2.GraphDef()
    out.CopyFrom(analysis.graph_def)
    # Only the nodes this function changes: pinned ones and consumers.
    wanted = {n for n, p in analysis.placements.items() if p.inferred}
    for edge in analysis.planned:
        wanted.update(c for c, _ in edge.consumers)
    wanted.update(c for c, _, _ in analysis.implied)
    nodes = {n.name: n for n in out.node if n.name in wanted}
    for name, placement in analysis.placements.items():
        if placement.inferred:
            nodes[name].device = placement.device
    used = {n.name for n in analysis.graph_def.node}

    def unique(base):
        base = _NODE_NAME_BAD.sub("_", base)
        candidate, i = base, 1
        while candidate in used:
            candidate, i = f"{base}_{i}", i + 1
        used.add(candidate)
        return candidate

    names = {}  # edge key -> (send node, recv node)
    for edge in analysis.planned:
        names[edge.key] = (unique(f"tf_rdma/send/{edge.key}"),
                           unique(f"tf_rdma/recv/{edge.key}"))
    start_after = _recv_start_after(analysis)
    for edge in analysis.planned:
        slot = plan.slot(edge.key)
        send_name, recv_name = names[edge.key]
        if edge.kind == CONTROL:
            # An empty constant, passed through an Identity that runs after
            # the producer: the control edge sits on the Identity, because
            # TensorFlow may evaluate (or fold) a Const ahead of its
            # control inputs.
            empty = unique(f"{send_name}/empty")
            const = out.node.add(name=empty, op="Const",
                                 device=_task_device(edge.src))
            const.attr["dtype"].type = types_pb2.DT_INT8
            const.attr["value"].tensor.CopyFrom(tensor_pb2.TensorProto(
                dtype=types_pb2.DT_INT8,
                tensor_shape=tensor_shape_pb2.TensorShapeProto(
                    dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=0)])))
            token = unique(f"{send_name}/token")
            after = out.node.add(name=token, op="Identity",
                                 device=_task_device(edge.src))
            after.input.extend([empty, "^" + edge.producer])
            after.attr["T"].type = types_pb2.DT_INT8
            send_input = token
        else:
            send_input = input_string(edge.producer, edge.index)
        _op_node(out, send_name, "TfRdmaSend", _task_device(edge.src), "T",
                 slot.dtype, plan.op_attrs(edge.key, "send", timeout_ms, match_calls=True),
                 [send_input])
        _op_node(out, recv_name, "TfRdmaRecv", _task_device(edge.dst),
                 "dtype", slot.dtype,
                 plan.op_attrs(edge.key, "recv", timeout_ms, match_calls=True),
                 ["^" + names[key][0] for key in start_after.get(edge.key, ())])
        replacement = input_string(recv_name, -1 if edge.kind == CONTROL else 0)
        for consumer, input_slot in edge.consumers:
            node = nodes[consumer]
            if node.input[input_slot] != input_string(edge.producer, edge.index) \
                    and not node.input[input_slot] == f"{edge.producer}:0":
                raise PlanError(
                    f"internal error: input {input_slot} of {consumer!r} is "
                    f"{node.input[input_slot]!r}, expected {edge.tensor!r}")
            node.input[input_slot] = replacement
    # Control inputs another input implies are dropped (last, and from the
    # back, so that the slots above still pointed at the inputs they name).
    dropped = {}
    for consumer, producer, _ in analysis.implied:
        for inp in analysis.view.inputs[consumer]:
            if inp.is_control and inp.producer == producer:
                dropped.setdefault(consumer, []).append(inp.slot)
    for consumer, slots in dropped.items():
        for input_slot in sorted(slots, reverse=True):
            del nodes[consumer].input[input_slot]
    return out
