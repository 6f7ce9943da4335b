"""Read-only views of a TensorFlow GraphDef for the graph passes.

A GraphDef names edges as strings on the consumer: ``"producer"`` (output 0),
``"producer:3"`` (output 3) or ``"^producer"`` (a control edge). Output
dtypes are not stored on the node: they follow from the op's registered
OpDef (or, for a call of a library function, from the function's signature)
and the node's attrs. Output shapes are stored only when the graph was
exported with ``add_shapes=True`` (the ``_output_shapes`` attr); without
them every shape is unknown. This module turns all of that into plain Python
values so that the passes above it never parse strings or protos.

It imports TensorFlow's protos and op registry, never the tf_rdma engine.
"""

import dataclasses
import re

from tensorflow.core.framework import types_pb2
from tensorflow.python.framework import op_def_registry

from tf_rdma.errors import PlanError

# Ops that call a function from the library, and the attrs naming it.
CALL_OPS = frozenset(("PartitionedCall", "StatefulPartitionedCall"))
FUNCTIONAL_OPS = frozenset((
    "PartitionedCall", "StatefulPartitionedCall", "If", "StatelessIf",
    "While", "StatelessWhile", "Case", "StatelessCase"))
# TensorFlow 1 control flow: its edges carry frames and dead tensors, which a
# static per-step slot cannot represent.
V1_CONTROL_FLOW_OPS = frozenset((
    "Switch", "RefSwitch", "Merge", "RefMerge", "Enter", "RefEnter", "Exit",
    "RefExit", "NextIteration", "RefNextIteration", "LoopCond"))

_DTYPE_NAMES = {
    types_pb2.DT_HALF: "float16", types_pb2.DT_BFLOAT16: "bfloat16",
    types_pb2.DT_FLOAT: "float32", types_pb2.DT_DOUBLE: "float64",
    types_pb2.DT_INT8: "int8", types_pb2.DT_INT16: "int16",
    types_pb2.DT_INT32: "int32", types_pb2.DT_INT64: "int64",
    types_pb2.DT_UINT8: "uint8", types_pb2.DT_UINT16: "uint16",
    types_pb2.DT_UINT32: "uint32", types_pb2.DT_UINT64: "uint64",
    types_pb2.DT_BOOL: "bool", types_pb2.DT_COMPLEX64: "complex64",
    types_pb2.DT_COMPLEX128: "complex128", types_pb2.DT_STRING: "string",
    types_pb2.DT_RESOURCE: "resource", types_pb2.DT_VARIANT: "variant",
}
DTYPE_ENUMS = {name: enum for enum, name in _DTYPE_NAMES.items()}

_DEVICE_TASK_RE = re.compile(
    r"/job:(?P<job>[^/]+)(?:/replica:(?P<replica>\d+))?(?:/task:(?P<task>\d+))?")


def dtype_name(enum):
    """Returns a readable name for a DataType enum value ("float32", ...)."""
    if enum in _DTYPE_NAMES:
        return _DTYPE_NAMES[enum]
    if enum > 100:  # Reference types: DT_FLOAT_REF = DT_FLOAT + 100.
        return dtype_name(enum - 100) + "_ref"
    return types_pb2.DataType.Name(enum)[3:].lower()


def task_of(device):
    """Returns ``"/job:J/task:T"`` for a device string that names a job.

    ``"/job:worker/replica:0/task:1/device:CPU:0"`` and ``"/job:worker/task:1"``
    give ``"/job:worker/task:1"``; a device with a job but no task means task 0
    (TensorFlow's default). A device without a job (``""``, ``"/device:GPU:0"``)
    gives None: such a node runs where the caller's default device says.
    """
    m = _DEVICE_TASK_RE.search(device or "")
    if m is None:
        return None
    return f"/job:{m.group('job')}/task:{int(m.group('task') or 0)}"


def pin_to_task(device, task):
    """Returns ``device`` with its job/replica/task set to ``task``.

    The device type part (``/device:GPU:0``) of ``device`` is kept, so a node
    the user put on a GPU of an unnamed task stays on a GPU.
    """
    job_part = task.replace("/task:", "/replica:0/task:")
    rest = _DEVICE_TASK_RE.sub("", device or "")
    rest = re.sub(r"^(/replica:\d+)?(/task:\d+)?", "", rest)
    return job_part + rest


