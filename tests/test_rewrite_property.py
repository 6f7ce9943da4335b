"""Property: on random multi-task programs the rewrite changes no bit.

Hypothesis draws small programs as data: a DAG of elementwise, matmul,
reduce, concat and cast ops over 2-4 tasks of one live cluster (4 workers,
started once for the module), on random static shapes, some with an unknown
batch dimension (input_signature with None), in float32, float64 or int32,
with a few nodes nobody placed (they run on the client). One client process
(a single TensorFlow import) builds and runs every drawn program as a plain
tf.function and through tf_rdma.rewrite, and answers per program; the test
checks that every output of every call is byte-identical and that the plan
has exactly the cross-worker edges the program implies (static where the
shape is known, dynamic where it is not).

Reproducible: derandomized, no example database; a failure prints the
program as JSON (feed it to CLIENT by hand to replay it).
"""

import json
import os
import queue
import signal
import subprocess
import sys
import threading

import pytest
from hypothesis import HealthCheck, Phase, given, settings, strategies as st

from conftest import LiveCluster, die_with_parent
from test_rewrite import OP_TIMEOUT_S

pytestmark = pytest.mark.timeout(480)

N_WORKERS = 4
TASKS = [f"/job:worker/task:{i}" for i in range(N_WORKERS)]
DTYPES = ("float32", "float64", "int32")
UNARY = ("negative", "abs", "square")
BINARY = ("add", "subtract", "multiply", "maximum", "minimum")
PER_PROGRAM_S = 120

CLIENT = r"""
import contextlib, json, os, sys, traceback
import numpy as np
import tensorflow as tf
import tf_rdma
cluster = json.loads(os.environ["TF_CONFIG"])["cluster"]
tf.config.experimental_connect_to_cluster(tf.train.ClusterSpec(cluster))
OP_TIMEOUT = float(os.environ["TEST_OP_TIMEOUT"])

def node_value(node, vals):
    op, ins = node["op"], [vals[i] for i in node["inputs"]]
    a = ins[0]
    if op in ("negative", "abs", "square"):
        return getattr(tf.math, op)(a)
    if op == "cast":
        return tf.cast(a, node["dtype"])
    if op in ("add", "subtract", "multiply", "maximum", "minimum"):
        b = ins[1] if len(ins) > 1 else tf.constant(node["scalar"], a.dtype)
        return getattr(tf.math, op)(a, b)
    if op == "matmul_t":
        return tf.matmul(a, a, transpose_b=True)
    if op == "matmul_tt":
        return tf.matmul(a, a, transpose_a=True)
    if op == "sum":
        return tf.reduce_sum(a, axis=node["axis"], keepdims=True)
    if op == "max":
        return tf.reduce_max(a, axis=node["axis"], keepdims=True)
    if op == "concat":
        return tf.concat(ins, axis=node["axis"])
    raise ValueError(op)

def build(prog):
    def fn(*args):
        vals = list(args)
        for node in prog["nodes"]:
            ctx = tf.device(node["task"]) if node["task"] else contextlib.nullcontext()
            with ctx:
                vals.append(node_value(node, vals))
        return vals[len(args):]
    return fn

def feeds(prog):
    rng = np.random.RandomState(prog["seed"])
    out = []
    for batch in prog["batches"]:
        args = []
        for arg in prog["args"]:
            shape = [batch, arg["cols"]]
            if arg["dtype"] == "int32":
                a = rng.randint(-4, 5, size=shape).astype(np.int32)
            else:
                a = (rng.randn(*shape) * 2).astype(arg["dtype"])
            args.append(tf.constant(a))
        out.append(args)
    return out

def raw(t):
    a = np.asarray(t.numpy())
    return a.dtype.name, list(a.shape), a.tobytes().hex()

def run(prog):
    sig = [tf.TensorSpec([None if prog["unknown_batch"] else prog["batches"][0],
                          a["cols"]], a["dtype"]) for a in prog["args"]]
    fn = build(prog)
    plain = tf.function(fn, input_signature=sig)
    # A name per program: two programs with one graph but another depth
    # would otherwise share a plan name (test_rewrite.py tests that alone).
    rdma = tf_rdma.rewrite(tf.function(fn, input_signature=sig),
                           timeout=OP_TIMEOUT, name=f"prop{prog['index']}",
                           depth=prog["depth"])
    same, first_diff = [], None
    for args in feeds(prog):
        p = [raw(t) for t in plain(*args)]
        r = [raw(t) for t in rdma(*args)]
        same.append(p == r)
        if p != r and first_diff is None:
            first_diff = [(i, x, y) for i, (x, y) in enumerate(zip(p, r))
                          if x != y][:2]
    a = rdma.analyses[-1]
    ops = [o.type for o in rdma.get_concrete_function(*sig).graph.get_operations()]
    kinds = {}
    for e in a.edges:
        if e.src != a.caller_task and e.dst != a.caller_task:
            kinds[e.kind] = kinds.get(e.kind, 0) + 1
    return {"same": same, "first_diff": first_diff, "kinds": kinds,
            "transfers": len(rdma.plan.transfers),
            "sends": ops.count("TfRdmaSend"), "recvs": ops.count("TfRdmaRecv"),
            "n_plans": len(rdma.plans)}

print("READY", flush=True)
for line in sys.stdin:
    prog = json.loads(line)
    try:
        out = run(prog)
    except Exception:
        out = {"error": traceback.format_exc()[-4000:]}
    print("RESULT " + json.dumps(out), flush=True)
"""


