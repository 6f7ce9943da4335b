"""Tests of ``tf-rdma launch``: the real launcher, real servers, real clients.

Every launch here is ``python -m tf_rdma.cli launch ...``, which starts real
``python -m tf_rdma.server`` processes; the commands are real TensorFlow
clients or plain programs. Each launch costs several TensorFlow imports (the
launcher, every server, a TensorFlow client), so the file starts all of its
launches at once, in a module fixture, and each test then checks its own:
the imports overlap instead of adding up.

Argument errors are checked in-process through ``tf_rdma.cli.main``: they
exit before any server starts.

Every launcher runs in its own process group, every wait has a timeout, and
the groups are killed at the end of the module, whatever happened.
"""

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from conftest import shm_segments
from tf_rdma import cli

pytestmark = pytest.mark.timeout(180)

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable

#: How long a launch may take from start to exit while all of them run at once.
LAUNCH_TIMEOUT_S = 150
#: --timeout-start for the launches: generous, since all of them start together.
START_TIMEOUT_S = "120"

SECRET = "launch-test-" + secrets.token_hex(8)
PORT_OFFSET = 123


# --------------------------------------------------------------------------- processes


def pid_alive(pid):
    """True if a process with this pid exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"  # the state follows the command name


def wait_dead(pids, timeout):
    deadline = time.monotonic() + timeout
    while any(pid_alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


class Launch:
    """A ``python -m tf_rdma.cli launch`` process whose output lines are timestamped."""

    def __init__(self, args, env=None, nice=0):
        full_env = {
            k: v for k, v in os.environ.items()
            if k != "TF_CONFIG" and not k.startswith("TF_RDMA_")
        }
        full_env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p
        )
        full_env["TF_CPP_MIN_LOG_LEVEL"] = "2"
        full_env["PYTHONUNBUFFERED"] = "1"
        full_env.update(env or {})
        self.args = args
        self.started = time.monotonic()
        self.ended = None  # when the launcher exited, set by _reap
        self._reaped = threading.Event()
        self.proc = subprocess.Popen(
            [PY, "-m", "tf_rdma.cli", "launch", *args],
            cwd=REPO,
            env=full_env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # its own process group, for kill_group
            preexec_fn=(lambda: os.nice(nice)) if nice else None,
        )
        self.lines = {"stdout": [], "stderr": []}  # (monotonic time, line)
        self._changed = threading.Condition()
        self._threads = [
            threading.Thread(target=self._pump, args=(getattr(self.proc, name), name), daemon=True)
            for name in self.lines
        ]
        for thread in self._threads:
            thread.start()
        threading.Thread(target=self._reap, daemon=True).start()

    def _reap(self):
        self.proc.wait()
        self.ended = time.monotonic()
        self._reaped.set()

    def _pump(self, stream, name):
        for line in stream:
            with self._changed:
                self.lines[name].append((time.monotonic(), line.rstrip("\n")))
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def _done(self):
        return self.proc.poll() is not None and not any(t.is_alive() for t in self._threads)

    def wait_for(self, pattern, stream="stderr", timeout=LAUNCH_TIMEOUT_S):
        """Returns (time, match) of the first line matching the regex."""
        regex = re.compile(pattern)
        deadline = self.started + timeout
        with self._changed:
            while True:
                for stamp, line in self.lines[stream]:
                    match = regex.search(line)
                    if match:
                        return stamp, match
                if time.monotonic() > deadline or self._done():
                    raise AssertionError(f"no line matching {pattern!r} on {stream}\n{self.output()}")
                self._changed.wait(0.2)

    def has(self, pattern, stream="stderr"):
        with self._changed:
            return any(re.search(pattern, line) for _, line in self.lines[stream])

    def wait(self, timeout=None):
        """Waits for the launcher to exit; returns its status."""
        left = self.started + LAUNCH_TIMEOUT_S - time.monotonic() if timeout is None else timeout
        try:
            code = self.proc.wait(max(left, 0.1))
        except subprocess.TimeoutExpired:
            self.kill_group()
            raise AssertionError(f"launcher did not exit in time\n{self.output()}") from None
        self._reaped.wait(10)
        for thread in self._threads:
            thread.join(10)
        return code

    def server_pids(self):
        with self._changed:
            text = "\n".join(line for _, line in self.lines["stderr"])
        return [int(pid) for pid in re.findall(r"^tf-rdma launch: started \S+ pid=(\d+)$", text, re.M)]

    def output(self):
        with self._changed:
            return "\n".join(
                f"--- {name} of launch {self.args}\n" + "\n".join(line for _, line in lines)
                for name, lines in self.lines.items()
            )

    def kill_group(self):
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass


def python(code):
    """A command that runs Python code."""
    return [PY, "-c", textwrap.dedent(code)]


# --------------------------------------------------------------------------- the launches

# A TensorFlow client: it reports what the launcher gave it, runs an op on
# worker 1, sends a tensor from worker 0 to worker 1 through tf_rdma (so that
# the servers hold shared-memory segments), and then sleeps until it is stopped.
CLIENT = """
    import json, os, time
    config = json.loads(os.environ["TF_CONFIG"])
    print("CONFIG " + json.dumps(config), flush=True)
    print("SECRET " + os.environ.get("TF_RDMA_SECRET", ""), flush=True)
    import tensorflow as tf
    import tf_rdma
    tf.config.experimental_connect_to_cluster(tf.train.ClusterSpec(config["cluster"]))
    with tf.device("/job:worker/task:1"):
        x = tf.constant(1.0) + 1
    plan = tf_rdma.Plan([tf_rdma.Transfer("x", "worker:0", "worker:1", "float32", [4])])

    @tf.function
    def step():
        with tf.device("/job:worker/task:0"):
            tf_rdma.ops.send(tf.range(4, dtype=tf.float32), plan, "x")
        with tf.device("/job:worker/task:1"):
            return tf_rdma.ops.recv(plan, "x") * 2

    y = step()
    print("CLIENT " + json.dumps({"x": float(x.numpy()), "x_device": x.device,
                                  "y": y.numpy().tolist(), "pid": os.getpid()}), flush=True)
    time.sleep(300)
