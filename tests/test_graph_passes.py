"""The graph passes on real and hand-written GraphDefs (no cluster).

Graphs come from tracing small tf.functions with tf.device placements
(tracing needs no cluster: a device string is only a string until the
function runs) or from GraphDef protos written by hand. Each test runs
``analyze`` and/or ``rewrite_graph`` and checks the placements, the edges
and the rewritten graph against values worked out by hand.
"""

import pytest
import tensorflow as tf
from tensorflow.core.framework import graph_pb2

import tf_rdma.ops  # noqa: F401  (registers TfRdmaSend / TfRdmaRecv for import)
from tf_rdma.errors import PlanError
from tf_rdma.graph_passes import rewrite as rw
from tf_rdma.graph_passes.graph import GraphView, parse_input, task_of
from tf_rdma.graph_passes.transfers import (
    CONTROL, DYNAMIC, KEPT, STATIC)

pytestmark = pytest.mark.fast  # in `make test-fast`: no processes, no sockets

W0 = "/job:worker/task:0"
W1 = "/job:worker/task:1"
W2 = "/job:worker/task:2"
PS = "/job:ps/task:0"
PS_DEVICE = "/job:ps/replica:0/task:0/device:CPU:0"
CLIENT = "/job:localhost/task:0"


# --- Helpers. ----------------------------------------------------------------


def trace(fn, *specs):
    """Traces ``fn`` and returns (concrete function, GraphDef with shapes)."""
    concrete = fn.get_concrete_function(*specs)
    return concrete, concrete.graph.as_graph_def(add_shapes=True)


def capture_devices(concrete, device=PS_DEVICE):
    """{captured placeholder: device}, as the decorator passes arg_devices.

    Variables here live on the local CPU (there is no cluster); the test
    says where they would live, as a captured handle's device would.
    """
    return {p.op.name: device for p in concrete.graph.internal_captures}


def edge(analysis, key):
    found = [e for e in analysis.edges if e.key == key]
    assert found, f"no edge {key!r}; edges: {[e.key for e in analysis.edges]}"
    return found[0]


def node_def(name, op, inputs=(), device="", dtype=None, attrs=None):
    from tensorflow.core.framework import attr_value_pb2, types_pb2
    node = graph_pb2.GraphDef().node.add(name=name, op=op, device=device)
    node.input.extend(inputs)
    if dtype is not None:
        node.attr["T" if op != "Const" else "dtype"].type = dtype
    if op == "Const":
        node.attr["value"].tensor.dtype = dtype or types_pb2.DT_FLOAT
        node.attr["value"].tensor.float_val.append(1.0)
        node.attr["value"].tensor.dtype = types_pb2.DT_FLOAT
    for k, v in (attrs or {}).items():
        node.attr[k].CopyFrom(attr_value_pb2.AttrValue(**v))
    return node


def graph_def(*nodes):
    g = graph_pb2.GraphDef()
    for n in nodes:
        g.node.add().CopyFrom(n)
    return g


def float_const(name, device=""):
    from tensorflow.core.framework import types_pb2
    return node_def(name, "Const", device=device, dtype=types_pb2.DT_FLOAT)


def binary(name, op, a, b, device=""):
    from tensorflow.core.framework import types_pb2
    return node_def(name, op, [a, b], device=device, dtype=types_pb2.DT_FLOAT)


def identity(name, a, device=""):
    from tensorflow.core.framework import types_pb2
    return node_def(name, "Identity", [a], device=device,
                    dtype=types_pb2.DT_FLOAT)


def two_worker_fn(names):
    """a = x * 2 on worker 0; b = a + 1 and c = a * 3 on worker 1."""

    @tf.function
    def f(x):
        with tf.device(W0):
            a = x * 2.0
        with tf.device(W1):
            b = a + 1.0
            c = a * 3.0
        names.update(a=a.op.name, b=b.op.name, c=c.op.name)
        return b, c

    return f


SPEC3 = tf.TensorSpec([4, 3], tf.float32)


# --- Device resolution. --------------------------------------------------------


def test_explicit_device_is_kept_and_not_inferred():
    names = {}
    _, gd = trace(two_worker_fn(names), SPEC3)
    a = rw.analyze(gd)
    pa = a.placements[names["a"]]
    assert (pa.task, pa.inferred, pa.reason) == (W0, False, "placed by the user")
    assert task_of(pa.device) == W0
    for n in ("b", "c"):
        assert a.placements[names[n]].task == W1
        assert not a.placements[names[n]].inferred
    # The argument and the outputs nobody placed run on the caller.
    px = a.placements["x"]
    assert (px.task, px.inferred) == (CLIENT, True)
    assert px.reason == "argument, on the caller's device"


def test_resource_ops_follow_their_variable_not_the_user():
    v = tf.Variable(tf.ones([4, 3]))
    names = {}

    @tf.function
    def step(x):
        with tf.device(W1):  # The user asks for worker 1 ...
            g = x * 0.5
            v.assign_sub(g)
            y = v.read_value() + 1.0
        names.update(g=g.op.name, y=y.op.name)
        return y

    concrete, gd = trace(step, SPEC3)
    args = capture_devices(concrete)
    (handle,) = args
    a = rw.analyze(gd, arg_devices=args)
    # ... but the variable lives on the ps: its ops run there.
    ph = a.placements[handle]
    assert (ph.task, ph.inferred, ph.reason) == (
        PS, True, "argument with a known device")
    ops = {n.op: n for n in gd.node}
    for op in ("AssignSubVariableOp", "ReadVariableOp"):
        name = ops[op].name
        assert task_of(ops[op].device) == W1
        p = a.placements[name]
        assert (p.task, p.inferred) == (PS, True), (op, p)
        assert p.reason == f"colocated with its resource {handle!r}"
        assert task_of(p.device) == PS
    assert a.placements[names["g"]].task == W1
    assert a.placements[names["y"]].task == W1
    # The gradient goes to the ps, the value read comes back: both planned.
    assert edge(a, f"{names['g']}:0>ps:0").kind == STATIC
    read = ops["ReadVariableOp"].name
    assert edge(a, f"{read}:0>worker:1").kind == STATIC
    # The resource handle itself never crosses.
    assert not [e for e in a.edges if e.dtype == "resource"]


