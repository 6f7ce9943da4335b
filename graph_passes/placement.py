"""Device resolution: which task runs every node of a function's graph.

Transfers are edges between tasks, so before anything else every node needs
a task, including the many nodes the user never placed. TensorFlow decides
those in its placer, at run time and out of our reach; this pass makes the
same decisions on the GraphDef, with the placer's rules in the placer's
order, and the rewrite then pins each node to the task chosen here, so the
plan and the placement cannot disagree:

1. Colocation groups (union-find, as TensorFlow's ColocationGraph): a node
   that takes a resource (or a reference) input joins the group of the node
   that produced it, because a variable's ops must run where the variable
   lives; a ``_class`` attr ``loc:@other`` joins ``other``'s group. Calls of
   functions and functional control flow are exempt, as in TensorFlow: they
   may take resources from any task.
2. A group's task comes from, in order: an argument with a known device
   (a captured variable handle, an input tensor), a node placed by the user,
   or nothing yet. Within a group an argument overrides what the user asked
   for, which is what TensorFlow's soft placement (on by default in TF2) does.
3. Nodes still without a task, in topological order: metadata ops (``Shape``,
   ``Size``, ``Rank``, ``ShapeN``) go with their first input if it is placed
   already (the placer's "heuristic B"); everything else goes to the
   caller's device.
4. Then "generators" (no data inputs, one output, e.g. a ``Const``) whose
   consumers all ended up on one task move to that task (the placer's
   "heuristic A"), so a constant is not shipped across the network every step.
   A device that names no task (``/device:CPU:0``, which a
   ParameterServerStrategy step gives every op it makes) does not hold a
   generator back, as it does not in TensorFlow's placer.

Only tasks matter here (job and task index); a node's device type part
(``/device:GPU:0``) is kept as the user wrote it.

Cost: near-linear in nodes + edges (union-find with path halving, one
topological sort).
"""

import collections
import dataclasses

from tensorflow.core.framework import types_pb2

from tf_rdma.errors import PlanError
from tf_rdma.graph_passes.graph import FUNCTIONAL_OPS, pin_to_task, task_of

