"""Tests for tf_rdma.graph_passes.buckets (pure Python, no cluster)."""

import json

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tf_rdma.errors import PlanError
from tf_rdma.graph_passes import buckets as bl
from tf_rdma.graph_passes.buckets import BucketPlan, Gradient

pytestmark = pytest.mark.fast  # in `make test-fast`: no processes, no sockets


def G(key, shape, dtype="float32"):
    return Gradient(key, dtype, shape)


# A small MLP in forward (variable) order: 64-32-10.
MLP = [
    G("dense/kernel", [64, 32]),    # 8192 bytes
    G("dense/bias", [32]),          # 128 bytes
    G("dense_1/kernel", [32, 10]),  # 1280 bytes
    G("dense_1/bias", [10]),        # 40 bytes
]


# --- Known plans, numbers worked out by hand. --------------------------------


def test_reverse_order_packs_last_layers_first():
    plan = BucketPlan(MLP, bucket_bytes=2048)
    # Walk: dense_1/bias (40) @0, dense_1/kernel (1280) @64 -> end 1344;
    # dense/bias (128) @1344 -> end 1472 <= 2048; dense/kernel (8192) does
    # not fit: bucket 0 closes, dense/kernel is alone (bigger than 2048).
    assert [b.keys for b in plan.buckets] == [
        ("dense_1/bias", "dense_1/kernel", "dense/bias"),
        ("dense/kernel",),
    ]
    b0, b1 = plan.buckets
    assert b0.indices == (3, 2, 1)
    assert b0.nbytes == 1472 and b0.payload_bytes == 1448 and b0.offset == 0
    assert b1.nbytes == 8192 and b1.offset == 1472
    assert plan.buffer_bytes == 1472 + 8192
    assert plan.layout("dense_1/bias").offset == 0
    assert plan.layout("dense_1/kernel").offset == 64
    assert plan.layout("dense/bias").offset == 1344
    assert plan.layout("dense/kernel").buffer_offset == 1472
    assert plan.layout("dense/kernel").bucket == 1
    assert plan.layout("dense/bias").position == 2


def test_given_order():
    plan = BucketPlan(MLP, bucket_bytes=2048, order="given")
    # dense/kernel (8192) alone; then bias 128 @0, dense_1/kernel @128 -> 1408,
    # dense_1/bias @1408 -> 1448.
    assert [b.keys for b in plan.buckets] == [
        ("dense/kernel",),
        ("dense/bias", "dense_1/kernel", "dense_1/bias"),
    ]
    assert plan.layout("dense_1/bias").offset == 1408
    assert plan.buckets[1].nbytes == 1472


def test_every_gradient_alone_when_bucket_is_tiny():
    plan = BucketPlan(MLP, bucket_bytes=1)
    assert [b.keys for b in plan.buckets] == [
        ("dense_1/bias",), ("dense_1/kernel",), ("dense/bias",),
        ("dense/kernel",)]
    # Every bucket starts aligned in the buffer.
    assert [b.offset for b in plan.buckets] == [0, 64, 64 + 1280,
                                                64 + 1280 + 128]


def test_one_bucket_when_everything_fits():
    plan = BucketPlan(MLP, bucket_bytes=1 << 20)
    assert len(plan.buckets) == 1
    assert plan.buckets[0].keys == ("dense_1/bias", "dense_1/kernel",
                                    "dense/bias", "dense/kernel")
    # 40 -> 64, +1280 = 1344, +128 = 1472, +8192 = 9664.
    assert plan.buffer_bytes == 9664


def test_exact_fit_stays_in_bucket():
    grads = [G("a", [16]), G("b", [16])]  # 64 bytes each
    assert len(BucketPlan(grads, bucket_bytes=128).buckets) == 1
    assert len(BucketPlan(grads, bucket_bytes=127).buckets) == 2


def test_dtypes_get_separate_buckets_in_ready_order():
    grads = [G("f0", [4]), G("h0", [4], "float16"), G("f1", [4]),
             G("h1", [4], "float16")]
    plan = BucketPlan(grads, bucket_bytes=1 << 20)
    # Reverse walk: h1, f1, h0, f0: the float16 bucket's last gradient (h0)
    # comes before the float32 bucket's (f0), so it is ready first.
    assert [(b.dtype, b.keys) for b in plan.buckets] == [
        ("float16", ("h1", "h0")), ("float32", ("f1", "f0"))]
    assert plan.layout("h0").offset == 64


def test_zero_size_and_scalar_gradients():
    plan = BucketPlan([G("s", []), G("empty", [0, 3]), G("v", [3])],
                      bucket_bytes=100)
    assert plan.buckets[0].keys == ("v", "empty", "s")
    assert [plan.layout(k).offset for k in ("v", "empty", "s")] == [0, 64, 64]
    assert plan.buckets[0].nbytes == 128