"""

AFFINITY = """
    import json, os
    print("CPUS " + json.dumps([sorted(os.sched_getaffinity(0)),
                                os.environ.get("TF_RDMA_HOST_CPUS"),
                                os.environ.get("TF_NUM_INTEROP_THREADS")]), flush=True)
"""

LAUNCHES = {
    # ps + 2 workers, a given secret and port offset, a TensorFlow client;
    # stopped by SIGINT in test_sigint_stops_everything_and_removes_segments.
    "client": (
        ["--ps", "1", "-n", "2", "--timeout-start", START_TIMEOUT_S, "--", *python(CLIENT)],
        {"TF_RDMA_SECRET": SECRET, "TF_RDMA_PORT_OFFSET": str(PORT_OFFSET)},
    ),
    # The others are started with a lower priority: the client launch, three
    # TensorFlow imports in a row, is the one that takes longest.
    "exit3": (
        ["-n", "1", "--timeout-start", START_TIMEOUT_S, "--", *python("""
            import os, sys
            print("SECRET " + os.environ["TF_RDMA_SECRET"], flush=True)
            # TensorFlow's start-up notice, a line of its own and a line
            # that never ends: only the notice is dropped.
            sys.stderr.write("WARNING: All log messages before absl::InitializeLog() "
                             "is called are written to STDERR\\nOWN LINE\\nUNENDED")
            sys.exit(3)
        """)],
        None,
    ),
    "killed": (
        ["-n", "1", "--timeout-start", START_TIMEOUT_S, "--",
         *python("import os, signal; os.kill(os.getpid(), signal.SIGKILL)")],
        None,
    ),
    "not_found": (
        ["-n", "1", "--timeout-start", START_TIMEOUT_S, "--", "/nonexistent/tf-rdma-test-command", "x"],
        None,
    ),
    # --spmd: the command itself, once per worker, each with its own task;
    # the copies meet through tf_rdma and allreduce their ranks + 1.
    "spmd": (
        ["--spmd", "-n", "2", "--", *python("""
            import json, os
            import tensorflow as tf
            import tf_rdma
            from tf_rdma import cluster, collectives
            config = json.loads(os.environ["TF_CONFIG"])
            task = cluster.canonical_task(config["task"]["type"], config["task"]["index"])
            tf_rdma.start_endpoint(task, config["cluster"])
            group = collectives.default_group()
            total = collectives.all_reduce(tf.constant([group.rank + 1.0]))
            print(f"SPMD {task} {float(total[0])} {os.environ['TF_RDMA_SECRET'] != ''}", flush=True)
            print("CPUS " + json.dumps([sorted(os.sched_getaffinity(0)),
                                        os.environ.get("TF_RDMA_HOST_CPUS"),
                                        os.environ.get("TF_NUM_INTEROP_THREADS")]),
                  flush=True)
        """)],
        None,
    ),
    # Binding: none asked for, and more tasks than CPUs (never bound).
    "unbound": (
        ["--spmd", "--bind", "none", "-n", "2", "--", *python(AFFINITY)],
        None,
    ),
    "crowded": (
        ["--spmd", "-n", str(len(os.sched_getaffinity(0)) + 1), "--", *python(AFFINITY)],
        None,
    ),
    # --spmd: task 1 fails at once, task 0 would sleep for 300 s.
    "spmd_fails": (
        ["--spmd", "-n", "2", "--", *python("""
            import json, os, sys, time
            if json.loads(os.environ["TF_CONFIG"])["task"]["index"] == 1:
                sys.exit(5)
            time.sleep(300)
        """)],
        None,
    ),
    # The real server refuses the setting (ConfigError) and exits before it is ready.
    "server_fails": (
        ["-n", "1", "--timeout-start", START_TIMEOUT_S, "--", *python("print('command ran')")],
        {"TF_RDMA_TRANSPORT": "bogus"},
    ),
}


@pytest.fixture(scope="module")
def launches():
    started = {}
    try:
        for name, (args, env) in LAUNCHES.items():
            started[name] = Launch(args, env, nice=0 if name == "client" else 5)
        yield started
    finally:
        for launch in started.values():
            pids = launch.server_pids()
            launch.kill_group()
            if wait_dead(pids, 10):
                for name in shm_segments(pids):  # only after a failure: tests check it is empty
                    os.unlink(os.path.join("/dev/shm", name))


def ready_lines(launch):
    """{task: (grpc, endpoint)} from the servers' ready lines, as the launcher forwards them."""
    with launch._changed:
        lines = [line for _, line in launch.lines["stderr"]]
    found = {}
    for line in lines:
        match = re.match(r"^\[\w+:\d+\] tf_rdma server ready: (\S+) grpc=(\S+) endpoint=(\S+)$", line)
        if match:
            found[match[1]] = (match[2], match[3])
    return found


