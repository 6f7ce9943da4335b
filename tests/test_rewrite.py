"""@tf_rdma.rewrite on a live cluster: bit-identical to the plain tf.function.

One cluster per transport (ps:0, worker:0, worker:1: `python -m
tf_rdma.server` processes; TF_RDMA_TRANSPORT auto, then verbs) and one client
process that connects to it and runs every scenario: the same Python function as a plain ``tf.function`` and through
``tf_rdma.rewrite``, on separate but identical state, over several calls,
compared byte for byte. The client prints one RESULT line per scenario
(scenarios are isolated with try/except and a per-op timeout, so one broken
scenario fails its own test only); each test below checks its scenario.

Steps are fed as function arguments: an eager assign on a remote task is not
ordered with the next remote function call (tests/test_client_driven.py).

Every wait is bounded: servers must say "ready" within a deadline, the client
runs under a subprocess timeout, every tf_rdma op under a 30 s timeout, and
the module ends with a SIGTERM shutdown that must leave no /dev/shm segment.
"""

import json
import re
import sys

import pytest

from conftest import LiveCluster, shm_segments, use_transport
from tf_rdma import cluster as cluster_lib

pytestmark = pytest.mark.timeout(420)

OP_TIMEOUT_S = 30


# The client: connects, defines the helpers, then runs each scenario in
# TEST_SCENARIOS (a JSON list) and prints one RESULT per scenario.
CLIENT_PRELUDE = r"""
import json, os, sys, traceback
import numpy as np
import tensorflow as tf
import tf_rdma
from tf_rdma.graph_passes import rewrite as rw
cluster = json.loads(os.environ["TF_CONFIG"])["cluster"]
tf.config.experimental_connect_to_cluster(tf.train.ClusterSpec(cluster))
PS, W0, W1 = "/job:ps/task:0", "/job:worker/task:0", "/job:worker/task:1"
OP_TIMEOUT = float(os.environ["TEST_OP_TIMEOUT"])
SYNC_DIR = os.environ["TEST_SYNC_DIR"]

def rewrite(fn, **kw):
    return tf_rdma.rewrite(fn, timeout=OP_TIMEOUT, **kw)

def as_bytes(t):
    if t.dtype == tf.string:
        a = np.asarray(t.numpy(), dtype=object)
        return [bytes(x).hex() for x in a.ravel()], list(a.shape), "string"
    a = np.asarray(t.numpy())
    return a.tobytes().hex(), list(a.shape), a.dtype.name

def identical(p, r):
    fp = tf.nest.flatten(p)
    fr = tf.nest.flatten(r)
    if len(fp) != len(fr):
        return False
    return all(as_bytes(a) == as_bytes(b) for a, b in zip(fp, fr))

def summary(t):
    return [np.asarray(x.numpy()).ravel()[:4].tolist() if x.dtype != tf.string
            else [s.decode() for s in np.asarray(x.numpy(), dtype=object).ravel()[:4]]
            for x in tf.nest.flatten(t)]

def compare(plain, rdma, feeds):
    # Calls both on every feed; returns [identical?] and a short trace.
    same, shown = [], []
    for args in feeds:
        p = plain(*args)
        r = rdma(*args)
        same.append(identical(p, r))
        shown.append({"plain": summary(p), "rdma": summary(r),
                      "rdma_devices": [x.device for x in tf.nest.flatten(r)]})
    return same, shown

def graph_facts(fn, *args):
    # What the rewrite did: plans, edges by kind, the ops in the graph it runs.
    a = fn.analyses[-1]
    ops = [op.type for op in fn.get_concrete_function(*args).graph.get_operations()]
    nodes = {n.name: n.op for n in a.graph_def.node}
    return {
        "plans": [p.hash for p in fn.plans],
        "transfers": [t.to_dict() for t in fn.plan.transfers],
        "edges": [dict(e.to_dict(), producer_op=nodes[e.producer],
                       consumer_ops=sorted({nodes[c] for c, _ in e.consumers}))
                  for e in a.edges],
        "sends": ops.count("TfRdmaSend"), "recvs": ops.count("TfRdmaRecv"),
        "explain": fn.explain(file=open(os.devnull, "w")),
    }

SCENARIOS = {}
def scenario(f):
    SCENARIOS[f.__name__] = f
    return f
"""