# --- Programs as data. ---------------------------------------------------------


@st.composite
def programs(draw):
    n_tasks = draw(st.integers(2, N_WORKERS))
    tasks = draw(st.permutations(TASKS))[:n_tasks]
    dtype = draw(st.sampled_from(DTYPES))
    unknown = draw(st.sampled_from([True, False, False, False]))
    rows = draw(st.integers(1, 4))
    # Actual batch sizes of the calls; with an unknown batch they differ
    # (and grow), so the dynamic path sees several shapes.
    batches = [rows, rows + 2, rows] if unknown else [rows, rows, rows]
    args = [{"cols": draw(st.integers(1, 4)), "dtype": dtype}
            for _ in range(draw(st.integers(1, 2)))]
    # Each value: static shape (None = unknown), the shapes it has in each
    # call, dtype, task (None: the client).
    values = [{"static": (None if unknown else rows, a["cols"]),
               "actual": [(b, a["cols"]) for b in batches],
               "dtype": dtype, "task": None} for a in args]
    nodes = []
    for _ in range(draw(st.integers(3, 10))):
        # Mostly a recent value (deep chains), on another task than it.
        i = max(0, len(values) - 1 - draw(st.integers(0, 3)))
        a = values[i]
        others = [t for t in tasks if t != a["task"]]
        task = draw(st.sampled_from(others * 4 + [a["task"], None]))
        op = draw(st.sampled_from(
            UNARY + BINARY + ("cast", "matmul_t", "matmul_tt", "sum", "max",
                              "concat")))
        node = {"op": op, "inputs": [i], "task": task}
        static, actual, out_dtype = a["static"], a["actual"], a["dtype"]
        if op == "cast":
            out_dtype = draw(st.sampled_from(
                [d for d in DTYPES if d != a["dtype"]]))
            node["dtype"] = out_dtype
        elif op in BINARY:
            partners = [j for j, v in enumerate(values)
                        if v["static"] == static and v["actual"] == actual
                        and v["dtype"] == a["dtype"]]
            j = draw(st.sampled_from(partners + [None]))
            if j is None:
                node["scalar"] = draw(st.integers(-3, 3))
            else:
                node["inputs"].append(j)
        elif op == "matmul_t":
            static = (static[0], static[0])
            actual = [(s[0], s[0]) for s in actual]
        elif op == "matmul_tt":
            static = (static[1], static[1])
            actual = [(s[1], s[1]) for s in actual]
        elif op in ("sum", "max"):
            axis = draw(st.integers(0, 1))
            node["axis"] = axis
            static = (1, static[1]) if axis == 0 else (static[0], 1)
            actual = [(1, s[1]) if axis == 0 else (s[0], 1) for s in actual]
        elif op == "concat":
            axis = draw(st.integers(0, 1))
            other = 1 - axis
            partners = [j for j, v in enumerate(values)
                        if v["static"][other] == static[other]
                        and [s[other] for s in v["actual"]] ==
                        [s[other] for s in actual]
                        and v["dtype"] == a["dtype"]]
            j = draw(st.sampled_from(partners))  # i itself always fits.
            node["inputs"].append(j)
            node["axis"] = axis
            b = values[j]

            def join(x, y):
                return None if x is None or y is None else x + y

            static = tuple(join(static[k], b["static"][k]) if k == axis
                           else static[k] for k in (0, 1))
            actual = [tuple(s[k] + t[k] if k == axis else s[k] for k in (0, 1))
                      for s, t in zip(actual, b["actual"])]
        nodes.append(node)
        values.append({"static": static, "actual": actual, "dtype": out_dtype,
                       "task": task})
    return {"tasks": tasks, "unknown_batch": unknown, "batches": batches,
            "depth": draw(st.integers(1, 3)),
            "args": args, "nodes": nodes, "seed": draw(st.integers(0, 2**31)),
            "expected": expected_kinds(values, nodes, len(args))}