def test_empty_plan():
    plan = BucketPlan([])
    assert plan.buckets == () and plan.buffer_bytes == 0
    assert "(no gradients)" in plan.summary()
    assert BucketPlan.from_json(plan.to_json()) == plan


def test_split_and_merge_round_trip():
    plan = BucketPlan(MLP, bucket_bytes=2048)
    values = ["k0", "b0", "k1", "b1"]
    parts = plan.split(values)
    assert parts == [["b1", "k1", "b0"], ["k0"]]
    assert plan.merge(parts) == values
    with pytest.raises(PlanError, match="has 4 gradients, got 3"):
        plan.split(values[:3])
    with pytest.raises(PlanError, match="bucket 1 .* has 1 gradients, got 2"):
        plan.merge([["b1", "k1", "b0"], ["k0", "x"]])
    with pytest.raises(PlanError, match="has 2 buckets, got 1"):
        plan.merge([["b1"]])


def test_collective_names():
    plan = BucketPlan(MLP, bucket_bytes=2048, name="step")
    names = [plan.collective_name(i) for i in range(len(plan.buckets))]
    assert names == [f"step.{plan.hash[:8]}.bucket0",
                     f"step.{plan.hash[:8]}.bucket1"]
    with pytest.raises(PlanError, match=r"bucket must be an int in \[0, 2\), "
                                        r"got 2"):
        plan.collective_name(2)


def test_accepts_dicts_tuples_and_dtype_objects():
    a = BucketPlan([("w", np.float32, (2, 3)),
                    {"key": "b", "dtype": np.dtype("float32"), "shape": [3]}])
    b = BucketPlan([G("w", [2, 3]), G("b", [3])])
    assert a == b and a.hash == b.hash


# --- JSON and hash. -----------------------------------------------------------


def test_json_round_trip_and_stable_hash():
    plan = BucketPlan(MLP, bucket_bytes=2048, name="model.grads")
    again = BucketPlan.from_json(plan.to_json())
    assert again == plan
    assert again.buckets == plan.buckets and again.layouts == plan.layouts
    assert BucketPlan.from_json(plan.to_json(indent=2)).hash == plan.hash
    assert BucketPlan.from_json(plan.to_json().encode()).hash == plan.hash
    # The hash is the sha256 of the canonical JSON, so it is stable across
    # processes and python versions; this value pins the format.
    d = json.loads(plan.to_json())
    assert d == {"format": 1, "name": "model.grads", "bucket_bytes": 2048,
                 "alignment": 64, "order": "reverse",
                 "gradients": [g.to_dict() for g in MLP]}
    import hashlib
    assert plan.hash == hashlib.sha256(plan.to_json().encode()).hexdigest()


@pytest.mark.parametrize("change", [
    dict(bucket_bytes=4096), dict(alignment=128), dict(order="given"),
    dict(name="other")])
def test_hash_covers_settings(change):
    base = dict(bucket_bytes=2048, alignment=64, order="reverse", name="grads")
    assert (BucketPlan(MLP, **base).hash
            != BucketPlan(MLP, **{**base, **change}).hash)


def test_hash_covers_gradient_order_and_shapes():
    h = BucketPlan(MLP).hash
    assert BucketPlan(MLP[::-1]).hash != h
    assert BucketPlan(MLP[:-1] + [G("dense_1/bias", [11])]).hash != h
    assert BucketPlan(MLP[:-1] + [G("dense_1/bias", [10], "float64")]).hash != h


@pytest.mark.parametrize("text, match", [
    ("{", "malformed bucket plan JSON"),
    ("[]", "must be a JSON object"),
    ('{"format": 1}', "missing fields"),
    (json.dumps({"format": 2, "name": "g", "bucket_bytes": 1, "alignment": 64,
                 "order": "reverse", "gradients": []}),
     "format version 2"),
    (json.dumps({"format": 1, "name": "g", "bucket_bytes": 1, "alignment": 64,
                 "order": "reverse", "gradients": [], "extra": 1}),
     r"unknown fields \['extra'\]"),
    (json.dumps({"format": 1, "name": "g", "bucket_bytes": 1, "alignment": 64,
                 "order": "reverse", "gradients": {}}),
     "'gradients' must be a list"),
    (json.dumps({"format": 1, "name": "g", "bucket_bytes": 1, "alignment": 64,
                 "order": "reverse", "gradients": [{"key": "a"}]}),
     "exactly the fields"),
])
def test_bad_json(text, match):
    with pytest.raises(PlanError, match=match):
        BucketPlan.from_json(text)


# --- Errors name the bad value. -------------------------------------------------


