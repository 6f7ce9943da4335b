"""Collectives (tf_rdma.collectives) between real processes, against numpy.

Every algorithm x kind x dtype x size runs in P real processes (P = 2, 3, 4)
over shared memory; each rank checks its own output against a numpy
reference computed from every rank's input (the inputs are a deterministic
function of rank, dtype and size, so every rank can compute all of them).

Exactness and the stated bound: the matrix inputs are small integers
(|x| <= 3, products of at most 4 of them), so sum, prod, min and max are
exact in every dtype and in any order of evaluation, and the outputs must be
bit-identical to numpy's. mean divides the exact sum by P: integers truncate
toward zero (C++ division, stated in the API), floats must be within one
rounding of the quotient (relative 2^-(mantissa bits)). A second sweep uses
random non-integer floats, where the order of the additions matters; there
the bound is the classic one for a sum of P terms:
|y - ref| <= (P - 1) * eps * sum_i |x_i| (+ one rounding for mean).
"""

import json
import os

import pytest

from conftest import make_cluster, run_tasks, use_transport
from tf_rdma.collectives import ALGORITHMS

# The body every rank runs; MATRIX(P) is substituted.
MATRIX = r"""
import functools, itertools
start()
from tf_rdma import collectives as C
g = C.default_group()
P, r = g.size, g.rank
DTYPES = ["float16", "bfloat16", "float32", "float64", "int8", "int16",
          "int32", "int64", "uint8", "uint16", "uint32", "uint64",
          "complex64", "complex128"]
SIZES = [0, 1, 7, 4096 + 3, 1 << 18, 1 << 22]   # elements (float32: up to 16 MiB)
ALGS = list(C.ALGORITHMS)
KINDS = ["allreduce", "broadcast", "reduce", "allgather"]
REDS = ["sum", "mean", "min", "max", "prod"]
# 1 MiB and 16 MiB (float32) for two dtypes: the small sizes cover every
# dtype's reduction kernels, the large ones the pipelining (many blocks).
BIG_DTYPES = {"float32": 1 << 22, "int32": 1 << 18}

def np_dtype(name):
    if name == "bfloat16":
        return tf.bfloat16.as_numpy_dtype
    return np.dtype(name)

def data(rank, dtype, n, seed=0):
    rng = np.random.default_rng([rank, n, DTYPES.index(dtype), seed])
    lo = 0 if dtype.startswith("uint") else -3
    v = rng.integers(lo, 4, size=n)
    if dtype.startswith("complex"):
        v = v + 1j * rng.integers(-3, 4, size=n)
    return v.astype(np.complex128 if dtype.startswith("complex") else np.float64)

# Every rank's input, computed once: each (dtype, n) recurs for every
# algorithm, kind and reduction.
@functools.lru_cache(maxsize=None)
def inputs(dtype, n):
    return tuple(data(q, dtype, n) for q in range(P))

def reference(kind, red, dtype, n, root):
    xs = inputs(dtype, n)
    if kind == "broadcast":
        return xs[root]
    if kind == "allgather":
        return np.concatenate(xs)
    if red in ("sum", "mean"):
        v = sum(xs)
    elif red == "prod":
        v = np.prod(xs, axis=0)
    elif red == "min":
        v = np.min(xs, axis=0)
    else:
        v = np.max(xs, axis=0)
    if red == "mean":
        if dtype.startswith(("int", "uint")):
            v = np.sign(v) * (np.abs(v) // P)
        else:
            v = v / P
    if kind == "reduce" and r != root:
        return xs[r]
    return v

def check(y, ref, dtype, red):
    y = np.asarray(y)
    if dtype in ("float16", "bfloat16", "float32", "float64") and red == "mean":
        bits = {"float16": 11, "bfloat16": 8, "float32": 24, "float64": 53}[dtype]
        return np.allclose(y.astype(np.float64), ref, rtol=2.0 ** -bits, atol=0)
    if dtype.startswith("complex") and red == "mean":
        return np.allclose(y.astype(np.complex128), ref, rtol=1e-6, atol=0)
    return np.array_equal(y.astype(ref.dtype), ref)

bad, count = [], 0
for alg, kind, dtype, n in itertools.product(ALGS, KINDS, DTYPES, SIZES):
    if n > 4099 and n > BIG_DTYPES.get(dtype, 0):
        continue
    if kind in ("allreduce", "reduce"):
        reds = REDS if n == 7 else [REDS[(len(dtype) + n) % len(REDS)]]
    else:
        reds = ["sum"]
    for red in reds:
        if dtype.startswith("complex") and red in ("min", "max"):
            continue
        root = (n + len(dtype)) % P
        x = tf.constant(inputs(dtype, n)[r].astype(np_dtype(dtype)))
        block = 4096 if n < (1 << 18) else 1 << 20
        if kind == "allreduce":
            y = C.all_reduce(x, reduction=red, algorithm=alg, block_bytes=block)
        elif kind == "reduce":
            y = C.reduce(x, root=root, reduction=red, algorithm=alg, block_bytes=block)
        elif kind == "broadcast":
            y = C.broadcast(x, root=root, algorithm=alg, block_bytes=block)
        else:
            y = C.all_gather(x, algorithm=alg, block_bytes=block)
        count += 1
        if not check(y.numpy(), reference(kind, red, dtype, n, root), dtype, red):
            bad.append([alg, kind, dtype, n, red])

# Random floats: rounding depends on the order; the stated bound holds.
for alg in ALGS:
    for dtype, eps in (("float32", 2.0 ** -24), ("float64", 2.0 ** -53)):
        xs = [np.random.default_rng([q, 99]).standard_normal(10007) for q in range(P)]
        y = C.all_reduce(tf.constant(xs[r].astype(dtype)), algorithm=alg,
                         block_bytes=4096).numpy().astype(np.float64)
        exact = sum(x.astype(dtype).astype(np.float64) for x in xs)
        bound = (P - 1) * eps * sum(np.abs(x) for x in xs) + eps * np.abs(exact)
        count += 1
        if not np.all(np.abs(y - exact) <= bound):
            bad.append([alg, "allreduce-random", dtype, 10007, "sum"])

# A result of at least 8 MiB streams its last copies (StreamCopy in
# kernels/engine/collective.cc); an odd length puts the chunks' and the
# pieces' ends inside 16-byte lines, so the copy's head and tail are needed.
n = (1 << 21) + 13
for alg in ALGS:
    for kind in ("allreduce", "broadcast", "allgather"):
        x = tf.constant(inputs("float32", n)[r].astype(np.float32))
        root = P - 1
        if kind == "allreduce":
            y = C.all_reduce(x, algorithm=alg, block_bytes=1 << 20)
        elif kind == "broadcast":
            y = C.broadcast(x, root=root, algorithm=alg, block_bytes=1 << 20)
        else:
            y = C.all_gather(x, algorithm=alg, block_bytes=1 << 20)
        count += 1
        if not check(y.numpy(), reference(kind, "sum", "float32", n, root),
                     "float32", "sum"):
            bad.append([alg, kind, "float32", n, "streamed"])
result({"bad": bad, "count": count})
"""


