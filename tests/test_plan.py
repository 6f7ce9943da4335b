"""Tests for tf_rdma.graph_passes.plan (pure Python, no TensorFlow)."""

import hashlib
import json
import re

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tf_rdma.errors import PlanError
from tf_rdma.graph_passes import plan as plan_lib
from tf_rdma.graph_passes.plan import (DYNAMIC_META_BYTES, SLOT_HEADER_BYTES, Plan,
                                      Transfer)

pytestmark = pytest.mark.fast  # in `make test-fast`: no processes, no sockets

W0 = "/job:worker/task:0"
W1 = "/job:worker/task:1"
PS0 = "/job:ps/task:0"


def T(key, src, dst, dtype="float32", shape=(3,)):
    return plan_lib.Transfer(key, src, dst, dtype, shape)


# --- Known plan, numbers computed by hand. ---------------------------------


def known_plan(**kwargs):
    return plan_lib.Plan([
        T("b", "worker:0", "worker:1", "int64", [2, 3]),   # 48 bytes
        T("g", "ps:0", "worker:0", "bfloat16", ()),        # 2 bytes
        T("a", "worker:0", "worker:1", "float32", [3]),    # 12 bytes
        T("big", "worker:0", "worker:1", "uint8", [4000]),  # 4000 bytes
    ], **kwargs)


def test_known_plan_layout():
    p = known_plan()
    assert p.depth == 2 and p.alignment == 64 and p.name == "default"
    assert [t.key for t in p.transfers] == ["g", "a", "b", "big"]
    assert p.tasks == (PS0, W0, W1)
    assert p.bytes_per_step == 2 + 12 + 48 + 4000

    a = p.slot("a")
    assert (a.nbytes, a.stride, a.offset, a.depth) == (12, 128, 0, 2)
    assert a.credit_index == 0
    b = p.slot("b")
    # 64 + 48 = 112 -> 128; starts after a's two copies: 2 * 128 = 256.
    assert (b.nbytes, b.stride, b.offset, b.credit_index) == (48, 128, 256, 1)
    big = p.slot("big")
    # 64 + 4000 = 4064 -> 4096; starts at 256 + 2 * 128 = 512.
    assert (big.stride, big.offset, big.credit_index) == (4096, 512, 2)
    # Total 512 + 2 * 4096 = 8704 -> 3 pages.
    assert a.region_bytes == b.region_bytes == big.region_bytes == 12288
    assert a.credit_bytes == 4096  # 3 slots * 2 copies * 64 = 384 -> 1 page.
    assert a.region == b.region == f"default/{W0}->{W1}"

    g = p.slot("g")
    assert (g.nbytes, g.stride, g.offset, g.credit_index) == (2, 128, 0, 0)
    assert g.region == f"default/{PS0}->{W0}"
    assert g.region_bytes == 4096 and g.credit_bytes == 4096

    assert p.regions == (
        plan_lib.RegionLayout(f"default/{PS0}->{W0}", PS0, W0, 4096, 4096,
                              ("g",)),
        plan_lib.RegionLayout(f"default/{W0}->{W1}", W0, W1, 12288, 4096,
                              ("a", "b", "big")),
    )
    assert [s.key for s in p.slots] == ["g", "a", "b", "big"]
    assert p.region_bytes(W1) == 12288
    assert p.region_bytes("worker:0") == 4096
    assert p.region_bytes(PS0) == 0
    assert p.credit_bytes(W0) == 4096 and p.credit_bytes(W1) == 0

    assert b.copy_offset(1) == 384 and b.payload_offset(1) == 448
    assert b.credit_offset(0) == 128 and b.credit_offset(1) == 192
    with pytest.raises(PlanError, match="copy"):
        b.copy_offset(2)


def test_known_plan_depth_and_alignment():
    p = known_plan(depth=3, alignment=256)
    a, b, big = p.slot("a"), p.slot("b"), p.slot("big")
    assert (a.stride, a.offset) == (256, 0)
    assert (b.stride, b.offset) == (256, 768)
    assert (big.stride, big.offset) == (4096, 1536)
    # 1536 + 3 * 4096 = 13824 -> 16384.
    assert a.region_bytes == 16384
    assert big.credit_offset(2) == (2 * 3 + 2) * 64


def test_credit_bytes_grow_past_one_page():
    transfers = [T(f"k{i:03d}", W0, W1, "int8", ()) for i in range(40)]
    p = plan_lib.Plan(transfers, depth=2)
    # 40 * 2 * 64 = 5120 -> 8192.
    assert p.regions[0].credit_bytes == 8192
    # 40 slots * 2 copies * 128 = 10240 -> 12288.
    assert p.regions[0].nbytes == 12288


