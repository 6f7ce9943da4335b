"""Tests of ``tf-rdma inspect``: real tracing, real files, the real command.

The end-to-end runs are ``python -m tf_rdma.cli inspect ...`` subprocesses on
a traced function, a SavedModel and a text GraphDef (all written here, from
one model with every kind of cross-task edge), and on a bad input. Each run
imports TensorFlow, so the module fixture starts all of them at once and the
tests check their own: the imports overlap.

The binary GraphDef, argument errors, the other bad inputs and the
renderers are checked in-process, through ``tf_rdma.cli.main`` (in the
inputs' folder, as the command runs there) and the ``tf_rdma.inspect``
modules.

The HTML page is loaded in headless Chromium (Debian's ``chromium``; the test
skips with the reason where it is not installed) and the DOM it builds must
hold the transfer table and the graph.

``--cluster`` (and ``TF_CONFIG``) runs are CLI subprocesses too (they start
in-process TensorFlow servers, which must not outlive a test): a script that
creates its variable on ``/job:ps/task:0`` at import time is inspected with
them and fails (in-process), with a hint, without them.

The graph's geometry (no edge in a foreign task's box, each label on its own
edge) is checked from coordinates, for both layouts (Graphviz's where ``dot``
is installed, and the built-in one): the SVG's own, and in headless Chromium
the rendered page's.
"""

import html
import html.parser
import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from xml.etree import ElementTree

import pytest

from conftest import base_env
from tf_rdma import cli
from tf_rdma.inspect import command, load, local_cluster, render_graph, report as report_lib
from tf_rdma.inspect.render_graph import render_dot
from tf_rdma.inspect.render_html import render_html
from tf_rdma.inspect.render_json import render_json
from tf_rdma.inspect.render_text import render_text

pytestmark = pytest.mark.timeout(240)

#: Seconds every CLI run (all started together) may take.
RUN_TIMEOUT_S = 180

# One model, placed on three tasks, with an edge of every class:
#   h        worker:0 -> worker:1  static   float32 [32, 128]
#   r        worker:1 -> worker:0  static   float32 [32, 128]
#   z        worker:0 -> worker:1  dynamic  float32 [None, 8]
#   ^tick    worker:0 -> worker:1  control
#   s        worker:0 -> worker:1  kept     string (not memcpy-able)
#   w        ps:0     -> worker:0  static   float32 [128, 16]
# plus the arguments and results, kept: the caller has no endpoint.
MODEL = '''
import tensorflow as tf

SIGNATURE = [tf.TensorSpec([32, 64], tf.float32),
             tf.TensorSpec([None, 8], tf.float32)]


@tf.function
def step(x, y):
    with tf.device("/job:ps/task:0"):
        w = tf.random.stateless_normal([128, 16], seed=[1, 2], name="w")
    with tf.device("/job:worker/task:0"):
        h = tf.matmul(x, tf.ones([64, 128]), name="h")
        z = tf.multiply(y, 2.0, name="z")
        s = tf.strings.as_string(h[0, 0], name="s")
        tick = tf.no_op(name="tick")
    with tf.device("/job:worker/task:1"):
        with tf.control_dependencies([tick]):
            r = tf.nn.relu(h, name="r")
        n = tf.strings.length(s, name="n")
        m = tf.reduce_sum(z, name="m")
    with tf.device("/job:worker/task:0"):
        out = tf.matmul(r, w, name="out")
    return out, n, m


def local_only(x):
    return x * 2.0
'''

SIGNATURE = ("[tf.TensorSpec([32, 64], tf.float32), "
             "tf.TensorSpec([None, 8], tf.float32)]")

EXPECTED = {  # key -> kind, for every input made from MODEL.
    "h:0>worker:1": "static",
    "r:0>worker:0": "static",
    "z:0>worker:1": "dynamic",
    "^tick>worker:1": "control",
    "s:0>worker:1": "kept",
    "w:0>worker:0": "static",
}


# A training script as users write them: the variable is created on the
# parameter server at import time, which needs a cluster (--cluster).
PS_SCRIPT = '''
import tensorflow as tf

with tf.device("/job:ps/task:0"):
    weights = tf.Variable(tf.ones([64, 16]), name="weights")


@tf.function(input_signature=[tf.TensorSpec([32, 64], tf.float32)])
def train_step(x):
    with tf.device("/job:worker/task:0"):
        h = tf.matmul(x, weights, name="h")
    with tf.device("/job:worker/task:1"):
        return tf.nn.relu(h, name="r")
'''

#: A TF_CONFIG whose addresses are unreachable: inspect must use only its
#: job names and task indices.
PS_TF_CONFIG = json.dumps({
    "cluster": {"worker": ["192.0.2.1:2222", "192.0.2.2:2222"],
                "ps": ["192.0.2.3:2222"]},
    "task": {"type": "worker", "index": 0}})


def _start(args, cwd, env=None):
    environment = base_env()
    environment.pop("TF_CONFIG", None)
    environment.update(env or {})
    return subprocess.Popen(
        [sys.executable, "-m", "tf_rdma.cli", "inspect", *args],
        cwd=cwd, env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True)


class Run:
    def __init__(self, name, args, returncode, stdout, stderr):
        self.name, self.args = name, args
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr

    def describe(self):
        return (f"--- {self.name}: tf-rdma inspect {' '.join(self.args)}: exit "
                f"{self.returncode}\nstdout:\n{self.stdout[-3000:]}\n"
                f"stderr:\n{self.stderr[-3000:]}")