def test_without_arg_devices_the_variable_is_on_the_user_device():
    v = tf.Variable(tf.ones([3]))

    @tf.function
    def f():
        with tf.device(W1):
            return v.read_value() * 2.0

    concrete, gd = trace(f)
    a = rw.analyze(gd)
    (handle,) = capture_devices(concrete)
    # No device known for the handle: its group follows the user's request.
    assert a.placements[handle].task == W1


def test_class_attr_colocates():
    from tensorflow.core.framework import attr_value_pb2
    gd = graph_def(
        float_const("c0", device=W0),
        identity("a", "c0", device=W0),
        identity("b", "a"),
        binary("d", "Mul", "b", "b", device=W1),
    )
    b = [n for n in gd.node if n.name == "b"][0]
    b.attr["_class"].CopyFrom(attr_value_pb2.AttrValue(
        list=attr_value_pb2.AttrValue.ListValue(s=[b"loc:@a"])))
    a = rw.analyze(gd)
    pb = a.placements["b"]
    assert (pb.task, pb.inferred, pb.reason) == (W0, True, "colocated with 'a'")
    # Without the attr, b would have run on the caller.
    del b.attr["_class"]
    assert rw.analyze(gd).placements["b"].task == CLIENT


def test_metadata_ops_go_with_their_input():
    names = {}

    @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.float32)])
    def f(x):
        with tf.device(W0):
            a = x * 2.0
        s = tf.shape(a)  # Unknown batch: a real Shape op, nobody placed it.
        n = tf.size(a)
        with tf.device(W1):
            y = tf.cast(s, tf.float32) + tf.cast(n, tf.float32)
        names.update(a=a.op.name, s=s.op.name, n=n.op.name)
        return y

    _, gd = trace(f)
    ops = {n.name: n.op for n in gd.node}
    assert ops[names["s"]] == "Shape" and ops[names["n"]] == "Size"
    a = rw.analyze(gd)
    for n in ("s", "n"):
        p = a.placements[names[n]]
        assert (p.task, p.inferred) == (W0, True)
        assert p.reason == f"metadata op, placed with its input {names['a']!r}"
    # The shape (int32 [2]) and the size (int32 []) then go to worker 1.
    e = edge(a, f"{names['s']}:0>worker:1")
    assert (e.kind, e.dtype, e.shape, e.nbytes) == (STATIC, "int32", (2,), 8)
    e = edge(a, f"{names['n']}:0>worker:1")
    assert (e.kind, e.dtype, e.shape, e.nbytes) == (STATIC, "int32", (), 4)
    # a itself has an unknown batch dimension: it crosses nowhere.
    assert not [e for e in a.edges if e.producer == names["a"]]


def test_metadata_op_of_an_unplaced_generator():
    # Shape of a Const nobody placed: the Const is a generator (placed last,
    # with its consumers), the Shape a metadata op (placed with its input).
    gd = graph_def(
        float_const("c"),
        node_def("s", "Shape", ["c"], attrs={"T": {"type": 1},
                                             "out_type": {"type": 3}}),
        node_def("y", "Cast", ["s"], device=W1,
                 attrs={"SrcT": {"type": 3}, "DstT": {"type": 1}}),
    )
    a = rw.analyze(gd)
    # Shape and its input run on one task (here the caller's: the Const
    # follows its only consumer, the Shape, which nobody placed).
    assert a.placements["s"].task == a.placements["c"].task == CLIENT
    assert edge(a, "s:0>worker:1").kind == KEPT
    check_rewrite(a, rw.rewrite_graph(a))


def test_const_generators_move_to_their_consumers():
    names = {}

    @tf.function
    def f(x):
        k1 = tf.constant([1.0, 2.0, 3.0])  # Used on worker 1 only.
        k2 = tf.constant([4.0, 5.0, 6.0])  # Used on worker 0 and worker 1.
        with tf.device(W0):
            a = x * k2
        with tf.device(W1):
            b = a + k1
            c = b * k2
        names.update(k1=k1.op.name, k2=k2.op.name)
        return c

    _, gd = trace(f, tf.TensorSpec([3], tf.float32))
    devices = {n.name: n.device for n in gd.node}
    assert devices[names["k1"]] == devices[names["k2"]] == ""
    a = rw.analyze(gd)
    p1 = a.placements[names["k1"]]
    assert (p1.task, p1.inferred, p1.reason) == (
        W1, True, "generator, placed with its consumers")
    # Consumers on two tasks: the caller's device, as TensorFlow's placer.
    p2 = a.placements[names["k2"]]
    assert (p2.task, p2.reason) == (CLIENT, "not placed; the caller's device")
    # No constant crosses between the workers every step.
    assert not [e for e in a.edges
                if e.producer == names["k1"] and e.kind == STATIC]


def test_unplaced_nodes_go_to_the_caller_device():
    @tf.function
    def f(x):
        return x * 2.0 + 1.0

    _, gd = trace(f, SPEC3)
    for caller, task in ((rw.DEFAULT_CALLER_DEVICE, CLIENT),
                         ("/job:worker/replica:0/task:1/device:CPU:0", W1)):
        a = rw.analyze(gd, caller_device=caller)
        assert a.caller_task == task
        assert {p.task for p in a.placements.values()} == {task}
        assert all(p.inferred for p in a.placements.values())
        reasons = {n: p.reason for n, p in a.placements.items()}
        assert reasons["x"] == "argument, on the caller's device"
        assert reasons["mul"] == "not placed; the caller's device"
        assert a.edges == ()
        assert a.plan.transfers == ()