def test_hash_is_sha256_of_canonical_json():
    p = known_plan()
    expected = {
        "format": 1, "name": "default", "depth": 2, "alignment": 64,
        "transfers": [
            {"key": "g", "src": PS0, "dst": W0, "dtype": "bfloat16",
             "shape": []},
            {"key": "a", "src": W0, "dst": W1, "dtype": "float32",
             "shape": [3]},
            {"key": "b", "src": W0, "dst": W1, "dtype": "int64",
             "shape": [2, 3]},
            {"key": "big", "src": W0, "dst": W1, "dtype": "uint8",
             "shape": [4000]},
        ],
    }
    text = json.dumps(expected, sort_keys=True, separators=(",", ":"))
    assert p.hash == hashlib.sha256(text.encode()).hexdigest()
    assert p.to_json() == text
    assert p.short_hash == p.hash[:12] and len(p.hash) == 64
    assert p.to_dict() == expected


def test_empty_plan():
    p = plan_lib.Plan([])
    assert p.slots == () and p.regions == () and p.tasks == ()
    assert p.bytes_per_step == 0
    assert plan_lib.Plan.from_json(p.to_json()) == p
    assert "no transfers" in p.summary()
    with pytest.raises(PlanError, match="no transfer 'x'"):
        p.slot("x")


# --- Hash sensitivity. ------------------------------------------------------


@pytest.mark.parametrize("change", [
    dict(depth=3),
    dict(alignment=128),
    dict(name="other"),
    dict(dtype="int32"),
    dict(shape=(4,)),
    dict(shape=(3, 1)),
    dict(key="c"),
    dict(src="worker:2"),
    dict(dst="ps:0"),
])
def test_hash_changes(change):
    def make(depth=2, alignment=64, name="p", key="a", src="worker:0",
             dst="worker:1", dtype="float32", shape=(3,)):
        return plan_lib.Plan([T(key, src, dst, dtype, shape),
                              T("z", "worker:1", "worker:0")],
                             name=name, depth=depth, alignment=alignment)

    base, changed = make(), make(**change)
    assert base.hash != changed.hash
    assert base != changed
    assert make() == base and hash(make()) == hash(base)


# --- canonical_task. --------------------------------------------------------


@pytest.mark.parametrize("form", [
    "/job:worker/task:1",
    "/job:worker/replica:0/task:1",
    "/job:worker/replica:0/task:1/device:CPU:0",
    "/job:worker/task:1/device:GPU:3",
    "job:worker/task:1",
    "job:worker/replica:0/task:1",
    "worker:1",
    "worker:01",
])
def test_canonical_task_forms(form):
    assert plan_lib.canonical_task(form) == "/job:worker/task:1"


def test_canonical_task_other_job():
    assert plan_lib.canonical_task("chief:0") == "/job:chief/task:0"
    assert plan_lib.canonical_task("/job:ps_2/task:12") == "/job:ps_2/task:12"


@pytest.mark.parametrize("bad", [
    "", "worker", "worker:", "worker:-1", "/job:worker", "/job:worker/task:x",
    "/job:worker/task:1/", " worker:1", "1:worker", "/task:1",
    "/job:worker/replica:1/task:0", "/job:worker/task:1/device:CPU",
])
def test_canonical_task_rejects(bad):
    with pytest.raises(PlanError, match=re.escape(repr(bad))) as info:
        plan_lib.canonical_task(bad)
    if "replica:1" not in bad:
        assert "/job:<job>/task:<i>" in str(info.value)
        assert "<job>:<i>" in str(info.value)


def test_canonical_task_rejects_non_str():
    with pytest.raises(PlanError, match="42"):
        plan_lib.canonical_task(42)


# --- normalize_dtype. -------------------------------------------------------


def test_normalize_dtype_inputs():
    assert plan_lib.normalize_dtype("float32") == "float32"
    assert plan_lib.normalize_dtype(np.dtype("int16")) == "int16"
    assert plan_lib.normalize_dtype(np.float64) == "float64"
    assert plan_lib.normalize_dtype(np.bool_) == "bool"
    assert plan_lib.normalize_dtype(np.complex64) == "complex64"

    class FakeTfDType:  # Duck-typed like tf.DType.
        name = "bfloat16"

    assert plan_lib.normalize_dtype(FakeTfDType()) == "bfloat16"
    for name, size in plan_lib.DTYPE_SIZES.items():
        assert plan_lib.normalize_dtype(name) == name
        if name != "bfloat16":
            assert np.dtype(name).itemsize == size


