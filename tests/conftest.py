"""Shared test harness: real processes that meet through a real cluster.

`run_tasks` starts one Python process per task (each with its own tf_rdma
endpoint, as in SPMD programs), gives every process the cluster, the secret
and the repository on its path, waits for all of them under a hard timeout,
and on failure reports every task's exit code and the tail of its output.
No test can hang: a timeout kills the whole process group.
"""

import contextlib
import glob
import hashlib
import importlib.util
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.parse

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)
# examples/ holds mwms_keras.py, the Keras-fit patch of the MWMS baseline that
# the strategy tests' tasks import (they get this path through PYTHONPATH).
EXAMPLES = os.path.join(REPO, "examples")
if EXAMPLES not in sys.path:
    sys.path.append(EXAMPLES)

from tf_rdma import cluster as cluster_lib  # noqa: E402

# Every task program starts with this: `task`, `cluster`, `start(**kw)` (starts
# the endpoint), `result(obj)` (prints a JSON line the test reads back),
# `error_of(fn)`, `segments_of(pid)` and the file-based `touch` / `wait_file`
# sync helpers are defined.
PRELUDE = """
import json, os, sys, time
import numpy as np
import tensorflow as tf
import tf_rdma
task = os.environ["TEST_TASK"]
cluster = json.loads(os.environ["TEST_CLUSTER"])
def result(obj):
    print("RESULT " + json.dumps(obj), flush=True)
def start(**kwargs):
    return tf_rdma.start_endpoint(task, cluster, **kwargs)
# Cross-process ordering for scenarios: one task touches a file in the shared
# TEST_SYNC_DIR, another waits for it (bounded).
SYNC_DIR = os.environ.get("TEST_SYNC_DIR", "")
def touch(name, text="1"):
    path = os.path.join(SYNC_DIR, name)
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.rename(path + ".tmp", path)
# What an op or call raised, for the test to check (None when it succeeded).
def error_of(fn):
    t0 = time.monotonic()
    try:
        fn()
    except Exception as e:  # reported, checked by the test
        return {"type": type(e).__name__,
                "mro": [c.__name__ for c in type(e).__mro__],
                "message": str(e), "elapsed_s": time.monotonic() - t0}
    return None
# This process's (or `pid`'s) tf_rdma segments in /dev/shm.
def segments_of(pid=None):
    prefix = "tfrdma.%d." % (os.getpid() if pid is None else pid)
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix))
def wait_file(name, timeout=60):
    path = os.path.join(SYNC_DIR, name)
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError("no " + path)
        time.sleep(0.02)
    with open(path) as f:
        return f.read()
"""


class TaskResult:
    def __init__(self, task, returncode, stdout, stderr):
        self.task, self.returncode = task, returncode
        self.stdout, self.stderr = stdout, stderr

    @property
    def results(self):
        return [json.loads(line[len("RESULT "):])
                for line in self.stdout.splitlines()
                if line.startswith("RESULT ")]

    @property
    def result(self):
        found = self.results
        assert found, f"{self.task} printed no RESULT\n{self.describe()}"
        return found[-1]

    def describe(self):
        return (f"--- {self.task}: exit {self.returncode}\n"
                f"stdout:\n{self.stdout[-3000:]}\nstderr:\n{self.stderr[-3000:]}")


def make_cluster(n, job="worker"):
    ports = cluster_lib.free_ports(n)
    return {job: [f"127.0.0.1:{p}" for p in ports]}


def base_env(extra=None):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (REPO, EXAMPLES, env.get("PYTHONPATH")) if p)
    env.setdefault("TF_RDMA_SECRET", "test-secret-of-the-suite")
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    if _softnic_for_this_test[0]:  # require_verbs() chose the emulated NIC
        env = softnic_env(env)
    return env


