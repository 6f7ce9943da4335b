"""End-to-end basics over each transport: steps in order, zero-copy receive,
and a late sender.

A recv that times out gives its step back: the next recv of the same tensor
waits for the same step, so data that arrives after a timeout is not lost
and the steps of both ends stay paired.
"""

import pytest

from conftest import DATA_PATH_TRANSPORTS, run_tasks, use_transport

pytestmark = pytest.mark.timeout(120)

PROGRAM = """
plan = tf_rdma.Plan([tf_rdma.Transfer("x", "worker:0", "worker:1", "int32", [5]),
                     tf_rdma.Transfer("late", "worker:0", "worker:1", "int64", [2])])
ep = start()
if task == "worker:0":
    for step in range(3):
        tf_rdma.ops.send(tf.range(5) * (step + 1), plan, "x")
    time.sleep(1.5)  # the receiver's first recv of "late" times out meanwhile
    tf_rdma.ops.send(tf.constant([7, 8], tf.int64), plan, "late")
    tf_rdma.ops.send(tf.constant([9, 10], tf.int64), plan, "late")
    result(tf_rdma.endpoint_info()["pair"])
else:
    import ctypes
    capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
    capsule_pointer.restype = ctypes.c_void_p
    capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
    def in_region(tensor):
        # True if the tensor's buffer lies in one of this process's segments.
        # (DLPack exports the buffer itself; .numpy() would copy it.) The
        # first field of a DLManagedTensor is its data pointer.
        dl = capsule_pointer(tf.experimental.dlpack.to_dlpack(tensor), b"dltensor")
        address = ctypes.c_void_p.from_address(dl).value
        with open("/proc/self/maps") as maps:
            for line in maps:
                if "/dev/shm/tfrdma.%d." % os.getpid() in line:
                    lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                    if lo <= address and address + 4 * 5 <= hi:
                        return True
        return False
    got, zero_copy = [], []
    for _ in range(3):  # one at a time: with depth 2, holding 3 would stall
        t = tf_rdma.ops.recv(plan, "x")
        got.append(t.numpy().tolist())
        zero_copy.append(in_region(t))
        del t
    try:
        tf_rdma.ops.recv(plan, "late", timeout=0.3)
        timed_out = None
    except tf.errors.DeadlineExceededError as e:
        timed_out = str(e)
    late = [tf_rdma.ops.recv(plan, "late", timeout=30).numpy().tolist()
            for _ in range(2)]
    result({"x": got, "timed_out": timed_out, "late": late,
            "zero_copy": zero_copy})
"""


@pytest.mark.parametrize("transport", DATA_PATH_TRANSPORTS)
def test_steps_in_order_and_late_sender(transport):
    use_transport(transport)
    out = run_tasks({"worker:0": PROGRAM, "worker:1": PROGRAM},
                    env={"TF_RDMA_TRANSPORT": transport})
    r = out["worker:1"].result
    assert r["x"] == [[0, 1, 2, 3, 4], [0, 2, 4, 6, 8], [0, 3, 6, 9, 12]]
    # The received tensors are the slots themselves: their bytes lie in the
    # receiver's shared-memory region (no copy on arrival).
    assert r["zero_copy"] == [True, True, True]
    assert r["timed_out"] is not None and "'late'" in r["timed_out"]
    assert "step 1" in r["timed_out"]
    # The timed-out step was retried, not skipped: both late steps arrive.
    assert r["late"] == [[7, 8], [9, 10]]
    assert out["worker:0"].result == [
        f"/job:worker/task:0 -> /job:worker/task:1 {transport}"]
