"""The training examples, end to end, under the real launcher.

``examples/ps_training.py`` (1 worker, 1 ps), ``examples/ps_strategy.py``
(1 worker, 1 ps, the command as ParameterServerStrategy's coordinator) and
``examples/model_parallel.py`` (2 workers) run in their ``--quick`` mode, each under
``python -m tf_rdma.cli launch``: real servers, a real client, the real
``@tf_rdma.rewrite``. Each trains the same model twice from the same weights,
through gRPC and through tf_rdma, and these tests check what it prints and
writes (``--json``): the losses bit-identical at every step, the loss going
down, the test accuracy reached, and the plan the rewrite made (which
tensors it moved and how many bytes per step).

The launches start at once, in a module fixture, so that their TensorFlow
imports overlap instead of adding up. Every launch runs in its own process
group under a hard deadline and is killed at the end of the module whatever
happened. The examples need scikit-learn (its bundled digits data set); the
tests skip with a reason without it.
"""

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(720)

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable
#: Seconds a launch may take from start to exit, both running at once. A
#: quick run takes about a minute on an idle 2-core machine (most of it
#: starting TensorFlow in 6 processes); the margin is for busy machines.
LAUNCH_TIMEOUT_S = 600

EXAMPLES = {
    # name: (launch arguments, script, extra example arguments)
    "ps": (["-n", "1", "--ps", "1"], "examples/ps_training.py", []),
    "mp": (["-n", "2"], "examples/model_parallel.py", []),
    # Two tasks: where the machine has two CPUs, each is bound to one.
    "pss": (["-n", "1", "--ps", "1", "--coordinator"], "examples/ps_strategy.py", []),
}


def _have_sklearn():
    try:
        import sklearn  # noqa: F401
    except ImportError:
        return False
    return True


class ExampleRun:
    """One ``tf-rdma launch ... -- python EXAMPLE --quick --json PATH``."""

    def __init__(self, name, tmp):
        launch_args, script, extra = EXAMPLES[name]
        self.name = name
        self.json_path = os.path.join(tmp, f"{name}.json")
        env = {k: v for k, v in os.environ.items()
               if k != "TF_CONFIG" and not k.startswith("TF_RDMA_")}
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
        env["TF_CPP_MIN_LOG_LEVEL"] = "2"
        env["PYTHONUNBUFFERED"] = "1"
        cmd = [PY, "-m", "tf_rdma.cli", "launch", *launch_args,
               "--timeout-start", str(LAUNCH_TIMEOUT_S // 2), "--",
               PY, script, "--quick", "--json", self.json_path, *extra]
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True)  # its own process group, for kill_group
        self.out = {"stdout": [], "stderr": []}
        self.threads = [threading.Thread(target=self._pump, args=(s,),
                                         daemon=True) for s in self.out]
        for t in self.threads:
            t.start()
        self.returncode = None
        self.elapsed = None

    def _pump(self, name):
        for line in getattr(self.proc, name):
            self.out[name].append(line.rstrip("\n"))

    def wait(self):
        left = self.started + LAUNCH_TIMEOUT_S - time.monotonic()
        try:
            self.returncode = self.proc.wait(max(left, 0.1))
        except subprocess.TimeoutExpired:
            self.kill_group()
            self.returncode = None
        for t in self.threads:
            t.join(10)
        self.elapsed = time.monotonic() - self.started
        return self.returncode

    def kill_group(self):
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass

    @property
    def stdout(self):
        return "\n".join(self.out["stdout"])

    def describe(self):
        return (f"--- {self.name}: exit {self.returncode} after "
                f"{self.elapsed:.0f} s\nstdout:\n{self.stdout[-4000:]}\n"
                f"stderr:\n" + "\n".join(self.out["stderr"][-60:]))

    def doc(self):
        with open(self.json_path) as f:
            return json.load(f)


@pytest.fixture(scope="module")
def runs():
    if not _have_sklearn():
        pytest.skip("the examples need scikit-learn (pip install "
                    "scikit-learn; `make test` installs it)")
    with tempfile.TemporaryDirectory(prefix="tf_rdma_examples_") as tmp:
        started = {name: ExampleRun(name, tmp) for name in EXAMPLES}
        try:
            for run in started.values():
                run.wait()
            # Read the JSON while the directory exists.
            for run in started.values():
                run.json = run.doc() if os.path.exists(run.json_path) else None
            yield started
        finally:
            for run in started.values():
                if run.proc.poll() is None:
                    run.kill_group()