DEFAULT_CALLER_DEVICE = "/job:localhost/replica:0/task:0"
METADATA_OPS = frozenset(("Shape", "ShapeN", "Size", "Rank"))


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where one node runs.

    Attributes:
      task: ``"/job:J/task:T"``.
      device: The device string the rewritten graph gives the node (the
        user's device type part kept).
      inferred: False when the user placed the node on exactly this task.
      reason: Why the node is there, for ``explain()`` and ``inspect``.
    """

    task: str
    device: str
    inferred: bool
    reason: str


class _Groups:
    """Union-find over node names."""

    def __init__(self, names):
        self.parent = {n: n for n in names}

    def find(self, n):
        while self.parent[n] != n:
            self.parent[n] = self.parent[self.parent[n]]
            n = self.parent[n]
        return n

    def union(self, a, b):
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[max(ra, rb)] = min(ra, rb)


def _colocation_targets(node):
    attr = node.attr.get("_class")
    if attr is None:
        return []
    return [s.decode("utf-8", "replace")[len("loc:@"):]
            for s in attr.list.s if s.startswith(b"loc:@")]


def topological_order(view):
    """The nodes of ``view``, each after all of its inputs.

    Raises:
      PlanError: If the graph has a cycle.
    """
    indegree = {n: 0 for n in view.nodes}
    for name, inputs in view.inputs.items():
        indegree[name] = len(inputs)
    ready = collections.deque(n for n in view.nodes if indegree[n] == 0)
    order = []
    while ready:
        n = ready.popleft()
        order.append(n)
        for consumer, _ in view.consumers[n]:
            indegree[consumer] -= 1
            if indegree[consumer] == 0:
                ready.append(consumer)
    if len(order) != len(view.nodes):
        stuck = sorted(n for n, d in indegree.items() if d > 0)[:5]
        raise PlanError(
            f"graph has a cycle through {stuck!r}; the top level of a "
            f"tf.function graph must be acyclic (loops are While ops)")
    return order


def resolve_devices(view, caller_device=DEFAULT_CALLER_DEVICE,
                    arg_devices=None):
    """Returns ``{node name: Placement}`` for every node of ``view``.

    Args:
      view: A :class:`~tf_rdma.graph_passes.graph.GraphView`.
      caller_device: The device the function is called on; nodes nobody
        placed run there, like the function's arguments and results.
      arg_devices: ``{placeholder name: device}`` for arguments whose device
        is known (e.g. captured variable handles live with their variable);
        other placeholders are on ``caller_device``.

    Raises:
      PlanError: If ``caller_device`` or an argument device names no task,
        or the graph has a cycle.
    """
    caller_task = task_of(caller_device)
    if caller_task is None:
        raise PlanError(
            f"caller device {caller_device!r} names no job; expected e.g. "
            f"{DEFAULT_CALLER_DEVICE!r}")
    arg_devices = dict(arg_devices or {})
    for name, device in arg_devices.items():
        if task_of(device) is None:
            raise PlanError(
                f"argument {name!r} has device {device!r}, which names no "
                f"job; expected e.g. '/job:ps/replica:0/task:0/device:CPU:0'")

    groups = _Groups(view.nodes)
    resource_of = {}  # Node -> the producer whose resource pins it.
    for name, node in view.nodes.items():
        if node.op not in FUNCTIONAL_OPS and not view.is_function_call(name):
            for inp in view.inputs[name]:
                if inp.is_control:
                    continue
                types = view.output_types(inp.producer)
                if inp.index < len(types) and (
                        types[inp.index] == types_pb2.DT_RESOURCE
                        or types[inp.index] > 100):
                    groups.union(name, inp.producer)
                    resource_of.setdefault(name, inp.producer)
        for target in _colocation_targets(node):
            if target in view.nodes:
                groups.union(name, target)

    # The task of each group, and the member that decided it.
    members = collections.defaultdict(list)
    for name in sorted(view.nodes):
        members[groups.find(name)].append(name)
    group_task = {}
    for root, names in members.items():
        decided = None
        for name in names:
            if view.nodes[name].op == "Placeholder":
                device = arg_devices.get(name)
                if device is not None:
                    decided = (task_of(device), name, "argument")
                    break
        if decided is None:
            for name in names:
                task = task_of(view.nodes[name].device)
                if task is not None:
                    decided = (task, name, "user")
                    break
        if decided is not None:
            group_task[root] = decided

    placements = {}

    def place(name, task, reason):
        node = view.nodes[name]
        inferred = task_of(node.device) != task
        placements[name] = Placement(task, pin_to_task(node.device, task),
                                     inferred, reason)

    generators = []
    for name in topological_order(view):
        node = view.nodes[name]
        root = groups.find(name)
        if root in group_task:
            task, decider, how = group_task[root]
            if decider == name:
                reason = ("placed by the user" if how == "user" else
                          "argument with a known device")
            elif name in resource_of:
                reason = f"colocated with its resource {resource_of[name]!r}"
            else:
                reason = f"colocated with {decider!r}"
            place(name, task, reason)
            continue
        if len(members[root]) == 1 and _is_generator(view, name):
            generators.append(name)
            continue
        data_inputs = [i for i in view.inputs[name] if not i.is_control]
        if (node.op in METADATA_OPS and data_inputs
                and data_inputs[0].producer in placements):
            source = data_inputs[0].producer
            place(name, placements[source].task,
                  f"metadata op, placed with its input {source!r}")
        elif node.op == "Placeholder":
            place(name, caller_task, "argument, on the caller's device")
        else:
            place(name, caller_task, "not placed; the caller's device")
        if len(members[root]) > 1:
            # The rest of the group follows the first member placed.
            group_task[root] = (placements[name].task, name, "group")
    for name in reversed(generators):
        consumers = {placements[c].task for c, _ in view.consumers[name]
                     if c in placements}
        if len(consumers) == 1:
            place(name, consumers.pop(),
                  "generator, placed with its consumers")
        else:
            place(name, caller_task, "not placed; the caller's device")
    return placements


def _is_generator(view, name):
    node = view.nodes[name]
    if node.op == "Placeholder" or task_of(node.device) is not None:
        return False
    if any(not i.is_control for i in view.inputs[name]):
        return False
    types = view.output_types(name)
    return len(types) == 1 and types[0] < 100 and bool(view.consumers[name])