CLIENT_MAIN = r"""
import time
for name in json.loads(os.environ["TEST_SCENARIOS"]):
    start = time.monotonic()
    try:
        out = SCENARIOS[name]()
        out.update(scenario=name, ok=True,
                   seconds=round(time.monotonic() - start, 2))
    except Exception as e:  # Reported in the scenario's own test.
        out = {"scenario": name, "ok": False,
               "error": traceback.format_exc()[-4000:]}
    print("RESULT " + json.dumps(out), flush=True)
"""

SCENARIO_CODE = r'''
@scenario
def ps_training():
    # Linear regression, variables on the ps, gradients on worker 0,
    # assign_sub on the ps.
    rng = np.random.RandomState(0)
    w0 = rng.randn(8, 2).astype(np.float32)
    def variables():
        with tf.device(PS):
            return (tf.Variable(w0), tf.Variable(tf.zeros([2])))
    def make(w, b):
        def step(x, y, lr):
            with tf.device(W0):
                with tf.GradientTape() as tape:
                    pred = tf.matmul(x, w) + b
                    loss = tf.reduce_mean(tf.square(pred - y))
                gw, gb = tape.gradient(loss, [w, b])
                gw, gb = gw * lr, gb * lr
            with tf.device(PS):
                w.assign_sub(gw)
                b.assign_sub(gb)
            return loss, w.read_value(), b.read_value()
        return step
    plain = tf.function(make(*variables()))
    rdma = rewrite(make(*variables()), name="ps_training")
    feeds = [(tf.constant(rng.randn(16, 8).astype(np.float32)),
              tf.constant(rng.randn(16, 2).astype(np.float32)),
              tf.constant(0.05)) for _ in range(5)]
    same, shown = compare(plain, rdma, feeds)
    return dict(same=same, shown=shown, **graph_facts(rdma, *feeds[0]))


@scenario
def model_split():
    # Layer 1 on worker 0, layer 2 and the loss on worker 1; the gradient of
    # the activations flows back from worker 1 to worker 0.
    rng = np.random.RandomState(1)
    a1, a2 = rng.randn(6, 5).astype(np.float32), rng.randn(5, 3).astype(np.float32)
    def variables():
        with tf.device(W0):
            v1 = tf.Variable(a1)
        with tf.device(W1):
            v2 = tf.Variable(a2)
        return v1, v2
    def make(v1, v2):
        def step(x, y):
            with tf.GradientTape(persistent=True) as tape:
                with tf.device(W0):
                    h = tf.nn.relu(tf.matmul(x, v1))
                with tf.device(W1):
                    out = tf.matmul(h, v2)
                    loss = tf.reduce_sum(tf.square(out - y))
            with tf.device(W1):
                g2, dh = tape.gradient(loss, [v2, h])
                v2.assign_sub(0.01 * g2)
            with tf.device(W0):
                (g1,) = tape.gradient(h, [v1], output_gradients=dh)
                v1.assign_sub(0.01 * g1)
            return loss, out, v1.read_value(), v2.read_value()
        return step
    plain = tf.function(make(*variables()))
    rdma = rewrite(make(*variables()), name="model_split")
    feeds = [(tf.constant(rng.randn(4, 6).astype(np.float32)),
              tf.constant(rng.randn(4, 3).astype(np.float32)))
             for _ in range(5)]
    same, shown = compare(plain, rdma, feeds)
    return dict(same=same, shown=shown, **graph_facts(rdma, *feeds[0]))


@scenario
def side_effect_order():
    # (a) assign_add then a read asked for on another task: the read runs with
    # the variable and after the assign. (b) a file written on worker 0 and
    # read on worker 1, ordered only by tf.control_dependencies: the control
    # edge crosses tasks and must still order the read after the write.
    # (The control input goes on an Identity of the file name: TensorFlow
    # does not reliably order a read whose only control input sits on a
    # Const, with or without the rewrite; see the report of issue 3.)
    def make(tag):
        with tf.device(W0):
            counter = tf.Variable(0.0)
        path = os.path.join(SYNC_DIR, f"side_effect_{tag}.txt")
        def step(inc, suffix):
            with tf.device(W0):
                bump = counter.assign_add(inc)
                # Some work before the write, so an unordered read would win.
                m = tf.random.stateless_uniform([192, 192], seed=[1, 2])
                for _ in range(6):
                    m = tf.matmul(m, m) / 192.0
                slow = tf.cast(tf.reduce_sum(m) * 0.0, tf.float32)
                text = tf.strings.as_string(inc + slow, precision=1)
                write = tf.io.write_file(path, text)
            with tf.device(W1):
                with tf.control_dependencies([bump]):
                    after = counter.read_value() * 10.0
                name = tf.strings.join([path, suffix])
                with tf.control_dependencies([write]):
                    name = tf.identity(name)
                read = tf.strings.to_number(tf.io.read_file(name))
                got = read * 2.0
            return after, got
        return step
    plain = tf.function(make("plain"))
    rdma = rewrite(make("rdma"), name="side_effect_order")
    feeds = [(tf.constant(float(i + 1)), tf.constant("")) for i in range(8)]
    same, shown = compare(plain, rdma, feeds)
    # Each step reads back what it wrote (2 * inc) and the running total.
    expected = [[10.0 * sum(range(1, i + 2)), 2.0 * (i + 1)] for i in range(8)]
    return dict(same=same, shown=shown, expected=expected,
                **graph_facts(rdma, *feeds[0]))


@scenario
def strings_cross():
    def step(x):
        with tf.device(W0):
            a = x * 3.0
            s = tf.strings.as_string(a, precision=2)
        with tf.device(W1):
            n = tf.strings.to_number(s) + a
            joined = tf.strings.reduce_join(s, separator=",")
        return n, joined
    plain = tf.function(step)
    rdma = rewrite(step, name="strings_cross")
    feeds = [(tf.constant([1.5, -2.0, float(i)]),) for i in range(4)]
    same, shown = compare(plain, rdma, feeds)
    return dict(same=same, shown=shown, **graph_facts(rdma, *feeds[0]))


@scenario
def nested_function():
    with tf.device(W1):
        w = tf.Variable(tf.reshape(tf.range(12, dtype=tf.float32), [3, 4]) / 7.0)
    @tf.function
    def layer(x, kernel):
        return tf.nn.relu(tf.matmul(x, kernel) - 1.0)
    def step(x):
        with tf.device(W0):
            a = x * 2.0
        with tf.device(W1):
            b = layer(a, w)
        with tf.device(W0):
            c = tf.reduce_sum(b, axis=1) + 1.0
        return c
    plain = tf.function(step)
    rdma = rewrite(step, name="nested_function")
    feeds = [(tf.constant(np.arange(15, dtype=np.float32).reshape(5, 3) - i),)
             for i in range(4)]
    same, shown = compare(plain, rdma, feeds)
    return dict(same=same, shown=shown, **graph_facts(rdma, *feeds[0]))


@scenario
def control_flow():
    def step(x, n):
        with tf.device(W0):
            a = x * 2.0
            positive = tf.reduce_sum(x) > 0.0
            limit = n + 1
        with tf.device(W1):
            _, acc = tf.while_loop(
                lambda i, acc: i < limit,
                lambda i, acc: (i + 1, acc * 0.5 + a),
                (tf.constant(0), tf.zeros_like(a)))
            r = tf.cond(positive, lambda: acc + a, lambda: acc - 1.0)
        with tf.device(W0):
            out = r * 3.0
        return out, acc
    plain = tf.function(step)
    rdma = rewrite(step, name="control_flow")
    feeds = [(tf.constant([[1.0, -2.0, 3.0]]) * s, tf.constant(k))
             for s, k in ((1.0, 2), (-1.0, 4), (0.5, 0), (-3.0, 7))]
    same, shown = compare(plain, rdma, feeds)
    return dict(same=same, shown=shown, **graph_facts(rdma, *feeds[0]))


@scenario
def retrace():
    def step(x):
        with tf.device(W0):
            a = x * 3.0
        with tf.device(W1):
            b = tf.reduce_sum(a, axis=0)
        with tf.device(W0):
            c = b - tf.reduce_max(a)
        return c
    plain = tf.function(step)
    rdma = rewrite(step, name="retrace")
    first = tf.constant(np.arange(12, dtype=np.float32).reshape(4, 3))
    second = tf.constant(np.arange(18, dtype=np.float32).reshape(6, 3))
    feeds = [(first,), (first + 1,), (second,), (second * 2,), (first - 5,)]
    same, shown = compare(plain, rdma, feeds)
    plans = [{"hash": p.hash, "shapes": sorted(map(str, (t.shape for t in p.transfers)))}
             for p in rdma.plans]
    return dict(same=same, shown=shown, plan_list=plans,
                **graph_facts(rdma, second))

@scenario
def twins():
    # Two functions whose graphs differ (another variable, another constant
    # on the receiving side) but whose transfers are the same: one layout, so
    # one plan (plans are named after their layout) and the same regions.
    # Called in an irregular order, and fetched only at the end, each must
    # still get its own tensors.
    def make(scale, offset):
        with tf.device(W0):
            v = tf.Variable(tf.range(4, dtype=tf.float32) * scale)
        def step(x):
            with tf.device(W0):
                a = v.read_value() * x
            with tf.device(W1):
                b = a + offset
            return b
        return step
    fa, fb = make(1.0, 1.0), make(10.0, 2.0)
    plain = {"a": tf.function(fa), "b": tf.function(fb)}
    rdma = {"a": rewrite(fa, name="twin"), "b": rewrite(fb, name="twin")}
    order = "aabab" + "bba"
    xs = [tf.constant([float(i + 1)] * 4) for i in range(len(order))]
    p = [plain[w](x) for w, x in zip(order, xs)]
    r = [rdma[w](x) for w, x in zip(order, xs)]
    same = [identical(a, b) for a, b in zip(p, r)]
    facts = graph_facts(rdma["a"], xs[0])
    facts["same_plan"] = rdma["a"].plan == rdma["b"].plan
    return dict(same=same, shown=[summary(t) for t in r], **facts)


@scenario
def called_under_device():
    # The first call is made under tf.device(worker 1): the nodes nobody
    # placed run there (the caller), and a large client tensor (captured by
    # handle, so it stays on the client) feeds worker 0.
    k = tf.constant(np.arange(300, dtype=np.float32).reshape(100, 3))
    def step(x):
        with tf.device(W0):
            a = x * k
        return tf.reduce_sum(a, axis=0) + 1.0
    plain = tf.function(step)
    rdma = rewrite(step, name="called_under_device")
    same, shown = [], []
    for i in range(3):
        x = tf.constant([float(i), 1.0, 2.0])
        with tf.device(W1):
            p, r = plain(x), rdma(x)
        # Results on a remote task are fetched through a local copy.
        with tf.device("/job:localhost/replica:0/task:0/device:CPU:0"):
            p, r = tf.identity(p), tf.identity(r)
        same.append(identical(p, r))
        shown.append({"plain": summary(p), "rdma": summary(r)})
    return dict(same=same, shown=shown, **graph_facts(rdma, x))

@scenario
def same_graph_two_depths():
    # One Python function rewritten with depth 1 and with depth 2: one graph,
    # two layouts. Each must run, in any order.
    def step(x):
        with tf.device(W0):
            a = x * 2.0
        with tf.device(W1):
            b = a + 1.0
        return b
    plain = tf.function(step)
    rdma = [rewrite(step, name="depths", depth=d) for d in (1, 2)]
    same, shown = [], []
    for i, which in enumerate([0, 1, 0, 1, 1, 0]):
        x = tf.constant([float(i), 2.0])
        p = plain(x)
        try:
            r = rdma[which](x)
        except Exception as e:
            shown.append(f"call {i} (depth {which + 1}): {type(e).__name__}: "
                         + str(e).splitlines()[-1][:300])
            same.append(False)
            continue
        same.append(identical(p, r))
    facts = graph_facts(rdma[1], x)
    facts["names"] = [f.plan.name for f in rdma]
    facts["hashes"] = [f.plan.hash for f in rdma]
    return dict(same=same, shown=shown, **facts)

@scenario
def variable_argument():
    # A variable on the ps passed as an argument (not captured): its reads
    # and updates run on the ps, whatever device the user asked for.
    def variables():
        with tf.device(PS):
            return tf.Variable(tf.range(6, dtype=tf.float32))
    def step(var, x):
        with tf.device(W0):
            a = var.read_value() * x
            var.assign_add(a * 0.5)
        with tf.device(W1):
            b = a + 1.0
        return b, var.read_value()
    v_plain, v_rdma = variables(), variables()
    plain, rdma = tf.function(step), rewrite(step, name="variable_argument")
    same, shown = [], []
    for i in range(4):
        x = tf.fill([6], float(i + 1))
        p, r = plain(v_plain, x), rdma(v_rdma, x)
        same.append(identical(p, r))
        shown.append({"plain": summary(p), "rdma": summary(r)})
    facts = graph_facts(rdma, v_rdma, x)
    a = rdma.analyses[-1]
    facts["var_ops"] = sorted({(n.op, a.placements[n.name].task)
                               for n in a.graph_def.node
                               if n.op.endswith("VariableOp")})
    return dict(same=same, shown=shown, **facts)

@scenario
def gradient_through():
    # A GradientTape around the call: a transfer carries no gradient, so
    # differentiating through the rewritten function must fail loudly (not
    # return None for everything upstream of a transfer), while a gradient
    # computed inside the function is planned and matches the plain one.
    with tf.device(W0):
        v = tf.Variable([1.0, 2.0, 3.0])
    def step(x):
        with tf.device(W0):
            a = v * x
        with tf.device(W1):
            b = tf.reduce_sum(a * a)
        return b
    def step_with_grad(x):
        with tf.GradientTape() as tape:
            loss = step(x)
        return loss, tape.gradient(loss, v)
    rdma = rewrite(step, name="gradient_outside")
    x = tf.constant([1.0, 1.0, 2.0])
    try:
        with tf.GradientTape() as tape:
            loss = rdma(x)
        tape.gradient(loss, v)
        outside = "no error"
    except tf_rdma.errors.PlanError as e:
        outside = str(e)
    plain, inside = tf.function(step_with_grad), rewrite(step_with_grad,
                                                         name="gradient_inside")
    feeds = [(tf.constant([1.0, 1.0, float(i)]),) for i in range(3)]
    same, shown = compare(plain, inside, feeds)
    return dict(same=same, shown=shown, outside=outside,
                **graph_facts(inside, *feeds[0]))

@scenario
def dynamic_mask():
    # tf.boolean_mask on one task, consumed on another: the edge's length is
    # known only at run time, so it takes the dynamic path, and the sizes
    # change from step to step (empty, growing past earlier capacities,
    # shrinking).
    spec = [tf.TensorSpec([None], tf.float32)]
    def step(x):
        with tf.device(W0):
            kept = tf.boolean_mask(x, x > 0.5)
        with tf.device(W1):
            return tf.reduce_sum(kept * 3.0), tf.size(kept), kept[:5]
    plain = tf.function(step, input_signature=spec)
    rdma = rewrite(tf.function(step, input_signature=spec), name="dynamic_mask")
    rng = np.random.default_rng(7)
    feeds = [(tf.constant(rng.random(n, dtype=np.float32)),)
             for n in (10, 0, 5000, 3, 200000, 40)]
    same, shown = compare(plain, rdma, feeds)
    return dict(same=same, shown=shown, **graph_facts(rdma, *feeds[0]))

@scenario
def long_chain():
    # 300 hops between worker 0 and worker 1: about 150 recvs wait at once on
    # each task, more than one futex_waitv watches (kMaxWatchedWords = 128).
    def step(x):
        a = x
        for i in range(300):
            with tf.device(W0 if i % 2 == 0 else W1):
                a = a * 1.0001 + 1.0
        return a
    plain, rdma = tf.function(step), rewrite(step, name="long_chain")
    feeds = [(tf.constant([1.0, float(i)]),) for i in range(2)]
    same, shown = compare(plain, rdma, feeds)
    return dict(same=same, shown=shown, **graph_facts(rdma, *feeds[0]))
'''