def spawn_task(task, program, cluster, env=None, prefix=()):
    """Starts one task program (PRELUDE + program) in its own process group.

    `prefix` goes before the Python command line (e.g. `nsenter ... --` to
    run the task in another namespace); it must exec Python, not fork it.
    """
    e = base_env(env)
    e["TEST_TASK"] = task
    e["TEST_CLUSTER"] = json.dumps(cluster)
    code = PRELUDE + textwrap.dedent(program)
    return subprocess.Popen([*prefix, sys.executable, "-c", code], env=e,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def kill_group(proc, sig=signal.SIGKILL):
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


@contextlib.contextmanager
def mount_namespace(mounts, what):
    """A mount namespace of its own, made by the shell command `mounts`.

    Yields the command prefix that runs a program inside it (spawn_task's
    `prefix`). Skips the test, saying that `what` cannot be made, where the
    namespace cannot (not root, no util-linux, no such mount).
    """
    if os.geteuid() != 0:
        pytest.skip(f"{what} needs root (a mount namespace)")
    for tool in ("unshare", "nsenter"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} (util-linux) is not installed")
    holder = subprocess.Popen(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c",
         f"{mounts} && echo ready && exec sleep 600"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    try:
        if holder.stdout.readline().strip() != "ready":
            holder.wait(timeout=10)
            pytest.skip(f"cannot make {what}: " + holder.stderr.read().strip())
        yield ["nsenter", "-t", str(holder.pid), "-m", "--"]
    finally:
        kill_group(holder)
        holder.wait()


def collect(procs, timeout):
    """Waits for every process (task → Popen) under one deadline."""
    deadline = time.monotonic() + timeout
    out = {}
    timed_out = []
    for task, proc in procs.items():
        left = max(0.1, deadline - time.monotonic())
        try:
            stdout, stderr = proc.communicate(timeout=left)
        except subprocess.TimeoutExpired:
            timed_out.append(task)
            kill_group(proc)
            stdout, stderr = proc.communicate()
        out[task] = TaskResult(task, proc.returncode, stdout, stderr)
    if timed_out:
        for proc in procs.values():
            kill_group(proc)
        pytest.fail(f"tasks {timed_out} did not finish within {timeout} s\n" +
                    "\n".join(r.describe() for r in out.values()))
    return out


def run_tasks(programs, cluster=None, env=None, timeout=90, check=True,
              prefixes=None):
    """Runs {task: program} concurrently; returns {task: TaskResult}.

    prefixes ({task: argv}) puts a command before a task's Python (taskset).
    With check=True, fails the test unless every task exits 0.
    """
    if cluster is None:
        cluster = make_cluster(len(programs))
    prefixes = prefixes or {}
    procs = {t: spawn_task(t, p, cluster, env, prefix=prefixes.get(t, ()))
             for t, p in programs.items()}
    out = collect(procs, timeout)
    if check:
        bad = [r for r in out.values() if r.returncode != 0]
        if bad:
            pytest.fail("task failed\n" + "\n".join(r.describe()
                                                    for r in out.values()))
    return out


def shm_segments(pids=None):
    """Names in /dev/shm of tf_rdma segments (optionally of some pids)."""
    names = [n for n in os.listdir("/dev/shm") if n.startswith("tfrdma.")]
    if pids is not None:
        prefixes = tuple(f"tfrdma.{p}." for p in pids)
        names = [n for n in names if n.startswith(prefixes)]
    return names



def die_with_parent():
    """preexec_fn: SIGTERM this child when the test process dies (even by
    SIGKILL), so that no server outlives a killed pytest; a server handles
    SIGTERM as a clean shutdown that removes its /dev/shm segments."""
    import ctypes
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    except OSError:  # Not glibc: no safety net, the fixtures still stop them.
        pass


class LiveCluster:
    """Servers of a cluster {job: n} (python -m tf_rdma.server), logs in files.

    stdout/stderr go to files (a pipe nobody reads could fill and stall a
    server); ``logs()`` reads the stderr files at any time. Every tf_rdma op
    waits at most ``op_timeout`` seconds. With ``coordinator``, the cluster
    also has a task chief:0 for the client (a ParameterServerStrategy
    coordinator, which starts its own server there), and ``run_client``'s
    TF_CONFIG names it.
    """

    def __init__(self, jobs, log_dir, env=None, op_timeout=30,
                 coordinator=False):
        self.jobs = dict(jobs)
        ports = iter(cluster_lib.free_ports(sum(self.jobs.values())
                                            + int(coordinator)))
        self.cluster = {job: [f"127.0.0.1:{next(ports)}" for _ in range(n)]
                        for job, n in self.jobs.items()}
        # A ParameterServerStrategy coordinator's own task: the client
        # (run_client) is chief:0 and starts its TensorFlow server there.
        self.client_task = None
        if coordinator:
            self.cluster["chief"] = [f"127.0.0.1:{next(ports)}"]
            self.client_task = {"type": "chief", "index": 0}
        self.log_dir = log_dir
        self.env = base_env({"TF_RDMA_TIMEOUT": str(op_timeout),
                             **(env or {})})
        self.procs = {}
        self.stopped = None

    @property
    def tasks(self):
        return [f"/job:{job}/task:{i}" for job, n in self.jobs.items()
                for i in range(n)]

    def start(self, timeout=120):
        for job, n in self.jobs.items():
            for i in range(n):
                e = dict(self.env)
                e["TF_CONFIG"] = json.dumps(
                    {"cluster": self.cluster, "task": {"type": job, "index": i}})
                name = f"{job}{i}"
                out = open(os.path.join(self.log_dir, name + ".out"), "w")
                err = open(os.path.join(self.log_dir, name + ".err"), "w")
                self.procs[name] = subprocess.Popen(
                    [sys.executable, "-m", "tf_rdma.server"], env=e,
                    stdout=out, stderr=err, start_new_session=True,
                    preexec_fn=die_with_parent)
                out.close()
                err.close()
        deadline = time.monotonic() + timeout
        waiting = set(self.procs)
        while waiting:
            for name in sorted(waiting):
                with open(os.path.join(self.log_dir, name + ".out")) as f:
                    if "tf_rdma server ready" in f.read():
                        waiting.discard(name)
                        continue
                if self.procs[name].poll() is not None:
                    self.stop()
                    pytest.fail(f"server {name} exited with "
                                f"{self.procs[name].returncode}:\n"
                                + self.logs()[-3000:])
            if waiting and time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"servers {sorted(waiting)} not ready within "
                            f"{timeout} s:\n" + self.logs()[-3000:])
            time.sleep(0.1)

    def logs(self):
        text = []
        for name in sorted(self.procs):
            with open(os.path.join(self.log_dir, name + ".err")) as f:
                text.append(f"--- {name}\n" + f.read())
        return "\n".join(text)

    @property
    def pids(self):
        return [p.pid for p in self.procs.values()]

    def stop(self, timeout=20):
        """SIGTERM, then SIGKILL after ``timeout``; returns {name: exit code}."""
        if self.stopped is not None:
            return self.stopped
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        codes = {}
        for name, p in self.procs.items():
            try:
                codes[name] = p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
                codes[name] = "killed"
        self.stopped = codes
        return codes

    def run_client(self, program, env=None, timeout=240, argv=None):
        """Runs a client program connected to the cluster; returns RESULTs.

        ``program`` is Python source, or None to run ``argv`` (a script
        and its arguments) instead.
        """
        e = dict(self.env)
        config = {"cluster": self.cluster}
        if self.client_task:
            config["task"] = self.client_task
        e["TF_CONFIG"] = json.dumps(config)
        e.update(env or {})
        command = ["-c", program] if program is not None else list(argv)
        try:
            proc = subprocess.run([sys.executable, *command], env=e,
                                  capture_output=True, text=True,
                                  timeout=timeout, start_new_session=True,
                                  preexec_fn=die_with_parent)
        except subprocess.TimeoutExpired as ex:
            pytest.fail(f"client did not finish within {timeout} s\nstdout:\n"
                        f"{(ex.stdout or b'')[-3000:]}\nstderr:\n"
                        f"{(ex.stderr or b'')[-3000:]}\nservers:\n"
                        + self.logs()[-3000:])
        results = [json.loads(line[len("RESULT "):])
                   for line in proc.stdout.splitlines()
                   if line.startswith("RESULT ")]
        return proc, results


# ---------------------------------------------------------------------------
# The verbs transport's tests need an RDMA device with an active port that the
# engine can use. Where there is none they skip with the reason, unless
# TF_RDMA_TEST_VERBS=1 says that this is an RDMA host, which turns the skip
# into a failure.

SYS_CLASS_INFINIBAND = "/sys/class/infiniband"
_verbs_missing = []  # the answer of verbs_missing(), once computed


def softnic_loaded():
    """True when the libibverbs this process loads is softnic, the emulated NIC
    (tests/softnic/; LD_LIBRARY_PATH=build/softnic selects it)."""
    import ctypes  # noqa: E402 - only the verbs tests need it

    try:
        return hasattr(ctypes.CDLL("libibverbs.so.1"), "softnic_emulated")
    except OSError:
        return False


def _active_port_missing():
    """None when a device under /sys/class/infiniband has an ACTIVE port, else why not."""
    if softnic_loaded():
        return None  # no sysfs for the emulation: the engine is asked below
    if not os.path.isdir(SYS_CLASS_INFINIBAND):
        return (f"no RDMA support in this kernel ({SYS_CLASS_INFINIBAND} is "
                f"absent)")
    states = []
    for device in sorted(os.listdir(SYS_CLASS_INFINIBAND)):
        ports = os.path.join(SYS_CLASS_INFINIBAND, device, "ports")
        for port in sorted(os.listdir(ports)) if os.path.isdir(ports) else []:
            try:
                with open(os.path.join(ports, port, "state")) as f:
                    state = f.read().strip()
            except OSError:
                continue
            if "ACTIVE" in state:
                return None
            states.append(f"{device} port {port}: {state}")
    return ("no RDMA port is ACTIVE (" + ("; ".join(states) or "no devices") +
            ")")


def verbs_missing():
    """None when the engine can use verbs here, else why the verbs tests cannot run.

    An ACTIVE port in sysfs is not enough (a low memlock limit, a container
    without /dev/infiniband, a plugin that was not built): where sysfs shows
    one, the engine itself is asked, as a starting endpoint would be.
    """
    if not _verbs_missing:
        missing = _active_port_missing()
        if missing is None:
            from tf_rdma import server  # noqa: E402 - loads TensorFlow

            status = server.verbs_status()
            if not status["available"]:
                missing = f"the engine cannot use verbs: {status['reason']}"
        _verbs_missing.append(missing)
    return _verbs_missing[0]


# Where this host has no usable RDMA port (this repository's CI), the data-path
# tests run their verbs cases on softnic, the emulated NIC (tests/softnic/,
# docs/verbs.md): require_verbs() then marks the current test so that
# base_env() puts build/softnic first on its tasks' library path. Only the
# tests that ask for verbs get it: the others, and test_verbs.py's checks of
# a host without RDMA, keep the real libibverbs and its answer.
SOFTNIC_DIR = os.path.join(REPO, "build", "softnic")
_softnic_missing = []  # the answer of softnic_missing(), once computed
_softnic_for_this_test = [False]


def softnic_env(env=None):
    """``env`` (default: this process's) with softnic first on LD_LIBRARY_PATH."""
    env = dict(os.environ if env is None else env)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        p for p in (SOFTNIC_DIR, env.get("LD_LIBRARY_PATH")) if p)
    return env


