"""tf_rdma.stats(): the engine's transfer counters add up.

For each transport (shm, tcp, and verbs where require_verbs() finds a
device or softnic) one pair of processes runs four scenarios, each between
two stats() snapshots, and reports the snapshots' difference:

- `steps`: STEPS steps of a plan with transfers both ways; per peer, the
  bytes each task sent and received equal STEPS times the plan's bytes per
  step in that direction, and the writes and receives STEPS times its
  transfers; nothing waited on a transport named "none";
- `late`: the receiver's recv starts LATE_S before the sender sends: one
  data wait of about LATE_S on the receiver, no credit wait on the sender;
- `held`: a depth-1 slot whose receiver holds step 1 for HOLD_S: the
  sender's step 2 makes one credit wait of about HOLD_S;
- `dynamic`: a dynamic transfer of growing tensors: the tensors' bytes (not
  the slot's meta) on both sides and one regrowth of the payload area;
- `collective`: `last_collective` is None before the first collective call;
  after two calls of one instance it names the second, admitted and ended
  within the caller's own perf_counter readings around it; in a call that
  worker:1 joins LATE_S late, worker:0 waited about LATE_S and worker:1
  hardly at all.

The pure-Python `difference` of two snapshots is checked on its own (fast).
"""

import pytest

from conftest import DATA_PATH_TRANSPORTS, make_cluster, run_tasks, use_transport
from tf_rdma import counters
from tf_rdma.graph_passes.plan import Plan, Transfer

pytestmark = pytest.mark.timeout(200)

STEPS = 25
LATE_S = 0.5
HOLD_S = 0.5
A, B = "/job:worker/task:0", "/job:worker/task:1"
# Both directions, odd sizes: 4000 + 60 bytes A -> B, 2048 + 1 bytes B -> A.
TRANSFERS = [("a", A, B, "float32", [1000]), ("b", A, B, "int32", [3, 5]),
             ("c", B, A, "float64", [256]), ("d", B, A, "bool", [1])]
DYNAMIC_SIZES = [100, 50, 5000]  # float32 elements: the third does not fit

PROGRAM = """
from tf_rdma import counters
from tf_rdma.cluster import canonical_task
A, B = "/job:worker/task:0", "/job:worker/task:1"
me = canonical_task(task)
peer = B if me == A else A
steps = tf_rdma.Plan([tf_rdma.Transfer(*t) for t in TRANSFERS], name="steps")
late = tf_rdma.Plan([tf_rdma.Transfer("x", A, B, "float32", [1024])], name="late")
held = tf_rdma.Plan([tf_rdma.Transfer("x", A, B, "float32", [1024])], name="held",
                    depth=1)
dyn = tf_rdma.Plan([tf_rdma.Transfer("x", A, B, "float32", [None], dynamic=True)],
                   name="dyn")
start()

def report(name, before):
    result({"scenario": name, "delta": counters.difference(tf_rdma.stats(), before)})

# steps: each task sends its transfers, then takes the other's.
mine = [t for t in TRANSFERS if t[1] == me]
theirs = [t for t in TRANSFERS if t[2] == me]
before = tf_rdma.stats()
for step in range(STEPS):
    for key, _, _, dtype, shape in mine:
        tf_rdma.ops.send(tf.cast(tf.fill(shape, step), dtype), steps, key)
    for key, *_ in theirs:
        t = tf_rdma.ops.recv(steps, key)
        t.numpy()
        del t
report("steps", before)

# late: the sender sends LATE_S after the receiver started waiting.
before = tf_rdma.stats()
if me == A:
    wait_file("late_ready")
    time.sleep(LATE_S)
    tf_rdma.ops.send(tf.zeros([1024]), late, "x")
else:
    touch("late_ready")
    tf_rdma.ops.recv(late, "x").numpy()
report("late", before)

# held: depth 1; the receiver holds step 1 for HOLD_S, so step 2 waits.
if me == A:
    tf_rdma.ops.send(tf.zeros([1024]), held, "x")
    before = tf_rdma.stats()
    tf_rdma.ops.send(tf.ones([1024]), held, "x")
    report("held", before)
else:
    before = tf_rdma.stats()
    t1 = tf_rdma.ops.recv(held, "x")
    time.sleep(HOLD_S)
    del t1
    tf_rdma.ops.recv(held, "x").numpy()
    report("held", before)

# dynamic: growing tensors; the last needs a larger payload area.
before = tf_rdma.stats()
for n in DYNAMIC_SIZES:
    if me == A:
        tf_rdma.ops.send(tf.range(n, dtype=tf.float32), dyn, "x")
    else:
        t = tf_rdma.ops.recv(dyn, "x")
        assert t.shape == [n], (t.shape, n)
        del t
report("dynamic", before)

# collective: the last call's admission and end, on the caller's clock.
from tf_rdma import collectives as C
first = tf_rdma.stats()["last_collective"]
C.all_reduce(tf.ones([64]), name="last_call", algorithm="oneshot").numpy()
t0 = time.perf_counter()
C.all_reduce(tf.ones([64]), name="last_call", algorithm="oneshot").numpy()
t1 = time.perf_counter()
result({"scenario": "collective", "first": first, "t0": t0, "t1": t1,
        "last": tf_rdma.stats()["last_collective"]})

# collective_wait: worker:1 joins a call LATE_S after worker:0.
if me != A:
    time.sleep(LATE_S)
C.all_reduce(tf.ones([64]), name="late_call", algorithm="oneshot").numpy()
result({"scenario": "collective_wait",
        "last": tf_rdma.stats()["last_collective"]})
touch("done_" + me[-1])
wait_file("done_" + peer[-1])
"""