def port(address):
    return int(address.rsplit(":", 1)[1])


# --------------------------------------------------------------------------- tests


def test_client_gets_cluster_secret_and_offset(launches):
    launch = launches["client"]
    _, match = launch.wait_for(r"^CLIENT (.*)$", stream="stdout")
    result = json.loads(match[1])
    assert result["x"] == 2.0 and "/task:1/" in result["x_device"], result
    assert result["y"] == [0.0, 2.0, 4.0, 6.0], result

    # TF_CONFIG is the cluster alone (the command is the client), and the
    # secret is the one from the environment, not a generated one.
    config = json.loads(launch.wait_for(r"^CONFIG (.*)$", stream="stdout")[1][1])
    assert set(config) == {"cluster"}, config
    cluster = config["cluster"]
    assert {job: len(tasks) for job, tasks in cluster.items()} == {"worker": 2, "ps": 1}, cluster
    assert launch.wait_for(r"^SECRET (.*)$", stream="stdout")[1][1] == SECRET
    # TensorFlow's start-up notices (printed whatever the log level on some
    # CPUs) reach no one: the client's stderr passes through the launcher.
    assert not launch.has(r"absl::InitializeLog|oneDNN custom operations"), launch.output()

    # Every server said it was ready at its gRPC address with its endpoint at
    # gRPC port + TF_RDMA_PORT_OFFSET.
    ready = ready_lines(launch)
    tasks = {f"/job:{job}/task:{i}": address for job, addresses in cluster.items()
             for i, address in enumerate(addresses)}
    assert set(ready) == set(tasks), launch.output()
    for task, (grpc, endpoint) in ready.items():
        assert grpc == tasks[task], (task, grpc, tasks)
        assert port(endpoint) == port(grpc) + PORT_OFFSET, (task, grpc, endpoint)
    assert len(launch.server_pids()) == 3, launch.output()