BENCH = os.path.join(REPO, "bench")


def load_bench(script):
    """bench/<script> as a module, its bench/_harness imports resolved as
    when it runs as ``python bench/<script>`` (bench/ first on sys.path)."""
    spec = importlib.util.spec_from_file_location(
        "bench_" + os.path.splitext(script)[0], os.path.join(BENCH, script))
    module = importlib.util.module_from_spec(spec)
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(BENCH)
        spec.loader.exec_module(module)
    return module


def softnic_missing():
    """None when the engine can use verbs over softnic, else why not.

    Asked of the engine in a child process with softnic on its library path
    (this process keeps the libibverbs it loaded).
    """
    if not _softnic_missing:
        if not os.path.exists(os.path.join(SOFTNIC_DIR, "libibverbs.so.1")):
            missing = f"softnic is not built ({SOFTNIC_DIR}; `make softnic`)"
        else:
            code = ("import json; from tf_rdma import server; "
                    "print('STATUS ' + json.dumps(server.verbs_status()))")
            proc = subprocess.run([sys.executable, "-c", code], env=base_env(softnic_env()),
                                  capture_output=True, text=True, timeout=120)
            lines = [l for l in proc.stdout.splitlines() if l.startswith("STATUS ")]
            if not lines:
                missing = f"asking the engine about softnic failed: {proc.stderr[-1000:]}"
            else:
                status = json.loads(lines[-1][len("STATUS "):])
                missing = (None if status["available"] else
                           f"the engine cannot use softnic: {status['reason']}")
        _softnic_missing.append(missing)
    return _softnic_missing[0]