SCENARIOS = ["ps_training", "model_split", "side_effect_order", "strings_cross",
             "nested_function", "control_flow", "retrace", "twins",
             "called_under_device", "same_graph_two_depths",
             "variable_argument", "gradient_through", "dynamic_mask",
             "long_chain"]


# The cluster runs every scenario twice: under TF_RDMA_TRANSPORT=auto (shm
# between these tasks on one host) and under verbs (softnic where the host
# has no RDMA port: conftest.require_verbs). Every scenario moves tensors
# between the servers' processes and compares them bit for bit; the servers'
# and the client's start-up cost most of each run (~25 s), the scenarios
# over verbs ~6 s.
TRANSPORTS = ("auto", "verbs")


@pytest.fixture(scope="module", params=TRANSPORTS)
def transport(request):
    """The cluster's TF_RDMA_TRANSPORT."""
    return request.param


@pytest.fixture(scope="module")
def live(transport, tmp_path_factory):
    use_transport(transport)  # verbs: skips, or picks softnic, before base_env
    log_dir = str(tmp_path_factory.mktemp(f"rewrite_cluster_{transport}"))
    env = {} if transport == "auto" else {"TF_RDMA_TRANSPORT": transport}
    c = LiveCluster({"ps": 1, "worker": 2}, log_dir, env=env,
                    op_timeout=OP_TIMEOUT_S)
    c.start()
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def results(transport, live, tmp_path_factory):
    """Runs every scenario in one client process: {scenario: RESULT}."""
    sync_dir = str(tmp_path_factory.mktemp(f"rewrite_sync_{transport}"))
    program = CLIENT_PRELUDE + SCENARIO_CODE + CLIENT_MAIN
    proc, found = live.run_client(program, env={
        "TEST_SCENARIOS": json.dumps(SCENARIOS),
        "TEST_OP_TIMEOUT": str(OP_TIMEOUT_S),
        "TEST_SYNC_DIR": sync_dir})
    by_name = {r["scenario"]: dict(r, transport=transport) for r in found}
    sys.stderr.write(f"scenario seconds ({transport}): " + json.dumps(
        {r["scenario"]: r.get("seconds") for r in found}) + "\n")
    by_name["_client"] = {"returncode": proc.returncode,
                          "stderr": proc.stderr[-4000:]}
    return by_name