@pytest.fixture(scope="module", params=DATA_PATH_TRANSPORTS)
def run(request, tmp_path_factory):
    transport = request.param
    use_transport(transport)
    sync_dir = tmp_path_factory.mktemp(f"stats-{transport}")
    constants = dict(TRANSFERS=TRANSFERS, STEPS=STEPS, LATE_S=LATE_S,
                     HOLD_S=HOLD_S, DYNAMIC_SIZES=DYNAMIC_SIZES)
    program = "".join(f"{k} = {v!r}\n" for k, v in constants.items()) + PROGRAM
    out = run_tasks({"worker:0": program, "worker:1": program},
                    cluster=make_cluster(2),
                    env={"TF_RDMA_TRANSPORT": transport, "TF_RDMA_TIMEOUT": "20",
                         "TEST_SYNC_DIR": str(sync_dir)},
                    timeout=150)
    return transport, out


def delta_of(out, task, name):
    """The counters' growth `task` reported for scenario `name`."""
    reports = [r for r in out[task].results if r.get("scenario") == name]
    assert reports, f"{task} reported nothing for {name!r}\n{out[task].describe()}"
    return reports[-1]["delta"]


def peer_counters(delta, peer, transport):
    """The one transport's counters of `peer`; fails if others appear."""
    by_transport = delta["peers"].get(peer, {})
    assert set(by_transport) == {transport}, (peer, delta["peers"])
    return by_transport[transport]


def test_last_collective_is_timed_on_the_callers_clock(run):
    _, out = run
    for task in ("worker:0", "worker:1"):
        reports = [r for r in out[task].results
                   if r.get("scenario") == "collective"]
        assert reports, out[task].describe()
        r = reports[-1]
        assert r["first"] is None, r
        last = r["last"]
        assert (last["instance"], last["call"]) == ("last_call", 2), last
        assert r["t0"] <= last["began"] <= last["ended"] <= r["t1"], r


def test_last_collective_says_how_long_the_call_waited(run):
    _, out = run
    last = {}
    for task in ("worker:0", "worker:1"):
        reports = [r for r in out[task].results
                   if r.get("scenario") == "collective_wait"]
        assert reports, out[task].describe()
        last[task] = reports[-1]["last"]
        assert last[task]["instance"] == "late_call", last[task]
        assert 0 <= last[task]["waited"] <= \
            last[task]["ended"] - last[task]["began"], last[task]
    # worker:0 was admitted LATE_S before worker:1 wrote its block.
    assert last["worker:0"]["waited"] >= 0.8 * LATE_S, last
    assert last["worker:1"]["waited"] < 0.5 * LATE_S, last