def _write_inputs(d):
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    from google.protobuf import text_format  # pylint: disable=import-outside-toplevel

    (d / "model.py").write_text(MODEL)
    (d / "ps_script.py").write_text(PS_SCRIPT)
    spec = importlib.util.spec_from_file_location("inspect_test_model", d / "model.py")
    model = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(model)

    # GraphDefs as users export them: no _output_shapes (inspect re-infers them).
    graph_def = model.step.get_concrete_function(*model.SIGNATURE).graph.as_graph_def()
    (d / "model.pb").write_bytes(graph_def.SerializeToString())
    (d / "model.pbtxt").write_text(text_format.MessageToString(graph_def))

    class Saved(tf.Module):
        pass

    saved = Saved()
    saved.step = model.step
    tf.saved_model.save(saved, str(d / "saved"),
                        signatures=model.step.get_concrete_function(*model.SIGNATURE))

    local = tf.function(model.local_only).get_concrete_function(
        tf.TensorSpec([4], tf.float32)).graph.as_graph_def()
    (d / "local.pbtxt").write_text(text_format.MessageToString(local))
    (d / "notgraph.pb").write_text("this is a shopping list, not a graph\n")
    (d / "malformed.pbtxt").write_text(
        'node {\n  name: "a"\n  op: "Const"\n  colour: "blue"\n}\n')


@pytest.fixture(autouse=True)
def _no_tf_config(monkeypatch):
    """In-process runs must not start servers for the caller's TF_CONFIG."""
    monkeypatch.delenv("TF_CONFIG", raising=False)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    d = tmp_path_factory.mktemp("inspect")
    _write_inputs(d)
    return d


