"""Data-path correctness of send/recv between two real processes.

For each transport (shm, tcp, and verbs where an RDMA device exists) one pair of processes runs every scenario in
turn (process start-up costs seconds, so the scenarios share it); each test
below checks one scenario's reports:

- bit-exact transfer of every memcpy-able dtype in awkward shapes;
- one 256 MiB tensor;
- 1,000 consecutive steps of a tf.function with depth 2;
- a received tensor that the receiver keeps (it aliases the slot) is not
  overwritten: with depth 2 while the next steps arrive, with depth 1 while
  the sender's next send times out waiting for the slot.

Each side prints one RESULT line per scenario: {"scenario": NAME, ...}.
"""

import hashlib

import numpy as np
import pytest

from conftest import DATA_PATH_TRANSPORTS, make_cluster, run_tasks, use_transport
from tf_rdma.graph_passes.plan import DTYPE_SIZES

pytestmark = pytest.mark.timeout(400)

DTYPES = ("float16", "bfloat16", "float32", "float64", "int8", "int16",
          "int32", "int64", "uint8", "uint16", "uint32", "uint64", "bool",
          "complex64", "complex128")
SHAPES = ((), (0,), (3, 0), (1,), (7,), (3, 5), (1000, 3))
MATRIX_STEPS = 2

BIG_ELEMENTS = 64 * 1024 * 1024  # float32: 256 MiB
BIG_SEED = 20240607

LOOP_STEPS = 1000
LOOP_ELEMENTS = 1024  # int32: 4 KiB
LOOP_MULTIPLIER = 7919

HELD_ELEMENTS = 512  # float64: 4 KiB


def key_of(dtype, shape):
    return f"{dtype}_{'x'.join(map(str, shape)) or 'scalar'}"


def loop_checksum(step):
    """The checksum the receiver must compute for step `step` of the loop."""
    x = np.arange(LOOP_ELEMENTS, dtype=np.int64) + step * LOOP_MULTIPLIER
    weights = np.arange(1, LOOP_ELEMENTS + 1, dtype=np.int64)
    return int(np.sum(x * weights))