def test_sigint_stops_everything_and_removes_segments(launches):
    launch = launches["client"]
    _, match = launch.wait_for(r"^CLIENT (.*)$", stream="stdout")
    cmd_pid = json.loads(match[1])["pid"]
    server_pids = launch.server_pids()
    pids = server_pids + [cmd_pid]
    assert len(server_pids) == 3 and all(pid_alive(p) for p in pids), launch.output()
    # The transfer left the servers holding segments: the clean-up has work to do.
    assert shm_segments(server_pids), "the servers hold no /dev/shm/tfrdma.* segments"

    sent = time.monotonic()
    launch.proc.send_signal(signal.SIGINT)
    code = launch.wait(timeout=30)
    assert code == 130, launch.output()
    assert time.monotonic() - sent < 20, launch.output()
    assert wait_dead(pids, 5), launch.output()
    assert shm_segments(pids) == [], launch.output()


def test_command_exit_status_and_generated_secret(launches):
    launch = launches["exit3"]
    assert launch.wait() == 3, launch.output()
    # No TF_RDMA_SECRET in the environment: the launcher made one up.
    assert re.fullmatch(r"[0-9a-f]{64}", launch.wait_for(r"^SECRET (.*)$", stream="stdout")[1][1])
    launch.wait_for(r"^tf-rdma launch: cluster ready: ")
    assert wait_dead(launch.server_pids(), 5), launch.output()
    # The command's stderr passed through the launcher without the notice.
    launch.wait_for(r"^OWN LINE$")
    launch.wait_for(r"^UNENDED")
    assert not launch.has(r"absl::InitializeLog"), launch.output()


def test_command_killed_by_signal(launches):
    launch = launches["killed"]
    assert launch.wait() == 128 + signal.SIGKILL, launch.output()
    assert wait_dead(launch.server_pids(), 5), launch.output()


def test_command_not_found(launches):
    launch = launches["not_found"]
    assert launch.wait() == 127, launch.output()
    launch.wait_for(r"^tf-rdma launch: could not run /nonexistent/tf-rdma-test-command x: .*No such file")
    assert wait_dead(launch.server_pids(), 5), launch.output()


def test_server_failing_at_start(launches):
    launch = launches["server_fails"]
    assert launch.wait() == 1, launch.output()
    launch.wait_for(
        r"^tf-rdma launch: the server for /job:worker/task:0 exited with status 2 before it was ready"
    )
    # The server's own error line, as it printed it, under the launcher's report.
    launch.wait_for(r"^    \[worker:0\] tf_rdma server: TF_RDMA_TRANSPORT='bogus' is not auto or a comma-separated list of")
    # Quickly: as soon as the server exited, not after --timeout-start.
    error_at, _ = launch.wait_for(r"^\[worker:0\] tf_rdma server: TF_RDMA_TRANSPORT='bogus'")
    assert launch.ended - error_at < 10, launch.output()
    assert not launch.has(r"cluster ready") and not launch.has("command ran", stream="stdout")
    assert wait_dead(launch.server_pids(), 5), launch.output()