@pytest.mark.parametrize("kwargs, match", [
    (dict(bucket_bytes=0), r"bucket_bytes must be in \[1, .*got 0"),
    (dict(bucket_bytes=1.5), "bucket_bytes must be an int, got 1.5"),
    (dict(bucket_bytes=True), "bucket_bytes must be an int, got True"),
    (dict(alignment=96), "power of two .* got 96"),
    (dict(alignment=32), r"alignment must be in \[64, 4096\], got 32"),
    (dict(order="forward"), "order must be one of .* got 'forward'"),
    (dict(name="a b"), "name must be .* got 'a b'"),
])
def test_bad_settings(kwargs, match):
    with pytest.raises(PlanError, match=match):
        BucketPlan(MLP, **kwargs)


@pytest.mark.parametrize("grads, match", [
    ([G("a", [2]), G("a", [3])], "duplicate gradient key 'a'"),
    ([("a", "float32", [None, 3])], r"dimension 0 of shape \[None, 3\] is unknown"),
    ([("a", "float32", None)], "unknown rank"),
    ([("a", "float32", [-1])], r"dimension 0 of shape \[-1\] is unknown"),
    ([("a", "float32", "ab")], "shape must be a sequence of ints, got 'ab'"),
    ([("a", "float32", [2.5])], r"must be an int, got 2.5"),
    ([("a", "string", [2])], "unsupported dtype 'string'"),
    ([("", "float32", [2])], "gradient key must be a non-empty str, got ''"),
    ([("a b", "float32", [2])], "'a b' must not contain whitespace"),
    ([42], "gradient 0 must be a Gradient.*got 42"),
    ("abc", "iterable of Gradient, got 'abc'"),
    (7, "iterable of Gradient, got 7"),
])
def test_bad_gradients(grads, match):
    with pytest.raises(PlanError, match=match):
        BucketPlan(grads)


def test_unknown_key():
    with pytest.raises(PlanError, match="no gradient 'nope'"):
        BucketPlan(MLP).layout("nope")


def test_summary_lists_every_gradient():
    plan = BucketPlan(MLP, bucket_bytes=2048)
    text = plan.summary()
    assert "4 gradients in 2 buckets of <= 2048 bytes" in text
    for g in MLP:
        assert g.key in text
    assert repr(plan).startswith("BucketPlan(name='grads', gradients=4, "
                                 "buckets=2")


# --- Properties over random gradient lists. -------------------------------------

dtypes = st.sampled_from(["float32", "float16", "float64", "int32"])
shapes = st.lists(st.integers(0, 40), min_size=0, max_size=3)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(dtypes, shapes), max_size=30),
       st.integers(1, 5000), st.sampled_from([64, 128, 4096]),
       st.sampled_from(bl.ORDERS))
def test_layout_properties(specs, bucket_bytes, alignment, order):
    grads = [G(f"g{i}", s, d) for i, (d, s) in enumerate(specs)]
    plan = BucketPlan(grads, bucket_bytes=bucket_bytes, alignment=alignment,
                      order=order)
    # Every gradient in exactly one bucket.
    seen = sorted(i for b in plan.buckets for i in b.indices)
    assert seen == list(range(len(grads)))
    walk = list(range(len(grads)))
    if order == "reverse":
        walk.reverse()
    rank = {i: r for r, i in enumerate(walk)}
    end = 0
    for b in plan.buckets:
        # One dtype per bucket; produced order within it.
        assert {grads[i].dtype for i in b.indices} == {b.dtype}
        assert [rank[i] for i in b.indices] == sorted(rank[i] for i in b.indices)
        # Within the size limit, unless a single gradient is bigger.
        assert b.nbytes % alignment == 0 and b.offset % alignment == 0
        assert b.offset == end
        end += b.nbytes
        last = plan.layouts[b.indices[-1]]
        if len(b.indices) > 1:
            assert last.offset + last.nbytes <= bucket_bytes
        prev_end = 0
        for pos, i in enumerate(b.indices):
            l = plan.layouts[i]
            assert l.bucket == b.index and l.position == pos
            assert l.offset % alignment == 0
            assert l.offset >= prev_end and l.offset - prev_end < alignment
            assert l.buffer_offset == b.offset + l.offset
            prev_end = l.offset + l.nbytes
    assert plan.buffer_bytes == end
    # Greedy: a bucket was closed only because the next gradient of its
    # dtype (in produced order) did not fit behind it.
    by_dtype = {}
    for b in plan.buckets:
        by_dtype.setdefault(b.dtype, []).append(b)
    for same in by_dtype.values():
        same.sort(key=lambda b: rank[b.indices[0]])
        for a, nxt in zip(same, same[1:]):
            g = grads[nxt.indices[0]]
            last = plan.layouts[a.indices[-1]]
            assert (bl.align_up(last.offset + last.nbytes, alignment)
                    + g.nbytes > bucket_bytes)
    # The buckets are numbered in the order they become ready.
    ready = [max(rank[i] for i in b.indices) for b in plan.buckets]
    assert ready == sorted(ready)
    assert BucketPlan.from_json(plan.to_json()).layouts == plan.layouts