def result_of(results, name):
    r = results.get(name)
    if r is None:
        pytest.fail(f"client printed no RESULT for {name!r}: exit "
                    f"{results['_client']['returncode']}\n"
                    f"{results['_client']['stderr']}")
    assert r["ok"], f"scenario {name} raised:\n{r['error']}"
    return r


def planned(r):
    return [e for e in r["edges"] if e["kind"] in ("static", "dynamic", "control")]


def check_moved(r, calls):
    """The results were identical and the rewrite really used tf_rdma."""
    assert r["same"] == [True] * calls, json.dumps(r["shown"], indent=1)
    assert r["transfers"], r["explain"]
    # One send and one recv op per planned transfer in the graph that runs.
    assert r["sends"] == r["recvs"] == len(r["transfers"]), r["explain"]
    assert len(planned(r)) == len(r["transfers"])
    # The client has no endpoint: the argument and result edges are kept,
    # and explain() says so.
    kept = [e for e in r["edges"] if e["kind"] == "kept"]
    assert kept
    for e in kept:
        assert e["key"] in r["explain"] and e["reason"] in r["explain"]
    # ... and names the transport of every task pair the plan uses (the
    # client has TF_CONFIG's cluster and the servers' settings: the engine's
    # expected choice; the one the cluster was told to use, if it was).
    named = "verbs|shm|tcp" if r["transport"] == "auto" else re.escape(r["transport"])
    for src, dst in pairs(r):
        line = (f"{cluster_lib.canonical_task(src)} -> "
                f"{cluster_lib.canonical_task(dst)}: ")
        assert re.search(re.escape(line) + rf"({named}) \((expected|connected): ",
                         r["explain"]), r["explain"]