def test_spmd_runs_the_command_once_per_task(launches):
    launch = launches["spmd"]
    assert launch.wait() == 0, launch.output()
    for task in ("/job:worker/task:0", "/job:worker/task:1"):
        index = task[-1]
        # Both copies got their own task and the shared secret, met, and
        # summed 1 + 2; their stdout stays stdout, prefixed with the task.
        launch.wait_for(rf"^\[worker:{index}\] SPMD {task} 3.0 True$", stream="stdout")
    assert launch.server_pids() == []  # no servers in SPMD mode


def _cpus_by_task(launch):
    """{task index: [its CPUs, its TF_RDMA_HOST_CPUS, its
    TF_NUM_INTEROP_THREADS]} from the CPUS lines."""
    found = {}
    with launch._changed:
        for _, line in launch.lines["stdout"]:
            match = re.match(r"^\[worker:(\d+)\] CPUS (.*)$", line)
            if match:
                found[int(match[1])] = json.loads(match[2])
    return found


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="binding 2 tasks needs 2 CPUs")
def test_spmd_tasks_are_bound_to_their_own_cpus(launches):
    """Like mpirun's ranks: each task its own share of the launcher's CPUs,
    and the engine told how many the host's tasks share (a collective's
    auto spin); a task bound to one CPU gets two inter-op threads (with
    one, a ready op waits for the step's compute); unbound with --bind none
    or more tasks than CPUs."""
    cpus = sorted(os.sched_getaffinity(0))
    launch = launches["spmd"]
    assert launch.wait() == 0, launch.output()
    bound = _cpus_by_task(launch)
    assert sorted(bound) == [0, 1], launch.output()
    assert bound[0][0] + bound[1][0] == cpus, bound  # disjoint, all of them
    assert bound[0][1] == bound[1][1] == str(len(cpus)), bound
    for share, _, interop in bound.values():
        assert interop == ("2" if len(share) == 1 else None), bound
    launch.wait_for(r"^tf-rdma launch: bound each task to its own CPUs \(--bind none: unbound\): "
                    r"worker:0 \S+, worker:1 \S+$")
    launch.wait_for(r"collectives of up to 1 MiB spin up to 500 us for each block before "
                    rf"sleeping \(2 tasks of the cluster on this host, {len(cpus)} CPUs, each "
                    r"task bound to its own\)")
    for name in ("unbound", "crowded"):
        launch = launches[name]
        assert launch.wait() == 0, launch.output()
        found = _cpus_by_task(launch)
        assert found and all(v == [cpus, None, None] for v in found.values()), (name, found)
        assert "bound each task" not in launch.output()
    launches["crowded"].wait_for(
        rf"^tf-rdma launch: not binding the {len(cpus) + 1} tasks to CPUs: this launcher may "
        rf"use {len(cpus)} CPU\(s\), fewer than the tasks$")