@dataclasses.dataclass(frozen=True)
class Input:
    """One input of a node: a data edge (``index >= 0``) or a control edge."""

    producer: str
    index: int  # -1 for a control edge.
    slot: int  # Position among the consumer's inputs.

    @property
    def is_control(self):
        return self.index < 0

    @property
    def tensor(self):
        return f"{self.producer}:{self.index}"


def parse_input(text, slot):
    """Parses one GraphDef input string into an :class:`Input`."""
    if text.startswith("^"):
        return Input(text[1:], -1, slot)
    name, sep, index = text.rpartition(":")
    if sep and index.isdigit():
        return Input(name, int(index), slot)
    return Input(text, 0, slot)


def input_string(producer, index):
    """The GraphDef spelling of output ``index`` of ``producer``."""
    if index < 0:
        return "^" + producer
    return producer if index == 0 else f"{producer}:{index}"


class GraphView:
    """Index of a GraphDef: nodes by name, consumers, output dtypes and shapes.

    Args:
      graph_def: A ``tf.compat.v1.GraphDef`` (top level; the function library
        is read for call signatures and bodies).

    Raises:
      PlanError: If two nodes share a name or an input names no node.
    """

    def __init__(self, graph_def):
        self.graph_def = graph_def
        self.nodes = {}
        for node in graph_def.node:
            if node.name in self.nodes:
                raise PlanError(f"graph has two nodes named {node.name!r}")
            self.nodes[node.name] = node
        self.functions = {f.signature.name: f for f in graph_def.library.function}
        self.inputs = {}
        self.consumers = {name: [] for name in self.nodes}
        for node in graph_def.node:
            parsed = [parse_input(t, i) for i, t in enumerate(node.input)]
            for inp in parsed:
                if inp.producer not in self.nodes:
                    raise PlanError(
                        f"node {node.name!r} has input {node.input[inp.slot]!r}, "
                        f"but the graph has no node {inp.producer!r}")
                self.consumers[inp.producer].append((node.name, inp))
            self.inputs[node.name] = parsed
        self._types = {}

    def output_types(self, name):
        """Returns the output dtype enums of node ``name`` (empty if unknown)."""
        if name not in self._types:
            self._types[name] = _output_types(self.nodes[name], self.functions)
        return self._types[name]

    def output_dtype(self, name, index):
        """Returns the dtype name of output ``index`` of ``name``, or None."""
        types = self.output_types(name)
        return dtype_name(types[index]) if index < len(types) else None

    def output_shape(self, name, index):
        """Returns output ``index``'s shape as a tuple (None = unknown dim), or
        None when the rank is unknown or the graph carries no shapes."""
        attr = self.nodes[name].attr.get("_output_shapes")
        if attr is None or index >= len(attr.list.shape):
            return None
        proto = attr.list.shape[index]
        if proto.unknown_rank:
            return None
        return tuple(d.size if d.size >= 0 else None for d in proto.dim)

    def called_functions(self, name):
        """Names of the library functions node ``name`` calls, directly or not."""
        seen = []
        stack = list(_callees(self.nodes[name], self.functions))
        while stack:
            fname = stack.pop()
            if fname in seen:
                continue
            seen.append(fname)
            for body_node in self.functions[fname].node_def:
                stack.extend(_callees(body_node, self.functions))
        return seen

    def is_function_call(self, name):
        node = self.nodes[name]
        return node.op in FUNCTIONAL_OPS or node.op in self.functions


def _callees(node, functions):
    """Library functions that ``node`` calls itself (not through its callees)."""
    if node.op in functions:
        yield node.op
    for value in node.attr.values():
        if value.HasField("func"):
            if value.func.name in functions:
                yield value.func.name
        elif value.HasField("list"):
            for f in value.list.func:
                if f.name in functions:
                    yield f.name


def _output_types(node, functions):
    if node.op in functions:
        return [a.type for a in functions[node.op].signature.output_arg]
    op_def = op_def_registry.get(node.op)
    if op_def is None:
        return []
    types = []
    for arg in op_def.output_arg:
        if arg.type_list_attr:
            types.extend(node.attr[arg.type_list_attr].list.type)
            continue
        if arg.type_attr:
            t = node.attr[arg.type_attr].type
        else:
            t = arg.type
        count = node.attr[arg.number_attr].i if arg.number_attr else 1
        if arg.is_ref:
            t += 100
        types.extend([t] * count)
    return types