def test_bytes_and_transfers_per_step_match_the_plan(run):
    transport, out = run
    plan = Plan([Transfer(*t) for t in TRANSFERS], name="steps")
    a_to_b = sum(t.nbytes for t in plan.transfers if t.src == A)
    b_to_a = sum(t.nbytes for t in plan.transfers if t.src == B)
    assert a_to_b == 4060 and b_to_a == 2049 and a_to_b + b_to_a == plan.bytes_per_step
    n_a_to_b = sum(1 for t in plan.transfers if t.src == A)
    n_b_to_a = len(plan.transfers) - n_a_to_b
    for me, peer, sent, received, writes, receives in (
            ("worker:0", B, a_to_b, b_to_a, n_a_to_b, n_b_to_a),
            ("worker:1", A, b_to_a, a_to_b, n_b_to_a, n_a_to_b)):
        delta = delta_of(out, me, "steps")
        c = peer_counters(delta, peer, transport)
        assert c["bytes_sent"] == STEPS * sent, (me, c)
        assert c["bytes_received"] == STEPS * received, (me, c)
        assert c["writes"] == STEPS * writes, (me, c)
        assert c["receives"] == STEPS * receives, (me, c)
        assert c["dynamic_regrowths"] == 0, (me, c)
        # The totals and the per-transport sums are the same counters.
        assert delta["transports"] == {transport: c}
        assert delta["total"] == c
    both = (delta_of(out, "worker:0", "steps")["total"]["bytes_sent"]
            + delta_of(out, "worker:1", "steps")["total"]["bytes_sent"])
    assert both == STEPS * plan.bytes_per_step


def test_a_late_sender_makes_the_receiver_wait_for_data(run):
    transport, out = run
    receiver = peer_counters(delta_of(out, "worker:1", "late"), A, transport)
    assert receiver["data_waits"] == 1, receiver
    assert LATE_S * 0.8 <= receiver["data_wait_seconds"] < LATE_S + 10, receiver
    assert receiver["receives"] == 1 and receiver["bytes_received"] == 4096
    delta = delta_of(out, "worker:1", "late")
    assert delta["data_wait_busy_seconds"] >= LATE_S * 0.8, delta
    assert delta["data_wait_busy_seconds"] <= delta["elapsed_seconds"] + 0.01, delta
    sender = peer_counters(delta_of(out, "worker:0", "late"), B, transport)
    assert sender["credit_waits"] == 0 and sender["writes"] == 1, sender


def test_a_held_slot_makes_the_sender_wait_for_its_credit(run):
    transport, out = run
    sender_delta = delta_of(out, "worker:0", "held")
    sender = peer_counters(sender_delta, B, transport)
    assert sender["credit_waits"] == 1, sender
    assert HOLD_S * 0.6 <= sender["credit_wait_seconds"] < HOLD_S + 10, sender
    assert sender_delta["credit_wait_busy_seconds"] >= HOLD_S * 0.6, sender_delta
    assert sender["writes"] == 1 and sender["bytes_sent"] == 4096, sender
    receiver = peer_counters(delta_of(out, "worker:1", "held"), A, transport)
    assert receiver["receives"] == 2 and receiver["credit_waits"] == 0, receiver


def test_dynamic_tensors_count_their_bytes_and_regrowths(run):
    transport, out = run
    nbytes = 4 * sum(DYNAMIC_SIZES)
    sender = peer_counters(delta_of(out, "worker:0", "dynamic"), B, transport)
    receiver = peer_counters(delta_of(out, "worker:1", "dynamic"), A, transport)
    assert sender["bytes_sent"] == nbytes and sender["writes"] == 3, sender
    assert receiver["bytes_received"] == nbytes and receiver["receives"] == 3, receiver
    # Generation 1 (one page: 1024 floats) holds the first two; the third
    # (5000 floats) opens a larger one.
    assert sender["dynamic_regrowths"] == 1, sender
    assert receiver["dynamic_regrowths"] == 0, receiver