@pytest.mark.parametrize("P", [2, 3, 4])
def test_every_algorithm_kind_dtype_and_size_matches_numpy(P):
    out = run_tasks({f"/job:worker/task:{i}": MATRIX for i in range(P)},
                    cluster=make_cluster(P), timeout=600)
    for task, res in out.items():
        assert res.result["count"] > 1000, task
        assert res.result["bad"] == [], (task, res.result["bad"][:20])


ODD_SIZES = r"""
start()
from tf_rdma import collectives as C
g = C.default_group()
# GROUP_SIZES: the groups of the first N tasks to run the schedules in, one
# after another (a task not in a group goes on to the next); default: all.
bad = {}
for size in json.loads(os.environ.get("GROUP_SIZES", "null")) or [g.size]:
    if g.rank >= size:
        continue
    group = g if size == g.size else C.Group(g.tasks[:size])
    P, r = group.size, group.rank
    bad[size] = []
    for alg in C.ALGORITHMS:
        for n in [1, 5, 1000]:
            x = np.arange(n, dtype=np.int64) * (r + 1)
            y = C.all_reduce(tf.constant(x), algorithm=alg, group=group,
                             block_bytes=64).numpy()
            if not np.array_equal(y, np.arange(n) * sum(range(1, P + 1))):
                bad[size].append(["allreduce", alg, n])
            # Channels of 1 and 2 blocks: lp's one pipeline (up and down
            # the chain at once) and oneshot's sends to everyone first must
            # not deadlock where few blocks are in flight.
            for depth in (1, 2):
                y = C.all_reduce(tf.constant(x), algorithm=alg, group=group,
                                 block_bytes=64, depth=depth,
                                 name=f"depth{depth}/{alg}/{n}/{size}").numpy()
                if not np.array_equal(y, np.arange(n) *
                                      sum(range(1, P + 1))):
                    bad[size].append(["allreduce", alg, n, "depth", depth])
            for root in range(P):
                y = C.broadcast(tf.constant(x), root=root, algorithm=alg,
                                group=group, block_bytes=64).numpy()
                if not np.array_equal(y, np.arange(n) * (root + 1)):
                    bad[size].append(["broadcast", alg, n, root])
                y = C.reduce(tf.constant(x), root=root, algorithm=alg,
                             reduction="max", group=group, block_bytes=64).numpy()
                want = np.arange(n) * P if r == root else x
                if not np.array_equal(y, want):
                    bad[size].append(["reduce", alg, n, root])
            y = C.all_gather(tf.constant(x.reshape(n, 1)), algorithm=alg,
                             group=group, block_bytes=64).numpy()
            if not np.array_equal(y[:, 0], np.concatenate(
                    [np.arange(n) * (q + 1) for q in range(P)])):
                bad[size].append(["allgather", alg, n])
result({"bad": bad})
"""