def pairs(r):
    return {(t["src"], t["dst"]) for t in r["transfers"]}


W0, W1, PS = "/job:worker/task:0", "/job:worker/task:1", "/job:ps/task:0"


def test_ps_training_step(results):
    r = result_of(results, "ps_training")
    check_moved(r, 5)
    # Weights go ps -> worker 0 and gradients come back worker 0 -> ps.
    assert pairs(r) == {(PS, W0), (W0, PS)}
    ops = {e["producer_op"] for e in planned(r) if e["src"] == PS}
    assert ops == {"ReadVariableOp"}
    to_ps = [e for e in planned(r) if e["dst"] == PS]
    assert {tuple(e["shape"]) for e in to_ps} >= {(8, 2), (2,)}
    # Training moved the weights (the comparison is not between two no-ops).
    losses = [s["plain"][0][0] for s in r["shown"]]
    assert len(set(losses)) == len(losses)


def test_model_split_over_two_workers(results):
    r = result_of(results, "model_split")
    check_moved(r, 5)
    assert pairs(r) == {(W0, W1), (W1, W0)}
    # The activations (4, 5) go forward, their gradient (4, 5) comes back.
    shapes = {(e["src"], tuple(e["shape"])) for e in planned(r)
              if e["kind"] == "static"}
    assert (W0, (4, 5)) in shapes and (W1, (4, 5)) in shapes
    # The results come back on the caller's device (docs/rewrite.md,
    # "Results and gradients").
    assert {d for s in r["shown"] for d in s["rdma_devices"]} == {
        "/job:localhost/replica:0/task:0/device:CPU:0"}


