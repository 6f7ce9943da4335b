"""The dynamic path: tensors whose shape is known only at run time.

Two real processes per transport (shm, tcp). worker:0 sends, worker:1
receives, through a plan of dynamic transfers:

- ``grow``: a float32 vector whose length changes every step — up, down, to
  zero and past every earlier capacity — received bit-exact each step, while
  the receiver *keeps* the tensor of a large step (the plan has depth 16,
  so holding it does not block the sender): it aliases an
  older payload area and must not change when later steps open new ones;
- ``rank``: an int64 tensor planned with unknown rank, sent with ranks 0 to 3;
- ``wrong``: a send whose shape contradicts the plan's known dims fails on
  the sender with a message naming both shapes.

Each side prints RESULT lines; the test compares them.
"""

import pytest

from conftest import DATA_PATH_TRANSPORTS, make_cluster, run_tasks, use_transport

pytestmark = pytest.mark.timeout(300)

SIZES = [5, 0, 1000, 3, 300000, 17, 0, 1200000, 64]
KEPT_STEP = 4  # the 300000-element step, kept by the receiver to the end
RANK_SHAPES = [[], [4], [2, 3], [2, 0, 5], [3, 1, 2]]

PROGRAM = f"""
import hashlib
SIZES = {SIZES!r}
KEPT_STEP = {KEPT_STEP}
RANK_SHAPES = {RANK_SHAPES!r}
plan = tf_rdma.Plan([
    tf_rdma.Transfer("grow", "worker:0", "worker:1", "float32", [None], dynamic=True),
    tf_rdma.Transfer("rank", "worker:0", "worker:1", "int64", None, dynamic=True),
    tf_rdma.Transfer("wrong", "worker:0", "worker:1", "int32", [None, 3], dynamic=True),
], name="dyn", depth=16)  # the receiver holds one tensor across steps
start()

def sha(a):
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()

def vector(step):
    n = SIZES[step - 1]
    return (np.arange(n, dtype=np.float32) * 0.5 + step).astype(np.float32)

def tensor_of_rank(i):
    shape = RANK_SHAPES[i]
    return np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape) * 7 - i

if task == "worker:0":
    @tf.function
    def send_grow(x):
        tf_rdma.ops.send(x, plan, "grow")
    for step in range(1, len(SIZES) + 1):
        send_grow(tf.constant(vector(step)))
    for i in range(len(RANK_SHAPES)):
        tf_rdma.ops.send(tf.constant(tensor_of_rank(i)), plan, "rank")
    try:
        tf_rdma.ops.send(tf.zeros([4, 2], tf.int32), plan, "wrong")
        result({{"wrong": "accepted"}})
    except tf_rdma.errors.PlanError as e:
        result({{"wrong": str(e)}})
    try:  # past the Python check: the kernel checks too
        tf_rdma.ops.raw_ops().tf_rdma_send(
            tf.zeros([4, 2], tf.int32), **plan.op_attrs("wrong", "send", 5000))
        result({{"wrong_kernel": "accepted"}})
    except tf.errors.InvalidArgumentError as e:
        result({{"wrong_kernel": e.message}})
    wait_file("done", timeout=120)
else:
    kept = None
    got = []
    for step in range(1, len(SIZES) + 1):
        y = tf_rdma.ops.recv(plan, "grow")
        got.append([list(y.shape), sha(y.numpy()) == sha(vector(step))])
        if step == KEPT_STEP:
            kept = y
    kept_ok = sha(kept.numpy()) == sha(vector(KEPT_STEP))
    ranks = []
    for i in range(len(RANK_SHAPES)):
        y = tf_rdma.ops.recv(plan, "rank")
        ranks.append([list(y.shape), bool(np.array_equal(y.numpy(), tensor_of_rank(i)))])
    result({{"got": got, "kept_ok": kept_ok, "ranks": ranks}})
    touch("done")
"""


@pytest.mark.parametrize("transport", DATA_PATH_TRANSPORTS)
def test_dynamic_path(transport, tmp_path):
    use_transport(transport)
    out = run_tasks({"worker:0": PROGRAM, "worker:1": PROGRAM},
                    cluster=make_cluster(2),
                    env={"TF_RDMA_TRANSPORT": transport,
                         "TF_RDMA_TIMEOUT": "30",
                         "TEST_SYNC_DIR": str(tmp_path)},
                    timeout=240)
    receiver = out["worker:1"].result
    assert receiver["got"] == [[[n], True] for n in SIZES]
    # The tensor of step KEPT_STEP lives in an older payload area than the
    # 1.2M-element step's; holding it across the growth kept it intact.
    assert receiver["kept_ok"] is True
    assert receiver["ranks"] == [[s, True] for s in RANK_SHAPES]
    sender = {k: v for r in out["worker:0"].results for k, v in r.items()}
    assert "(4, 2)" in sender["wrong"] and "[None, 3]" in sender["wrong"], sender
    assert "[4,2]" in sender["wrong_kernel"] and "[?,3]" in sender["wrong_kernel"], sender