ODD_GROUP_SIZES = [5, 6, 7]


@pytest.fixture(scope="module")
def odd_groups():
    """One cluster of 7 tasks runs the schedules in the group of its first
    5 tasks, then of its first 6, then of all 7: {task: {size: bad}}."""
    P = max(ODD_GROUP_SIZES)
    out = run_tasks({f"/job:worker/task:{i}": ODD_SIZES for i in range(P)},
                    cluster=make_cluster(P), timeout=300,
                    env={"GROUP_SIZES": json.dumps(ODD_GROUP_SIZES)})
    return {task: res.result["bad"] for task, res in out.items()}


@pytest.mark.parametrize("P", ODD_GROUP_SIZES)
def test_group_sizes_that_are_not_powers_of_two_with_every_root(odd_groups, P):
    """rhd's fold, the tree's uneven subtrees and every root, with tiny blocks."""
    for i in range(P):
        bad = odd_groups[f"/job:worker/task:{i}"]
        assert bad[str(P)] == [], (i, bad[str(P)][:20])


@pytest.mark.parametrize("transport", ["tcp", "verbs"])
def test_every_algorithm_over_tcp_and_verbs(transport):
    """The same schedules with the TCP transport (the receiving side's
    progress thread applies each block, shorter last blocks included) and,
    on an RDMA host, verbs (blocks forwarded from registered channels)."""
    use_transport(transport)
    out = run_tasks({f"/job:worker/task:{i}": ODD_SIZES for i in range(3)},
                    cluster=make_cluster(3), timeout=300,
                    env={"TF_RDMA_TRANSPORT": transport})
    for task, res in out.items():
        assert f"uses {transport}" in res.stderr and "uses shm" not in res.stderr, res.stderr
        assert res.result["bad"] == {"3": []}, (task, res.result["bad"])


INLINE = r"""
import time
start()
import tf_rdma, tf_rdma.counters
from tf_rdma import collectives as C
g = C.default_group()
P, r = g.size, g.rank
LATE = 1  # the rank that arrives late on the odd calls
x = np.arange(1000, dtype=np.int64) * (r + 1) - 7 * r
xs = [np.arange(1000, dtype=np.int64) * (q + 1) - 7 * q for q in range(P)]
def call(kind, i):
    name = f"inline/{kind}"
    if kind == "allreduce":
        return C.all_reduce(tf.constant(x), algorithm="oneshot", name=name), sum(xs)
    if kind == "reduce":
        root = i % P
        want = np.max(xs, axis=0) if r == root else x
        return C.reduce(tf.constant(x), root=root, reduction="max",
                        algorithm="oneshot", name=f"{name}/{root}"), want
    if kind == "broadcast":
        root = i % P
        return C.broadcast(tf.constant(x), root=root, algorithm="oneshot",
                           name=f"{name}/{root}"), xs[root]
    if kind == "bucket":  # 100 + 900 int64, padded by the op to 104 + 904
        ys = C.all_reduce([tf.constant(x[:100]), tf.constant(x[100:])],
                          algorithm="oneshot", name=name)
        return tf.concat(ys, 0), sum(xs)
    return (C.all_gather(tf.constant(x.reshape(-1, 2)), algorithm="oneshot",
                         name=name), np.concatenate(xs).reshape(-1, 2))
bad, late_calls = [], {}
for kind in ("allreduce", "reduce", "broadcast", "allgather", "bucket"):
    for i in range(2 * P):  # a first call of each: connecting
        y, want = call(kind, i)
        if not np.array_equal(y.numpy(), want):
            bad.append([kind, i, "first"])
    before = tf_rdma.stats()
    for i in range(8):
        late = i % 2 == 1
        if late and r == LATE:
            time.sleep(0.2)
        y, want = call(kind, i)
        if not np.array_equal(y.numpy(), want):
            bad.append([kind, i, late])
    d = tf_rdma.counters.difference(tf_rdma.stats(), before)
    late_calls[kind] = [d["collectives_inline"], d["collectives_handed_off"]]
# The same bits whether the call is one block (the inline path) or many
# (OneShot() on an engine thread): the same operands in the same order.
f = np.random.default_rng([r, 5]).standard_normal(4099).astype(np.float32)
one = C.all_reduce(tf.constant(f), algorithm="oneshot", name="bits/one")
many = C.all_reduce(tf.constant(f), algorithm="oneshot", block_bytes=256,
                    name="bits/many")
same_bits = bool(np.array_equal(one.numpy().view(np.int32),
                                many.numpy().view(np.int32)))
result({"bad": bad, "late_calls": late_calls, "same_bits": same_bits})
"""