@pytest.mark.parametrize("bad", ["string", "resource", "variant", "float",
                                 "qint8"])
def test_normalize_dtype_rejects_names(bad):
    with pytest.raises(PlanError, match=f"'{bad}'.*float32"):
        plan_lib.normalize_dtype(bad)


def test_normalize_dtype_rejects_objects():
    with pytest.raises(PlanError, match="3.5"):
        plan_lib.normalize_dtype(3.5)
    with pytest.raises(PlanError, match="byte order"):
        plan_lib.normalize_dtype(np.dtype(">f4"))
    with pytest.raises(PlanError, match="'str"):
        plan_lib.normalize_dtype(np.dtype("U4"))


# --- Transfer validation. ---------------------------------------------------


def test_transfer_normalises():
    t = plan_lib.Transfer("k", "worker:0", "/job:ps/replica:0/task:0",
                          np.float16, [np.int64(2), 3])
    assert t == plan_lib.Transfer("k", W0, PS0, "float16", (2, 3))
    assert t.shape == (2, 3) and type(t.shape[0]) is int
    assert t.nbytes == 12
    assert T("s", W0, W1, "complex128", ()).nbytes == 16
    assert T("e", W0, W1, "float32", (0, 5)).nbytes == 0
    with pytest.raises(Exception):
        t.key = "other"  # Frozen.


@pytest.mark.parametrize("kwargs, match", [
    (dict(key=""), "non-empty"),
    (dict(key="a b"), "'a b'.*whitespace"),
    (dict(key="a\tb"), "whitespace"),
    (dict(key=3), "3"),
    (dict(dst="worker:0"), "same task '/job:worker/task:0'"),
    (dict(dst="nonsense"), "'nonsense'"),
    (dict(shape=(3, None)), "unknown.*dynamic"),
    (dict(shape=(-1,)), r"-1.*dynamic"),
    (dict(shape=(2.0,)), "2.0"),
    (dict(shape=(True,)), "True"),
    (dict(shape="34"), "'34'"),
    (dict(shape=3), "3"),
    (dict(dtype="string"), "'string'"),
])
def test_transfer_rejects(kwargs, match):
    args = dict(key="k", src="worker:0", dst="worker:1", dtype="float32",
                shape=(3,))
    args.update(kwargs)
    with pytest.raises(PlanError, match=match):
        plan_lib.Transfer(**args)


# --- Plan validation. -------------------------------------------------------


@pytest.mark.parametrize("kwargs, match", [
    (dict(name=""), "''"),
    (dict(name="a/b"), "'a/b'"),
    (dict(name=None), "None"),
    (dict(depth=0), "depth.*0"),
    (dict(depth=65), "depth.*65"),
    (dict(depth=2.0), "depth.*2.0"),
    (dict(depth=True), "depth.*True"),
    (dict(alignment=32), "alignment.*32"),
    (dict(alignment=96), "power of two.*96"),
    (dict(alignment=8192), "alignment.*8192"),
])
def test_plan_rejects_settings(kwargs, match):
    with pytest.raises(PlanError, match=match):
        plan_lib.Plan([T("a", W0, W1)], **kwargs)


def test_plan_rejects_duplicate_keys():
    with pytest.raises(PlanError, match="duplicate transfer key 'a'"):
        plan_lib.Plan([T("a", W0, W1), T("a", W1, W0)])


def test_plan_rejects_bad_transfers():
    with pytest.raises(PlanError, match="Transfer"):
        plan_lib.Plan(T("a", W0, W1))
    with pytest.raises(PlanError, match="42"):
        plan_lib.Plan([42])


def test_plan_accepts_dicts():
    p = plan_lib.Plan([dict(key="a", src="worker:0", dst="worker:1",
                            dtype="float32", shape=[3])])
    assert p == plan_lib.Plan([T("a", W0, W1)])


def test_unknown_slot_lists_keys():
    p = known_plan()
    with pytest.raises(PlanError, match="'bb'.*'b'"):
        p.slot("bb")
    with pytest.raises(PlanError, match="'zzz'.*'a'"):
        p.slot("zzz")


def test_region_bytes_unknown_task():
    with pytest.raises(PlanError, match="'/job:worker/task:7'"):
        known_plan().region_bytes("worker:7")


# --- JSON. ------------------------------------------------------------------


