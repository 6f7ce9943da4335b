"""Questions over the control connection (engine/query.cc).

Two tasks on one host exchange one tensor each way (so each has a control
connection with the other), then each measures the offset of the other's
trace clock with `tfrdma_clock_offsets`. Both processes read the same
CLOCK_REALTIME, so the true offset is 0 and the 4-timestamp estimate must
land within half its own round trip of it: t1 <= t2 <= t3 <= t4 holds on
one clock, which bounds |offset| by rtt / 2. A wrong sign, a swapped
timestamp or a missing subtraction of the peer's handling time breaks that
bound.
"""

import pytest

from conftest import make_cluster, run_tasks

pytestmark = pytest.mark.timeout(120)

PROGRAM = """
import ctypes
from tf_rdma import _loader
from tf_rdma.cluster import canonical_task
A, B = "/job:worker/task:0", "/job:worker/task:1"
me = canonical_task(task)
peer = B if me == A else A
plan = tf_rdma.Plan([tf_rdma.Transfer("x", A, B, "float32", [4]),
                     tf_rdma.Transfer("y", B, A, "float32", [4])], name="q")
start()
tf_rdma.ops.send(tf.zeros([4]), plan, "x" if me == A else "y")
tf_rdma.ops.recv(plan, "y" if me == A else "x").numpy()
buf = ctypes.create_string_buffer(1 << 16)
_loader.load().c.tfrdma_clock_offsets(16, 5000, buf, len(buf))
result(json.loads(buf.value.decode()))
touch("done_" + me[-1])
wait_file("done_" + peer[-1])
"""


def test_clock_offset_between_two_tasks_on_one_clock_is_within_half_the_rtt(
        tmp_path):
    out = run_tasks({"worker:0": PROGRAM, "worker:1": PROGRAM},
                    cluster=make_cluster(2),
                    env={"TF_RDMA_TRANSPORT": "tcp", "TF_RDMA_TIMEOUT": "20",
                         "TEST_SYNC_DIR": str(tmp_path)},
                    timeout=100)
    for me, peer in (("worker:0", "/job:worker/task:1"),
                     ("worker:1", "/job:worker/task:0")):
        offsets = out[me].results[-1]
        assert set(offsets["peers"]) == {peer}, offsets
        sample = offsets["peers"][peer]
        assert "error" not in sample, sample
        assert 0 < sample["rtt_ns"] < 50_000_000, sample
        assert abs(sample["offset_ns"]) <= sample["rtt_ns"] // 2 + 1, sample