def test_device_type_part_is_kept_when_pinning():
    gd = graph_def(
        float_const("c", device=W0),
        identity("a", "c", device="/device:GPU:0"),
        identity("b", "a", device=W1 + "/device:CPU:0"),
    )
    a = rw.analyze(gd, caller_device="/job:worker/replica:0/task:2")
    assert a.placements["a"].device == "/job:worker/replica:0/task:2/device:GPU:0"
    assert a.placements["a"].task == W2


@pytest.mark.parametrize("kwargs, named", [
    (dict(caller_device="/device:CPU:0"), "'/device:CPU:0'"),
    (dict(arg_devices={"x": "/device:CPU:0"}), "'x'"),
])
def test_bad_devices_raise_plan_error(kwargs, named):
    names = {}
    _, gd = trace(two_worker_fn(names), SPEC3)
    with pytest.raises(PlanError, match=named.replace("/", ".")) as info:
        rw.analyze(gd, **kwargs)
    assert "names no job" in str(info.value)


# --- Transfer discovery. -------------------------------------------------------


def test_one_transfer_per_tensor_and_destination():
    names = {}
    _, gd = trace(two_worker_fn(names), SPEC3)
    a = rw.analyze(gd)
    e = edge(a, f"{names['a']}:0>worker:1")
    assert (e.src, e.dst, e.kind, e.dtype, e.shape, e.nbytes) == (
        W0, W1, STATIC, "float32", (4, 3), 48)
    assert [c for c, _ in e.consumers] == sorted([names["b"], names["c"]])
    assert [t.key for t in a.plan.transfers] == [e.key]
    assert a.plan.transfers[0].shape == (4, 3)


def test_two_destinations_two_transfers():
    names = {}

    @tf.function
    def f(x):
        with tf.device(W0):
            a = x * 2.0
        with tf.device(W1):
            b = a + 1.0
        with tf.device(W2):
            c = a - 1.0
            d = a * a
        names.update(a=a.op.name, c=c.op.name, d=d.op.name)
        return b, c, d

    _, gd = trace(f, SPEC3)
    a = rw.analyze(gd)
    keys = sorted(e.key for e in a.planned)
    assert keys == [f"{names['a']}:0>worker:1", f"{names['a']}:0>worker:2"]
    e2 = edge(a, f"{names['a']}:0>worker:2")
    # d reads a twice: both inputs are consumers of the one transfer.
    assert e2.consumers == tuple(sorted(
        [(names["c"], 0), (names["d"], 0), (names["d"], 1)]))
    assert {r.dst for r in a.plan.regions} == {W1, W2}


def test_control_edge_across_tasks_is_a_zero_byte_transfer():
    names = {}

    @tf.function
    def f(x):
        with tf.device(W0):
            a = x * 2.0
        with tf.device(W1):
            with tf.control_dependencies([a]):
                b = tf.identity(x) + 1.0
        names.update(a=a.op.name, b=b.op.name)
        return a, b

    _, gd = trace(f, SPEC3)
    a = rw.analyze(gd)
    controls = a.edges_of_kind(CONTROL)
    assert len(controls) == 1, a.summary()
    e = controls[0]
    assert e.key == f"^{names['a']}>worker:1"
    assert (e.index, e.src, e.dst, e.nbytes, e.dtype, e.shape) == (
        -1, W0, W1, 0, None, None)
    assert e.tensor == f"^{names['a']}"
    t = a.plan.slot(e.key)
    assert (t.dtype, t.shape, t.nbytes) == ("int8", (0,), 0)


def test_a_parameter_server_step_moves_no_constant_and_no_implied_control():
    # The shape of a ParameterServerStrategy step: every op made under
    # /device:CPU:0 (no task), the variable on the ps, its read and update
    # there, the step's compute on the worker that calls it.
    v = tf.Variable(tf.ones([4, 3]))
    names = {}

    @tf.function
    def f(x):
        with tf.device("/device:CPU:0"):
            w = v.read_value()
            g = x * w
            alpha = tf.constant(0.1)
            update = tf.raw_ops.ResourceApplyGradientDescent(
                var=v.handle, alpha=alpha, delta=g)
        names.update(alpha=alpha.op.name, update=update.name)
        return g

    concrete, gd = trace(f, SPEC3)
    (names["read"],) = [n.name for n in gd.node if n.op == "ReadVariableOp"]
    a = rw.analyze(gd, caller_device=W0, client_device=CLIENT,
                   arg_devices=capture_devices(concrete))
    # The learning rate is made where its only consumer runs, as
    # TensorFlow's placer makes it: it does not cross every step.
    p = a.placements[names["alpha"]]
    assert (p.task, p.reason) == (PS, "generator, placed with its consumers")
    assert not [e for e in a.edges if e.producer == names["alpha"]]
    # The function's outputs wait for the read and for the update; the
    # update waits for the read itself, so only the update's control edge
    # crosses.
    implied = {(c, p): o for c, p, o in a.implied}
    assert any(p == names["read"] and o == names["update"]
               for (c, p), o in implied.items()), a.implied
    controls = [e.producer for e in a.edges_of_kind(CONTROL)]
    assert names["update"] in controls and names["read"] not in controls, (
        controls)
    check_rewrite(a, rw.rewrite_graph(a))


def test_strings_are_kept_with_a_reason():
    names = {}

    @tf.function
    def f(x):
        with tf.device(W0):
            s = tf.strings.as_string(x)
        with tf.device(W1):
            n = tf.strings.length(s)
        names.update(s=s.op.name)
        return n

    _, gd = trace(f, SPEC3)
    a = rw.analyze(gd)
    e = edge(a, f"{names['s']}:0>worker:1")
    assert (e.kind, e.dtype, e.nbytes) == (KEPT, "string", None)
    assert e.reason == "string tensors are not memcpy-able"
    assert a.plan.transfers == ()
    assert e.key in a.summary() and e.reason in a.summary()