PROGRAM = """
import hashlib

def key_of(dtype, shape):
    return dtype + "_" + ("x".join(map(str, shape)) or "scalar")

def sha(t):
    return hashlib.sha256(np.asarray(t.numpy()).tobytes()).hexdigest()

def make(dtype, shape, seed):
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape, dtype=np.int64))
    if dtype == "bool":
        a = rng.integers(0, 2, size=n, dtype=np.uint8).astype(bool)
    else:
        npdt = np.dtype(tf.as_dtype(dtype).as_numpy_dtype)
        raw = rng.integers(0, 256, size=n * npdt.itemsize, dtype=np.uint8)
        a = raw.view(npdt)  # any bit pattern, NaN payloads included
    return tf.constant(a.reshape(shape))

def held_value(step):
    return tf.range(HELD_ELEMENTS, dtype=tf.float64) + 1000.0 * step

SENDER, RECEIVER = "worker:0", "worker:1"
matrix = tf_rdma.Plan(
    [tf_rdma.Transfer(key_of(d, s), SENDER, RECEIVER, d, list(s))
     for d in DTYPES for s in SHAPES], name="matrix")
big = tf_rdma.Plan([tf_rdma.Transfer("big", SENDER, RECEIVER, "float32",
                                     [BIG_ELEMENTS])], name="big", depth=1)
loop = tf_rdma.Plan([tf_rdma.Transfer("loop", SENDER, RECEIVER, "int32",
                                      [LOOP_ELEMENTS])], name="loop", depth=2)
held2 = tf_rdma.Plan([tf_rdma.Transfer("held", SENDER, RECEIVER, "float64",
                                       [HELD_ELEMENTS])], name="held2", depth=2)
held1 = tf_rdma.Plan([tf_rdma.Transfer("held", SENDER, RECEIVER, "float64",
                                       [HELD_ELEMENTS])], name="held1", depth=1)

ep = start()

if task == SENDER:
    # 1. every dtype x shape, MATRIX_STEPS steps, data from a seed.
    sent = {}
    for step in range(MATRIX_STEPS):
        for i, d in enumerate(DTYPES):
            for j, s in enumerate(SHAPES):
                t = make(d, s, seed=1000 * step + 10 * i + j)
                sent.setdefault(key_of(d, s), []).append(sha(t))
                tf_rdma.ops.send(t, matrix, key_of(d, s))
    result({"scenario": "matrix", "sha": sent,
             "pair": tf_rdma.endpoint_info()["pair"]})

    # 2. one 256 MiB tensor.
    a = np.random.default_rng(BIG_SEED).random(BIG_ELEMENTS, dtype=np.float32)
    digest = hashlib.sha256(memoryview(a)).hexdigest()
    t = tf.constant(a)
    t0 = time.monotonic()
    tf_rdma.ops.send(t, big, "big")
    result({"scenario": "big", "sha": digest, "first": float(a[0]),
             "last": float(a[-1]), "send_s": time.monotonic() - t0})
    del a, t

    # 3. LOOP_STEPS steps of a tf.function.
    @tf.function
    def send_step(step):
        x = tf.range(LOOP_ELEMENTS, dtype=tf.int32) + step * LOOP_MULTIPLIER
        tf_rdma.ops.send(x, loop, "loop")
    t0 = time.monotonic()
    for step in range(1, LOOP_STEPS + 1):
        send_step(tf.constant(step, dtype=tf.int32))
    result({"scenario": "loop", "steps": LOOP_STEPS,
             "elapsed_s": time.monotonic() - t0})

    # 4a. depth 2: steps 1-4; step 3 reuses step 1's copy, which the
    # receiver holds for a while, so step 3 has to wait for it.
    for step in (1, 2):
        tf_rdma.ops.send(held_value(step), held2, "held")
    t0 = time.monotonic()
    tf_rdma.ops.send(held_value(3), held2, "held")
    step3_wait = time.monotonic() - t0
    tf_rdma.ops.send(held_value(4), held2, "held")
    result({"scenario": "held2", "step3_wait_s": step3_wait})

    # 4b. depth 1: the receiver holds step 1, so step 2 cannot be written.
    tf_rdma.ops.send(held_value(1), held1, "held")
    t0 = time.monotonic()
    try:
        tf_rdma.ops.send(held_value(2), held1, "held", timeout=2)
        error = None
    except Exception as e:  # reported, checked by the test
        error = {"type": type(e).__name__, "message": str(e)}
    elapsed = time.monotonic() - t0
    touch("held1_sender_failed")
    result({"scenario": "held1", "error": error, "elapsed_s": elapsed})
    wait_file("held1_receiver_done")
else:
    # 1.
    got = {}
    for step in range(MATRIX_STEPS):
        for d in DTYPES:
            for s in SHAPES:
                t = tf_rdma.ops.recv(matrix, key_of(d, s))
                got.setdefault(key_of(d, s), []).append(
                    {"sha": sha(t), "dtype": t.dtype.name,
                      "shape": list(t.shape)})
                del t
    result({"scenario": "matrix", "got": got,
             "pair": tf_rdma.endpoint_info()["pair"]})

    # 2.
    t = tf_rdma.ops.recv(big, "big")
    a = t.numpy()
    result({"scenario": "big",
             "sha": hashlib.sha256(memoryview(np.ascontiguousarray(a))).hexdigest(),
             "first": float(a[0]), "last": float(a[-1]),
             "dtype": t.dtype.name, "shape": list(t.shape)})
    del a, t

    # 3.
    weights = tf.range(1, LOOP_ELEMENTS + 1, dtype=tf.int64)
    @tf.function
    def recv_step():
        y = tf_rdma.ops.recv(loop, "loop")
        return tf.reduce_sum(tf.cast(y, tf.int64) * weights)
    expected_of = lambda step: int(np.sum(
        (np.arange(LOOP_ELEMENTS, dtype=np.int64) + step * LOOP_MULTIPLIER)
        * np.arange(1, LOOP_ELEMENTS + 1, dtype=np.int64)))
    mismatched = []
    sums = []
    for step in range(1, LOOP_STEPS + 1):
        got_sum = int(recv_step().numpy())
        sums.append(got_sum)
        if got_sum != expected_of(step):
            mismatched.append(step)
    result({"scenario": "loop", "mismatched_steps": mismatched[:20],
             "mismatches": len(mismatched), "steps": len(sums),
             "first_sums": sums[:3], "last_sum": sums[-1]})

    # 4a.
    t1 = tf_rdma.ops.recv(held2, "held")
    before = t1.numpy().tobytes()
    t2 = tf_rdma.ops.recv(held2, "held")
    step2_ok = t2.numpy().tobytes() == held_value(2).numpy().tobytes()
    time.sleep(1.5)  # the sender is now waiting to write step 3
    after = t1.numpy().tobytes()
    step1_ok = before == held_value(1).numpy().tobytes()
    del t1, t2
    later = [tf_rdma.ops.recv(held2, "held").numpy().tobytes() ==
             held_value(step).numpy().tobytes() for step in (3, 4)]
    result({"scenario": "held2", "step1_as_sent": step1_ok,
             "step1_unchanged": before == after, "step2_ok": step2_ok,
             "steps_3_4_ok": later})

    # 4b.
    t1 = tf_rdma.ops.recv(held1, "held")
    before = t1.numpy().tobytes()
    wait_file("held1_sender_failed")
    time.sleep(0.5)
    after = t1.numpy().tobytes()
    result({"scenario": "held1",
             "step1_as_sent": before == held_value(1).numpy().tobytes(),
             "step1_unchanged": before == after})
    del t1
    touch("held1_receiver_done")
"""


