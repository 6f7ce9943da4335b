"""What TensorFlow's tracing makes of tf_rdma ops inside a tf.function.

Graph-level checks (traced, not run): the control edges that automatic
control dependencies add around TfRdmaSend / TfRdmaRecv, and where the
values a function returns are computed (tf_rdma/_auto_control_deps.py).
"""

import os
import subprocess
import sys

import pytest
import tensorflow as tf

import tf_rdma

W0 = "/job:worker/task:0"
W1 = "/job:worker/task:1"

pytestmark = [pytest.mark.fast, pytest.mark.timeout(120)]


def plan(name):
    return tf_rdma.Plan([tf_rdma.Transfer("x", W0, W1, "float32", [4]),
                         tf_rdma.Transfer("y", W1, W0, "float32", [4])],
                        name=name)


def traced(fn):
    return fn.get_concrete_function(tf.TensorSpec([4], tf.float32)).graph


def op_of(graph, op_type):
    (op,) = [op for op in graph.get_operations() if op.type == op_type]
    return op


def test_send_and_recv_get_no_program_order_edges():
    p = plan("order")

    @tf.function
    def fn(a):
        # The recv is written before the send of the same step would be
        # (a ping-pong): program order would make it wait for itself.
        with tf.device(W0):
            b = tf_rdma.ops.recv(p, "y")
            tf_rdma.ops.send(a * 2.0, p, "x")
        with tf.device(W1):
            tf_rdma.ops.send(tf_rdma.ops.recv(p, "x") + 1.0, p, "y")
        return b

    graph = traced(fn)
    for op in graph.get_operations():
        if op.type in ("TfRdmaSend", "TfRdmaRecv"):
            assert [c.type for c in op.control_inputs] == [], op.name
    must_run = {op.type for op in graph.control_outputs}
    assert {"TfRdmaSend", "TfRdmaRecv"} <= must_run


def test_returned_value_stays_on_the_task_that_computes_it():
    p = plan("placement")

    @tf.function
    def fn(a):
        with tf.device(W0):
            tf_rdma.ops.send(a * 2.0, p, "x")
        with tf.device(W1):
            return tf_rdma.ops.recv(p, "x") + 1.0

    graph = traced(fn)
    (out,) = graph.outputs
    assert out.op.type == "Identity"
    # Still ordered after the ops that must run (the send among them) ...
    (noop,) = [c for c in out.op.control_inputs if c.type == "NoOp"]
    assert "TfRdmaSend" in {c.type for c in noop.control_inputs}
    # ... but computed where its value is, not on the client ...
    on_w1 = tf.DeviceSpec.from_string(W1)
    assert tf.DeviceSpec.from_string(out.op.device) == on_w1
    assert tf.DeviceSpec.from_string(noop.device) == on_w1
    # ... and a copy, so that a result the caller keeps does not hold the
    # slot it was computed from (tests/test_client_driven.py runs this).
    (copy,) = [t.op for t in out.op.inputs]
    assert copy.type == "DeepCopy"
    assert tf.DeviceSpec.from_string(copy.device) == on_w1
    assert copy.inputs[0].op.type == "AddV2"


FIRST_FUNCTION = """
import {first}
import {second}
import tensorflow as tf
import tf_rdma
p = tf_rdma.Plan([tf_rdma.Transfer("x", "{w0}", "{w1}", "float32", [4])],
                 name="first")

@tf.function
def fn(a):
    # The process's first use of tf_rdma.ops: tracing this loads the library.
    with tf.device("{w0}"):
        tf_rdma.ops.send(a * 2.0, p, "x")
    with tf.device("{w1}"):
        return tf_rdma.ops.recv(p, "x") + 1.0

graph = fn.get_concrete_function(tf.TensorSpec([4], tf.float32)).graph
print("DEVICE=" + graph.outputs[0].op.device)
"""


@pytest.mark.parametrize("first,second", [("tensorflow", "tf_rdma"),
                                          ("tf_rdma", "tensorflow")])
def test_the_first_function_that_loads_the_library_is_placed_too(first,
                                                                 second):
    # The hooks used to come with the op library, loaded while the first
    # function using tf_rdma ops was traced: too late for that function,
    # whose result then went through the client on every call (measured in
    # bench/p2p.py: the chain of the first size, docs/benchmarks.md).
    code = FIRST_FUNCTION.format(first=first, second=second, w0=W0, w1=W1)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True,
                          text=True, timeout=110,
                          env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [out for out in proc.stdout.splitlines()
               if out.startswith("DEVICE=")]
    device = line[len("DEVICE="):]
    assert device and (tf.DeviceSpec.from_string(device) ==
                       tf.DeviceSpec.from_string(W1)), line


def test_functions_without_tf_rdma_ops_are_left_alone():
    @tf.function
    def fn(a):
        with tf.device(W1):
            tf.print(a)  # an op that must run, with no data path out
            return a + 1.0

    (out,) = traced(fn).outputs
    assert out.op.type == "Identity"
    assert out.op.control_inputs  # the print must run first
    assert out.op.device == ""  # TensorFlow's own placement decides


@pytest.mark.parametrize("timeout", [0, -1, 1e-4, 604800.001, 1e10, float("inf"),
                                     float("nan"), "soon", None])
def test_op_timeout_is_a_number_of_seconds_up_to_a_week(timeout):
    if timeout is None:
        assert tf_rdma.ops.timeout_to_ms(None) == -1  # TF_RDMA_TIMEOUT's
        return
    # Past a week a bound used to reach the engine and, past ~292 years,
    # wrap its deadline into the past: every wait failed at once.
    with pytest.raises(tf_rdma.errors.PlanError, match=r"in \(0, 604800\]"):
        tf_rdma.ops.timeout_to_ms(timeout)


def test_op_timeout_limits_accepted():
    assert tf_rdma.ops.timeout_to_ms(0.001) == 1
    assert tf_rdma.ops.timeout_to_ms(604800) == 604800 * 1000