def test_json_round_trip_and_indent():
    p = known_plan(name="run.1", depth=4, alignment=512)
    for text in (p.to_json(), p.to_json(indent=2)):
        q = plan_lib.Plan.from_json(text)
        assert q == p and q.hash == p.hash
        assert q.slots == p.slots and q.regions == p.regions
        assert (q.name, q.depth, q.alignment) == ("run.1", 4, 512)
    assert "\n" in p.to_json(indent=2)
    assert plan_lib.Plan.from_dict(p.to_dict()) == p


@pytest.mark.parametrize("text, match", [
    ("{not json", "malformed plan JSON"),
    ("[1, 2]", r"JSON object.*\[1, 2\]"),
    ('{"format": 2, "name": "p", "depth": 2, "alignment": 64, '
     '"transfers": []}', "format version 2"),
    ('{"format": "1", "name": "p", "depth": 2, "alignment": 64, '
     '"transfers": []}', "format version '1'"),
    ('{"format": 1, "name": "p", "depth": 2, "transfers": []}',
     "missing fields.*'alignment'"),
    ('{"format": 1, "name": "p", "depth": 2, "alignment": 64, '
     '"transfers": [], "extra": 1}', "unknown fields.*'extra'"),
    ('{"format": 1, "name": "p", "depth": 2, "alignment": 64, '
     '"transfers": {}}', "'transfers' must be a list"),
    ('{"format": 1, "name": "p", "depth": 2, "alignment": 64, '
     '"transfers": [{"key": "a"}]}', "transfer.*missing fields.*'src'"),
    ('{"format": 1, "name": "p", "depth": 0, "alignment": 64, '
     '"transfers": []}', "depth.*0"),
])
def test_from_json_rejects(text, match):
    with pytest.raises(PlanError, match=match):
        plan_lib.Plan.from_json(text)


# --- Display. ---------------------------------------------------------------


def test_summary_and_repr():
    p = known_plan()
    s = p.summary()
    assert p.short_hash in s and "bytes per step: 4062" in s
    assert f"{W0} -> {W1}" in s and "bfloat16" in s and "[2, 3]" in s
    assert "12288" in s  # Region total.
    assert len(s.splitlines()) >= 10
    r = repr(p)
    assert "default" in r and p.short_hash in r and "transfers=4" in r


def test_package_reexports():
    from tf_rdma import graph_passes
    for name in ("Plan", "Transfer", "SlotLayout", "RegionLayout",
                 "canonical_task", "normalize_dtype", "align_up",
                 "DTYPE_SIZES", "SLOT_HEADER_BYTES", "PAGE_BYTES",
                 "FORMAT_VERSION"):
        assert getattr(graph_passes, name) is getattr(plan_lib, name)


def test_align_up():
    assert plan_lib.align_up(0, 64) == 0
    assert plan_lib.align_up(1, 64) == 64
    assert plan_lib.align_up(64, 64) == 64
    assert plan_lib.align_up(65, 64) == 128
    assert plan_lib.align_up(10, 12) == 12
    with pytest.raises(PlanError, match="0"):
        plan_lib.align_up(5, 0)


# --- Properties over random plans. ------------------------------------------

_TASK_FORMS = [
    lambda job, i: f"{job}:{i}",
    lambda job, i: f"/job:{job}/task:{i}",
    lambda job, i: f"/job:{job}/replica:0/task:{i}/device:CPU:0",
]
_TASK_POOL = [("worker", 0), ("worker", 1), ("worker", 10), ("ps", 0)]


@st.composite
def random_plans(draw):
    n_tasks = draw(st.integers(2, 4))
    tasks = _TASK_POOL[:n_tasks]
    pair = st.tuples(st.integers(0, n_tasks - 1),
                     st.integers(0, n_tasks - 2)).map(
        lambda ij: (ij[0], ij[1] if ij[1] < ij[0] else ij[1] + 1))
    specs = draw(st.lists(
        st.tuples(
            st.text("abcxyz_./0123", min_size=1, max_size=6),
            pair,
            st.sampled_from(sorted(plan_lib.DTYPE_SIZES)),
            st.lists(st.integers(0, 40), max_size=3),
            st.sampled_from(_TASK_FORMS),
        ),
        max_size=12, unique_by=lambda s: s[0]))
    transfers = []
    for key, (i, j), dtype, shape, form in specs:
        transfers.append(plan_lib.Transfer(
            key, form(*tasks[i]), form(*tasks[j]), dtype, shape))
    depth = draw(st.integers(1, 5))
    alignment = draw(st.sampled_from([64, 128, 256, 1024, 4096]))
    return transfers, depth, alignment