@pytest.fixture(scope="module")
def runs(inputs):
    """Starts every CLI run at once; returns {name: Run}."""
    d = inputs
    plans = {
        "traced": ["model.py:step", "--signature", SIGNATURE],
        "saved_model": ["saved", "--format", "dot"],
        "pbtxt": ["model.pbtxt", "--format", "html", "--output", str(d / "plan.html")],
        "not_a_graph": ["notgraph.pb"],
        "cluster_flag": ["ps_script.py:train_step", "--cluster", "worker:2,ps:1",
                         "--format", "json"],
        "cluster_tf_config": ["ps_script.py:train_step", "--format", "json"],
    }
    envs = {"cluster_tf_config": {"TF_CONFIG": PS_TF_CONFIG}}
    procs = {name: _start(args, d, envs.get(name)) for name, args in plans.items()}
    deadline = time.monotonic() + RUN_TIMEOUT_S
    out = {}
    try:
        for name, proc in procs.items():
            try:
                stdout, stderr = proc.communicate(
                    timeout=max(1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"tf-rdma inspect {plans[name]} did not finish in "
                            f"{RUN_TIMEOUT_S} s")
            out[name] = Run(name, plans[name], proc.returncode, stdout, stderr)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
    return out


def _ok(run):
    assert run.returncode == 0, run.describe()
    assert "Traceback" not in run.stderr, run.describe()
    return run


def _rows(text):
    """The transfer table of the text format: {key-ish (src node, dst task): row}."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("transfers ("))
    header = lines[start + 1].split()
    assert header[:3] == ["#", "src", "node"], lines[start + 1]
    rows = []
    for line in lines[start + 3:]:
        if not line.strip():
            break
        rows.append(line.split())
    return rows


# --------------------------------------------------------------------------- end to end


def test_traced_function_text(runs):
    run = _ok(runs["traced"])
    out = run.stdout
    assert "tf-rdma inspect: model.py:step" in out
    for column in ("src node", "dst node", "src task", "dst task", "dtype",
                   "shape", "bytes", "class", "region", "offset"):
        assert column in out, out
    rows = {(r[1], r[4]): r for r in _rows(out)}
    # h: float32 [32, 128] = 16384 bytes, in the worker:0 -> worker:1 region
    # after the control slot (key "^tick" sorts first; 2 copies of 64 bytes).
    h = rows[("h:0", "worker:1")]
    assert h[2:9] == ["r", "worker:0", "worker:1", "float32", "[32,", "128]", "16384"], h
    assert h[9:] == ["static", "worker:0->worker:1", "128"], h
    assert "static" in rows[("r:0", "worker:0")]
    w = rows[("w:0", "worker:0")]
    assert w[3] == "ps:0" and "static" in w and "ps:0->worker:0" in w, w
    z = rows[("z:0", "worker:1")]
    assert "[?," in z and "?" in z and "dynamic" in z and "worker:0->worker:1" in z, z
    tick = rows[("^tick", "worker:1")]
    assert "control" in tick and "worker:0->worker:1" in tick, tick
    s = rows[("s:0", "worker:1")]
    assert "string" in s and "kept" in s, s
    x = rows[("x:0", "worker:0")]
    assert x[3] == "localhost:0" and "kept" in x, x

    assert "per task pair" in out
    pair = next(line.split() for line in out.splitlines()
                if line.startswith("worker:0     worker:1"))
    # edges, static, dynamic, control, kept, tf_rdma bytes/step
    assert pair[2:8] == ["4", "1", "1", "1", "1", "16384"], pair
    summary = out[out.index("\nsummary\n"):]
    assert "per step through tf_rdma: 40960 bytes (40.0 KiB) in 3 static slots" in summary
    assert "+ 1 control token" in summary
    assert "shape [None, 8] not fully known at trace time: z:0>worker:1" in summary
    assert "string tensors are not memcpy-able: s:0>worker:1" in summary
    assert "/job:localhost/task:0 has no tf_rdma endpoint" in summary
    assert "payload areas of the dynamic slots" in summary
    # The arguments' placement was inferred, and the table says why.
    assert any(line.split()[:2] == ["x", "localhost:0"] and "argument" in line
               for line in out.splitlines()), out


def _in_inputs(inputs, monkeypatch, argv, capsys):
    """``tf-rdma inspect ARGV`` in-process, run in the inputs' folder."""
    monkeypatch.chdir(inputs)
    return _main(["inspect", *argv], capsys)


def test_graph_def_binary_json(inputs, tmp_path, monkeypatch, capsys):
    code, out, err = _in_inputs(inputs, monkeypatch, [
        "model.pb", "--format", "json", "--output", str(tmp_path / "pb.json")], capsys)
    assert code == 0 and "Traceback" not in err, err
    assert out == ""  # --output: nothing on stdout.
    doc = json.loads((tmp_path / "pb.json").read_text())
    kinds = {e["key"]: e["kind"] for e in doc["edges"]}
    assert {k: kinds.get(k) for k in EXPECTED} == EXPECTED
    # Shapes were re-inferred from the shapeless GraphDef: h has a slot.
    h = next(e for e in doc["edges"] if e["key"] == "h:0>worker:1")
    assert h["shape"] == [32, 128] and h["nbytes"] == 16384
    assert h["region"].endswith("//job:worker/task:0->/job:worker/task:1")
    assert h["offset"] == 128 and h["stride"] == 16448  # After "^tick"'s slot.
    assert doc["notes"] == []
    assert doc["summary"]["bytes_per_step"]["tf_rdma"] == 2 * 16384 + 128 * 16 * 4
    assert doc["summary"]["counts"] == {"static": 3, "dynamic": 1, "control": 1,
                                        "kept": len(doc["edges"]) - 5}
    planned = {t["key"] for t in doc["plan"]["transfers"]}
    assert planned == {k for k, kind in EXPECTED.items() if kind != "kept"}
    assert {(p["src"], p["dst"]) for p in doc["pairs"]} >= {
        ("/job:worker/task:0", "/job:worker/task:1"),
        ("/job:ps/task:0", "/job:worker/task:0")}


def test_saved_model_dot(runs):
    out = _ok(runs["saved_model"]).stdout
    assert out.startswith("digraph ")
    for task in ("ps_0", "worker_0", "worker_1", "localhost_0"):
        assert f"subgraph cluster_{task} {{" in out, out
    # The signature's wrapper call is inlined: the saved function's nodes.
    assert '"PartitionedCall/h" -> "PartitionedCall/r" [label="PartitionedCall/h:0>worker:1' in out, out
    assert "16.0 KiB static" in out
    assert "control" in out and "dynamic" in out and "kept" in out
    assert out.count("{") == out.count("}")


def test_graph_def_text_html(runs, inputs):
    _ok(runs["pbtxt"])
    page = (inputs / "plan.html").read_text()
    assert page.startswith("<!DOCTYPE html>")
    assert "<svg" in page and 'id="transfers"' in page
    # Self-contained: no scripts, no stylesheets or images from elsewhere.
    assert "<script" not in page
    assert "http" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")


#: name -> (arguments, message, exit status) of each kind of bad input.
BAD_INPUTS = {
    "not_a_graph": (["notgraph.pb"], "notgraph.pb is not a graph: not a binary GraphDef",
                    command.EXIT_ERROR),
    "no_such_function": (["model.py:train_step", "--signature", SIGNATURE],
                         "no function 'train_step' in model.py; its functions: "
                         "local_only, step", command.EXIT_ERROR),
    "malformed_pbtxt": (["malformed.pbtxt"],
                        'malformed.pbtxt is not a graph: malformed text GraphDef (pbtxt), '
                        'line 4:3 : Message type "tensorflow.NodeDef" has no field named '
                        '"colour"', command.EXIT_ERROR),
    "no_cross_task_edges": (["local.pbtxt"], "no cross-task edges in local.pbtxt",
                            command.EXIT_NO_TRANSFERS),
}


def test_bad_input_is_one_clear_message(runs):
    """The command itself: a bad input exits with one message, no traceback."""
    run = runs["not_a_graph"]
    _, message, status = BAD_INPUTS["not_a_graph"]
    assert run.returncode == status, run.describe()
    assert message in run.stderr, run.describe()
    assert "Traceback" not in run.stderr, run.describe()
    assert run.stdout == "", run.describe()


@pytest.mark.parametrize("name", sorted(BAD_INPUTS))
def test_bad_inputs_in_process(inputs, monkeypatch, capsys, name):
    """Each kind of bad input: its exit status and one clear message."""
    argv, message, status = BAD_INPUTS[name]
    code, out, err = _in_inputs(inputs, monkeypatch, argv, capsys)
    assert code == status, (name, code, err)
    assert message in err and "Traceback" not in err, (name, err)
    assert out == "", (name, out)


def _ps_script_edges(run):
    doc = json.loads(_ok(run).stdout)
    return doc, {e["key"]: e for e in doc["edges"]}


@pytest.mark.parametrize("name, source", [("cluster_flag", "--cluster"),
                                          ("cluster_tf_config", "TF_CONFIG")])
def test_cluster_inspects_a_script_with_variables_on_ps(runs, name, source):
    """Variables created under tf.device("/job:ps/task:0") at import time."""
    doc, edges = _ps_script_edges(runs[name])
    assert doc["notes"] == [f"in-process local servers for ps:0, worker:0, "
                            f"worker:1 (from {source})"], doc["notes"]
    # The variable lives on ps:0: its read (placed with it) feeds worker:0.
    read = edges["h/ReadVariableOp:0>worker:0"]
    assert (read["src"], read["dst"], read["kind"], read["shape"], read["nbytes"]) == (
        "/job:ps/task:0", "/job:worker/task:0", "static", [64, 16], 64 * 16 * 4), read
    h = edges["h:0>worker:1"]
    assert (h["kind"], h["shape"], h["nbytes"]) == ("static", [32, 16], 32 * 16 * 4)


def test_script_with_variables_on_ps_needs_cluster(inputs, monkeypatch, capsys):
    """In-process: without a cluster the import fails before any server starts."""
    code, out, err = _in_inputs(inputs, monkeypatch, ["ps_script.py:train_step"], capsys)
    assert code == command.EXIT_ERROR, err
    assert "cannot import ps_script.py" in err, err
    assert "--cluster worker:2,ps:1" in err, err
    assert "Traceback" not in err and out == "", (out, err)


# --------------------------------------------------------------------------- HTML in a browser


class _DomScan(html.parser.HTMLParser):
    """Collects the data-key of transfer rows and of SVG transfer edges."""

    def __init__(self):
        super().__init__()
        self.rows, self.edges, self.svg, self.tasks = [], [], 0, []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        classes = (a.get("class") or "").split()
        if tag == "tr" and "edge-row" in classes:
            self.rows.append(a.get("data-key"))
        elif tag == "g" and "transfer" in classes:
            self.edges.append(a.get("data-key"))
        elif tag == "g" and "task" in classes:
            self.tasks.append(a.get("data-task"))
        elif tag == "svg":
            self.svg += 1


def _chromium():
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    return None


def test_html_renders_in_headless_chromium(runs, inputs, tmp_path, monkeypatch, capsys):
    browser = _chromium()
    if browser is None:
        pytest.skip("Debian's chromium is not installed (make test installs it "
                    "with apt where it can): cannot load the HTML page")
    _ok(runs["pbtxt"])
    code, out, err = _in_inputs(inputs, monkeypatch, ["model.pb", "--format", "json"],
                                capsys)
    assert code == 0, err
    expected = {e["key"] for e in json.loads(out)["edges"]}
    page = inputs / "plan.html"
    proc = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu",
         "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}",
         "--dump-dom", page.as_uri()],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "HOME": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    dom = proc.stdout
    assert "<tbody>" in dom, dom[:2000]  # Chromium's parse, not our text.
    scan = _DomScan()
    scan.feed(dom)
    assert scan.svg == 1, dom[:2000]
    assert sorted(scan.rows) == sorted(expected)
    assert set(scan.edges) == expected  # Every transfer is drawn.
    assert sorted(scan.tasks) == ["localhost:0", "ps:0", "worker:0", "worker:1"]