@pytest.mark.fast
def test_cpu_shares_split_the_cpus_in_order():
    from tf_rdma.launch import _cpu_list, cpu_shares

    one_thread_a_core = [[cpu] for cpu in range(16)]
    assert cpu_shares(2, [3, 0, 1, 2], one_thread_a_core) == [[0, 1], [2, 3]]
    assert cpu_shares(3, range(8), one_thread_a_core) == [[0, 1], [2, 3, 4], [5, 6, 7]]
    assert cpu_shares(1, [4, 6], one_thread_a_core) == [[4, 6]]
    assert cpu_shares(3, [0, 1], one_thread_a_core) is None
    assert _cpu_list([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"


@pytest.mark.fast
def test_cpu_shares_give_tasks_whole_cores_where_cpus_are_smt_threads():
    """A host that numbers a core's two threads 4 apart (cores {0,4} {1,5}
    {2,6} {3,7}): two tasks get two whole cores each, not the first and the
    second threads of the same four cores; three tasks whole cores in
    near-equal runs; more tasks than cores a core's threads to neighbours.
    Threads numbered side by side ({0,1} {2,3} ...) give the runs of the
    sorted CPUs, and only the allowed CPUs of a core are given."""
    from tf_rdma.launch import cpu_shares

    apart = [[core, core + 4] for core in range(4)]
    assert cpu_shares(2, range(8), apart) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert cpu_shares(3, range(8), apart) == [[0, 4], [1, 5], [2, 3, 6, 7]]
    assert cpu_shares(8, range(8), apart) == [[0], [4], [1], [5], [2], [6], [3], [7]]
    assert cpu_shares(6, range(8), apart) == [[0], [4], [1, 5], [2], [6], [3, 7]]
    side_by_side = [[2 * core, 2 * core + 1] for core in range(4)]
    assert cpu_shares(2, range(8), side_by_side) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert cpu_shares(2, [0, 1, 2, 4, 5], apart) == [[0, 4], [1, 2, 5]]


def test_cpu_shares_read_the_cores_from_the_kernel():
    """Without `cores`, each CPU's core is what sysfs lists for it: every
    CPU is in its own core's list, and the shares are the split of those
    cores (on a host without SMT, the runs of the sorted CPUs)."""
    from tf_rdma.launch import _core_of, cpu_shares

    cpus = sorted(os.sched_getaffinity(0))
    cores = {cpu: _core_of(cpu) for cpu in cpus}
    if any(core is None for core in cores.values()):
        pytest.skip("this kernel does not list the CPUs' cores (topology/thread_siblings_list)")
    assert all(cpu in core for cpu, core in cores.items()), cores
    count = min(2, len(cpus))
    shares = cpu_shares(count, cpus)
    assert shares == cpu_shares(count, cpus, set(cores.values()))
    assert sorted(cpu for share in shares for cpu in share) == cpus, shares
    if len(set(cores.values())) >= count:  # whole cores: no core in two shares
        owner = {core: i for i, share in enumerate(shares) for core in map(cores.get, share)}
        assert all(owner[cores[cpu]] == i for i, share in enumerate(shares) for cpu in share)
    assert _core_of(max(cpus) + 100000) is None


def test_spmd_first_failure_stops_the_other_tasks(launches):
    launch = launches["spmd_fails"]
    assert launch.wait() == 5, launch.output()
    failed_at, _ = launch.wait_for(
        r"^tf-rdma launch: /job:worker/task:1 exited with status 5; stopping the other tasks")
    assert launch.ended - failed_at < 15, launch.output()


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
        (["-n", "1", "--server-module", "x", "--", "true"], "unrecognized arguments"),
        (["-n", "2", "--ps", "1", "--spmd", "--", "true"], "--spmd runs one copy"),
        (["-n", "1", "--coordinator", "--", "true"], "add --ps M"),
        (["-n", "1", "--spmd", "--coordinator", "--", "true"], "choose one"),
    ],
)
def test_bad_arguments_exit_2(args, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["launch", *args])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" in err and message in err, err


def test_bad_port_offset_is_usage_error(capsys, monkeypatch):
    monkeypatch.setenv("TF_RDMA_PORT_OFFSET", "70000")
    with pytest.raises(SystemExit) as exit_:
        cli.main(["launch", "-n", "1", "--", "true"])
    assert exit_.value.code == 2
    assert "TF_RDMA_PORT_OFFSET='70000'" in capsys.readouterr().err