def test_side_effects_keep_their_order_across_tasks(results):
    r = result_of(results, "side_effect_order")
    check_moved(r, 8)
    # Both versions saw every write and every assign of their own step.
    for shown, want in zip(r["shown"], r["expected"]):
        assert [v[0] for v in shown["plain"]] == want
        assert [v[0] for v in shown["rdma"]] == want
    # Two control edges cross: the assign (to the read's Identity on worker
    # 1) and the write (to the read of the file).
    controls = [e for e in r["edges"] if e["kind"] == "control"]
    assert sorted((e["src"], e["dst"], e["producer_op"]) for e in controls) == [
        (W0, W1, "AssignAddVariableOp"), (W0, W1, "WriteFile")], r["explain"]
    (write,) = [e for e in controls if e["producer_op"] == "WriteFile"]
    assert write["consumer_ops"] == ["Identity"]
    assert {"int8"} == {t["dtype"] for t in r["transfers"]
                         if t["key"].startswith("^")}
    # The read of the counter ran on worker 0, with the counter, and its
    # value went to worker 1.
    reads = [e for e in planned(r) if e["producer_op"] == "ReadVariableOp"]
    assert [(e["src"], e["dst"], e["kind"]) for e in reads] == [
        (W0, W1, "static")]


def test_strings_stay_on_grpc(results):
    r = result_of(results, "strings_cross")
    check_moved(r, 4)
    strings = [e for e in r["edges"] if e["dtype"] == "string"
               and e["dst"] != "/job:localhost/task:0"]
    assert len(strings) == 1, r["explain"]
    (e,) = strings
    assert (e["src"], e["dst"], e["kind"]) == (W0, W1, "kept")
    assert e["reason"] == "string tensors are not memcpy-able"
    assert [t["dtype"] for t in r["transfers"]] == ["float32"]


