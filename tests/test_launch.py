"""Tests of ``tf-rdma launch`` (tf_rdma.launch and tf_rdma.cli).

Two groups:

* Tests against the real ``python -m tf_rdma.server``: they need the op library
  and skip with a reason where it is not built.
* Tests of the launcher's own behaviour (start-up failures, exit codes,
  signals, teardown, shared-memory clean-up) against a stand-in server that
  keeps the same contract (ready line on stdout, exit 0 on SIGTERM/SIGINT) and
  listens on the real gRPC and endpoint ports. They need no TensorFlow.

Every process is started with a timeout and killed at the end of its test.
"""

import glob
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable


def _package_locations():
    locations = [str(REPO / "tf_rdma")]
    spec = importlib.util.find_spec("tf_rdma")
    if spec is not None and spec.submodule_search_locations:
        locations += list(spec.submodule_search_locations)
    return locations


def _op_library_built():
    return any(glob.glob(os.path.join(loc, "_tf_rdma_ops*.so")) for loc in _package_locations())


def _server_module_present():
    return any(os.path.exists(os.path.join(loc, "server.py")) for loc in _package_locations())


def needs_server(test):
    """Skips a test that needs the real tf_rdma.Server and its op library."""
    test = pytest.mark.skipif(not _server_module_present(), reason="tf_rdma/server.py not present")(test)
    return pytest.mark.skipif(not _op_library_built(), reason="tf_rdma op library not built")(test)


# --------------------------------------------------------------------------- process helpers


def pid_alive(pid):
    """True if a process with this pid exists and is not a zombie."""
    try:
        import psutil  # optional
    except ImportError:
        psutil = None
    if psutil is not None:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return False
    # The state is the field after the parenthesised command name.
    return stat[stat.rindex(")") + 2] not in "ZX"