def test_oneshot_completes_inline_unless_it_must_wait():
    """A small oneshot collective completes on the op's thread when its
    peers' blocks are there, and hands off to an engine thread when one is
    late; both give numpy's result, and the same bits as many blocks. A
    small bucket is one block too (its block covers the op's padding)."""
    P = 3
    out = run_tasks({f"/job:worker/task:{i}": INLINE for i in range(P)},
                    cluster=make_cluster(P), timeout=240)
    for i in range(P):
        res = out[f"/job:worker/task:{i}"].result
        assert res["bad"] == [] and res["same_bits"], (i, res)
        for kind, (inline, handed_off) in res["late_calls"].items():
            assert inline + handed_off == 8, (i, kind, res["late_calls"])
            if kind in ("allreduce", "allgather", "bucket"):
                # The late rank finds every block there on its 4 late
                # calls; the others wait 0.2 s for it, on an engine thread.
                if i == 1:
                    assert inline >= 4, (i, kind, res["late_calls"])
                else:
                    assert handed_off >= 4, (i, kind, res["late_calls"])


PIECES = r"""
start()
from tf_rdma import collectives as C
g = C.default_group()
P, r = g.size, g.rank
SIZES = [1000, 70001, 3, 0, 65536, 20000]  # 156540 elements: above 256 KiB
def bucket(q, dtype):
    rng = np.random.default_rng([q, len(dtype)])
    return [rng.integers(-3, 4, size=n).astype(dtype) for n in SIZES]
bad, count = [], 0
for dtype in ("float32", "int64"):
    mine = [tf.constant(x) for x in bucket(r, dtype)]
    everyone = [bucket(q, dtype) for q in range(P)]
    for alg in C.ALGORITHMS:
        for block in (4096, 1 << 20):
            ys = C.all_reduce(mine, algorithm=alg, block_bytes=block,
                              name=f"pieces/{dtype}/{alg}/{block}")
            for i, y in enumerate(ys):
                count += 1
                if not np.array_equal(y.numpy(), sum(b[i] for b in everyone)):
                    bad.append(["allreduce", dtype, alg, block, i])
            root = (len(dtype) + block) % P
            ys = C.reduce(mine, root=root, reduction="max", algorithm=alg,
                          block_bytes=block,
                          name=f"pieces/max/{dtype}/{alg}/{block}")
            for i, y in enumerate(ys):
                count += 1
                want = (np.max([b[i] for b in everyone], axis=0)
                        if r == root else bucket(r, dtype)[i])
                if not np.array_equal(y.numpy(), want):
                    bad.append(["reduce", dtype, alg, block, i])
    # A group of one: the result is the rank's own input, which the call
    # must copy out of the pieces (and out of an input it cannot take over:
    # `x` stays referenced here) into its output.
    alone = C.Group([g.tasks[r]])
    x = tf.constant(bucket(r, dtype)[1])
    for alg in C.ALGORITHMS:
        for kind, call in (("allreduce", C.all_reduce), ("reduce", C.reduce)):
            ys = call(mine, group=alone, algorithm=alg,
                      name=f"alone/{kind}/{dtype}/{alg}")
            ys.append(call(x, group=alone, algorithm=alg,
                           name=f"alone1/{kind}/{dtype}/{alg}"))
            for i, y in enumerate(ys):
                count += 1
                if not np.array_equal(y.numpy(), bucket(r, dtype)[i % 6]
                                      if i < 6 else x.numpy()):
                    bad.append([kind + " alone", dtype, alg, i])
result({"bad": bad, "count": count})
"""


@pytest.mark.parametrize("P", [2, 3])
def test_a_large_bucket_is_read_where_its_tensors_are(P):
    """Buckets of 256 KiB and more go to the collective as input pieces
    (no copy into one buffer): blocks that span two tensors, an empty
    tensor and the padding between tensors, every algorithm, against numpy;
    in a group of one too (its result is the input, copied from the pieces)."""
    out = run_tasks({f"/job:worker/task:{i}": PIECES for i in range(P)},
                    cluster=make_cluster(P), timeout=400)
    for task, res in out.items():
        assert res.result["count"] == 2 * len(ALGORITHMS) * (2 * 2 * 6 + 2 * 7), task
        assert res.result["bad"] == [], (task, res.result["bad"][:20])


