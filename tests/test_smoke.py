"""The smallest end-to-end check: one tensor, two processes, each transport."""

import pytest

from conftest import run_tasks

pytestmark = pytest.mark.timeout(120)

PROGRAM = """
plan = tf_rdma.Plan([tf_rdma.Transfer("x", "worker:0", "worker:1", "int32", [5])])
ep = start()
if task == "worker:0":
    for step in range(3):
        tf_rdma.ops.send(tf.range(5) * (step + 1), plan, "x")
    result(tf_rdma.endpoint_info()["pair"])
else:
    got = [tf_rdma.ops.recv(plan, "x").numpy().tolist() for _ in range(3)]
    result(got)
"""


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_three_steps(transport):
    out = run_tasks({"worker:0": PROGRAM, "worker:1": PROGRAM},
                    env={"TF_RDMA_TRANSPORT": transport})
    assert out["worker:1"].result == [[0, 1, 2, 3, 4], [0, 2, 4, 6, 8],
                                      [0, 3, 6, 9, 12]]
    assert out["worker:0"].result == [
        f"/job:worker/task:0 -> /job:worker/task:1 {transport}"]