def test_resource_into_a_call_on_another_task_is_kept():
    v = tf.Variable(tf.ones([3]))
    names = {}

    @tf.function
    def inner(x):
        return v.read_value() * x

    @tf.function
    def f(x):
        with tf.device(W1):
            y = inner(x)
        names.update(y=y.op.name)
        return y

    concrete, gd = trace(f, tf.TensorSpec([3], tf.float32))
    args = capture_devices(concrete)
    (handle,) = args
    a = rw.analyze(gd, arg_devices=args)
    call = names["y"]
    call = [n for n in gd.node if n.name == call][0]
    if call.op == "Identity":  # tf.function's output identity of the call.
        call = [n for n in gd.node if n.name == parse_input(
            call.input[0], 0).producer][0]
    assert call.op in ("StatefulPartitionedCall", "PartitionedCall")
    # The call is exempt from resource colocation: it stays where asked.
    assert a.placements[call.name].task == W1
    e = edge(a, f"{handle}:0>worker:1")
    assert (e.kind, e.dtype) == (KEPT, "resource")
    assert "takes the resource" in e.reason and handle in e.reason


def test_edges_of_the_client_are_kept():
    names = {}
    _, gd = trace(two_worker_fn(names), SPEC3)
    a = rw.analyze(gd)
    kept = a.edges_of_kind(KEPT)
    assert {e.key for e in kept} == {
        "x:0>worker:0", f"{names['b']}:0>localhost:0",
        f"{names['c']}:0>localhost:0"}
    for e in kept:
        assert e.reason == f"{CLIENT} has no tf_rdma endpoint"
    # With explicit endpoint tasks, a task outside them is kept the same way.
    a = rw.analyze(gd, endpoint_tasks=[W1, CLIENT])
    e = edge(a, f"{names['a']}:0>worker:1")
    assert (e.kind, e.reason) == (KEPT, f"{W0} has no tf_rdma endpoint")
    a = rw.analyze(gd, endpoint_tasks=[W0, W1])
    assert edge(a, f"{names['a']}:0>worker:1").kind == STATIC


@pytest.mark.parametrize("form", ["worker:{}", "job:worker/task:{}",
                                  "/job:worker/replica:0/task:{}/device:CPU:0"])
def test_endpoint_tasks_accept_every_task_form(form):
    # decorator.py documents endpoint_tasks=["worker:0", "ps:0"].
    names = {}
    _, gd = trace(two_worker_fn(names), SPEC3)
    a = rw.analyze(gd, endpoint_tasks=[form.format(0), form.format(1)])
    e = edge(a, f"{names['a']}:0>worker:1")
    assert (e.kind, e.reason) == (STATIC, "")


def test_unknown_dims_are_dynamic():
    names = {}

    @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.float32)])
    def f(x):
        with tf.device(W0):
            a = x * 2.0
            r = tf.reduce_sum(a, axis=0)
        with tf.device(W1):
            b = a + 1.0
            c = r * 2.0
        names.update(a=a.op.name, r=r.op.name)
        return b, c

    _, gd = trace(f)
    a = rw.analyze(gd)
    e = edge(a, f"{names['a']}:0>worker:1")
    assert (e.kind, e.shape, e.nbytes) == (DYNAMIC, (None, 3), None)
    assert e.reason == "shape [None, 3] not fully known at trace time"
    # The reduction over the batch has a static shape again.
    assert edge(a, f"{names['r']}:0>worker:1").kind == STATIC
    # Both are planned; the dynamic one as a dynamic transfer.
    transfers = {t.key: t for t in a.plan.transfers}
    assert set(transfers) == {e.key, f"{names['r']}:0>worker:1"}
    t = transfers[e.key]
    assert (t.dynamic, t.shape, t.nbytes) == (True, (None, 3), None)
    assert not transfers[f"{names['r']}:0>worker:1"].dynamic
    assert a.plan.bytes_per_step == 12
    assert e.key in a.summary() and e.reason in a.summary()
    # Without _output_shapes every rank is unknown.
    a = rw.analyze(f.get_concrete_function().graph.as_graph_def())
    e = edge(a, f"{names['r']}:0>worker:1")
    assert (e.kind, e.shape, e.reason) == (
        DYNAMIC, None, "rank unknown at trace time")
    assert a.plan.slot(e.key).shape is None and a.plan.slot(e.key).dynamic
    check_rewrite(a, rw.rewrite_graph(a))


def test_call_whose_body_runs_on_another_task_is_kept():
    names = {}

    @tf.function
    def inner(x):
        with tf.device(W0):
            return x * 2.0

    @tf.function
    def f(x):
        with tf.device(W2):
            a = x + 1.0
        with tf.device(W1):
            y = inner(a)
            z = y - 1.0
        with tf.device(W2):
            w = y * 3.0
        names.update(a=a.op.name)
        return z, w

    _, gd = trace(f, SPEC3)
    a = rw.analyze(gd)
    calls = [n.name for n in gd.node
             if n.op in ("StatefulPartitionedCall", "PartitionedCall")]
    assert len(calls) == 1
    (call,) = calls
    assert a.placements[call].task == W1
    # Into the call and out of it: both edges stay on TensorFlow's path.
    for key in (f"{names['a']}:0>worker:1", f"{call}:0>worker:2"):
        e = edge(a, key)
        assert e.kind == KEPT, key
        assert e.reason.startswith("function body spans tasks: ")
        assert repr(call) in e.reason and "__inference_inner" in e.reason
        assert f"placed on {W0} while the call runs on {W1}" in e.reason
    assert a.plan.transfers == ()
    # The call itself is noted, with its body's traffic left to TensorFlow.
    assert [n for n in a.notes if repr(call) in n], a.notes
    assert "note: " in a.summary()
    # The same body called on worker 0 spans nothing: both edges planned.
    for n in gd.node:
        if n.name == call:
            n.device = W0
    a = rw.analyze(gd)
    assert {e.kind for e in a.edges if call in (e.producer,) + tuple(
        c for c, _ in e.consumers)} == {STATIC}