def test_buckets_in_tf_function_subgroups_auto_and_calibrate():
    program = r"""
start()
from tf_rdma import collectives as C
g = C.default_group()
r = g.rank
shapes = [[3], [5, 7], [], [0], [1000]]

@tf.function
def step(scale):
    ts = [tf.fill(s, scale * (r + 1)) for s in shapes]
    return C.all_reduce(ts, reduction="mean", name="bucket0")

outs = [step(tf.constant(float(k))) for k in (1, 2, 3)]
# mean over ranks of k * (r + 1) = k * (1 + 2 + 3) / 3 = 2k, every element.
ok = [all(bool(np.all(o.numpy() == 2.0 * k)) for o in out)
      for k, out in zip((1, 2, 3), outs)]
shapes_out = [list(o.shape) for o in outs[0]]
# A subgroup of the first two tasks; the third runs nothing.
pair = None
if r < 2:
    pair = C.all_reduce(tf.constant([r + 1.0]), group=C.Group(g.tasks[:2]),
                        algorithm="auto").numpy().tolist()
auto = C.all_reduce(tf.ones([300000]), algorithm="auto").numpy()
params = C.calibrate(probe_bytes=1 << 16, repeats=2)
result({"ok": ok, "shapes": shapes_out, "pair": pair,
        "auto_ok": bool(np.all(auto == 3.0)),
        "params": [params.alpha, params.beta, params.gamma, params.delta]})
"""
    out = run_tasks({f"/job:worker/task:{i}": program for i in range(3)},
                    cluster=make_cluster(3), timeout=180)
    for task, res in out.items():
        got = res.result
        assert got["shapes"] == [[3], [5, 7], [], [0], [1000]]
        assert got["ok"] == [True, True, True], (task, got["ok"])
        assert got["auto_ok"]
        assert all(v > 0 for v in got["params"]), got["params"]
        if task.endswith(("task:0", "task:1")):
            assert got["pair"] == [3.0]
    # calibrate(): rank 0 measures, every rank uses rank 0's numbers.
    assert len({tuple(r.result["params"]) for r in out.values()}) == 1


def test_bad_arguments_raise_collective_error():
    program = r"""
start()
from tf_rdma import collectives as C
from tf_rdma.errors import CollectiveError
errors = {}
def attempt(label, fn):
    try:
        fn()
        errors[label] = None
    except CollectiveError as e:
        errors[label] = str(e)
attempt("mixed", lambda: C.all_reduce([tf.ones([2]), tf.ones([2], tf.int32)]))
attempt("complex_max", lambda: C.all_reduce(tf.ones([2], tf.complex64), reduction="max"))
attempt("root", lambda: C.broadcast(tf.ones([2]), root=5))
attempt("algorithm", lambda: C.all_reduce(tf.ones([2]), algorithm="butterfly"))
attempt("reduction", lambda: C.all_reduce(tf.ones([2]), reduction="median"))
attempt("scalar_gather", lambda: C.all_gather(tf.ones([])))
attempt("string", lambda: C.all_reduce(tf.constant(["a"])))
attempt("block", lambda: C.all_reduce(tf.ones([2]), block_bytes=2))
attempt("not_in_group", lambda: C.Group(["/job:worker/task:7"]))
attempt("timeout", lambda: C.all_reduce(tf.ones([2]), timeout=-1))
result(errors)
"""
    out = run_tasks({"/job:worker/task:0": program}, cluster=make_cluster(1),
                    timeout=120)
    errors = out["/job:worker/task:0"].result
    expected = {"mixed": "float32 and int32", "complex_max": "complex64",
                "root": "root 5", "algorithm": "butterfly",
                "reduction": "median", "scalar_gather": "scalar",
                "string": "string", "block": "block_bytes 2",
                "not_in_group": "task:0", "timeout": "-1"}
    for label, fragment in expected.items():
        assert errors[label] is not None, f"{label}: no error"
        assert fragment in errors[label], (label, errors[label])


def test_an_instance_refuses_another_layout_after_many_calls():
    """Admission checks a call's layout against its instance's once per
    spec, not once per call: after calls with one spec, a call that changes
    any field of the layout still fails naming both hashes, and the first
    spec (and a timeout, which is no part of the layout) still runs."""
    program = r"""
start()
from tf_rdma import collectives as C
from tf_rdma.errors import CollectiveError
x = tf.ones([4])
def call(tensor=x, fn=C.all_reduce, **kw):
    args = dict(algorithm="oneshot", block_bytes=64, name="one/instance")
    args.update(kw)
    return fn(tensor, **args)
outcome = {}
for label, kw in [("first", {}), ("again", {}),
                  ("count", {"tensor": tf.ones([5])}),
                  ("dtype", {"tensor": tf.ones([4], tf.float64)}),
                  ("algorithm", {"algorithm": "ring"}),
                  ("block", {"block_bytes": 128}),
                  ("reduction", {"reduction": "max"}),
                  ("kind", {"fn": C.broadcast}),
                  ("depth", {"depth": 2}),
                  ("first_again", {}),
                  ("timeout", {"timeout": 30.0})]:
    try:
        y = call(**kw)
        outcome[label] = "ok" if np.array_equal(y.numpy(), np.ones(4)) else "wrong"
    except (CollectiveError, tf.errors.InvalidArgumentError) as e:
        outcome[label] = str(e)
result(outcome)
"""
    out = run_tasks({"/job:worker/task:0": program}, cluster=make_cluster(1),
                    timeout=120)
    outcome = out["/job:worker/task:0"].result
    for label in ("first", "again", "first_again", "timeout"):
        assert outcome[label] == "ok", (label, outcome)
    for label in ("count", "dtype", "algorithm", "block", "reduction", "kind",
                  "depth"):
        assert "another layout" in outcome[label], (label, outcome)