@pytest.fixture(autouse=True)
def _softnic_only_where_asked():
    _softnic_for_this_test[0] = False
    yield
    _softnic_for_this_test[0] = False


def require_verbs():
    """Makes the calling test's tasks use verbs: the host's RDMA port where it
    has a usable one, else softnic; skips when neither is usable (fails
    instead under TF_RDMA_TEST_VERBS=1, which says this is an RDMA host and
    never falls back to the emulation)."""
    missing = verbs_missing()
    if missing is None:
        return
    if os.environ.get("TF_RDMA_TEST_VERBS") == "1":
        pytest.fail(f"TF_RDMA_TEST_VERBS=1 but {missing}")
    emulated = softnic_missing()
    if emulated is None:
        _softnic_for_this_test[0] = True
        return
    pytest.skip(f"verbs transport test: {missing}, and {emulated}; on an RDMA "
                f"host, TF_RDMA_TEST_VERBS=1 makes this skip a failure")


#: The transports whose data path the two-process tests exercise (verbs
#: only where require_verbs() lets it run).
DATA_PATH_TRANSPORTS = ("shm", "tcp", "verbs")


def use_transport(name):
    """Called by a transport-parametrized fixture before it starts tasks."""
    if name == "verbs":
        require_verbs()


def pairs_and_transports(stderr):
    """{(writer, reader): transport} from a task's engine log lines
    ("tf_rdma[A]: A -> B uses shm")."""
    return {(a, b): t for a, b, t in re.findall(
        r"^tf_rdma\[[^\]]*\]: (\S+) -> (\S+) uses (\w+)$", stderr, re.M)}