def test_dtypes_and_sizes():
    names = {}

    @tf.function
    def f(x):
        with tf.device(W0):
            i = tf.cast(x, tf.int32)
            d = tf.cast(x, tf.float64)
            b = x > 0.0
            e = tf.zeros([0, 5], tf.int64) + tf.cast(tf.reduce_sum(x), tf.int64)
        with tf.device(W1):
            out = (tf.cast(i, tf.float64) + d, tf.logical_not(b), e + 1)
        names.update(i=i.op.name, d=d.op.name, b=b.op.name, e=e.op.name)
        return out

    _, gd = trace(f, SPEC3)
    a = rw.analyze(gd)
    expect = {"i": ("int32", (4, 3), 48), "d": ("float64", (4, 3), 96),
              "b": ("bool", (4, 3), 12), "e": ("int64", (0, 5), 0)}
    for n, (dtype, shape, nbytes) in expect.items():
        e = edge(a, f"{names[n]}:0>worker:1")
        assert (e.kind, e.dtype, e.shape, e.nbytes) == (
            STATIC, dtype, shape, nbytes), n
        assert a.plan.slot(e.key).dtype == dtype
    assert a.plan.bytes_per_step == 48 + 96 + 12 + 0


# --- Layout. -------------------------------------------------------------------


def many_pairs_fn(names, k=1.0):
    @tf.function
    def f(x):
        with tf.device(W0):
            a = x * 2.0
            r = tf.reduce_sum(x)
        with tf.device(W1):
            b = a + k
            s = tf.reduce_max(b)
        with tf.device(W0):
            c = b * s
        with tf.device(PS):
            d = a - r
        names.update(a=a.op.name, r=r.op.name, b=b.op.name, s=s.op.name)
        return c, d

    return f


def test_plan_regions_per_pair():
    names = {}
    _, gd = trace(many_pairs_fn(names), SPEC3)
    a = rw.analyze(gd, name="step", depth=3)
    plan = a.plan
    assert plan.name.startswith("step.") and plan.depth == 3
    pairs = {(r.src, r.dst): set(r.keys) for r in plan.regions}
    assert pairs == {
        (W0, PS): {f"{names['a']}:0>ps:0", f"{names['r']}:0>ps:0"},
        (W0, W1): {f"{names['a']}:0>worker:1"},
        (W1, W0): {f"{names['b']}:0>worker:0", f"{names['s']}:0>worker:0"},
    }
    for r in plan.regions:
        assert r.name == f"{plan.name}/{r.src}->{r.dst}"
        for k in r.keys:
            s = plan.slot(k)
            assert (s.region, s.src, s.dst, s.depth) == (r.name, r.src, r.dst, 3)
    assert plan.tasks == (PS, W0, W1)
    assert {t.key for t in plan.transfers} == {e.key for e in a.planned}


def test_plan_hash_stable_across_traces_and_different_for_another_layout():
    def analysis(k=1.0, spec=SPEC3, fn=many_pairs_fn):
        return rw.analyze(trace(fn({}, k), spec)[1], name="f")

    first, second = analysis(), analysis()
    assert first.graph_def is not second.graph_def
    assert first.plan.name == second.plan.name
    assert first.plan.hash == second.plan.hash
    assert first.plan == second.plan
    # Plans are named after their layout: another constant, same transfers,
    # the same plan (its regions fit either graph).
    other = analysis(k=2.0)
    assert other.graph_def != first.graph_def
    assert other.plan.hash == first.plan.hash
    # Another shape: another layout, another plan.
    bigger = analysis(spec=tf.TensorSpec([8, 3], tf.float32))
    assert bigger.plan.hash != first.plan.hash
    assert bigger.plan.name != first.plan.name
    assert bigger.plan.bytes_per_step == 2 * first.plan.bytes_per_step - 8
    # Another graph with other transfers: another plan.
    names = {}
    fewer = analysis(fn=lambda names_, k: two_worker_fn(names))
    assert fewer.plan.name != first.plan.name
    assert fewer.plan.hash != first.plan.hash


def test_plan_hash_stable_across_traces_with_library_functions():
    # The plan name is documented as stable for the same graph traced twice;
    # graphs with nested functions and loops name their library functions
    # with a process-wide counter (while_body_28, __inference_inner_24).
    def make():
        @tf.function
        def inner(x):
            return x * 3.0

        @tf.function
        def f(x):
            with tf.device(W0):
                a = inner(x)
            with tf.device(W1):
                b = tf.while_loop(lambda i, v: i < 3,
                                  lambda i, v: (i + 1, v * 2.0), (0, a))[1]
            return b

        return f

    hashes = {rw.analyze(trace(make(), SPEC3)[1], name="f").plan.hash
              for _ in range(2)}
    assert len(hashes) == 1


def test_one_plan_name_one_layout():
    # Regions are named after the plan: two plans with one name but another
    # layout would meet in the same regions (and be refused there). The same
    # graph planned with another depth, or other endpoint tasks, is such a
    # pair.
    _, gd = trace(many_pairs_fn({}), SPEC3)
    variants = [dict(depth=1), dict(depth=2), dict(depth=3),
                dict(endpoint_tasks=[W0, W1]), dict(endpoint_tasks=[W0, PS])]
    hashes = {}
    for kw in variants:
        plan = rw.analyze(gd, name="f", **kw).plan
        hashes.setdefault(plan.name, set()).add(plan.hash)
    assert all(len(h) == 1 for h in hashes.values()), hashes


def test_client_job_gets_no_tf_rdma_op_when_it_is_not_the_caller():
    # A function first called under tf.device(worker 1): the caller is
    # worker 1, and a large tensor captured from the client stays on the
    # client (job "localhost", no endpoint); its edge must stay on gRPC.
    names = {}
    gd = graph_def(
        node_def("k", "Placeholder", attrs={"dtype": {"type": 1}}),
        node_def("x", "Placeholder", attrs={"dtype": {"type": 1}}),
        binary("a", "Mul", "x", "k", device=W0),
        identity("out", "a"),
    )
    a = rw.analyze(gd, caller_device="/job:worker/replica:0/task:1/device:CPU:0",
                   arg_devices={"k": "/job:localhost/replica:0/task:0/device:CPU:0"})
    assert a.placements["k"].task == CLIENT
    e = edge(a, "k:0>worker:0")
    assert e.kind == KEPT, a.summary()
    assert not [t for t in a.plan.transfers if CLIENT in (t.src, t.dst)]