# --------------------------------------------------------------------------- graph geometry
#
# "No edge crosses a task box it does not belong to" and "a label sits on its
# edge", checked from coordinates: those of the SVG itself (parsed here: the
# built-in layout's rects and paths, Graphviz's cluster paths and splines, in
# one coordinate frame) and, where Chromium is installed, those the browser
# computes for the page it rendered (getPointAtLength, getBoundingClientRect).

_SVG = "{http://www.w3.org/2000/svg}"
_PATH_TOKEN = re.compile(r"[MLHVCQZmlhvcqz]|-?(?:\d+\.?\d*|\.\d+)(?:e-?\d+)?")
LABEL_TOLERANCE_PX = 16  # Label box to its own edge.


def _path_points(d, steps=24):
    """Points along an SVG path of absolute M, L, H, V, C, Q, Z commands."""
    tokens = _PATH_TOKEN.findall(d)
    points, cur, start, cmd, i = [], (0.0, 0.0), (0.0, 0.0), None, 0

    def take(n):
        nonlocal i
        vals = [float(t) for t in tokens[i:i + n]]
        i += n
        return vals

    while i < len(tokens):
        if tokens[i].isalpha():
            cmd = tokens[i]
            i += 1
            assert cmd.isupper() or cmd in "zZ", f"relative command {cmd} in {d}"
            if cmd in "zZ":
                points.append(start)
                cur = start
                continue
        if cmd == "M":
            cur = start = tuple(take(2))
            points.append(cur)
            cmd = "L"  # Further pairs are line-tos.
        elif cmd == "L":
            cur = tuple(take(2))
            points.append(cur)
        elif cmd == "H":
            cur = (take(1)[0], cur[1])
            points.append(cur)
        elif cmd == "V":
            cur = (cur[0], take(1)[0])
            points.append(cur)
        elif cmd in "CQ":
            ctrl = [cur] + [tuple(take(2)) for _ in range(3 if cmd == "C" else 2)]
            for k in range(1, steps + 1):
                t = k / steps
                pts = ctrl
                while len(pts) > 1:  # de Casteljau
                    pts = [((1 - t) * a[0] + t * b[0], (1 - t) * a[1] + t * b[1])
                           for a, b in zip(pts, pts[1:])]
                points.append(pts[0])
            cur = ctrl[-1]
        else:
            raise AssertionError(f"unexpected path command {cmd!r} in {d}")
    # Fill the straight legs too, so that a leg through a box shows up.
    dense = points[:1]
    for a, b in zip(points, points[1:]):
        n = max(1, int(math.hypot(b[0] - a[0], b[1] - a[1]) // 4))
        dense += [(a[0] + (b[0] - a[0]) * k / n, a[1] + (b[1] - a[1]) * k / n)
                  for k in range(1, n + 1)]
    return dense


def _shape_box(el):
    """The bounding box (x0, y0, x1, y1) of a rect, polygon or path."""
    if el.tag == _SVG + "rect":
        x, y = float(el.get("x")), float(el.get("y"))
        return x, y, x + float(el.get("width")), y + float(el.get("height"))
    if el.tag == _SVG + "polygon":
        nums = [float(v) for v in re.split(r"[ ,]+", el.get("points").strip())]
        pts = list(zip(nums[::2], nums[1::2]))
    else:
        pts = _path_points(el.get("d"))
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    return min(xs), min(ys), max(xs), max(ys)


def svg_geometry(svg_text):
    """``{"boxes": {task: box}, "edges": [...]}`` from the drawing's SVG.

    Each edge: its key, src and dst tasks, points along its path (and its
    arrowhead), and the estimated boxes of its label's lines.
    """
    root = ElementTree.fromstring(svg_text)
    boxes, edges = {}, []
    for g in root.iter(_SVG + "g"):
        classes = (g.get("class") or "").split()
        if "task" in classes:
            shape = next(el for el in g if el.tag in (_SVG + "rect", _SVG + "path",
                                                      _SVG + "polygon"))
            boxes[g.get("data-task")] = _shape_box(shape)
        elif "transfer" in classes:
            points = []
            for el in g.iter():
                if el.tag == _SVG + "path":
                    points += _path_points(el.get("d"))
                elif el.tag == _SVG + "polygon":
                    nums = [float(v) for v in re.split(r"[ ,]+", el.get("points").strip())]
                    points += list(zip(nums[::2], nums[1::2]))
            labels = []
            for el in g.iter(_SVG + "text"):
                text = "".join(el.itertext())
                size = float(el.get("font-size") or 11)
                x, y = float(el.get("x")), float(el.get("y"))
                w = 0.55 * size * len(text)
                labels.append((x - w / 2, y - size, x + w / 2, y))
            edges.append({"key": g.get("data-key"), "src": g.get("data-src"),
                          "dst": g.get("data-dst"), "points": points,
                          "labels": labels})
    return {"boxes": boxes, "edges": edges}


def _inside(p, box, margin=1.0):
    return (box[0] + margin < p[0] < box[2] - margin
            and box[1] + margin < p[1] < box[3] - margin)


def _box_distance(box, p):
    dx = max(box[0] - p[0], 0, p[0] - box[2])
    dy = max(box[1] - p[1], 0, p[1] - box[3])
    return math.hypot(dx, dy)


def geometry_problems(geometry):
    """What is wrong with a drawing, as sentences; [] when nothing is.

    An edge point or a label inside the box of a task the edge does not
    belong to; a label further than LABEL_TOLERANCE_PX from its own edge,
    nearer another edge, or with another edge running through it.
    """
    boxes, edges = geometry["boxes"], geometry["edges"]
    problems = []
    for e in edges:
        assert e["src"] in boxes and e["dst"] in boxes, (e["key"], sorted(boxes))
        foreign = {t: b for t, b in boxes.items() if t not in (e["src"], e["dst"])}
        for task, box in foreign.items():
            hits = [p for p in e["points"] if _inside(p, box)]
            if hits:
                problems.append(f"edge {e['key']} ({e['src']} -> {e['dst']}) crosses "
                                f"the box of {task} at {hits[0]}")
        # The label as one box (Graphviz writes one <text> per line).
        labels = [(min(b[0] for b in e["labels"]), min(b[1] for b in e["labels"]),
                   max(b[2] for b in e["labels"]), max(b[3] for b in e["labels"]))]
        assert e["labels"], e["key"]
        for label in labels:
            centre = ((label[0] + label[2]) / 2, (label[1] + label[3]) / 2)
            for task, box in foreign.items():
                if _inside(centre, box):
                    problems.append(f"label of {e['key']} at {centre} is inside "
                                    f"the box of {task}")
            own = min(_box_distance(label, p) for p in e["points"])
            if own > LABEL_TOLERANCE_PX:
                problems.append(f"label of {e['key']} at {label} is {own:.0f} px "
                                f"from its edge")
            # Edges of one transfer (one tensor, several consumers on the
            # destination task) share a key and a label: they are one edge here.
            through = [o["key"] for o in edges if o["key"] != e["key"]
                       and any(_inside(p, label, margin=2.0) for p in o["points"])]
            if through:
                problems.append(f"edge {through[0]} runs through the label of "
                                f"{e['key']} at {label}")
            others = [min(_box_distance(label, p) for p in o["points"])
                      for o in edges if o["key"] != e["key"]]
            if others and min(others) + 0.5 < own:
                problems.append(f"label of {e['key']} at {label} is nearer another "
                                f"edge ({min(others):.0f} px) than its own ({own:.0f} px)")
    return problems


def _model_report(inputs):
    from tensorflow.core.framework import graph_pb2  # pylint: disable=import-outside-toplevel
    from tf_rdma.graph_passes import rewrite as passes  # pylint: disable=import-outside-toplevel

    graph_def = graph_pb2.GraphDef.FromString((inputs / "model.pb").read_bytes())
    graph_def, _ = load.with_shapes(graph_def)
    return report_lib.make_report("model.pb", passes.analyze(graph_def, name="model"))


def _layouts():
    return ["columns", pytest.param("graphviz", marks=pytest.mark.skipif(
        render_graph.dot_program() is None,
        reason="Graphviz's dot is not installed (make install installs it "
               "where apt can)"))]


def _crosses(a, b, box):
    """True if the straight segment a-b passes through ``box``."""
    return any(_inside((a[0] + (b[0] - a[0]) * k / 100, a[1] + (b[1] - a[1]) * k / 100), box)
               for k in range(101))


@pytest.mark.parametrize("layout", _layouts())
def test_graph_edges_avoid_other_task_boxes(inputs, layout):
    """The issue's example: worker:1 -> client (localhost:0) across worker:0."""
    report = _model_report(inputs)
    drawing, used, note = render_graph.draw(report, layout)
    assert (used, note) == (layout, None)
    geometry = svg_geometry(drawing)
    assert sorted(geometry["boxes"]) == ["localhost:0", "ps:0", "worker:0", "worker:1"]
    expected = sum(len(r.dst_nodes) for r in report.rows)
    assert len(geometry["edges"]) == expected
    long_edges = [e for e in geometry["edges"]
                  if (e["src"], e["dst"]) == ("worker:1", "localhost:0")]
    assert {e["key"] for e in long_edges} == {"m:0>localhost:0", "n:0>localhost:0"}
    if layout == "columns":
        # worker:0 lies between the two columns: a straight edge would cross it.
        e = long_edges[0]
        assert _crosses(e["points"][0], e["points"][-1], geometry["boxes"]["worker:0"])
    assert geometry_problems(geometry) == []


def _random_graph(seed):
    """A function of 14 ops placed at random on 5 tasks (worker:0-3, ps:0)."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    import random  # pylint: disable=import-outside-toplevel
    rng = random.Random(seed)
    tasks = [f"/job:worker/task:{i}" for i in range(4)] + ["/job:ps/task:0"]

    @tf.function
    def f():
        values = []
        for i in range(14):
            with tf.device(rng.choice(tasks)):
                if values and rng.random() < 0.8:
                    v = tf.add(rng.choice(values), rng.choice(values), name=f"n{i}")
                else:
                    v = tf.ones([8, 8], name=f"n{i}")
            values.append(v)
        return values[-1]

    return f.get_concrete_function().graph.as_graph_def(add_shapes=True)


@pytest.fixture(scope="module")
def random_reports():
    """The reports of 8 random graphs, traced once for both layouts."""
    from tf_rdma.graph_passes import rewrite as passes  # pylint: disable=import-outside-toplevel
    return {seed: report_lib.make_report(
                "random", passes.analyze(_random_graph(seed), name="random"))
            for seed in range(8)}


@pytest.mark.parametrize("layout", _layouts())
def test_graph_geometry_of_random_graphs(random_reports, layout):
    """Five tasks, edges between every pair of columns, several per gap."""
    for seed, report in random_reports.items():
        drawing, used, _ = render_graph.draw(report, layout)
        assert used == layout
        problems = geometry_problems(svg_geometry(drawing))
        if layout == "columns":
            # The built-in layout's known limit: in a crowded gap, a label
            # may find no spot on its edge that no other edge crosses.
            problems = [p for p in problems if " runs through the label of " not in p
                        and " is nearer another edge " not in p]
        assert problems == [], (seed, problems)


def test_geometry_check_finds_a_crossing(inputs):
    """The check itself: a straight worker:1 -> localhost:0 edge fails it."""
    geometry = svg_geometry(render_graph.columns_svg(_model_report(inputs)))
    e = next(e for e in geometry["edges"] if e["key"] == "m:0>localhost:0")
    (ax, ay), (bx, by) = e["points"][0], e["points"][-1]
    e["points"] = [(ax + (bx - ax) * k / 200, ay + (by - ay) * k / 200)
                   for k in range(201)]
    problems = geometry_problems(geometry)
    assert any("edge m:0>localhost:0 (worker:1 -> localhost:0) crosses the box of worker:0"
               in p for p in problems), problems


def test_graph_layout_option(inputs, tmp_path, capsys, monkeypatch):
    out = tmp_path / "plan.html"
    code, _, err = _main(["inspect", str(inputs / "model.pb"), "--format", "html",
                          "--graph-layout", "columns", "-o", str(out)], capsys)
    assert code == 0, err
    page = out.read_text()
    assert 'data-layout="columns"' in page and "built-in column layout" in page
    monkeypatch.setattr(render_graph, "dot_program", lambda: None)
    code, _, err = _main(["inspect", str(inputs / "model.pb"), "--format", "html",
                          "--graph-layout", "graphviz", "-o", str(out)], capsys)
    assert code == command.EXIT_ERROR, err
    assert "--graph-layout graphviz: Graphviz's dot program is not installed" in err
    code, _, err = _main(["inspect", str(inputs / "model.pb"), "--format", "html",
                          "-o", str(out)], capsys)
    assert code == 0 and 'data-layout="columns"' in out.read_text(), err


# The browser's own geometry of the page it rendered, written into the DOM
# for --dump-dom: task boxes and points along every edge in page pixels.
_GEOMETRY_SCRIPT = """
<script>
window.addEventListener("load", () => {
  const svg = document.getElementById("plan-graph");
  const rect = (r) => [r.left, r.top, r.right, r.bottom];
  const out = {boxes: {}, edges: []};
  for (const g of svg.querySelectorAll("g.task")) {
    out.boxes[g.dataset.task] = rect(g.querySelector("rect, path, polygon").getBoundingClientRect());
  }
  for (const g of svg.querySelectorAll("g.transfer")) {
    const points = [];
    for (const path of g.querySelectorAll("path")) {
      const m = path.getScreenCTM(), len = path.getTotalLength();
      for (let i = 0; i <= 400; i++) {
        const p = path.getPointAtLength(len * i / 400).matrixTransform(m);
        points.push([p.x, p.y]);
      }
    }
    const labels = [...g.querySelectorAll("text")].map(t => rect(t.getBoundingClientRect()));
    out.edges.push({key: g.dataset.key, src: g.dataset.src, dst: g.dataset.dst,
                    points, labels});
  }
  const pre = document.createElement("pre");
  pre.id = "geometry";
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
});
</script>
"""


@pytest.mark.parametrize("layout", _layouts())
def test_graph_geometry_in_headless_chromium(inputs, tmp_path, layout):
    """Chromium lays out the page; its coordinates pass the same checks."""
    browser = _chromium()
    if browser is None:
        pytest.skip("Debian's chromium is not installed (make install installs "
                    "it with apt where it can): cannot render the HTML page")
    page = render_html(_model_report(inputs), layout)
    assert f'data-layout="{layout}"' in page
    probe = tmp_path / "probe.html"
    probe.write_text(page.replace("</body>", _GEOMETRY_SCRIPT + "</body>"))
    shot = tmp_path / "graph.png"
    common = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
              "--hide-scrollbars", f"--user-data-dir={tmp_path / 'profile'}",
              "--window-size=2000,1400"]
    env = {**os.environ, "HOME": str(tmp_path)}
    proc = subprocess.run([*common, "--dump-dom", probe.as_uri()], capture_output=True,
                          text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = re.search(r'<pre id="geometry">(.*?)</pre>', proc.stdout, re.S)
    assert m, proc.stdout[-2000:]
    geometry = json.loads(html.unescape(m.group(1)))
    assert len(geometry["boxes"]) == 4 and geometry["edges"], geometry
    assert all(len(e["points"]) > 100 for e in geometry["edges"])
    assert geometry_problems(geometry) == []
    # The screenshot, for a person to look at (the checks above do not).
    proc = subprocess.run([*common, f"--screenshot={shot}", probe.as_uri()],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0 and shot.stat().st_size > 10000, proc.stderr[-3000:]


# --------------------------------------------------------------------------- in-process


def _main(argv, capsys):
    try:
        code = cli.main(argv)
    except SystemExit as exit_:
        code = exit_.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_every_subcommand_has_help(capsys):
    parser = cli.build_parser()
    sub = next(a for a in parser._actions  # pylint: disable=protected-access
               if a.dest == "subcommand")
    assert {"launch", "inspect"} <= set(sub.choices)
    for name in sub.choices:
        code, out, _ = _main([name, "--help"], capsys)
        assert code == 0 and f"usage: tf-rdma {name}" in out, (name, out)
    code, out, _ = _main(["inspect", "--help"], capsys)
    for option in ("--signature", "--caller-device", "--endpoint-tasks", "--depth",
                   "--format", "--output", "tf.TensorSpec", "exit status"):
        assert option in out, option
    code, out, _ = _main(["--help"], capsys)
    assert code == 0 and "inspect" in out and "--helpfull" in out


def test_absl_flagfile(inputs, tmp_path, capsys):
    flagfile = tmp_path / "flags.txt"
    flagfile.write_text("--format=json\n--depth=3\n")
    code, out, err = _main(["inspect", str(inputs / "model.pb"),
                            f"--flagfile={flagfile}"], capsys)
    assert code == 0, err
    assert json.loads(out)["plan"]["depth"] == 3


@pytest.mark.parametrize("args, message", [
    (["--depth", "0"], "--depth: must be in [1, 64], got 0"),
    (["--endpoint-tasks", "worker 1"], "invalid task name 'worker 1'"),
    (["--caller-device", "/device:CPU:0"], "names no job"),
    (["--format", "svg"], "invalid choice: 'svg'"),
])
def test_bad_arguments_exit_2(inputs, args, message, capsys):
    code, _, err = _main(["inspect", str(inputs / "model.pb"), *args], capsys)
    assert code == 2 and "usage: tf-rdma inspect" in err and message in err, err


@pytest.mark.parametrize("value, message", [
    ("worker", "'worker' in 'worker' is not JOB:COUNT; expected JOB:COUNT[,JOB:COUNT...], "
               "e.g. worker:2,ps:1"),
    ("worker:two", "task count 'two' of job 'worker' in 'worker:two' is not an integer "
                   "from 1 to 64"),
    ("worker:0", "task count '0' of job 'worker'"),
    ("worker:2,worker:1", "job 'worker' appears twice in 'worker:2,worker:1'"),
    ("worker:2,,ps:1", "'worker:2,,ps:1' has an empty entry"),
    ("9lives:1", "job '9lives' in '9lives:1' is not a job name"),
    ("localhost:1", "job 'localhost' in 'localhost:1' is the inspecting client's own job"),
])
def test_bad_cluster_exit_2(inputs, value, message, capsys):
    code, _, err = _main(["inspect", str(inputs / "model.pb"), "--cluster", value],
                         capsys)
    assert code == 2 and "usage: tf-rdma inspect" in err, err
    assert f"--cluster: {message}" in err, err


def test_cluster_parse_and_tf_config():
    assert local_cluster.parse_cluster("worker:2, ps:1") == {"worker": [0, 1], "ps": [0]}
    assert local_cluster.parse_cluster("None") == {}
    env = {"TF_CONFIG": PS_TF_CONFIG}
    assert local_cluster.cluster_from_env(env) == {"worker": [0, 1], "ps": [0]}
    sparse = {"TF_CONFIG": json.dumps({"cluster": {"worker": {"3": "h:1"}}})}
    assert local_cluster.cluster_from_env(sparse) == {"worker": [3]}
    assert local_cluster.cluster_from_env({}) is None
    with pytest.raises(local_cluster.ClusterError,
                       match=r"TF_CONFIG=.*is not valid JSON.*--cluster none"):
        local_cluster.cluster_from_env({"TF_CONFIG": "{nope"})
    with pytest.raises(local_cluster.ClusterError,
                       match="'localhost', the inspecting client's own job"):
        local_cluster.cluster_from_env(
            {"TF_CONFIG": json.dumps({"cluster": {"localhost": ["h:1"]}})})


def test_bad_tf_config_is_one_clear_message(inputs, monkeypatch, capsys):
    monkeypatch.setenv("TF_CONFIG", '{"cluster": {"worker": "h:1"}}')
    code, out, err = _main(["inspect", f"{inputs / 'model.py'}:step",
                            "--signature", SIGNATURE], capsys)
    assert code == command.EXIT_ERROR and out == "", err
    assert "TF_CONFIG: job 'worker' is 'h:1'" in err and "--cluster none" in err, err
    assert err.count("\n") == 1, err
    # A GraphDef file runs no Python: TF_CONFIG is not even read.
    code, _, err = _main(["inspect", str(inputs / "model.pb")], capsys)
    assert code == 0, err


def test_bad_signature_exit_2(inputs, capsys):
    for signature, message in (("[tf.TensorSpec([32, 64]", "is not a Python expression"),
                               ("open('/etc/passwd')", "NameError"),
                               ("42", "must give a list, a dict or a tf.TensorSpec")):
        code, _, err = _main(["inspect", f"{inputs / 'model.py'}:step",
                              "--signature", signature], capsys)
        assert code == 2 and message in err, (signature, err)


def test_more_bad_inputs(inputs, tmp_path, capsys):
    (tmp_path / "empty.pbtxt").write_text("# nothing\n")
    (tmp_path / "notsaved").mkdir()
    (tmp_path / "explodes.py").write_text("raise RuntimeError('no GPU here')\n")
    (tmp_path / "shapes.py").write_text(textwrap.dedent("""
        import tensorflow as tf

        @tf.function
        def f():
            with tf.device("/job:worker/task:0"):
                return tf.matmul(tf.ones([2, 3]), tf.ones([4, 5]))
        """))
    cases = [
        ([str(tmp_path / "missing.pb")], "no such file or directory"),
        ([str(inputs / "model.py")], "name the function to trace as"),
        ([f"{inputs / 'model.py'}:step"],
         "takes arguments (x, y) and has no input_signature: give their specs with --signature"),
        ([str(tmp_path / "empty.pbtxt")], "parses, but has no nodes"),
        ([str(tmp_path / "notsaved")], "is a directory but not a SavedModel"),
        ([f"{tmp_path / 'explodes.py'}:f"],
         "cannot import", ),
        ([f"{tmp_path / 'shapes.py'}:f"], "Dimensions must be equal"),
        ([str(inputs / "saved"), "--signature-key", "predict"],
         "has no signature or restored function 'predict'; its signatures: serving_default"),
        ([str(inputs / "model.pb"), "--output", str(tmp_path / "no" / "dir")],
         "cannot write"),
        (["no_such_module_anywhere:f"], "no module named 'no_such_module_anywhere'"),
    ]
    for argv, message in cases:
        code, out, err = _main(["inspect", *argv], capsys)
        assert code == command.EXIT_ERROR, (argv, code, err)
        assert message in err and "Traceback" not in err, (argv, err)
        assert err.count("\n") == 1, (argv, err)  # One line.
    code, _, err = _main(["inspect", f"{tmp_path / 'explodes.py'}:f"], capsys)
    assert "RuntimeError: no GPU here (explodes.py, line 1)" in err, err
    code, _, err = _main(["inspect", f"{tmp_path / 'shapes.py'}:f"], capsys)
    assert "(shapes.py, line 7)" in err, err


def test_endpoint_tasks_and_caller_device(inputs, capsys):
    # Short task names work; only edges between endpoint tasks are planned.
    code, out, err = _main(["inspect", str(inputs / "model.pb"), "--format", "json",
                            "--endpoint-tasks", "worker:0,ps:0"], capsys)
    assert code == 0, err
    doc = json.loads(out)
    kinds = {e["key"]: (e["kind"], e["reason"]) for e in doc["edges"]}
    assert kinds["w:0>worker:0"] == ("static", "")
    assert kinds["h:0>worker:1"] == ("kept", "/job:worker/task:1 has no tf_rdma endpoint")
    assert doc["endpoint_tasks"] == ["/job:worker/task:0", "/job:ps/task:0"]
    # Called from worker:0, the arguments move worker:0 -> worker:0: no edge.
    code, out, err = _main(["inspect", str(inputs / "model.pb"), "--format", "json",
                            "--caller-device", "/job:worker/replica:0/task:0"], capsys)
    assert code == 0, err
    doc = json.loads(out)
    assert doc["caller_task"] == "/job:worker/task:0"
    assert not any(e["src"] == "/job:localhost/task:0" for e in doc["edges"])


def test_rewrite_function_and_plain_function(tmp_path, capsys):
    (tmp_path / "decorated.py").write_text(textwrap.dedent("""
        import tensorflow as tf
        import tf_rdma

        @tf_rdma.rewrite(depth=4)
        def step():
            with tf.device("/job:worker/task:0"):
                a = tf.ones([8, 8])
            with tf.device("/job:worker/task:1"):
                return tf.reduce_sum(a * 2.0)

        def plain():
            with tf.device("/job:worker/task:0"):
                a = tf.ones([4])
            with tf.device("/job:worker/task:1"):
                return a * 3.0
        """))
    code, out, err = _main(["inspect", f"{tmp_path / 'decorated.py'}:step",
                            "--format", "json"], capsys)
    assert code == 0, err
    doc = json.loads(out)
    assert doc["plan"]["depth"] == 4  # The decorator's own setting.
    assert [t["key"] for t in doc["plan"]["transfers"]] == ["ones:0>worker:1"]
    code, out, err = _main(["inspect", f"{tmp_path / 'decorated.py'}:plain",
                            "--depth", "1"], capsys)
    assert code == 0, err
    assert "ones:0>worker:1" not in out  # The text table shows nodes, not keys.
    assert "16 bytes (16 B) in 1 static slot" in out and "depth 1" in out


def test_renderers_agree(inputs):
    """Every format shows every edge of one analysis."""
    from tensorflow.core.framework import graph_pb2  # pylint: disable=import-outside-toplevel
    from tf_rdma.graph_passes import rewrite as passes  # pylint: disable=import-outside-toplevel

    graph_def = graph_pb2.GraphDef.FromString((inputs / "model.pb").read_bytes())
    graph_def, note = load.with_shapes(graph_def)
    assert note is None
    analysis = passes.analyze(graph_def, name="model")
    report = report_lib.make_report("model.pb", analysis)
    keys = {e.key for e in analysis.edges}
    doc = json.loads(render_json(report))
    assert {e["key"] for e in doc["edges"]} == keys
    dot = render_dot(report)
    page = render_html(report)
    text = render_text(report)
    for key in keys:
        assert f"{key}\\n" in dot, key
        assert f'data-key="{key}"' in page.replace("&gt;", ">"), key
    assert len(_rows(text)) == len(keys)


def test_saved_model_restored_function(inputs, capsys):
    # A restored tf.function (not a signature), as saved and re-traced.
    for extra in ([], ["--signature", SIGNATURE]):
        code, out, err = _main(["inspect", str(inputs / "saved"), "--signature-key",
                                "step", "--format", "json", *extra], capsys)
        assert code == 0, (extra, err)
        # A re-trace is a wrapper whose call is inlined: names get its prefix.
        kinds = {re.sub(r"^(\^?)PartitionedCall/", r"\1", e["key"]): e["kind"]
                 for e in json.loads(out)["edges"]}
        assert {k: kinds.get(k) for k in EXPECTED} == EXPECTED, (extra, kinds)
    code, _, err = _main(["inspect", str(inputs / "saved"), "--signature", SIGNATURE],
                         capsys)
    assert code == 2 and "--signature does not apply to the SavedModel signature" in err


def test_call_with_remote_body_is_named(tmp_path, capsys):
    (tmp_path / "nested.py").write_text(textwrap.dedent("""
        import tensorflow as tf

        @tf.function
        def inner(x):
            with tf.device("/job:worker/task:0"):
                return x * 2.0

        @tf.function
        def outer():
            return inner(tf.ones([4]))
        """))
    code, _, err = _main(["inspect", f"{tmp_path / 'nested.py'}:outer"], capsys)
    assert code == command.EXIT_NO_TRANSFERS, err
    assert "no cross-task edges at the top level" in err
    assert "runs on /job:worker/task:0" in err and "Traceback" not in err