@settings(max_examples=100, deadline=None)
@given(random_plans(), st.randoms(use_true_random=False))
def test_random_plan_properties(spec, rnd):
    transfers, depth, alignment = spec
    p = plan_lib.Plan(transfers, name="rand", depth=depth, alignment=alignment)
    H = plan_lib.SLOT_HEADER_BYTES

    assert len(p.slots) == len(transfers)
    assert p.bytes_per_step == sum(t.nbytes for t in transfers)
    regions = {r.name: r for r in p.regions}
    assert len(regions) == len({(t.src, t.dst) for t in transfers})
    assert list(p.regions) == sorted(p.regions, key=lambda r: (r.src, r.dst))

    for r in p.regions:
        slots = [p.slot(k) for k in r.keys]
        assert list(r.keys) == sorted(r.keys)
        assert r.nbytes % plan_lib.PAGE_BYTES == 0 and r.nbytes >= 4096
        assert r.credit_bytes % plan_lib.PAGE_BYTES == 0
        ranges, credits = [], set()
        expected_offset = 0
        for i, s in enumerate(slots):
            assert (s.src, s.dst, s.region) == (r.src, r.dst, r.name)
            assert s.region_bytes == r.nbytes
            assert s.credit_bytes == r.credit_bytes
            assert s.credit_index == i and s.depth == depth
            assert s.offset == expected_offset
            assert s.stride % alignment == 0 and s.stride >= H + s.nbytes
            assert s.stride < H + s.nbytes + alignment
            expected_offset = s.offset + depth * s.stride
            for c in range(depth):
                start = s.offset + c * s.stride
                assert start % alignment == 0
                assert s.copy_offset(c) == start
                assert 0 <= start and start + H + s.nbytes <= r.nbytes
                ranges.append((start, start + H + s.nbytes))
                w = s.credit_offset(c)
                assert w == (i * depth + c) * 64
                assert w % 64 == 0 and w + 64 <= r.credit_bytes
                credits.add(w)
        assert len(credits) == len(slots) * depth
        ranges.sort()
        for (_, end), (start, _) in zip(ranges, ranges[1:]):
            assert end <= start

    shuffled = list(transfers)
    rnd.shuffle(shuffled)
    q = plan_lib.Plan(shuffled, name="rand", depth=depth, alignment=alignment)
    assert q.hash == p.hash and q == p
    assert q.slots == p.slots and q.regions == p.regions
    assert q.transfers == p.transfers

    r = plan_lib.Plan.from_json(p.to_json())
    assert r == p and r.slots == p.slots and r.regions == p.regions
    assert hashlib.sha256(p.to_json().encode()).hexdigest() == p.hash


# --- dynamic transfers -------------------------------------------------------

def test_dynamic_transfer_shapes_and_slot():
    t = Transfer("d", "worker:0", "worker:1", "float32", [-1, 3], dynamic=True)
    assert t.shape == (None, 3) and t.nbytes is None
    u = Transfer("u", "worker:0", "worker:1", "int64", None, dynamic=True)
    assert u.shape is None
    plan = Plan([t, u], name="dyn")
    slot = plan.slot("d")
    assert slot.dynamic and slot.nbytes == DYNAMIC_META_BYTES
    assert slot.stride >= SLOT_HEADER_BYTES + DYNAMIC_META_BYTES
    assert plan.bytes_per_step == 0
    attrs = plan.op_attrs("u", "recv")
    assert attrs["dynamic"] is True and attrs["shape"] is None
    assert plan.op_attrs("d", "send")["shape"] == [None, 3]
    assert Plan.from_json(plan.to_json()) == plan
    assert "dynamic" in plan.summary() and "[?, 3]" in plan.summary()


def test_static_plan_json_has_no_dynamic_field():
    # Static plans serialise (and hash) as before the dynamic path existed.
    plan = Plan([Transfer("x", "worker:0", "worker:1", "float32", [2])])
    assert "dynamic" not in plan.to_json()


@pytest.mark.parametrize("shape, match", [
    ([None], "unknown"),
    (None, "unknown rank"),
])
def test_static_transfer_needs_known_shape(shape, match):
    with pytest.raises(PlanError, match=match):
        Transfer("x", "worker:0", "worker:1", "float32", shape)


def test_dynamic_rank_limit():
    with pytest.raises(PlanError, match="rank 30 exceeds 29"):
        Transfer("x", "worker:0", "worker:1", "float32", [None] * 30,
                 dynamic=True)
    with pytest.raises(PlanError, match="dynamic must be a bool"):
        Transfer("x", "worker:0", "worker:1", "float32", [1], dynamic="yes")