# --- Rewrite. --------------------------------------------------------------------


def check_rewrite(analysis, rewritten, timeout_ms=-1):
    """Every check of one rewritten GraphDef against its analysis."""
    plan = analysis.plan
    nodes = {n.name: n for n in rewritten.node}
    original = {n.name for n in analysis.graph_def.node}
    assert original <= set(nodes)
    # Every node has a device naming its task now.
    for name, p in analysis.placements.items():
        assert task_of(nodes[name].device) == p.task, name
    sends = [n for n in rewritten.node if n.op == "TfRdmaSend"]
    recvs = [n for n in rewritten.node if n.op == "TfRdmaRecv"]
    assert len(sends) == len(recvs) == len(plan.transfers) == len(
        analysis.planned)

    def by_key(ops):
        out = {}
        for n in ops:
            out.setdefault(n.attr["tensor_name"].s.decode(), []).append(n)
        return out

    sends, recvs = by_key(sends), by_key(recvs)
    for e in analysis.planned:
        (send,) = sends[e.key]
        (recv,) = recvs[e.key]
        assert task_of(send.device) == e.src and task_of(recv.device) == e.dst
        slot = plan.slot(e.key)
        for op, side, dtype_attr in ((send, "send", "T"),
                                     (recv, "recv", "dtype")):
            want = plan.op_attrs(e.key, side, timeout_ms, match_calls=True)
            got = {k: op.attr[k] for k in want}
            for k, v in want.items():
                if k == "shape":
                    if v is None:
                        assert got[k].shape.unknown_rank, e.key
                    else:
                        assert not got[k].shape.unknown_rank
                        assert [d.size for d in got[k].shape.dim] == [
                            -1 if d is None else d for d in v], (e.key, k)
                elif isinstance(v, bool):
                    assert got[k].b == v, (e.key, k)
                elif isinstance(v, str):
                    assert got[k].s.decode() == v, (e.key, k)
                else:
                    assert got[k].i == v, (e.key, k)
            assert tf.dtypes.as_dtype(op.attr[dtype_attr].type).name == slot.dtype
        check_recv_start(analysis, e, recv, nodes)
        if e.kind == CONTROL:
            (token_name,) = send.input
            token = nodes[token_name]
            # Identity(empty Const, ^producer): the control input sits on the
            # Identity, which TensorFlow cannot run ahead of it.
            assert token.op == "Identity" and task_of(token.device) == e.src
            empty, after = token.input
            assert after == f"^{e.producer}"
            assert nodes[empty].op == "Const" and list(nodes[empty].input) == []
            assert task_of(nodes[empty].device) == e.src
            want_input = f"^{recv.name}"
        else:
            assert [parse_input(send.input[0], 0).tensor] == [e.tensor]
            want_input = recv.name
        for consumer, slot_index in e.consumers:
            if e.kind == CONTROL:
                # Dropped control inputs (analysis.implied) move the
                # control inputs after them.
                assert want_input in nodes[consumer].input, (e.key, consumer)
            else:
                assert nodes[consumer].input[slot_index] == want_input, (
                    e.key, consumer)
    # No planned edge crosses tasks any more; the rest are the kept/dynamic
    # edges, unchanged.
    view = GraphView(rewritten)
    leftover = set()
    for name, inputs in view.inputs.items():
        dst = task_of(nodes[name].device)
        for inp in inputs:
            if task_of(nodes[inp.producer].device) != dst:
                leftover.add((inp.producer, inp.index, dst))
    unplanned = {(e.producer, e.index, e.dst)
                 for e in analysis.edges_of_kind(KEPT)}
    assert leftover == unplanned
    # Control inputs another input implies are gone.
    for consumer, producer, _ in analysis.implied:
        assert f"^{producer}" not in view.nodes[consumer].input, consumer

    # A second analysis finds nothing left to plan.
    again = rw.analyze(rewritten, caller_device=analysis.caller_task)
    assert again.planned == [], again.summary()
    # And TensorFlow takes the graph.
    with tf.Graph().as_default():
        tf.graph_util.import_graph_def(rewritten, name="")


def check_recv_start(analysis, e, recv, nodes):
    """A recv's only inputs: control inputs on the latest sends it waits for.

    Worked out here by a search of the original graph, not by the pass's
    bit sets: a send S (of edge s) precedes the recv of `e` when S runs on
    the recv's task and a consumer of s is `e`'s producer or one of its
    ancestors; the recv waits for exactly the preceding sends that no other
    preceding send's producer depends on.
    """
    view = GraphView(analysis.graph_def)

    def ancestors(name):
        seen, todo = {name}, [name]
        while todo:
            for inp in view.inputs[todo.pop()]:
                if inp.producer not in seen:
                    seen.add(inp.producer)
                    todo.append(inp.producer)
        return seen

    def behind(name):
        up = ancestors(name)
        return {s.key for s in analysis.planned
                if any(c in up for c, _ in s.consumers)}

    preceding = {s.key for s in analysis.planned
                 if s.src == e.dst} & behind(e.producer)
    by_key = {s.key: s for s in analysis.planned}
    implied = set()
    for key in preceding:
        implied |= behind(by_key[key].producer)
    want = preceding - implied
    got = set()
    for text in recv.input:
        assert text.startswith("^"), (e.key, list(recv.input))
        send = nodes[text[1:]]
        assert send.op == "TfRdmaSend", (e.key, text)
        assert task_of(send.device) == task_of(recv.device), (e.key, text)
        got.add(send.attr["tensor_name"].s.decode())
    assert got == want, (e.key, got, want)