def transports_used(stderr):
    """The transports a task's engine logged for its pairs, sorted."""
    return sorted(set(pairs_and_transports(stderr).values()))


def start_servers(cluster, env):
    """Starts one `python -m tf_rdma.server` per worker; waits for "ready"."""
    procs = []
    for i in range(len(cluster["worker"])):
        e = dict(env)
        e["TF_CONFIG"] = json.dumps(
            {"cluster": cluster, "task": {"type": "worker", "index": i}})
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "tf_rdma.server"], env=e,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True))
    for p in procs:  # wait for "ready" lines, bounded
        deadline = time.monotonic() + 60
        line = ""
        while time.monotonic() < deadline and "ready" not in line:
            line = p.stdout.readline()
            if not line and p.poll() is not None:
                pytest.fail("server died: " + p.stderr.read()[-3000:])
        assert "tf_rdma server ready" in line, line
    return procs


def stop_servers(procs):
    """SIGTERMs the servers; returns [(returncode, stderr)] (SIGKILL after 20 s)."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    out = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            _, err = p.communicate()
        out.append((p.returncode, err))
    return out


# A client of two `python -m tf_rdma.server` workers with a rewritten step:
# worker:0 computes x * 2 (ELEMENTS float32s), worker:1 adds 1, so each call
# is one planned transfer worker:0 -> worker:1. `exact_call()` makes a call
# and says whether it returned the exact values. The program that follows
# sets ELEMENTS and REWRITE_TIMEOUT before this prelude and prints its
# "RESULT {json}" lines (run_rewrite_client).
REWRITE_CLIENT = r"""
import json, os, sys, threading, time
import numpy as np
import tensorflow as tf
import tf_rdma
cluster = json.loads(os.environ["TF_CONFIG"])["cluster"]
tf.config.experimental_connect_to_cluster(tf.train.ClusterSpec(cluster))
W0, W1 = "/job:worker/task:0", "/job:worker/task:1"

@tf.function
def step(x):
    with tf.device(W0):
        y = x * 2.0
    with tf.device(W1):
        z = y + 1.0
    return z

fn = tf_rdma.rewrite(step, timeout=REWRITE_TIMEOUT)
x = tf.range(ELEMENTS, dtype=tf.float32)
want = np.arange(ELEMENTS, dtype=np.float32) * 2 + 1

def exact_call():
    return bool(np.array_equal(fn(x).numpy(), want))