def test_nested_function_called_under_a_device(results):
    r = result_of(results, "nested_function")
    check_moved(r, 4)
    calls = {"StatefulPartitionedCall", "PartitionedCall"}
    into = [e for e in planned(r) if set(e["consumer_ops"]) & calls]
    out_of = [e for e in planned(r) if e["producer_op"] in calls]
    assert into and out_of, r["explain"]
    assert pairs(r) == {(W0, W1), (W1, W0)}


def test_loop_and_cond_fed_from_another_task(results):
    r = result_of(results, "control_flow")
    check_moved(r, 4)
    consumers = set()
    for e in planned(r):
        consumers.update(e["consumer_ops"])
    assert consumers & {"While", "StatelessWhile"}, r["explain"]
    assert consumers & {"If", "StatelessIf"}, r["explain"]
    assert {"bool", "int32", "float32"} <= {t["dtype"] for t in r["transfers"]}


def test_retrace_gives_a_second_plan(results):
    r = result_of(results, "retrace")
    check_moved(r, 5)
    plans = r["plan_list"]
    assert len(plans) == 2, plans
    assert plans[0]["hash"] != plans[1]["hash"]
    assert "(4, 3)" in plans[0]["shapes"] and "(6, 3)" in plans[1]["shapes"]
    assert r["plans"] == [p["hash"] for p in plans]