def _snapshot(t, total, peers=None, busy=(0.0, 0.0), collectives=(0, 0)):
    peers = peers if peers is not None else {"/job:w/task:1": {"shm": total}}
    transports = {}
    for by_transport in peers.values():
        for name, c in by_transport.items():
            transports[name] = c
    return {"task": "/job:w/task:0", "peers": peers, "transports": transports,
            "total": total, "credit_wait_busy_seconds": busy[0],
            "data_wait_busy_seconds": busy[1],
            "collectives_inline": collectives[0],
            "collectives_handed_off": collectives[1], "time": t}


def _counters(**values):
    c = dict.fromkeys(counters.COUNTERS, 0)
    c.update(values)
    return c


@pytest.mark.fast
def test_difference_subtracts_every_counter():
    before = _snapshot(10.0, _counters(bytes_sent=100, writes=1,
                                       data_wait_seconds=0.25), busy=(0.0, 0.25),
                       collectives=(4, 1))
    after = _snapshot(12.5, _counters(bytes_sent=350, writes=3, data_waits=2,
                                      data_wait_seconds=1.0), busy=(0.5, 0.75),
                      collectives=(9, 3))
    d = counters.difference(after, before)
    assert d["elapsed_seconds"] == 2.5 and "time" not in d
    assert d["total"] == _counters(bytes_sent=250, writes=2, data_waits=2,
                                   data_wait_seconds=0.75)
    assert d["peers"]["/job:w/task:1"]["shm"] == d["total"]
    assert d["transports"] == {"shm": d["total"]}
    assert (d["credit_wait_busy_seconds"], d["data_wait_busy_seconds"]) == (0.5, 0.5)
    assert (d["collectives_inline"], d["collectives_handed_off"]) == (5, 2)


@pytest.mark.fast
def test_difference_counts_new_peers_from_zero_and_rejects_reversed_snapshots():
    before = _snapshot(1.0, _counters(), peers={})
    new = _counters(bytes_received=7, receives=1)
    after = _snapshot(2.0, new, peers={"/job:w/task:2": {"tcp": new}})
    assert counters.difference(after, before)["peers"] == {"/job:w/task:2": {"tcp": new}}
    with pytest.raises(ValueError, match="bytes_received went down from 7 to 0"):
        counters.difference(_snapshot(3.0, _counters(), peers={}), after)
    with pytest.raises(ValueError, match="taken 1.000 s after"):
        counters.difference(before, after)


@pytest.mark.fast
def test_summarize_groups_one_sides_phases_by_call():
    """measured.summarize: the newest `last` calls of one side, each phase
    summed within its call (a dynamic send may have two writes), medians
    and maxima in µs; the other side's events and older calls are left out."""
    from tf_rdma import measured

    def ev(name, step, start_us, end_us, nbytes=64):
        return {"name": "tf_rdma." + name, "peer": B, "step": step,
                "bytes": nbytes, "start_ns": start_us * 1000, "end_ns": end_us * 1000}

    events = [ev("send", 1, 0, 100), ev("write", 1, 10, 90),
              ev("credit_wait", 2, 100, 150), ev("write", 2, 150, 160),
              ev("write", 2, 160, 200), ev("send", 2, 100, 200),
              ev("credit_wait", 3, 200, 201), ev("write", 3, 201, 211),
              ev("send", 3, 200, 211, nbytes=128),
              ev("recv", 3, 0, 999), ev("data_wait", 3, 0, 998)]
    got = measured.summarize(events, "send", last=2)
    assert got["calls"] == 2 and got["bytes"] == 128
    assert got["op"] == {"median_us": 55.5, "max_us": 100.0}
    assert got["write"] == {"median_us": 30.0, "max_us": 50.0}  # 50 = 10 + 40
    assert got["credit_wait"] == {"median_us": 25.5, "max_us": 50.0}
    assert measured.summarize(events, "recv")["data_wait"]["max_us"] == 998.0
    assert measured.summarize([], "send") is None
    with pytest.raises(ValueError, match="what='everything'"):
        measured.task_report("everything")
