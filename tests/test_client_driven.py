"""Client-driven mode: a client connected to a cluster of tf_rdma.Servers.

The client places send on task 0 and recv on task 1 inside one tf.function;
TensorFlow dispatches each part to its server, and the tensor moves through
tf_rdma instead of gRPC. The result must equal the same function without
tf_rdma, bit for bit. The same client then checks that results it keeps do
not hold their slots. One cluster and one client per transport.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import (DATA_PATH_TRANSPORTS, base_env, make_cluster, shm_segments,
                      start_servers, stop_servers, use_transport)


pytestmark = pytest.mark.timeout(180)

CLIENT = r"""
import json, os, sys
import numpy as np
import tensorflow as tf
import tf_rdma
cluster = json.loads(os.environ["TF_CONFIG"])["cluster"]
tf.config.experimental_connect_to_cluster(tf.train.ClusterSpec(cluster))
plan = tf_rdma.Plan([
    tf_rdma.Transfer("x", "worker:0", "worker:1", "float32", [1000, 7]),
    tf_rdma.Transfer("back", "worker:1", "worker:0", "int64", [3]),
])
with tf.device("/job:worker/task:0"):
    v = tf.Variable(tf.random.stateless_uniform([1000, 7], seed=[1, 2]))

# The step's data comes from an argument, not from assigning v between calls:
# an eager assign_add on a remote task is not ordered with the next remote
# function call (TensorFlow's async remote execution), which made the
# baseline itself read stale values.
def body(use_rdma, step):
    with tf.device("/job:worker/task:0"):
        x = (v.read_value() + tf.cast(step, tf.float32)) * 3.0
        if use_rdma:
            tf_rdma.ops.send(x, plan, "x")
    with tf.device("/job:worker/task:1"):
        y = tf_rdma.ops.recv(plan, "x") if use_rdma else tf.identity(x)
        z = tf.reduce_sum(tf.bitcast(y, tf.int32), axis=0)[:3]
        z = tf.cast(z, tf.int64)
        if use_rdma:
            tf_rdma.ops.send(z, plan, "back")
    with tf.device("/job:worker/task:0"):
        w = tf_rdma.ops.recv(plan, "back") if use_rdma else tf.identity(z)
        return y, w + 1

plain = tf.function(lambda step: body(False, step))
rdma = tf.function(lambda step: body(True, step))
same = []
for step in range(5):
    s = tf.constant(step)
    a, b = plain(s), rdma(s)
    same.append(all(np.array_equal(p.numpy().view(np.uint8), q.numpy().view(np.uint8))
                    for p, q in zip(a, b)))
print("RESULT " + json.dumps({"same": same}), flush=True)
"""


# A function that returns what it received: the result would alias the slot
# (zero-copy recv), and with depth 1 a result the client keeps would hold
# the slot from the next call's send. tf_rdma/_auto_control_deps.py makes returned
# values local copies; without that the second call times out. It runs in
# CLIENT's process, after it, on every transport.
RETURNS_RECV = r"""
W0, W1 = "/job:worker/task:0", "/job:worker/task:1"
plan = tf_rdma.Plan([tf_rdma.Transfer("x", W0, W1, "float32", [4])], depth=1,
                    name="returns_recv")

@tf.function
def fn(a):
    with tf.device(W0):
        tf_rdma.ops.send(a * 2.0, plan, "x")
    with tf.device(W1):
        return tf_rdma.ops.recv(plan, "x")

kept = [fn(tf.fill([4], float(i))) for i in range(3)]  # all held at once
print("RESULT " + json.dumps({"values": [k.numpy().tolist() for k in kept],
                              "devices": [k.device for k in kept]}),
      flush=True)
"""


@pytest.fixture(scope="module", params=DATA_PATH_TRANSPORTS)
def driven(request):
    """Two servers over one transport; one client runs CLIENT, then
    RETURNS_RECV (both print a RESULT); then SIGTERM. Returns (transport,
    the client's results, the servers' stop codes and logs, segments left)."""
    transport = request.param
    use_transport(transport)
    cluster = make_cluster(2)
    # An op waits 10 s, not 60: RETURNS_RECV's failure mode is a timeout.
    env = base_env({"TF_RDMA_TRANSPORT": transport, "TF_RDMA_TIMEOUT": "10"})
    servers = start_servers(cluster, env)
    try:
        client_env = dict(env)
        client_env["TF_CONFIG"] = json.dumps({"cluster": cluster})
        client = subprocess.run([sys.executable, "-c", CLIENT + RETURNS_RECV],
                                env=client_env, capture_output=True, text=True,
                                timeout=150)
    finally:
        stopped = stop_servers(servers)
    assert client.returncode == 0, client.stderr[-3000:]
    results = [json.loads(l[7:]) for l in client.stdout.splitlines()
               if l.startswith("RESULT ")]
    assert len(results) == 2, client.stdout[-3000:]
    return (transport, results, stopped,
            shm_segments(pids=[p.pid for p in servers]))


def test_connect_to_cluster_send_recv(driven):
    transport, (r, _), stopped, left = driven
    assert r["same"] == [True] * 5
    # Both directions were set up over the requested transport and logged.
    logs = "".join(err for _, err in stopped)
    assert f"/job:worker/task:0 -> /job:worker/task:1 uses {transport}" in logs
    assert f"/job:worker/task:1 -> /job:worker/task:0 uses {transport}" in logs
    # SIGTERM is a clean shutdown: exit 0 and no segment left behind.
    assert [rc for rc, _ in stopped] == [0, 0], logs[-3000:]
    assert left == []


def test_kept_results_do_not_hold_their_slots(driven):
    _, (_, r), _, _ = driven
    assert r["values"] == [[2.0 * i] * 4 for i in range(3)]
    # The results stay on the task that received them, as without tf_rdma.
    assert r["devices"] == ["/job:worker/replica:0/task:1/device:CPU:0"] * 3