def test_cli_help_and_usage_errors(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["launch", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "--timeout-start" in out and "-- CMD" in out and "TF_RDMA_SECRET" in out
    assert "--server-module" not in out
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--help"])
    assert exit_.value.code == 0 and "launch" in capsys.readouterr().out
    for argv, message in (([], "usage:"), (["frobnicate"], "invalid choice")):
        with pytest.raises(SystemExit) as exit_:
            cli.main(argv)
        assert exit_.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.fast
def test_tensorflow_start_up_notices_are_dropped_unless_asked_for():
    from tf_rdma import launch

    notices = [
        "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
        "I0000 00:00:1796379241.964989    5316 port.cc:153] oneDNN custom operations are on. "
        "You may see slightly different numerical results",
    ]
    kept = ["tf_rdma[/job:ps/task:0]: pair /job:ps/task:0 <-> /job:worker/task:0: shm",
            "W0000 00:00:1796379241.964989    5316 foo.cc:1] a real warning",
            "Traceback (most recent call last):"]
    assert all(launch._TF_STARTUP_NOTICE.search(line) for line in notices)
    assert not any(launch._TF_STARTUP_NOTICE.search(line) for line in kept)
    assert launch._quiet_tensorflow({"TF_CPP_MIN_LOG_LEVEL": "2"})
    assert not launch._quiet_tensorflow({"TF_CPP_MIN_LOG_LEVEL": "0"})
    assert not launch._quiet_tensorflow({})


@pytest.mark.fast
def test_forwarding_drops_notices_and_holds_a_partial_line_briefly():
    from tf_rdma import launch

    env = {"TF_CPP_MIN_LOG_LEVEL": "2"}
    read_end, write_end = os.pipe()
    got, changed = [], threading.Condition()

    def write(data):
        with changed:
            got.append(data)
            changed.notify_all()

    def received():
        with changed:
            return b"".join(got)

    def wait_for(text):
        with changed:
            assert changed.wait_for(lambda: b"".join(got) == text, timeout=10), got

    forwarder = threading.Thread(target=launch.forward_dropping_notices,
                                 args=(read_end, write, env))
    forwarder.start()
    try:
        os.write(write_end, b"WARNING: All log messages before absl::InitializeLog() is "
                            b"called are written to STDERR\nkept\npart")
        # "part" may be the start of a notice: held back, then forwarded
        # unended after _PARTIAL_LINE_S; its rest follows as it comes.
        wait_for(b"kept\npart")
        os.write(write_end, b"ial\nI0000 00:00:1796379241.964989    5316 port.cc:153] "
                            b"oneDNN custom operations are on.\n\rbar 10%")
        wait_for(b"kept\npartial\n\rbar 10%")
        os.write(write_end, b"\rbar 20%")
    finally:
        os.close(write_end)
        forwarder.join(10)
        os.close(read_end)
    assert not forwarder.is_alive()
    assert received() == b"kept\npartial\n\rbar 10%\rbar 20%"
    # A log level that asks for INFO keeps the notices.
    read_end, write_end = os.pipe()
    notice = b"WARNING: All log messages before absl::InitializeLog() is called\n"
    os.write(write_end, notice)
    os.close(write_end)
    got.clear()
    launch.forward_dropping_notices(read_end, write, {"TF_CPP_MIN_LOG_LEVEL": "0"})
    os.close(read_end)
    assert received() == notice


@pytest.mark.fast
def test_a_binding_that_fails_is_reported_not_a_traceback():
    """sched_setaffinity fails in the child (a CPU the launcher does not
    have): subprocess says only that the child's set-up failed, so the
    launcher's message names the CPUs and --bind none."""
    from tf_rdma.launch import _bound, _start_error
    missing = [4095]
    with pytest.raises(subprocess.SubprocessError) as caught:
        subprocess.Popen([sys.executable, "-c", "pass"],
                         preexec_fn=_bound(None, missing))
    text = _start_error(caught.value, missing)
    assert "binding it to CPUs 4095 failed" in text and "--bind none" in text
    assert _start_error(FileNotFoundError(2, "No such file"), missing) == \
        "[Errno 2] No such file"