def _finished(run):
    assert run.returncode is not None, (
        f"{run.name} did not finish within {LAUNCH_TIMEOUT_S} s\n"
        + run.describe())
    assert run.returncode == 0, run.describe()
    assert run.json is not None, f"no JSON written\n{run.describe()}"
    return run.json


def _check_training(run):
    doc = _finished(run)
    steps = doc["steps"]
    grpc, rdma = doc["losses"]["grpc"], doc["losses"]["tf_rdma"]
    assert len(grpc) == len(rdma) == steps
    # Bit-identical: the JSON holds the float32 losses as exact doubles.
    assert grpc == rdma, run.describe()
    assert doc["losses_identical"] is True
    assert f"losses: bit-identical at all {steps} steps" in run.stdout
    # It learns: the loss falls and the test accuracy reaches the target.
    assert max(rdma[-5:]) < rdma[0] / 2, rdma
    for system in ("grpc", "tf_rdma"):
        assert doc["accuracy"][system] >= doc["target"] >= 0.85, doc["accuracy"]
        assert f"test accuracy ({system}): " in run.stdout
    assert "MISSED" not in run.stdout
    # What the demo shows: step times, the speedup, the plan.
    for system in ("grpc", "tf_rdma"):
        assert len(doc["step_times_s"][system]) == steps
        assert doc["median_step_s"][system] > 0
    assert "speedup: tf_rdma is" in run.stdout
    assert "the plan @tf_rdma.rewrite made for the step" in run.stdout
    assert "bytes per step:" in run.stdout
    return doc


def test_ps_training(runs):
    run = runs["ps"]
    doc = _check_training(run)
    # 3 dense layers: 6 weight/bias reads ps -> worker and 6 gradients back,
    # every byte of the model both ways.
    assert doc["plan"]["transfers"] == 12, doc["plan_summary"]
    assert doc["plan"]["bytes_per_step"] == 2 * doc["weight_bytes"]
    assert "/job:ps/task:0 -> /job:worker/task:0" in run.stdout
    assert "/job:worker/task:0 -> /job:ps/task:0" in run.stdout
    # Nothing but the client's own traffic (the step number in, the loss
    # and the completion tokens out) stays on TensorFlow's path.
    kept = [l for l in run.stdout.splitlines() if l.strip().startswith("kept:")]
    assert kept and all("/job:localhost/task:0" in l for l in kept), kept


def test_model_parallel(runs):
    run = runs["mp"]
    doc = _check_training(run)
    # The cut activations forward and their gradient back, nothing else.
    assert doc["plan"]["transfers"] == 2, doc["plan_summary"]
    assert doc["plan"]["bytes_per_step"] == 2 * doc["cut_bytes"]
    assert "/job:worker/task:0 -> /job:worker/task:1" in run.stdout
    assert "/job:worker/task:1 -> /job:worker/task:0" in run.stdout
    kept = [l for l in run.stdout.splitlines() if l.strip().startswith("kept:")]
    assert kept and all("/job:localhost/task:0" in l for l in kept), kept


def test_ps_strategy(runs):
    """The launcher's --coordinator: TF_CONFIG names chief:0 in a cluster
    with a chief, and a task bound to one CPU still runs PSS steps (two
    inter-op threads); the example's plain and rewritten steps agree."""
    run = runs["pss"]
    doc = _finished(run)
    assert doc["ok"] and doc["losses_identical"], run.describe()
    assert doc["workers_traced"], run.describe()
    assert doc["workers_traced"] == ["/job:worker/task:0"], doc
    assert all(doc["bytes_sent"][w] > 0 for w in doc["workers_traced"]), doc
    assert "bit-identical at all" in run.stdout


@pytest.mark.parametrize("script", ["examples/ps_training.py",
                                    "examples/model_parallel.py",
                                    "examples/ps_strategy.py"])
def test_without_cluster_says_how_to_run(script):
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    proc = subprocess.run([PY, script, "--quick"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "tf-rdma launch" in proc.stderr