@pytest.fixture(scope="module", params=DATA_PATH_TRANSPORTS)
def run(request, tmp_path_factory):
    transport = request.param
    use_transport(transport)
    sync_dir = tmp_path_factory.mktemp(f"transfer-{transport}")
    constants = dict(
        DTYPES=DTYPES, SHAPES=SHAPES, MATRIX_STEPS=MATRIX_STEPS,
        BIG_ELEMENTS=BIG_ELEMENTS, BIG_SEED=BIG_SEED, LOOP_STEPS=LOOP_STEPS,
        LOOP_ELEMENTS=LOOP_ELEMENTS, LOOP_MULTIPLIER=LOOP_MULTIPLIER,
        HELD_ELEMENTS=HELD_ELEMENTS)
    program = "".join(f"{k} = {v!r}\n" for k, v in constants.items()) + PROGRAM
    out = run_tasks({"worker:0": program, "worker:1": program},
                    cluster=make_cluster(2),
                    env={"TF_RDMA_TRANSPORT": transport,
                         "TF_RDMA_TIMEOUT": "20",
                         "TEST_SYNC_DIR": str(sync_dir)},
                    timeout=240, check=False)
    return transport, out


def scenario(out, name):
    """Returns (sender report, receiver report) of scenario `name`."""
    found = []
    for task in ("worker:0", "worker:1"):
        reports = [r for r in out[task].results if r.get("scenario") == name]
        if not reports:
            pytest.fail(f"{task} reported nothing for scenario {name!r}\n" +
                        "\n".join(r.describe() for r in out.values()))
        found.append(reports[-1])
    return found


def test_both_tasks_exit_cleanly(run):
    _, out = run
    bad = [r for r in out.values() if r.returncode != 0]
    assert not bad, "\n".join(r.describe() for r in out.values())


def test_every_dtype_and_shape_bit_exact(run):
    transport, out = run
    sent, got = scenario(out, "matrix")
    assert sent["pair"] == [
        f"/job:worker/task:0 -> /job:worker/task:1 {transport}"]
    expected_keys = {key_of(d, s) for d in DTYPES for s in SHAPES}
    assert set(sent["sha"]) == expected_keys
    assert set(got["got"]) == expected_keys
    wrong = []
    for d in DTYPES:
        for s in SHAPES:
            key = key_of(d, s)
            assert len(got["got"][key]) == MATRIX_STEPS
            for step, (want, have) in enumerate(zip(sent["sha"][key],
                                                    got["got"][key])):
                if have["sha"] != want:
                    wrong.append(f"{key} step {step + 1}: bytes differ")
                if have["dtype"] != d:
                    wrong.append(f"{key}: dtype {have['dtype']}")
                if have["shape"] != list(s):
                    wrong.append(f"{key}: shape {have['shape']}")
            elements = int(np.prod(s))
            bits = elements * (1 if d == "bool" else 8 * DTYPE_SIZES[d])
            if bits >= 32:
                # The data really changes from step to step (seeded).
                assert len(set(sent["sha"][key])) == MATRIX_STEPS, key
            elif not elements:
                assert sent["sha"][key] == [hashlib.sha256(b"").hexdigest()] * \
                    MATRIX_STEPS
    assert not wrong, "\n".join(wrong)


def test_256_mib_tensor(run):
    _, out = run
    sent, got = scenario(out, "big")
    assert got["dtype"] == "float32"
    assert got["shape"] == [BIG_ELEMENTS]
    assert got["sha"] == sent["sha"]
    assert got["first"] == sent["first"]
    assert got["last"] == sent["last"]
    # random in [0, 1): a region left at zero would not match
    assert (sent["first"], sent["last"]) != (0.0, 0.0)


def test_thousand_steps_in_tf_function(run):
    _, out = run
    sent, got = scenario(out, "loop")
    assert sent["steps"] == LOOP_STEPS
    assert got["steps"] == LOOP_STEPS
    assert got["mismatches"] == 0, got["mismatched_steps"]
    assert got["first_sums"] == [loop_checksum(s) for s in (1, 2, 3)]
    assert got["last_sum"] == loop_checksum(LOOP_STEPS)


def test_held_tensor_is_not_overwritten_depth_2(run):
    _, out = run
    sent, got = scenario(out, "held2")
    assert got["step1_as_sent"]
    assert got["step2_ok"]
    assert got["step1_unchanged"], "step 1's tensor changed while it was held"
    assert got["steps_3_4_ok"] == [True, True]
    # Step 3 reuses step 1's copy: the sender had to wait for the release
    # (the receiver held it for 1.5 s after receiving step 2).
    assert sent["step3_wait_s"] >= 0.5, sent


def test_held_tensor_blocks_sender_depth_1(run):
    _, out = run
    sent, got = scenario(out, "held1")
    error = sent["error"]
    assert error is not None, "step 2 overwrote a slot the receiver holds"
    assert error["type"] == "DeadlineExceededError", error
    message = error["message"]
    assert "'held'" in message, message
    assert "/job:worker/task:1" in message, message
    assert "step 2" in message, message
    assert "release" in message, message
    assert 1.5 <= sent["elapsed_s"] <= 8, sent
    assert got["step1_as_sent"]
    assert got["step1_unchanged"], "the failed send overwrote the held tensor"