"""


def run_rewrite_client(program, env, timeout=120):
    """Starts two workers, runs `program` (after REWRITE_CLIENT's prelude) as
    their client with the servers' pids in TEST_SERVER_PIDS, stops them.

    Returns (the client's last RESULT, [(exit code, stderr)] per server);
    fails the test if the client failed or printed no RESULT.
    """
    cluster = make_cluster(2)
    servers = start_servers(cluster, env)
    try:
        client_env = dict(env, TF_CONFIG=json.dumps({"cluster": cluster}),
                          TEST_SERVER_PIDS=" ".join(str(p.pid) for p in servers))
        proc = subprocess.run([sys.executable, "-c", program], env=client_env,
                              capture_output=True, text=True, timeout=timeout)
    finally:
        logs = stop_servers(servers)
    results = [json.loads(line[len("RESULT "):])
               for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not results:
        pytest.fail(f"client failed ({proc.returncode}):\n{proc.stderr[-3000:]}\n"
                    + "\n".join(err[-1500:] for _, err in logs))
    return results[-1], logs


# ---------------------------------------------------------------------------
# Two "hosts" on one machine: network namespaces joined by a veth pair, each
# with an address from TEST-NET-1 (192.0.2.0/24, the documentation range,
# used only inside these namespaces). A task runs in one with
# spawn_task(..., prefix=[IP, "netns", "exec", ns]).

IP = shutil.which("ip") or "/usr/sbin/ip"
ADDR_A, ADDR_B = "192.0.2.1", "192.0.2.2"


def ip(*args, check=True):
    r = subprocess.run([IP, *args], capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({r.returncode}): "
                           f"{r.stderr.strip()}")
    return r


@pytest.fixture
def two_hosts():
    """Yields ((netns, veth, address) of host a, same of host b)."""
    if not os.path.exists(IP):
        pytest.skip(f"no `ip` command (looked for {IP}); install iproute2")
    tag = f"{os.getpid() % 100000}{random.randrange(16**4):04x}"
    ns_a, ns_b = f"tfrdma-a-{tag}", f"tfrdma-b-{tag}"
    veth_a, veth_b = f"tfa{tag}"[:15], f"tfb{tag}"[:15]
    r = ip("netns", "add", ns_a, check=False)
    if r.returncode != 0:
        pytest.skip(f"cannot create network namespaces here (`ip netns add` "
                    f"failed as uid {os.getuid()}: {r.stderr.strip()})")
    created = [ns_a]
    try:
        ip("netns", "add", ns_b)
        created.append(ns_b)
        r = ip("link", "add", veth_a, "netns", ns_a, "type", "veth", "peer",
               "name", veth_b, "netns", ns_b, check=False)
        if r.returncode != 0:
            pytest.skip(f"cannot create a veth pair between namespaces: "
                        f"{r.stderr.strip()}")
        for ns, dev, addr in ((ns_a, veth_a, ADDR_A), (ns_b, veth_b, ADDR_B)):
            ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            ip("-n", ns, "link", "set", dev, "up")
            ip("-n", ns, "link", "set", "lo", "up")
        yield (ns_a, veth_a, ADDR_A), (ns_b, veth_b, ADDR_B)
    finally:
        for ns in created:  # removes the veth ends inside them too
            ip("netns", "del", ns, check=False)


# ---------------------------------------------------------------------------
# A two-task exchange (tests/test_chaos.py, tests/test_many_hosts.py): worker:0
# and worker:1 send each other a tensor per step, each checked by its SHA-256,
# under whatever condition the test makes (a bad network, a stopped task, an
# unplugged host).

EXCHANGE_TASKS = ("worker:0", "worker:1")
EXCHANGE_PEER_OF = {"worker:0": "/job:worker/task:1", "worker:1": "/job:worker/task:0"}

# The exchange's set-up: the plan, the payloads, the endpoint.
EXCHANGE = """
import hashlib
N, STEPS = int(os.environ["TEST_ELEMENTS"]), int(os.environ["TEST_STEPS"])
plan = tf_rdma.Plan([
    tf_rdma.Transfer("a2b", "worker:0", "worker:1", "float32", [N]),
    tf_rdma.Transfer("b2a", "worker:1", "worker:0", "float32", [N]),
], name="chaos", depth=2)
def payload(sender, step):
    return np.random.default_rng(1000 * sender + step).standard_normal(N, dtype=np.float32)
listen = os.environ.get("TEST_LISTEN_" + task.replace(":", "_"))
ep = start(listen=listen) if listen else start()
me = int(task.rsplit(":", 1)[1])
out_key, in_key = ("a2b", "b2a") if me == 0 else ("b2a", "a2b")
"""
# Each task sends its tensor, then receives the other's, STEPS times. It
# reports after every step and, with TEST_PAUSE_AFTER_STEP, waits there for
# the test's "go" (so the test acts between two steps however fast they
# run); on the first failing op it reports the error with the op's key,
# step and duration.
EXCHANGE_PROGRAM = EXCHANGE + """
pause_after = int(os.environ.get("TEST_PAUSE_AFTER_STEP", "0"))
digests, failure = [], None
t0 = time.monotonic()
for step in range(1, STEPS + 1):
    value = tf.constant(payload(me, step))  # made before the op is timed
    error = error_of(lambda: tf_rdma.ops.send(value, plan, out_key))
    if error:
        failure = dict(error, key=out_key, step=step)
        break
    got = []
    error = error_of(lambda: got.append(tf_rdma.ops.recv(plan, in_key).numpy()))
    if error:
        failure = dict(error, key=in_key, step=step)
        break
    digests.append(hashlib.sha256(got.pop().tobytes()).hexdigest())
    touch(f"{task}-step{step}")
    if step == pause_after:  # the test acts (stops a task, cuts the path)
        wait_file("go", timeout=120)
result({"digests": digests, "failure": failure, "seconds": time.monotonic() - t0})
"""


def payload_digest(sender, step, n):
    values = np.random.default_rng(1000 * sender + step).standard_normal(n, dtype=np.float32)
    return hashlib.sha256(values.tobytes()).hexdigest()


def run_exchange(tmp_path, cluster, *, elements, steps, timeout_s, transport="tcp",
                 prefixes=None, listen=None, during=None, pause_after=0, budget=150):
    """Runs EXCHANGE_PROGRAM on both tasks; `during(procs)` runs while they do.

    With `pause_after`, both tasks wait after that step until `during`
    touches "go" in tmp_path.
    """
    env = {"TEST_SYNC_DIR": str(tmp_path), "TF_RDMA_TRANSPORT": transport,
           "TF_RDMA_TIMEOUT": str(timeout_s), "TEST_ELEMENTS": str(elements),
           "TEST_STEPS": str(steps), "TEST_PAUSE_AFTER_STEP": str(pause_after)}
    for task, address in (listen or {}).items():
        env["TEST_LISTEN_" + task.replace(":", "_")] = address
    procs = {t: spawn_task(t, EXCHANGE_PROGRAM, cluster, env, prefix=(prefixes or {}).get(t, ()))
             for t in EXCHANGE_TASKS}
    try:
        if during is not None:
            during(procs)
        out = collect(procs, timeout=budget)
    finally:
        for p in procs.values():
            kill_group(p)
    for r in out.values():
        assert r.returncode == 0, r.describe()
    return {t: r.result for t, r in out.items()}


def assert_exchange_contract(results, *, elements, steps, timeout_s, stopped=None, stop_s=0.0,
                     must_fail=()):
    """Correct results on every task, or its first failing op raised a
    DeadlineExceeded or Unavailable error naming the tensor, the peer task
    and the step, no later than timeout + 1 s after the op started (for the
    task that was itself `stopped`, after its stop of `stop_s` ended)."""
    for task, r in results.items():
        me = int(task.rsplit(":", 1)[1])
        expected = [payload_digest(1 - me, s, elements) for s in range(1, steps + 1)]
        done = len(r["digests"])
        assert r["digests"] == expected[:done], f"{task} received wrong bytes"
        failure = r["failure"]
        if failure is None:
            assert done == steps, r
            assert task not in must_fail, f"{task} was expected to fail: {r}"
            continue
        assert failure["type"] in ("DeadlineExceededError", "UnavailableError"), (task, failure)
        message = failure["message"]
        for part in (f"'{failure['key']}'", EXCHANGE_PEER_OF[task], f"step {failure['step']}"):
            assert part in message, (task, part, failure)
        bound = timeout_s + 1.0 + (stop_s if task == stopped else 0.0)
        assert failure["elapsed_s"] <= bound, (task, bound, failure)


def wait_for_step(tmp_path, procs, tasks, step):
    """Waits until every task in `tasks` reported `step` (bounded)."""
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"{t}-step{step}").exists() for t in tasks):
        for t, p in procs.items():
            if p.poll() is not None:
                out = collect(procs, timeout=30)
                pytest.fail(f"{t} exited before step {step}\n" +
                            "\n".join(r.describe() for r in out.values()))
        assert time.monotonic() < deadline, f"step {step} never finished"
        time.sleep(0.02)


# ---------------------------------------------------------------------------
# Emulated hosts: each its own network namespace (an "eth0" veth to a bridge
# in the root namespace, an address from TEST-NET-2, 198.51.100.0/24, used
# only inside these namespaces), its own mount namespace with a private
# tmpfs on /dev/shm and an /etc/hosts that names every emulated host, and its
# own hostname (a UTS namespace). Tasks name each other by host name in their
# cluster, as on a real cluster. What they share is what hosts on one fabric
# share: the file system (tests/softnic's directory of queue pairs, its
# emulated fabric, included), the boot id and the process ids.

HOSTS_NET = "198.51.100"


class EmulatedHost:
    """One emulated host.

    Attributes:
      name: Its host name, resolvable on every emulated host.
      address: Its IPv4 address.
      prefix: The argv that runs a program on it (spawn_task's `prefix`).
      link: Its cable: the root-namespace end of its veth (set_link).
    """

    def __init__(self, index, tag, holder):
        self.name = f"tfrdma-host{index}"
        self.address = f"{HOSTS_NET}.{index + 1}"
        self.netns = f"tfrdma-h{index}-{tag}"
        self.link = f"tfh{index}{tag}"[:15]
        self.holder = holder
        self.prefix = ["nsenter", "-t", str(holder.pid) if holder else "0",
                       "-n", "-m", "-u", "--"]

    def set_link(self, up):
        """Plugs (True) or unplugs (False) this host's cable."""
        ip("link", "set", self.link, "up" if up else "down")

    def __repr__(self):
        return f"EmulatedHost({self.name}, {self.address})"


@contextlib.contextmanager
def emulated_hosts(count, shm_mib=512):
    """Yields `count` EmulatedHosts on one bridge; removes them afterwards.

    Skips the calling test, with the reason, where they cannot be made (not
    root, no iproute2 or util-linux, no bridge or veth support).
    """
    if os.geteuid() != 0:
        pytest.skip("emulated hosts need root (network and mount namespaces)")
    for tool in (IP, "unshare", "nsenter"):
        if shutil.which(tool) is None:
            pytest.skip(f"emulated hosts need {tool} (iproute2, util-linux)")
    tag = f"{os.getpid() % 1000}{random.randrange(16**3):03x}"
    bridge = f"tfbr{tag}"
    workdir = tempfile.mkdtemp(prefix="tfrdma-hosts-")
    hosts_file = os.path.join(workdir, "hosts")
    with open(hosts_file, "w") as f:
        f.write("127.0.0.1 localhost\n::1 localhost ip6-localhost\n")
        for i in range(count):
            f.write(f"{HOSTS_NET}.{i + 1} tfrdma-host{i}\n")
    hosts, bridged = [], False
    try:
        r = ip("link", "add", bridge, "type", "bridge", check=False)
        if r.returncode != 0:
            pytest.skip(f"cannot create a bridge here: {r.stderr.strip()}")
        bridged = True
        ip("link", "set", bridge, "up")
        for i in range(count):
            host = EmulatedHost(i, tag, None)
            r = ip("netns", "add", host.netns, check=False)
            if r.returncode != 0:
                pytest.skip(f"cannot create network namespaces here: "
                            f"{r.stderr.strip()}")
            hosts.append(host)
            ip("link", "add", host.link, "type", "veth", "peer", "name",
               "eth0", "netns", host.netns)
            ip("link", "set", host.link, "master", bridge, "up")
            ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev",
               "eth0")
            ip("-n", host.netns, "link", "set", "eth0", "up")
            ip("-n", host.netns, "link", "set", "lo", "up")
            setup = (f"hostname {host.name} && "
                     f"mount -t tmpfs -o size={shm_mib}m tmpfs /dev/shm && "
                     f"mount --bind {hosts_file} /etc/hosts && "
                     f"echo ready && exec sleep 3600")
            host.holder = subprocess.Popen(
                [IP, "netns", "exec", host.netns, "unshare", "--uts",
                 "--mount", "--propagation", "private", "sh", "-c", setup],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                start_new_session=True)
            if host.holder.stdout.readline().strip() != "ready":
                host.holder.wait(timeout=10)
                pytest.skip(f"cannot make emulated host {host.name}: "
                            f"{host.holder.stderr.read().strip()}")
            host.prefix[2] = str(host.holder.pid)
        yield hosts
    finally:
        for host in hosts:
            if host.holder is not None:
                kill_group(host.holder)
                host.holder.wait()
            ip("netns", "del", host.netns, check=False)
        if bridged:
            ip("link", "del", bridge, check=False)
        shutil.rmtree(workdir, ignore_errors=True)


# ---------------------------------------------------------------------------
# The TensorFlow profiler's output: the XPlane file a session writes under
# LOGDIR/plugins/profile/RUN/HOST.xplane.pb (tests/test_profiler.py, and
# Keras' TensorBoard(profile_batch=...) in tests/test_strategy.py).


def read_xplane_events(logdir, prefix=""):
    """Returns the events of the host plane the profiler wrote under logdir
    (those whose name starts with `prefix`: a profile of a Keras fit holds
    many thousands of TensorFlow's own).

    Each event is a dict: name, start_ps, end_ps (absolute, picoseconds) and
    its stats by name (ints for numbers, str otherwise).
    """
    from tensorflow.tsl.profiler.protobuf import xplane_pb2  # noqa: E402

    paths = glob.glob(os.path.join(logdir, "plugins", "profile", "*",
                                   "*.xplane.pb"))
    assert len(paths) == 1, f"expected one .xplane.pb under {logdir}, found {paths}"
    space = xplane_pb2.XSpace()
    with open(paths[0], "rb") as f:
        space.ParseFromString(f.read())
    hosts = [p for p in space.planes if p.name == "/host:CPU"]
    assert hosts, ("no /host:CPU plane in the profile; planes: "
                   f"{[p.name for p in space.planes]}")
    plane = hosts[0]
    events = []
    for line in plane.lines:
        for e in line.events:
            name = plane.event_metadata[e.metadata_id].name
            if not name.startswith(prefix):
                continue
            stats = {}
            for s in e.stats:
                stat = plane.stat_metadata[s.metadata_id].name
                kind = s.WhichOneof("value")
                if kind == "ref_value":
                    value = plane.stat_metadata[s.ref_value].name
                else:
                    value = getattr(s, kind)
                # tf_rdma percent-encodes '#', ',' and '%' in a value
                # (kernels/ops/trace_sink.cc).
                if isinstance(value, str):
                    value = urllib.parse.unquote(value)
                stats[stat] = value
            start = line.timestamp_ns * 1000 + e.offset_ps
            events.append({"name": name,
                           "start_ps": start, "end_ps": start + e.duration_ps,
                           "stats": stats})
    return events


def named(events, name, key=None):
    """The events called `name` (any name if None) with stat key == `key`
    (any key if None)."""
    return [e for e in events if (name is None or e["name"] == name) and
            (key is None or e["stats"].get("key") == key)]


def inside(inner, outer):
    """True if `inner` lies within `outer` (1 us of slack for rounding)."""
    slack = 1_000_000
    return (inner["start_ps"] >= outer["start_ps"] - slack and
            inner["end_ps"] <= outer["end_ps"] + slack)