def wait_dead(pids, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(pid_alive(p) for p in pids):
            return True
        time.sleep(0.05)
    return not any(pid_alive(p) for p in pids)


def shm_files(pids):
    found = []
    for pid in pids:
        found += glob.glob(f"/dev/shm/tfrdma.{pid}.*")
    return found


class Launcher:
    """A ``tf-rdma launch`` subprocess whose output is collected by threads."""

    def __init__(self, args, env=None, extra_path=None):
        full_env = dict(os.environ)
        for name in ("TF_CONFIG", "TF_RDMA_ENDPOINTS", "TF_RDMA_SECRET", "TF_RDMA_PORT_OFFSET"):
            full_env.pop(name, None)
        paths = [str(REPO)] + ([str(extra_path)] if extra_path else [])
        if full_env.get("PYTHONPATH"):
            paths.append(full_env["PYTHONPATH"])
        full_env["PYTHONPATH"] = os.pathsep.join(paths)
        full_env.update(env or {})
        self.proc = subprocess.Popen(
            [PY, "-m", "tf_rdma.cli", "launch", *args],
            cwd=REPO,
            env=full_env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.stdout = []
        self.stderr = []
        self._changed = threading.Condition()
        self._threads = [
            threading.Thread(target=self._pump, args=(self.proc.stdout, self.stdout), daemon=True),
            threading.Thread(target=self._pump, args=(self.proc.stderr, self.stderr), daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _pump(self, stream, lines):
        for line in stream:
            with self._changed:
                lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def wait_for(self, pattern, timeout=60, stream="stderr"):
        """Waits for a line matching the regex; returns the match."""
        regex = re.compile(pattern)
        lines = self.stderr if stream == "stderr" else self.stdout
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for line in lines:
                    match = regex.search(line)
                    if match:
                        return match
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not any(t.is_alive() for t in self._threads)):
                    raise AssertionError(
                        f"no line matching {pattern!r} on {stream}; output so far:\n{self.output()}"
                    )
                self._changed.wait(min(left, 0.2))

    def wait(self, timeout=90):
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"launcher did not exit within {timeout} s:\n{self.output()}")
        for t in self._threads:
            t.join(10)
        return code

    def output(self):
        return "--- stdout\n" + "\n".join(self.stdout) + "\n--- stderr\n" + "\n".join(self.stderr)

    def server_pids(self):
        return [int(m) for m in re.findall(r"tf-rdma launch: started \S+ pid=(\d+)", "\n".join(self.stderr))]

    def kill(self):
        pids = self.server_pids()
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


@pytest.fixture
def launchers():
    started = []

    def start(args, **kwargs):
        launcher = Launcher(args, **kwargs)
        started.append(launcher)
        return launcher

    yield start
    for launcher in started:
        launcher.kill()


def client(code):
    """A CMD that runs Python code."""
    return [PY, "-c", textwrap.dedent(code)]


# --------------------------------------------------------------------------- real server


CONNECT_CODE = """
    import json, os, sys
    config = json.loads(os.environ["TF_CONFIG"])
    assert "task" not in config, config
    cluster = config["cluster"]
    assert len(cluster["worker"]) == 2, cluster
    assert os.environ.get("TF_RDMA_SECRET"), "no secret"
    import tensorflow as tf
    tf.config.experimental_connect_to_cluster(tf.train.ClusterSpec(cluster))
    with tf.device("/job:worker/task:1"):
        x = tf.constant(1.0) + 1
    assert float(x.numpy()) == 2.0, x
    print("client ok", flush=True)
"""


@needs_server
def test_real_two_workers_run_client(launchers):
    launcher = launchers(["-n", "2", "--", *client(CONNECT_CODE)])
    code = launcher.wait(110)
    assert code == 0, launcher.output()
    assert "client ok" in launcher.stdout, launcher.output()
    assert len(launcher.server_pids()) == 2
    assert wait_dead(launcher.server_pids(), 5), launcher.output()


@needs_server
def test_real_exit_code_propagated(launchers):
    launcher = launchers(["-n", "1", "--", *client("import sys; sys.exit(3)")])
    assert launcher.wait(110) == 3, launcher.output()


@needs_server
def test_real_sigint_tears_everything_down(launchers):
    launcher = launchers(
        ["-n", "2", "--", *client("import os, time; print('cmd pid', os.getpid(), flush=True); time.sleep(300)")]
    )
    cmd_pid = int(launcher.wait_for(r"cmd pid (\d+)", 100, stream="stdout").group(1))
    server_pids = launcher.server_pids()
    assert len(server_pids) == 2
    started = time.monotonic()
    launcher.proc.send_signal(signal.SIGINT)
    code = launcher.wait(30)
    assert time.monotonic() - started < 20, launcher.output()
    assert code == 130, launcher.output()
    pids = server_pids + [cmd_pid]
    assert wait_dead(pids, 5), launcher.output()
    assert shm_files(pids) == [], launcher.output()


@needs_server
def test_real_ps_and_workers(launchers):
    code = """
        import json, os
        cluster = json.loads(os.environ["TF_CONFIG"])["cluster"]
        assert len(cluster["ps"]) == 1 and len(cluster["worker"]) == 2, cluster
        print("shape ok", flush=True)
    """
    launcher = launchers(["--ps", "1", "-n", "2", "--", *client(code)])
    assert launcher.wait(110) == 0, launcher.output()
    assert "shape ok" in launcher.stdout
    assert len(launcher.server_pids()) == 3
    for task in ("/job:ps/task:0", "/job:worker/task:0", "/job:worker/task:1"):
        assert any(f"started {task} pid=" in line for line in launcher.stderr), launcher.output()


# --------------------------------------------------------------------------- arguments


@pytest.mark.parametrize(
    "args, message",
    [
        (["-n", "0", "--", "true"], "at least 1"),
        (["-n", "x", "--", "true"], "not an integer"),
        (["-n", "2"], "no command"),
        (["-n", "2", "--"], "no command"),
        (["--", "true"], "-n"),
        (["-n", "1", "--ps", "-1", "--", "true"], "negative"),
        (["-n", "1", "--timeout-start", "0", "--", "true"], "positive"),
    ],
)
def test_bad_arguments_exit_2(args, message):
    result = subprocess.run(
        [PY, "-m", "tf_rdma.cli", "launch", *args],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2, result
    assert "usage:" in result.stderr and message in result.stderr, result.stderr


def test_bad_port_offset_is_usage_error():
    env = dict(os.environ, TF_RDMA_PORT_OFFSET="70000")
    result = subprocess.run(
        [PY, "-m", "tf_rdma.cli", "launch", "-n", "1", "--", "true"],
        cwd=REPO, capture_output=True, text=True, timeout=60, env=env,
    )
    assert result.returncode == 2
    assert "TF_RDMA_PORT_OFFSET='70000'" in result.stderr


def test_cli_help_and_unknown_subcommand():
    for args in (["--help"], ["launch", "--help"]):
        result = subprocess.run(
            [PY, "-m", "tf_rdma.cli", *args], cwd=REPO, capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0, result
        assert "launch" in result.stdout
    result = subprocess.run(
        [PY, "-m", "tf_rdma.cli", "launch", "--help"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert "--timeout-start" in result.stdout and "-- CMD" in result.stdout
    result = subprocess.run(
        [PY, "-m", "tf_rdma.cli", "frobnicate"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2 and "invalid choice" in result.stderr
    result = subprocess.run([PY, "-m", "tf_rdma.cli"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2


def test_cli_help_does_not_import_tensorflow():
    code = (
        "import sys\n"
        "from tf_rdma import cli\n"
        "try:\n"
        "    cli.main(['launch', '--help'])\n"
        "except SystemExit as e:\n"
        "    assert e.code == 0\n"
        "assert 'tensorflow' not in sys.modules\n"
    )
    subprocess.run([PY, "-c", code], cwd=REPO, check=True, timeout=60, capture_output=True)


# --------------------------------------------------------------------------- stand-in server

# Keeps the server's contract: listens on its gRPC address and its endpoint,
# creates a shared-memory segment named like the engine's, prints the ready
# line, exits 0 on SIGTERM/SIGINT. It leaves its segment behind on purpose
# (the launcher must remove it). FAKE_FAIL / FAKE_HANG / FAKE_STUBBORN name a
# task that fails at start, never gets ready, or ignores SIGTERM.
FAKE_SERVER = r'''
import argparse, json, os, signal, socket, sys, time
from tf_rdma import cluster as C

parser = argparse.ArgumentParser()
parser.add_argument("--job", required=True)
parser.add_argument("--task", type=int, required=True)
args = parser.parse_args()
task = C.canonical_task(args.job, args.task)
assert C.task_from_tf_config() == (args.job, args.task)
cluster = C.cluster_from_tf_config()
grpc = cluster[args.job][args.task]
endpoint = C.endpoints(cluster)[task]
print(f"starting {task} secret={os.environ['TF_RDMA_SECRET']}", file=sys.stderr, flush=True)
if os.environ.get("FAKE_FAIL") == task:
    print("something went wrong", file=sys.stderr, flush=True)
    print("fatal: cannot start", file=sys.stderr, flush=True)
    sys.exit(7)
sockets = []
for address in (grpc, endpoint):
    host, port = C.split_address(address)
    s = socket.socket()
    s.bind((host, port))
    s.listen()
    sockets.append(s)
with open(f"/dev/shm/tfrdma.{os.getpid()}.0.region", "w") as f:
    f.write("x")
stop = []
if os.environ.get("FAKE_STUBBORN") == task:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
else:
    signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
signal.signal(signal.SIGINT, lambda *a: stop.append(1))
if os.environ.get("FAKE_HANG") != task:
    print(f"tf_rdma server ready: {task} grpc={grpc} endpoint={endpoint}", flush=True)
while not stop:
    time.sleep(0.02)
print(f"{task} stopping", file=sys.stderr, flush=True)
sys.exit(0)
'''


@pytest.fixture
def fake(tmp_path, launchers):
    (tmp_path / "fake_tfrdma_server.py").write_text(FAKE_SERVER)

    def start(args, env=None):
        return launchers(["--server-module", "fake_tfrdma_server", *args], env=env, extra_path=tmp_path)

    return start


def test_fake_cluster_runs_command_and_cleans_up(fake):
    code = """
        import json, os, re
        config = json.loads(os.environ["TF_CONFIG"])
        assert set(config) == {"cluster"}, config
        assert list(config["cluster"]) == ["worker"] and len(config["cluster"]["worker"]) == 2
        assert re.fullmatch("[0-9a-f]{64}", os.environ["TF_RDMA_SECRET"])
        print("secret", os.environ["TF_RDMA_SECRET"], flush=True)
        print("cmd pid", os.getpid(), flush=True)
        open(f"/dev/shm/tfrdma.{os.getpid()}.3", "w").close()
    """
    launcher = fake(["-n", "2", "--", *client(code)])
    assert launcher.wait() == 0, launcher.output()
    secret = launcher.wait_for(r"^secret (\w+)$", stream="stdout").group(1)
    cmd_pid = int(launcher.wait_for(r"^cmd pid (\d+)$", stream="stdout").group(1))
    pids = launcher.server_pids()
    assert len(pids) == 2
    # Server output is forwarded, prefixed, and the servers got the same secret.
    launcher.wait_for(rf"^\[worker:0\] starting /job:worker/task:0 secret={secret}$")
    launcher.wait_for(rf"^\[worker:1\] starting /job:worker/task:1 secret={secret}$")
    launcher.wait_for(r"^\[worker:1\] /job:worker/task:1 stopping$")
    launcher.wait_for(r"^tf-rdma launch: cluster ready: .*\"worker\"")
    assert wait_dead(pids, 5)
    assert shm_files(pids + [cmd_pid]) == [], launcher.output()


def test_fake_secret_and_offset_from_environment(fake):
    code = """
        import json, os
        from tf_rdma import cluster as C
        print("secret", os.environ["TF_RDMA_SECRET"], "offset", os.environ["TF_RDMA_PORT_OFFSET"], flush=True)
        print("endpoints", json.dumps(C.endpoints(C.cluster_from_tf_config())), flush=True)
    """
    launcher = fake(["-n", "1", "--", *client(code)], env={"TF_RDMA_SECRET": "s3cret", "TF_RDMA_PORT_OFFSET": "17"})
    assert launcher.wait() == 0, launcher.output()
    assert "secret s3cret offset 17" in launcher.stdout
    endpoints = json.loads(launcher.wait_for(r"^endpoints (.*)$", stream="stdout").group(1))
    ready = launcher.wait_for(r"tf_rdma server ready: /job:worker/task:0 grpc=(\S+) endpoint=(\S+)")
    grpc, endpoint = ready.group(1), ready.group(2)
    assert endpoints == {"/job:worker/task:0": endpoint}
    assert int(endpoint.rsplit(":", 1)[1]) == int(grpc.rsplit(":", 1)[1]) + 17


def test_fake_ps_and_workers(fake):
    code = """
        import json, os
        cluster = json.loads(os.environ["TF_CONFIG"])["cluster"]
        assert len(cluster["ps"]) == 1 and len(cluster["worker"]) == 2, cluster
    """
    launcher = fake(["--ps", "1", "-n", "2", "--", *client(code)])
    assert launcher.wait() == 0, launcher.output()
    launcher.wait_for(r"^\[ps:0\] starting /job:ps/task:0")
    assert len(launcher.server_pids()) == 3


@pytest.mark.parametrize(
    "code, expected",
    [("import sys; sys.exit(3)", 3), ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", 137)],
)
def test_fake_exit_status_propagated(fake, code, expected):
    launcher = fake(["-n", "1", "--", *client(code)])
    assert launcher.wait() == expected, launcher.output()
    assert wait_dead(launcher.server_pids(), 5)


def test_fake_command_not_found(fake):
    launcher = fake(["-n", "1", "--", "/nonexistent/tf-rdma-test-command"])
    assert launcher.wait() == 127, launcher.output()
    launcher.wait_for("could not run /nonexistent/tf-rdma-test-command")
    assert wait_dead(launcher.server_pids(), 5)


@pytest.mark.parametrize("signum, expected", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_fake_signal_tears_everything_down(fake, signum, expected):
    launcher = fake(
        ["-n", "2", "--", *client("import os, time; print('cmd pid', os.getpid(), flush=True); time.sleep(300)")]
    )
    cmd_pid = int(launcher.wait_for(r"cmd pid (\d+)", stream="stdout").group(1))
    pids = launcher.server_pids() + [cmd_pid]
    assert all(pid_alive(p) for p in pids)
    started = time.monotonic()
    launcher.proc.send_signal(signum)
    assert launcher.wait(30) == expected, launcher.output()
    assert time.monotonic() - started < 20
    assert wait_dead(pids, 5), launcher.output()
    assert shm_files(pids) == [], launcher.output()


def test_fake_server_failure_at_start(fake):
    launcher = fake(
        ["-n", "2", "--", *client("print('command ran')")], env={"FAKE_FAIL": "/job:worker/task:1"}
    )
    assert launcher.wait() == 1, launcher.output()
    assert "command ran" not in launcher.stdout
    launcher.wait_for(r"server for /job:worker/task:1 exited with status 7 before it was ready")
    launcher.wait_for(r"^    \[worker:1\] fatal: cannot start$")
    assert wait_dead(launcher.server_pids(), 5)
    assert shm_files(launcher.server_pids()) == []


def test_fake_server_start_timeout(fake):
    launcher = fake(
        ["-n", "2", "--timeout-start", "3", "--", *client("print('command ran')")],
        env={"FAKE_HANG": "/job:worker/task:0"},
    )
    assert launcher.wait() == 1, launcher.output()
    assert "command ran" not in launcher.stdout
    launcher.wait_for(r"server for /job:worker/task:0 was not ready after 3 s")
    launcher.wait_for(r"^    \[worker:0\] starting /job:worker/task:0")
    assert wait_dead(launcher.server_pids(), 5)


def test_fake_server_dying_while_command_runs(fake):
    launcher = fake(["-n", "2", "--", *client("import time; time.sleep(300)")])
    launcher.wait_for(r"cluster ready")
    os.kill(launcher.server_pids()[1], signal.SIGKILL)
    assert launcher.wait(30) == 1, launcher.output()
    launcher.wait_for(r"server for /job:worker/task:1 exited with status 137 .*while the command was running")
    assert wait_dead(launcher.server_pids(), 5)


def test_fake_stubborn_server_is_killed(fake):
    launcher = fake(["-n", "1", "--", *client("pass")], env={"FAKE_STUBBORN": "/job:worker/task:0"})
    started = time.monotonic()
    assert launcher.wait(60) == 0, launcher.output()
    assert 9 < time.monotonic() - started < 40
    launcher.wait_for(r"killed /job:worker/task:0 after 10 s")
    pids = launcher.server_pids()
    assert wait_dead(pids, 5)
    assert shm_files(pids) == []


def test_fake_second_signal_skips_grace_period(fake):
    launcher = fake(
        ["-n", "1", "--", *client("import time; time.sleep(300)")], env={"FAKE_STUBBORN": "/job:worker/task:0"}
    )
    launcher.wait_for(r"cluster ready")
    launcher.proc.send_signal(signal.SIGINT)
    launcher.wait_for(r"SIGINT: stopping")
    time.sleep(0.5)
    started = time.monotonic()
    launcher.proc.send_signal(signal.SIGINT)
    assert launcher.wait(30) == 130, launcher.output()
    assert time.monotonic() - started < 5
    launcher.wait_for(r"killed /job:worker/task:0 \(interrupted again\)")
    assert wait_dead(launcher.server_pids(), 5)


def test_fake_servers_die_with_a_killed_launcher(fake):
    launcher = fake(["-n", "2", "--", *client("import time; time.sleep(300)")])
    launcher.wait_for(r"cluster ready")
    pids = launcher.server_pids()
    launcher.proc.kill()
    launcher.proc.wait(10)
    assert wait_dead(pids, 15), "servers outlived a SIGKILLed launcher"