def test_two_functions_with_one_plan(results):
    r = result_of(results, "twins")
    check_moved(r, 8)
    assert r["same_plan"]  # Otherwise this test shares no region.


def test_first_call_under_a_device_scope(results):
    r = result_of(results, "called_under_device")
    assert r["same"] == [True] * 3
    # Whatever the caller, nothing is sent from the client (no endpoint).
    assert not [t for t in r["transfers"] if "localhost" in t["src"] + t["dst"]]


def test_one_graph_two_depths(results):
    r = result_of(results, "same_graph_two_depths")
    assert r["same"] == [True] * 6, r["shown"]
    assert r["hashes"][0] != r["hashes"][1]


def test_variable_passed_as_an_argument(results):
    r = result_of(results, "variable_argument")
    check_moved(r, 4)
    assert [tuple(x) for x in r["var_ops"]] == [
        ("AssignAddVariableOp", PS), ("ReadVariableOp", PS)]
    assert pairs(r) >= {(PS, W0), (W0, PS), (W0, W1)}


def test_gradient_through_the_rewritten_function(results):
    r = result_of(results, "gradient_through")
    # Outside: a clear error instead of a silently missing gradient.
    assert "cannot differentiate through the rewritten function" in r["outside"], r["outside"]
    # Inside: the backward pass is planned and matches the plain function.
    check_moved(r, 3)


def test_dynamic_shapes_take_the_dynamic_path(results):
    r = result_of(results, "dynamic_mask")
    check_moved(r, 6)
    (t,) = [t for t in r["transfers"] if t["src"] == W0 and t["dst"] == W1]
    assert t.get("dynamic") is True and t["shape"] == [None], t


def test_long_chain_of_hops(results):
    r = result_of(results, "long_chain")
    check_moved(r, 2)
    assert len(r["transfers"]) == 299
    per_task = {}
    for t in r["transfers"]:
        per_task[t["dst"]] = per_task.get(t["dst"], 0) + 1
    assert min(per_task.values()) > 128, per_task


def test_servers_used_the_transport_and_shut_down_clean(transport, live, results):
    # Last of the transport's tests: every scenario has run. Under auto the
    # servers, on one host without an RDMA port, pick shm.
    assert results["_client"]["returncode"] == 0, results["_client"]["stderr"]
    codes = live.stop()
    logs = live.logs()
    used = "shm" if transport == "auto" else transport
    for src, dst in ((PS, W0), (W0, PS), (W0, W1), (W1, W0)):
        assert f"{src} -> {dst} uses {used}" in logs, logs[-3000:]
    assert codes == {name: 0 for name in live.procs}, logs[-3000:]
    assert shm_segments(pids=live.pids) == []