def test_dimensions_known_only_at_run_time():
    """A tensor whose static shape has None (a gradient whose shape
    TensorFlow lost) is reduced at its run-time size; a later call of the
    instance with another size fails naming both layouts, and ranks whose
    sizes differ fail naming the hashes, within the timeout."""
    program = r"""
start(timeout=5)
from tf_rdma import collectives as C
from tf_rdma.errors import CollectiveError
r = C.default_group().rank

@tf.function(input_signature=[tf.TensorSpec([None, 3], tf.float32)])
def reduce(x):
    assert x.shape.as_list() == [None, 3]
    return C.all_reduce(x, name="unknown/rows")

out = {"sum": reduce(tf.fill([4, 3], r + 1.0)).numpy().tolist()}
out["again"] = reduce(tf.fill([4, 3], r + 2.0)).numpy().tolist()
for label, rows in (("changed", 5), ("ranks_differ", 6 + r)):
    t = time.monotonic()
    try:
        f = tf.function(lambda x: C.all_reduce(x, name=label),
                        input_signature=[tf.TensorSpec([None, 3])])
        if label == "changed":
            reduce(tf.ones([rows, 3]))
        else:
            f(tf.ones([rows, 3]))
        out[label] = None
    except (tf.errors.OpError, CollectiveError) as e:
        out[label] = [str(e), time.monotonic() - t]
result(out)
"""
    out = run_tasks({f"/job:worker/task:{i}": program for i in range(2)},
                    cluster=make_cluster(2), timeout=120)
    for task, res in out.items():
        got = res.result
        assert got["sum"] == [[3.0] * 3] * 4, (task, got)
        assert got["again"] == [[5.0] * 3] * 4, (task, got)
        assert "another layout" in got["changed"][0], (task, got)
        message, seconds = got["ranks_differ"]
        assert "hash" in message, (task, message)
        assert seconds < 30, (task, seconds)


def test_a_killed_peer_fails_the_others_naming_collective_and_peer(tmp_path):
    """Rank 1 is SIGKILLed 0.2 s into a run of long allreduces (128 MiB in
    1 KiB blocks: 130k blocks a phase) that rank 0 is in too; rank 0 fails at
    once with an error naming the collective, its instance and the peer,
    instead of hanging. Both ranks repeat the call, so the kill lands inside
    one however fast the machine moves the blocks (a single call once ended
    before 0.2 s)."""
    victim = r"""
import signal, threading
start()
from tf_rdma import collectives as C
C.all_reduce(tf.ones([8]), name="warmup")
big = tf.ones([1 << 25])
wait_file("survivor-in")
threading.Timer(0.2, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
while True:
    C.all_reduce(big, algorithm="ring", block_bytes=1024, name="grads/bucket3")
"""
    survivor = r"""
start(timeout=20)
from tf_rdma import collectives as C
C.all_reduce(tf.ones([8]), name="warmup")
big = tf.ones([1 << 25])
touch("survivor-in")
got = {"error": None}
for calls in range(200):
    t = time.monotonic()
    try:
        C.all_reduce(big, algorithm="ring", block_bytes=1024,
                     name="grads/bucket3")
    except tf.errors.OpError as e:
        got = {"error": type(e).__name__, "message": e.message,
               "seconds": time.monotonic() - t, "calls_before": calls}
        break
result(got)
"""
    out = run_tasks({"/job:worker/task:0": survivor,
                     "/job:worker/task:1": victim},
                    cluster=make_cluster(2), timeout=120, check=False,
                    env={"TEST_SYNC_DIR": str(tmp_path)})
    assert out["/job:worker/task:1"].returncode == -9
    got = out["/job:worker/task:0"].result
    assert got["error"] in ("UnavailableError", "DeadlineExceededError"), got
    assert "allreduce 'grads/bucket3'" in got["message"], got
    assert "/job:worker/task:1" in got["message"], got
    assert got["seconds"] < 25, got