def test_recvs_of_a_chain_start_after_the_send_before_them():
    """A chain of hops between two tasks: each recv waits for one send."""
    @tf.function
    def chain(x):
        for i in range(6):
            with tf.device((W0, W1)[(i + 1) % 2]):
                x = x * 2.0
        return x

    _, gd = trace(chain, SPEC3)
    a = rw.analyze(gd)
    hops = sorted(a.planned, key=lambda e: gd_position(gd, e.producer))
    assert [(e.src, e.dst) for e in hops] == [
        ((W1, W0)[i % 2], (W0, W1)[i % 2]) for i in range(len(hops))], \
        a.summary()
    assert len(hops) == 5
    rewritten = rw.rewrite_graph(a)
    check_rewrite(a, rewritten)
    recv_of = {n.attr["tensor_name"].s.decode(): n for n in rewritten.node
               if n.op == "TfRdmaRecv"}
    send_name = {n.attr["tensor_name"].s.decode(): n.name
                 for n in rewritten.node if n.op == "TfRdmaSend"}
    assert list(recv_of[hops[0].key].input) == []
    for before, hop in zip(hops, hops[1:]):
        assert list(recv_of[hop.key].input) == ["^" + send_name[before.key]]


def gd_position(gd, name):
    return [n.name for n in gd.node].index(name)


def test_rewrite_moves_every_planned_edge():
    names = {}
    v = tf.Variable(tf.ones([4, 3]))

    @tf.function
    def f(x):
        with tf.device(W0):
            a = x * 2.0
            s = tf.strings.as_string(a)
        with tf.device(W1):
            b = a + v.read_value()
            with tf.control_dependencies([a]):
                c = tf.identity(b) * 3.0
            n = tf.strings.length(s)
            d = tf.reduce_sum(b, axis=0)
        with tf.device(W0):
            e = a * d
        with tf.device(W1):
            v.assign_add(b)
        names.update(a=a.op.name)
        return c, n, e

    concrete, gd = trace(f, SPEC3)
    a = rw.analyze(gd, arg_devices=capture_devices(concrete))
    kinds = sorted(e.kind for e in a.planned)
    assert kinds.count(STATIC) >= 3 and kinds.count(CONTROL) >= 1, a.summary()
    assert a.edges_of_kind(KEPT)
    before = gd.SerializeToString(deterministic=True)
    rewritten = rw.rewrite_graph(a)
    assert gd.SerializeToString(deterministic=True) == before  # Not modified.
    check_rewrite(a, rewritten)
    rewritten = rw.rewrite_graph(a, timeout_ms=1234)
    check_rewrite(a, rewritten, timeout_ms=1234)


def test_rewrite_many_pairs_and_two_destinations():
    names = {}
    _, gd = trace(many_pairs_fn(names), SPEC3)
    a = rw.analyze(gd, depth=4)
    check_rewrite(a, rw.rewrite_graph(a))


def test_rewrite_names_do_not_clash_with_user_nodes():
    # A user node already has the name the rewrite would pick.
    gd = graph_def(
        float_const("c", device=W0),
        identity("a", "c", device=W0),
        identity("b", "a", device=W1),
        identity("tf_rdma/send/a_0_worker_1", "c", device=W0),
        identity("tf_rdma/recv/a_0_worker_1", "c", device=W0),
    )
    a = rw.analyze(gd)
    assert [e.key for e in a.planned] == ["a:0>worker:1"]
    rewritten = rw.rewrite_graph(a)
    names = [n.name for n in rewritten.node]
    assert len(names) == len(set(names))
    check_rewrite(a, rewritten)


def test_rewrite_of_a_graph_without_transfers_only_pins_devices():
    @tf.function
    def f(x):
        return x + 1.0

    _, gd = trace(f, SPEC3)
    a = rw.analyze(gd)
    out = rw.rewrite_graph(a)
    assert [n.name for n in out.node] == [n.name for n in gd.node]
    assert {task_of(n.device) for n in out.node} == {CLIENT}


# --- Bad input. ------------------------------------------------------------------


def test_not_a_graph_def():
    with pytest.raises(PlanError, match="expected a GraphDef, got str"):
        rw.analyze("node { name: 'a' }")
    with pytest.raises(PlanError, match="got FunctionDef"):
        from tensorflow.core.framework import function_pb2
        rw.analyze(function_pb2.FunctionDef())


def test_input_naming_a_missing_node():
    gd = graph_def(float_const("c"), identity("a", "ghost:1"))
    with pytest.raises(PlanError) as info:
        rw.analyze(gd)
    msg = str(info.value)
    assert "'a'" in msg and "'ghost:1'" in msg and "no node 'ghost'" in msg


def test_cycle():
    gd = graph_def(binary("p", "Add", "q", "c"), binary("q", "Add", "p", "c"),
                   float_const("c"))
    with pytest.raises(PlanError, match=r"cycle through \['p', 'q'\]"):
        rw.analyze(gd)


def test_duplicate_node_name():
    gd = graph_def(float_const("c"), float_const("c"))
    with pytest.raises(PlanError, match="two nodes named 'c'"):
        rw.analyze(gd)


def test_graph_view_parses_inputs():
    assert parse_input("a", 0).tensor == "a:0"
    assert parse_input("a:3", 1).index == 3
    assert parse_input("^a", 2).is_control
    assert parse_input("scope/a:b", 0).producer == "scope/a:b"


# --- The decorator, on one task (no cluster). -----------------------------------------


def values(structure):
    return tf.nest.map_structure(
        lambda t: t if t is None else t.numpy().tolist(), structure)