def expected_kinds(values, nodes, n_args):
    """Cross-worker edges: one per (producer, consumer task); static or dynamic."""
    edges = {}
    for k, node in enumerate(nodes):
        dst = node["task"]
        for i in set(node["inputs"]):
            src = values[i]["task"]
            if src is None or dst is None or src == dst:
                continue
            edges[(i, dst)] = ("dynamic" if None in values[i]["static"]
                               else "static")
    kinds = {}
    for kind in edges.values():
        kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


# --- The live part. ----------------------------------------------------------


class Client:
    """One client process that runs the programs it reads on stdin."""

    def __init__(self, live):
        e = dict(live.env)
        e["TF_CONFIG"] = json.dumps({"cluster": live.cluster})
        e["TEST_OP_TIMEOUT"] = str(OP_TIMEOUT_S)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CLIENT], env=e, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True, preexec_fn=die_with_parent)
        self.lines = queue.Queue()
        self.stderr = []
        threading.Thread(target=self._pump, args=(self.proc.stdout, self.lines),
                         daemon=True).start()
        threading.Thread(target=self._pump, args=(self.proc.stderr, None),
                         daemon=True).start()
        self.read("READY", timeout=180)

    def _pump(self, stream, into):
        for line in stream:
            if into is None:
                self.stderr.append(line)
                del self.stderr[:-200]
            else:
                into.put(line)
        if into is not None:
            into.put(None)

    def read(self, prefix, timeout):
        while True:
            try:
                line = self.lines.get(timeout=timeout)
            except queue.Empty:
                self.close()
                pytest.fail(f"client gave no {prefix} within {timeout} s\n"
                            + "".join(self.stderr)[-3000:])
            if line is None:
                pytest.fail(f"client exited ({self.proc.wait()}) before "
                            f"{prefix}\n" + "".join(self.stderr)[-3000:])
            if line.startswith(prefix):
                return line[len(prefix):].strip()

    def run(self, program):
        self.proc.stdin.write(json.dumps(program) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.read("RESULT ", timeout=PER_PROGRAM_S))

    def close(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    c = LiveCluster({"worker": N_WORKERS},
                    str(tmp_path_factory.mktemp("property_cluster")))
    c.start()
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def client(live):
    c = Client(live)
    try:
        yield c
    finally:
        c.close()


RUN = {"sent": 0, "programs": 0, "dynamic": 0, "static": 0}


@settings(max_examples=40, derandomize=True, database=None, deadline=None,
          phases=[Phase.explicit, Phase.generate],
          suppress_health_check=[HealthCheck.function_scoped_fixture,
                                 HealthCheck.too_slow])
@given(program=programs())
def test_rewrite_is_bit_identical_on_random_programs(client, program):
    program = dict(program, index=RUN["sent"])
    RUN["sent"] += 1
    out = client.run(program)
    text = json.dumps(program)
    assert "error" not in out, f"{out['error']}\nprogram: {text}"
    assert out["same"] == [True] * len(program["batches"]), (
        f"outputs differ: {out['first_diff']}\nprogram: {text}")
    # Exactly the cross-worker edges the program has, all planned.
    assert out["kinds"] == program["expected"], text
    planned = sum(program["expected"].values())
    assert out["transfers"] == out["sends"] == out["recvs"] == planned, text
    assert out["n_plans"] == 1
    RUN["programs"] += 1
    for kind in ("static", "dynamic"):
        RUN[kind] += program["expected"].get(kind, 0)


def test_the_programs_moved_tensors_and_servers_stop_clean(live, client):
    from conftest import shm_segments
    # The property test above ran in this module first.
    if not RUN["sent"]:
        pytest.skip("runs after test_rewrite_is_bit_identical_on_random_programs")
    assert RUN["programs"] >= 30, RUN
    print("property run:", RUN)
    assert RUN["static"] > 0 and RUN["dynamic"] > 0, RUN
    assert client.close() == 0, "".join(client.stderr)[-3000:]
    codes = live.stop()
    logs = live.logs()
    assert "uses shm" in logs, logs[-3000:]
    assert codes == {name: 0 for name in live.procs}, logs[-3000:]
    assert shm_segments(pids=live.pids) == []