def test_a_stalled_peer_times_out_and_a_mismatch_names_both_hashes(tmp_path):
    rank0 = r"""
start(timeout=3)
from tf_rdma import collectives as C
out = {}
t = time.monotonic()
try:
    C.all_reduce(tf.ones([1000]), algorithm="ring", block_bytes=256, name="stalled")
except tf.errors.DeadlineExceededError as e:
    out["stalled"] = [e.message, time.monotonic() - t]
try:
    C.all_reduce(tf.ones([1000]), algorithm="ring", block_bytes=256, name="mismatch")
except tf.errors.OpError as e:
    out["mismatch"] = [type(e).__name__, e.message]
touch("done")
result(out)
"""
    rank1 = r"""
start(timeout=3)
from tf_rdma import collectives as C
time.sleep(5)   # never joins "stalled"
try:
    C.all_reduce(tf.ones([1000]), algorithm="ring", block_bytes=512, name="mismatch")
except tf.errors.OpError as e:
    pass
wait_file("done")
"""
    out = run_tasks({"/job:worker/task:0": rank0, "/job:worker/task:1": rank1},
                    cluster=make_cluster(2), timeout=120,
                    env={"TEST_SYNC_DIR": str(tmp_path)})
    got = out["/job:worker/task:0"].result
    message, seconds = got["stalled"]
    assert "allreduce 'stalled'" in message and "/job:worker/task:1" in message
    assert 2.5 < seconds < 10, seconds
    kind, message = got["mismatch"]
    assert "plan hash mismatch" in message or "hash" in message, got


def test_a_call_waiting_for_an_earlier_call_of_its_instance_is_bounded(tmp_path):
    """A call that finds its instance busy (an earlier call of it, in
    another thread, waits for a peer that never comes) fails after its own
    timeout, saying why, instead of waiting as long as the earlier call."""
    rank0 = r"""
start(timeout=8)
import threading
from tf_rdma import collectives as C
C.all_reduce(tf.ones([8]), algorithm="ring", name="busy").numpy()
first = {}
def earlier():
    first["error"] = error_of(lambda: C.all_reduce(
        tf.ones([8]), algorithm="ring", name="busy").numpy())
thread = threading.Thread(target=earlier)
thread.start()
time.sleep(0.5)
later = error_of(lambda: C.all_reduce(tf.ones([8]), algorithm="ring",
                                      name="busy", timeout=1).numpy())
thread.join()
touch("done")
result({"later": later, "first": first["error"]})
"""
    rank1 = r"""
start(timeout=8)
from tf_rdma import collectives as C
C.all_reduce(tf.ones([8]), algorithm="ring", name="busy").numpy()
wait_file("done")
"""
    out = run_tasks({"/job:worker/task:0": rank0, "/job:worker/task:1": rank1},
                    cluster=make_cluster(2), timeout=120,
                    env={"TEST_SYNC_DIR": str(tmp_path)})
    got = out["/job:worker/task:0"].result
    later, first = got["later"], got["first"]
    assert later["type"] == "DeadlineExceededError", got
    assert "earlier call of this instance" in later["message"], got
    assert "allreduce 'busy'" in later["message"], got
    assert later["elapsed_s"] < 5, got  # not the earlier call's 8 s
    assert first["type"] == "DeadlineExceededError", got
    assert "/job:worker/task:1" in first["message"], got


def test_a_oneshot_call_that_times_out_ends_every_wait_it_began(tmp_path):
    """Rank 0's oneshot call writes to both peers and polls for both their
    blocks on its own thread, hands off, and times out on the first; the
    wait for the second, never finished, is given up too: the process's
    data-wait clock stops."""
    rank0 = r"""
start(timeout=1)
import tf_rdma, tf_rdma.counters
from tf_rdma import collectives as C
C.all_reduce(tf.ones([100]), algorithm="oneshot", name="alone").numpy()
error = error_of(lambda: C.all_reduce(tf.ones([100]), algorithm="oneshot",
                                      name="alone").numpy())
before = tf_rdma.stats()
time.sleep(1.0)
d = tf_rdma.counters.difference(tf_rdma.stats(), before)
touch("done")
result({"error": error, "busy": d["data_wait_busy_seconds"]})
"""
    others = r"""
start(timeout=1)
from tf_rdma import collectives as C
C.all_reduce(tf.ones([100]), algorithm="oneshot", name="alone").numpy()
wait_file("done")
"""
    out = run_tasks({"/job:worker/task:0": rank0, "/job:worker/task:1": others,
                     "/job:worker/task:2": others},
                    cluster=make_cluster(3), timeout=120,
                    env={"TEST_SYNC_DIR": str(tmp_path)})
    got = out["/job:worker/task:0"].result
    assert got["error"] is not None, got
    assert "allreduce 'alone'" in got["error"]["message"], got
    assert got["busy"] < 0.1, got  # 1.0 if a wait were left running