def test_decorator_on_one_task_matches_tf_function():
    v = tf.Variable([1.0, 2.0, 3.0])
    w = tf.Variable([1.0, 2.0, 3.0])

    def body(var, x, scale=2.0):
        var.assign_add(x)
        return {"a": var.read_value() * scale, "b": None, "x": x,
                "t": (x + 1.0, tf.constant(5))}

    plain = tf.function(lambda x, scale=2.0: body(v, x, scale))
    rewritten = tf_rdma.rewrite(lambda x, scale=2.0: body(w, x, scale),
                                name="one_task")
    with pytest.raises(PlanError, match="no plan yet"):
        rewritten.plan
    assert "not traced yet" in rewritten.explain()
    for step in range(3):
        x = tf.constant([1.0, 0.5, step])
        for kw in ({}, {"scale": 3.0}):
            p, r = plain(x, **kw), rewritten(x, **kw)
            assert values(p) == values(r)
    assert v.numpy().tolist() == w.numpy().tolist()
    assert len(rewritten.analyses) == 2  # One trace per scale.
    assert rewritten.plan.transfers == ()
    assert rewritten.plan.name.startswith("one_task.")
    assert rewritten.plans == [a.plan for a in rewritten.analyses]


def test_decorator_function_without_outputs_still_runs_its_effects():
    v = tf.Variable([1.0, 2.0])

    @tf_rdma.rewrite
    def step(x):
        v.assign_sub(x)

    assert step(tf.constant([1.0, 1.0])) is None
    assert step(tf.constant([1.0, 1.0])) is None
    assert v.numpy().tolist() == [-1.0, 0.0]


def test_decorator_takes_a_variable_argument():
    v = tf.Variable([1.0, 2.0, 3.0])

    def f(var, x):
        var.assign_add(x)
        return var.read_value() * 2.0

    plain = tf.function(f)(v, tf.constant([1.0, 1.0, 1.0]))
    assert v.numpy().tolist() == [2.0, 3.0, 4.0]
    rewritten = tf_rdma.rewrite(f)(v, tf.constant([1.0, 1.0, 1.0]))
    assert v.numpy().tolist() == [3.0, 4.0, 5.0]
    assert rewritten.numpy().tolist() == [6.0, 8.0, 10.0] != plain.numpy().tolist()


def test_decorator_places_ops_of_a_variable_argument_with_the_variable():
    with tf.device("/job:localhost/replica:0/task:0/device:CPU:0"):
        v = tf.Variable([1.0, 2.0, 3.0])

    def f(var, x):
        with tf.device(W1):  # Asked for; the variable is on the client.
            return var.read_value() * x

    rewritten = tf_rdma.rewrite(f)
    rewritten.get_concrete_function(v, tf.TensorSpec([3], tf.float32)).graph
    a = rewritten.analyses[-1]
    (read,) = [n.name for n in a.graph_def.node if n.op == "ReadVariableOp"]
    # Where the plain tf.function reads it: with the variable, on the client.
    assert a.placements[read].task == CLIENT, a.placements[read]


# --- A plan per calling device (ParameterServerStrategy's coordinator). ------


def _ps_step(x):
    with tf.device(PS):
        y = x * 2.0
    return y + 1.0  # Nobody placed it: it runs where the function is called.


def test_client_device_has_no_endpoint_the_caller_has():
    _, gd = trace(tf.function(_ps_step), tf.TensorSpec([3], tf.float32))
    on_worker = rw.analyze(gd, caller_device=W0 + "/device:CPU:0",
                           client_device=CLIENT + "/device:CPU:0")
    assert (on_worker.caller_task, on_worker.client_task) == (W0, CLIENT)
    assert {(e.src, e.dst) for e in on_worker.planned} == {(W0, PS), (PS, W0)}
    assert not on_worker.edges_of_kind(KEPT)
    assert "called on /job:worker/task:0 (for the program on " in on_worker.summary()
    # Without a client device the caller is the program: its edges stay.
    alone = rw.analyze(gd, caller_device=W0 + "/device:CPU:0")
    assert alone.client_task == W0 and not alone.planned
    with pytest.raises(PlanError, match="names no job"):
        rw.analyze(gd, client_device="/device:CPU:0")


def test_decorator_traces_a_plan_per_calling_device():
    from tensorflow.python.eager import def_function
    rewritten = tf_rdma.rewrite(_ps_step, name="per_caller")
    # ClusterCoordinator.schedule takes only tf.function objects.
    assert isinstance(rewritten, def_function.Function)
    concrete = rewritten.get_concrete_function(tf.TensorSpec([3], tf.float32))
    assert rewritten.analyses == []  # traced per device, on first use
    assert concrete.structured_outputs.shape == [3]
    for worker in (W0, W1, W0):
        with tf.device(worker):
            assert concrete.graph is not None
    assert [a.caller_task for a in rewritten.analyses] == [W0, W1]
    assert {a.client_task for a in rewritten.analyses} == {CLIENT}
    first, second = rewritten.plans
    assert first.name != second.name and first.tasks != second.tasks
    assert {t.src for t in first.transfers} == {W0, PS}
    assert {t.src for t in second.transfers} == {W1, PS}


def test_decorator_warns_when_the_program_computes_and_sends_on_grpc():
    rewritten = tf_rdma.rewrite(_ps_step, name="on_client")
    with pytest.warns(tf_rdma.decorator.ClientComputeWarning,
                      match=r"AddV2.*compute on /job:localhost/task:0"):
        rewritten.get_concrete_function(tf.TensorSpec([3], tf.float32)).graph
    assert rewritten.analyses[-1].client_computes() == ["add"]
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # called on a worker: nothing to say
        with tf.device(W0):
            tf_rdma.rewrite(_ps_step).get_concrete_function(
                tf.TensorSpec([3], tf.float32)).graph


def test_decorator_follows_relaxed_and_declared_signatures():
    relaxed = tf_rdma.rewrite(tf.function(lambda x: x * 2.0, reduce_retracing=True))
    declared = tf_rdma.rewrite(tf.function(
        lambda x: x * 2.0, input_signature=[tf.TensorSpec([None], tf.float32)]))
    concrete = relaxed.get_concrete_function(tf.TensorSpec([None], tf.float32))
    for n in (2, 3, 4, 5):
        for fn in (relaxed, declared, concrete):
            assert fn(tf.ones([n])).numpy().tolist() == [2.0] * n