# all_gather_v: 3 ranks with different row counts (one with none), counts
# that change from call to call, every algorithm, inside a tf.function with
# an unknown first dimension; then a rank whose rows have another width:
# every rank fails with both shapes, none hangs.
GATHER_V = r"""
start(timeout=20)
from tf_rdma import collectives as C
g = C.default_group()
P, r = g.size, g.rank
def rows(rank, call):
    n = (rank * 3 + call) % 5 if rank != 1 else 0 if call == 0 else call
    return np.arange(n * 4, dtype=np.float32).reshape(n, 4) + 100 * rank + call

@tf.function(input_signature=[tf.TensorSpec([None, 4], tf.float32)])
def gather(x):
    return C.all_gather_v(x, algorithm=ALG, name="gv/" + ALG)

out = {}
for ALG in C.ALGORITHMS:
    ok = []
    for call in range(4):
        y = gather(tf.constant(rows(r, call))).numpy()
        want = np.concatenate([rows(q, call) for q in range(P)])
        ok.append(y.shape == want.shape and np.array_equal(y, want))
    out[ALG] = ok
idx = C.all_gather_v(tf.constant([r] * (r + 1), tf.int64), name="gv/idx")
out["int64"] = idx.numpy().tolist()
# unnamed: the default name must not follow this rank's row count
idx = C.all_gather_v(tf.constant([r] * (r + 1), tf.int64), timeout=20)
out["unnamed"] = idx.numpy().tolist()
try:
    width = 4 if r != 2 else 5
    C.all_gather_v(tf.ones([2, width]), name="gv/bad")
    out["mismatch"] = None
except tf.errors.OpError as e:
    out["mismatch"] = type(e).__name__ + ": " + e.message
result(out)
"""


def test_all_gather_v_rows_that_differ_by_rank_and_call():
    out = run_tasks({f"/job:worker/task:{i}": GATHER_V for i in range(3)},
                    timeout=150)
    for task, res in out.items():
        r = res.result
        for alg in ALGORITHMS:
            assert r[alg] == [True] * 4, (task, alg)
        assert r["int64"] == [0, 1, 1, 2, 2, 2]
        assert r["unnamed"] == [0, 1, 1, 2, 2, 2]
        assert r["mismatch"].startswith("InvalidArgumentError"), r["mismatch"]
        assert "2 rows of 5 elements of float" in r["mismatch"] or \
            "2 rows of 4 elements of float" in r["mismatch"], r["mismatch"]
        assert "/job:worker/task:2" in r["mismatch"], r["mismatch"]


REUSE = r"""
start()
import ctypes
from tf_rdma import collectives as C
P = C.default_group().size
capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
capsule_pointer.restype = ctypes.c_void_p
capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]

def address(t):
    # Where the tensor's bytes are: a DLManagedTensor starts with its
    # DLTensor, which starts with the data pointer (the capsule shares
    # the buffer and lets go of it when it is dropped, unconsumed).
    capsule = tf.experimental.dlpack.to_dlpack(t)
    managed = capsule_pointer(capsule, b"dltensor")
    return ctypes.c_void_p.from_address(managed).value

x = tf.constant(np.arange(1 << 20, dtype=np.float32))  # 4 MiB
want = x.numpy() * P

@tf.function(autograph=False)
def in_function(t):
    return C.all_reduce(t, algorithm="ring", name="reuse/function")

calls = {
    "function": lambda: in_function(x),
    "eager": lambda: C.all_reduce(x, algorithm="ring", name="reuse/eager"),
}
seen = {name: [] for name in calls}
wrong = []
for name, call in calls.items():
    # The loop goes straight on to the next call, as a training loop does:
    # a check here would give the engine thread time to let go anyway.
    for i in range(20):
        y = call()
        seen[name].append(address(y))
        del y
    if not np.array_equal(call().numpy(), want):
        wrong.append(name)
result({"buffers": {name: len(set(a)) for name, a in seen.items()},
        "wrong": wrong})
"""


def test_a_result_dropped_before_the_next_call_gives_it_its_buffer():
    """A loop whose allreduce result is gone before the next call gets the
    same result buffer every call: the op lets go of its own references
    before it wakes the caller. It used to keep them until the engine
    thread dropped the finished call, which a caller bound to the same CPU
    outran, so the calls alternated between two buffers (twice the memory
    through the caches: a 64 MiB ring took 11 instead of 9.5 ms). Each
    rank is bound to one CPU, as `tf-rdma launch` binds its tasks."""
    cpus = sorted(os.sched_getaffinity(0))
    tasks = [f"/job:worker/task:{i}" for i in range(2)]
    out = run_tasks({t: REUSE for t in tasks}, cluster=make_cluster(2),
                    prefixes={t: ("taskset", "-c", str(cpus[i % len(cpus)]))
                              for i, t in enumerate(tasks)},
                    timeout=150)
    for task, res in out.items():
        assert res.result["wrong"] == [], (task, res.result["wrong"])
        assert res.result["buffers"] == {"function": 1, "eager": 1}, (
            task, res.result["buffers"])
