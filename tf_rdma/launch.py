"""``tf-rdma launch``: run a command against a cluster of local tf_rdma servers.

::

    tf-rdma launch -n 2 [--ps 1] [--host 127.0.0.1] [--timeout-start 60] -- python train.py
    tf-rdma launch -n 2 --ps 2 --coordinator -- python train_with_ps_strategy.py
    tf-rdma launch --spmd -n 2 -- python train.py

With ``--spmd`` (for ``tf_rdma.distribute.RdmaStrategy`` and other SPMD
programs) there are no servers and no client: the command itself runs once per
worker task, each copy with ``TF_CONFIG`` naming its own task and the shared
``TF_RDMA_SECRET``, its output lines prefixed with the task (stdout to stdout,
stderr to stderr). The launcher exits with 0 when every copy did, else with
the status of the first copy that failed, and stops the other copies at once
(a collective would otherwise wait for the dead one until its timeout).

Without ``--spmd``, the launcher starts ``-n`` worker tasks (job ``worker``) and ``--ps`` parameter-server tasks
(job ``ps``) on this machine, each a ``python -m tf_rdma.server`` process with
its own ``TF_CONFIG``, waits until every one of them is serving, and then runs
the command with ``TF_CONFIG`` set to the cluster alone (no ``"task"``: the
command is the client) and ``TF_RDMA_SECRET`` set to the job secret. The
servers' logs appear on the launcher's stderr, each line prefixed with its task
(``[worker:0] ...``). With ``--coordinator`` the command is a
``ParameterServerStrategy`` coordinator instead: the cluster gets a ``chief``
task for it (TensorFlow's job name for the coordinator, which starts its own
server there), and its ``TF_CONFIG`` names that task, so that
``TFConfigClusterResolver()`` finds the whole cluster.

When the command exits, or the launcher gets SIGINT or SIGTERM, everything is
torn down: SIGTERM to the command and to every server, SIGKILL to whatever is
still alive 10 seconds later, and removal of the shared-memory segments
(``/dev/shm/tfrdma.<pid>.*``) that any of those processes left behind. The
launcher exits with the command's exit code (128 + N when it was killed by
signal N; 130 when the launcher was interrupted).

With ``--slurm`` the launcher runs as one task of an ``srun`` step instead:
:mod:`tf_rdma.slurm` reads the cluster and this task's role from Slurm's
environment.

The gRPC ports are picked at random among free ports such that each tf_rdma
endpoint port (gRPC port + ``TF_RDMA_PORT_OFFSET``, default 1000) is free as
well, both outside the kernel's range for outgoing connections' ports; see
:mod:`tf_rdma.cluster` for the address rule and :func:`tf_rdma.cluster.free_ports`.
"""

import argparse
import collections
import json
import os
import re
import secrets
import select
import shlex
import signal
import subprocess
import sys
import threading
import time

from tf_rdma import _native, cluster as _cluster
from tf_rdma.processes import (READY_PREFIX, TERM_GRACE_S, add_package_to_path, exit_status,
                               one_cpu_interop_threads, parent_death_signal)
from tf_rdma.errors import ConfigError, LibraryError
from tf_rdma.subcommand import Command

__all__ = ["main", "add_arguments", "run", "hides_tensorflow_notice", "forward_dropping_notices",
           "cpu_shares", "COMMAND"]

#: How many of a server's last stderr lines are shown when it fails.
_TAIL_LINES = 20

_PREFIX = "tf-rdma launch: "
_SHM_DIR = "/dev/shm"

_USAGE = ("%(prog)s [-h] -n N [--ps M [--coordinator] | --spmd] [--host HOST] "
          "[--timeout-start S] [--bind {auto,none}] -- CMD [ARGS...]\n"
          "       srun ... %(prog)s --slurm [--port P] [--ps M [--coordinator] | --spmd] "
          "[--timeout-start S] -- CMD [ARGS...]")

_DESCRIPTION = """\
Start a cluster of local tf_rdma servers and run a command against it.

Starts N worker tasks (job "worker") and M parameter-server tasks (job "ps"),
each a `python -m tf_rdma.server` process on HOST, waits until all of them are
serving, then runs CMD with TF_CONFIG={"cluster": {...}} (the command is the
client, so there is no "task") and TF_RDMA_SECRET set. Server logs go to stderr,
prefixed with their task ("[worker:0] ..."). When CMD exits, or on Ctrl-C or
SIGTERM, the command and the servers are stopped (SIGTERM, then SIGKILL after
10 s) and shared memory they leaked in /dev/shm is removed.

With --coordinator, CMD is the coordinator of TensorFlow's
ParameterServerStrategy: the cluster also has a task "chief" for it (CMD's
own TensorFlow server), and CMD's TF_CONFIG names that task, as
TFConfigClusterResolver expects.

A task bound to a single CPU gets TF_NUM_INTEROP_THREADS=2 (unless set):
with one inter-op thread, as TensorFlow sizes it to one CPU, a
ParameterServerStrategy step never ends and RdmaStrategy's gradient
all-reduces wait for the end of the backward pass.

With --spmd, runs CMD itself once per worker task instead (no servers): each
copy gets TF_CONFIG with its own "task", as tf_rdma.distribute.RdmaStrategy
and other SPMD programs expect; output is prefixed with the task; the first
copy that fails stops the others and gives the exit status.

Where this machine has at least as many CPUs as tasks, each task (server or
SPMD copy; not the client) is bound to its own share of the CPUs the launcher
may use, as mpirun binds its ranks (whole cores where the CPUs are hardware
threads and the tasks are no more than the cores): TensorFlow sizes its
thread pools to them, and tasks no longer take each other's cores (measured
on 2 vCPUs: a small collective 25% faster, a training step 25% faster;
docs/benchmarks.md).
--bind none leaves them unbound.

With --slurm, every task of an srun step runs this same command line and
becomes one task of the cluster: the hosts are the step's nodes, the ports
P, P+1, ... on each node (--port, default 8888), rank 0 runs CMD (the chief
with --coordinator, else a client), ranks 1..M are the ps servers and the
rest the worker servers; with --spmd every rank runs CMD as a worker. Rank 0
starts CMD once every server is ready and the servers stop when it ends.
Export TF_RDMA_SECRET before srun: the tasks share only their environment.
"""

_EPILOG = """\
environment:
  TF_RDMA_SECRET       job secret for the servers and CMD (default: 32 random bytes, in hex)
  TF_RDMA_PORT_OFFSET  endpoint port = gRPC port + offset (default 1000)
  TF_CPP_MIN_LOG_LEVEL TensorFlow's C++ log level in the tasks (default here: 2, warnings and
                       INFO off, and TensorFlow's start-up notices dropped from the servers'
                       and CMD's stderr; 0 shows them all)
  TF_RDMA_TRANSPORT    and every other variable is passed through to servers and CMD

exit status:
  CMD's exit status (128+N if CMD was killed by signal N), 130 if interrupted,
  1 if the cluster failed to start, 2 for bad arguments (under --slurm also a step
  it cannot use, or no TF_RDMA_SECRET), 127 if CMD was not found. Under --slurm
  a server rank exits 0 when rank 0's command has ended.

examples:
  tf-rdma launch -n 2 -- python -c "import os; print(os.environ['TF_CONFIG'])"
  tf-rdma launch -n 2 --ps 2 --coordinator -- python examples/ps_strategy.py
  tf-rdma launch --spmd -n 2 -- python train_with_rdma_strategy.py
  srun -N 2 -n 4 tf-rdma launch --slurm --spmd -- python train_with_rdma_strategy.py
  srun -N 2 -n 4 tf-rdma launch --slurm --ps 1 --coordinator -- python examples/ps_strategy.py
"""


def _positive_int(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _non_negative_int(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {value}")
    return value


def _positive_float(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value != value or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def add_arguments(parser):
    """Adds the ``launch`` options to an argparse parser.

    Args:
        parser: An ``argparse.ArgumentParser`` (or a subcommand parser).
    """
    parser.add_argument(
        "-n",
        "--num-workers",
        dest="num_workers",
        metavar="N",
        type=_positive_int,
        default=None,
        help='number of worker tasks (job "worker"), at least 1; required but '
        'under --slurm, where the step\'s tasks say it',
    )
    parser.add_argument(
        "--ps",
        dest="num_ps",
        metavar="M",
        type=_non_negative_int,
        default=0,
        help='number of parameter-server tasks (job "ps"); default 0',
    )
    parser.add_argument(
        "--coordinator",
        action="store_true",
        help='CMD is a ParameterServerStrategy coordinator: the cluster gets a '
        'task "chief" for it and its TF_CONFIG names it; needs --ps',
    )
    parser.add_argument(
        "--spmd",
        action="store_true",
        help="run CMD once per worker task (TF_CONFIG names its task) instead "
        "of servers plus one client; for RdmaStrategy programs",
    )
    parser.add_argument(
        "--slurm",
        action="store_true",
        help="run as one task of an srun step: the cluster from Slurm's environment, "
        "this task's role from its rank (rank 0 the command, then the ps tasks, then "
        "the workers; with --spmd every rank runs the command); docs/deploy.md",
    )
    parser.add_argument(
        "--port",
        metavar="P",
        type=_positive_int,
        default=None,
        help="with --slurm: the first gRPC port of each node, its tasks taking P, P+1, "
        "...; default 8888",
    )
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address the servers listen on and the cluster names; default 127.0.0.1",
    )
    parser.add_argument(
        "--timeout-start",
        dest="timeout_start",
        metavar="S",
        type=_positive_float,
        default=60.0,
        help="seconds to wait for all servers to be ready; default 60",
    )
    parser.add_argument(
        "--bind",
        choices=("auto", "none"),
        default="auto",
        help="auto (default): bind each task to its own CPUs where there are "
        "at least as many CPUs as tasks; none: leave the tasks unbound",
    )
    parser.add_argument(
        "command",
        nargs=argparse.REMAINDER,
        metavar="-- CMD [ARGS...]",
        help="the command to run against the cluster (after --)",
    )


def _build_parser(prog="tf-rdma launch"):
    parser = argparse.ArgumentParser(
        prog=prog,
        usage=_USAGE,
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    return parser


def _command_of(args, parser):
    command = list(args.command or [])
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        parser.error("no command given: write it after --, for example: -- python train.py")
    return command


def main(argv=None):
    """Runs ``tf-rdma launch``.

    Args:
        argv: The arguments after ``launch`` (default ``sys.argv[1:]``).

    Returns:
        The exit status: the command's, or 1 if the cluster failed to start,
        127 if the command was not found, 130 if interrupted. Bad arguments
        exit with status 2 through argparse.
    """
    parser = _build_parser()
    args = parser.parse_args(argv)
    return run(args, parser)


def run(args, parser=None):
    """Runs ``tf-rdma launch`` with parsed arguments.

    Args:
        args: The namespace from a parser set up by :func:`add_arguments`.
        parser: That parser, used to report a missing command as a usage
            error (exit status 2).

    Returns:
        The exit status, as :func:`main`.
    """
    parser = parser or _build_parser()
    command = _command_of(args, parser)
    spmd = getattr(args, "spmd", False)
    if spmd and args.num_ps:
        parser.error(f"--spmd runs one copy of the command per worker; --ps {args.num_ps} "
                     "has no place in it (drop --ps, or drop --spmd for a client-driven run)")
    coordinator = getattr(args, "coordinator", False)
    slurm = getattr(args, "slurm", False)
    if not slurm and getattr(args, "port", None) is not None:
        parser.error("--port sets the ports of a --slurm cluster; without --slurm the "
                     "launcher picks free ports itself")
    if not slurm and args.num_workers is None:
        parser.error("the following arguments are required: -n/--num-workers")
    if slurm and (args.host != "127.0.0.1" or getattr(args, "bind", "auto") != "auto"):
        parser.error("--host and --bind have no place under --slurm: the step's node "
                     "names are the cluster's hosts, and Slurm binds CPUs (srun --cpu-bind)")
    if coordinator and spmd:
        parser.error("--coordinator runs one coordinator against servers; --spmd runs the "
                     "command once per worker without servers: choose one")
    if coordinator and not args.num_ps:
        parser.error("--coordinator runs the command as a ParameterServerStrategy "
                     "coordinator, which needs parameter servers: add --ps M (M >= 1)")
    if slurm:
        from tf_rdma import slurm as slurm_lib  # pylint: disable=g-import-not-at-top

        return slurm_lib.run(args, command)
    try:
        launcher = _Launcher(
            num_workers=args.num_workers,
            num_ps=args.num_ps,
            host=args.host,
            timeout_start=args.timeout_start,
            command=command,
            spmd=spmd,
            bind=getattr(args, "bind", "auto"),
            coordinator=coordinator,
        )
    except ConfigError as err:
        parser.error(str(err))
    except OSError as err:
        print(f"{_PREFIX}could not pick ports for the cluster: {err}", file=sys.stderr)
        return 1
    return launcher.run()


#: ``tf-rdma launch``, for the ``tf-rdma`` parser (tf_rdma.cli).
COMMAND = Command(
    name="launch",
    help="start N local tf_rdma servers and run a command against them",
    usage=_USAGE,
    description=_DESCRIPTION,
    epilog=_EPILOG,
    add_arguments=add_arguments,
    run=run,
)


# --------------------------------------------------------------------------- implementation


def cpu_shares(count, cpus=None, cores=None):
    """Splits CPUs into `count` disjoint shares, one per local task.

    What ``tf-rdma launch`` binds its tasks to (and bench/ binds tf_rdma's
    ranks to, as mpirun binds its own). The split follows the cores: the
    CPUs are grouped by the core they are hardware threads of (SMT), the
    cores ordered by their lowest CPU. With no more tasks than cores, share
    i is the i-th of `count` near-equal runs of the cores, whole: two tasks
    never share a core's execution units while another core has nothing to
    run (on a host that numbers a core's threads n apart, a split of the
    sorted CPU numbers would give one task the first threads of some cores
    and the next task their second threads). With more tasks than cores,
    share i is the i-th near-equal run of the CPUs in core order, so a
    core's threads go to neighbouring tasks. Without SMT every CPU is a core
    and both are the i-th run of the sorted CPUs: tasks next to each other
    in the cluster sit on neighbouring CPUs.

    Args:
        count: The number of tasks (>= 1).
        cpus: The CPUs to split; default the ones this process may run on.
        cores: The CPUs of each core, an iterable of CPU collections
            (CPUs not in `cpus` are ignored); default what the kernel says
            (:func:`_core_of`). A CPU in none of them is a core of its own.

    Returns:
        A list of `count` sorted lists of CPU numbers, or None where there
        are fewer CPUs than tasks (they would share cores however bound).
    """
    cpus = sorted(set(os.sched_getaffinity(0) if cpus is None else cpus))
    if count < 1 or count > len(cpus):
        return None
    if cores is None:
        core_of = {cpu: _core_of(cpu) for cpu in cpus}
    else:
        core_of = {cpu: frozenset(core) for core in cores for cpu in core}
    groups = {}
    for cpu in cpus:
        groups.setdefault(core_of.get(cpu) or frozenset([cpu]), []).append(cpu)
    ordered = sorted(groups.values())  # each sorted: by its lowest CPU
    # What is handed out whole: the cores, or with more tasks than cores
    # their CPUs one by one (in core order).
    units = (ordered if count <= len(ordered)
             else [[cpu] for core in ordered for cpu in core])
    return [sorted(cpu for unit in units[i * len(units) // count:
                                         (i + 1) * len(units) // count]
                   for cpu in unit)
            for i in range(count)]


def _core_of(cpu, root="/sys/devices/system/cpu"):
    """The CPUs that share `cpu`'s core (its SMT siblings and itself), as
    Linux lists them (``topology/thread_siblings_list``: "0,4" or "0-1");
    None where the kernel does not say."""
    try:
        with open(f"{root}/cpu{cpu}/topology/thread_siblings_list") as f:
            text = f.read().strip()
        siblings = set()
        for part in text.split(","):
            first, _, last = part.partition("-")
            siblings.update(range(int(first), int(last or first) + 1))
    except (OSError, ValueError):
        return None
    return frozenset(siblings) if cpu in siblings else None


def _cpu_list(cpus):
    """[0, 1, 2, 5] -> "0-2,5"."""
    runs, start = [], None
    for i, cpu in enumerate(cpus):
        if start is None:
            start = cpu
        if i + 1 == len(cpus) or cpus[i + 1] != cpu + 1:
            runs.append(str(start) if start == cpu else f"{start}-{cpu}")
            start = None
    return ",".join(runs)


def _bound(preexec, cpus):
    """`preexec` (or None), then binding the child to `cpus` (or not)."""
    if cpus is None:
        return preexec

    def run():
        if preexec is not None:
            preexec()
        os.sched_setaffinity(0, cpus)

    return run


def _start_error(err, cpus):
    """What a failed start says: an OSError's text, or for the set-up run in
    the child before exec (subprocess reports only that it failed) the CPUs
    it was to be bound to."""
    if isinstance(err, OSError) or cpus is None:
        return str(err)
    return (f"{err} (binding it to CPUs {_cpu_list(cpus)} failed: were they "
            f"taken offline or out of this launcher's set? --bind none "
            f"leaves the tasks unbound)")


# TensorFlow's notices at start-up that it prints before its log level is
# read (absl's preamble, oneDNN's INFO line), whatever TF_CPP_MIN_LOG_LEVEL
# says: dropped from a task's stderr when the level asks for no INFO.
_TF_STARTUP_NOTICE = re.compile(
    r"^WARNING: All log messages before absl::InitializeLog\(\) is called"
    r"|^I\d{4} [\d:. ]+\d+ port\.cc:\d+\] oneDNN custom operations are on")


def _quiet_tensorflow(env):
    return env.get("TF_CPP_MIN_LOG_LEVEL", "0").strip() not in ("", "0")


def hides_tensorflow_notice(line, env):
    """True if `line` of a TensorFlow process's stderr is one of the start-up
    notices it prints before reading its log level, and `env` (that
    process's environment) asks for no INFO: a program forwarding the
    stderr of TensorFlow processes it started drops such lines."""
    return _quiet_tensorflow(env) and bool(_TF_STARTUP_NOTICE.search(line))


# How long a partial line of the command's stderr is held back before it is
# forwarded anyway (it might have been the start of a notice; a progress bar
# redrawn with \r never ends its line).
_PARTIAL_LINE_S = 0.1


def forward_dropping_notices(fd, write, env):
    """Copies the bytes read from `fd` to `write` (a function of bytes) until
    end of file, dropping whole lines that `hides_tensorflow_notice` hides
    for `env`.

    Lines pass as they end; a line that has not ended after _PARTIAL_LINE_S
    passes as far as it has come, and the rest of it as it arrives.
    """
    pending = b""     # the start of a line not forwarded yet
    passing = False   # the current line's start was forwarded already
    while True:
        if pending:
            readable, _, _ = select.select([fd], [], [], _PARTIAL_LINE_S)
            if not readable:
                write(pending)
                pending, passing = b"", True
                continue
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            chunk = b""
        if not chunk:
            break
        data, pending = pending + chunk, b""
        kept = []
        while data:
            end = data.find(b"\n") + 1
            if end == 0:
                if passing:
                    kept.append(data)
                else:
                    pending = data
                break
            line, data = data[:end], data[end:]
            if passing or not hides_tensorflow_notice(
                    line.decode("utf-8", errors="replace").rstrip("\r\n"), env):
                kept.append(line)
            passing = False
        if kept:
            write(b"".join(kept))
    if pending:
        write(pending)


class _Output:
    """Serializes the launcher's and the servers' lines on stderr."""

    def __init__(self):
        self._lock = threading.Lock()

    def write_bytes(self, data):
        """Writes `data` as it is (the command's own stderr) and flushes."""
        with self._lock:
            try:
                buffer = getattr(sys.stderr, "buffer", None)
                if buffer is not None:
                    sys.stderr.flush()
                    buffer.write(data)
                    buffer.flush()
                else:
                    sys.stderr.write(data.decode("utf-8", errors="replace"))
                    sys.stderr.flush()
            except (OSError, ValueError):
                pass

    def write(self, line, stream=None):
        stream = stream or sys.stderr
        with self._lock:
            try:
                stream.write(line if line.endswith("\n") else line + "\n")
                stream.flush()
            except (OSError, ValueError):
                pass

    def say(self, message):
        self.write(_PREFIX + message)


class _Server:
    """One server subprocess and the threads that read its output."""

    def __init__(self, job, index, address, stdout_to_stdout=False):
        self.stdout_to_stdout = stdout_to_stdout  # SPMD copies: their stdout stays stdout
        self.job = job
        self.index = index
        self.address = address
        self.task = _cluster.canonical_task(job, index)
        self.label = f"[{job}:{index}] "
        self.proc = None
        self.ready = threading.Event()
        self.ready_line = None
        self.bad_ready_line = None
        self.tail = collections.deque(maxlen=_TAIL_LINES)
        self.threads = []

    def start(self, argv, env, out, preexec):
        self.env = env
        self.proc = subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            preexec_fn=preexec,
        )
        for stream, is_stdout in ((self.proc.stdout, True), (self.proc.stderr, False)):
            thread = threading.Thread(
                target=self._pump,
                args=(stream, is_stdout, out),
                name=f"tf-rdma-launch {self.task} {'stdout' if is_stdout else 'stderr'}",
                daemon=True,
            )
            thread.start()
            self.threads.append(thread)

    def _pump(self, stream, is_stdout, out):
        try:
            for raw in iter(stream.readline, b""):
                line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
                if is_stdout and line.startswith(READY_PREFIX) and not self.ready.is_set():
                    fields = line[len(READY_PREFIX) :].split()
                    if fields and fields[0] == self.task:
                        self.ready_line = line
                    else:
                        self.bad_ready_line = line
                    self.ready.set()
                elif not is_stdout:
                    if hides_tensorflow_notice(line, self.env):
                        continue
                    self.tail.append(line)
                to_stdout = is_stdout and self.stdout_to_stdout
                out.write(self.label + line, sys.stdout if to_stdout else None)
        except (OSError, ValueError):
            pass
        finally:
            try:
                stream.close()
            except OSError:
                pass

    def join_output(self, timeout):
        deadline = time.monotonic() + timeout
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))


class _Launcher:
    def __init__(self, num_workers, num_ps, host, timeout_start, command, spmd=False,
                 bind="auto", coordinator=False):
        self.command = command
        self.spmd = spmd
        self.bind = bind
        self.timeout_start = timeout_start
        self.out = _Output()
        self.signal = None  # the first SIGINT/SIGTERM the launcher got
        self.signal_count = 0  # how many it got: a second one cuts the teardown short
        self.servers = []
        self.cmd = None
        self.cmd_stderr = None  # the thread forwarding its stderr, if any
        self.pids = []

        env = os.environ
        offset = _cluster.port_offset(env)
        host = host.strip()
        if not host:
            raise ConfigError("--host is empty")
        bare_host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        ports = _cluster.free_ports(num_workers + num_ps + int(coordinator), offset,
                                    host=bare_host)
        addresses = [_cluster.join_address(bare_host, port) for port in ports]
        self.cluster = {"worker": addresses[:num_workers]}
        if num_ps:
            self.cluster["ps"] = addresses[num_workers:num_workers + num_ps]
        # The command's own task, when it is a coordinator; it runs no tf_rdma server.
        self.command_task = None
        if coordinator:
            self.cluster["chief"] = addresses[num_workers + num_ps:]
            self.command_task = {"type": "chief", "index": 0}
        # Check the whole address plan (offset, TF_RDMA_ENDPOINTS) before starting anything.
        self.endpoints = _cluster.endpoints(self.cluster, env)
        for job, tasks in self.cluster.items():
            if job == "chief":
                continue
            for index, address in enumerate(tasks):
                self.servers.append(_Server(job, index, address, stdout_to_stdout=spmd))

        secret = env.get("TF_RDMA_SECRET", "")
        self.secret = secret if secret.strip() else secrets.token_hex(32)

    # -- signals -------------------------------------------------------------------

    def _on_signal(self, signum, frame):
        del frame
        if self.signal is None:
            self.signal = signum
        self.signal_count += 1

    def _install_signals(self):
        previous = {}
        for signum in (signal.SIGINT, signal.SIGTERM):
            try:
                previous[signum] = signal.signal(signum, self._on_signal)
            except ValueError:  # not the main thread: leave signals alone
                pass
        return previous

    @staticmethod
    def _restore_signals(previous):
        for signum, handler in previous.items():
            try:
                signal.signal(signum, handler)
            except (ValueError, TypeError):
                pass

    def _signal_status(self):
        return 130 if self.signal == signal.SIGINT else 128 + int(self.signal)

    # -- the run -------------------------------------------------------------------

    def run(self):
        previous = self._install_signals()
        try:
            return self._run()
        finally:
            self._teardown()
            self._restore_signals(previous)

    def _run(self):
        preexec = parent_death_signal()
        base_env = dict(os.environ)
        base_env["TF_RDMA_SECRET"] = self.secret
        # What a user sees first is tf_rdma's lines, not TensorFlow's INFO
        # logs (one can ask for them back).
        base_env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        shares = self._cpu_shares(base_env)
        server_env = dict(base_env)
        server_env["PYTHONUNBUFFERED"] = "1"
        add_package_to_path(server_env)
        if self.spmd:
            return self._run_spmd(base_env, preexec, shares)

        for i, server in enumerate(self.servers):
            if self.signal is not None:
                return self._signal_status()
            env = dict(server_env)
            env["TF_CONFIG"] = json.dumps(
                {"cluster": self.cluster, "task": {"type": server.job, "index": server.index}}
            )
            one_cpu_interop_threads(env, shares and shares[i])
            argv = [
                sys.executable,
                "-m",
                "tf_rdma.server",
                "--job",
                server.job,
                "--task",
                str(server.index),
            ]
            try:
                server.start(argv, env, self.out, _bound(preexec, shares and shares[i]))
            except (OSError, subprocess.SubprocessError) as err:
                self.out.say(f"could not start the server for {server.task}: "
                             f"{_start_error(err, shares and shares[i])}")
                return 1
            self.pids.append(server.proc.pid)
            self.out.say(f"started {server.task} pid={server.proc.pid}")

        status = self._wait_ready()
        if status is not None:
            return status

        env = dict(base_env)
        config = {"cluster": self.cluster}
        if self.command_task:
            config["task"] = self.command_task
        env["TF_CONFIG"] = json.dumps(config)
        # The command's stderr passes through the launcher where TensorFlow's
        # start-up notices are to be dropped (its stdout stays its own).
        quiet = _quiet_tensorflow(env)
        try:
            self.cmd = subprocess.Popen(self.command, env=env, preexec_fn=preexec,
                                        stderr=subprocess.PIPE if quiet else None)
        except OSError as err:
            self.out.say(f"could not run {_one_line(self.command)}: {err}")
            return 126 if isinstance(err, PermissionError) else 127
        if quiet:
            self.cmd_stderr = threading.Thread(
                target=forward_dropping_notices,
                args=(self.cmd.stderr.fileno(), self.out.write_bytes, env),
                name="tf-rdma-launch command stderr", daemon=True)
            self.cmd_stderr.start()
        self.pids.append(self.cmd.pid)
        self.out.say(
            f"cluster ready: {json.dumps(self.cluster)}; running {_one_line(self.command)} "
            f"(pid={self.cmd.pid})"
        )
        return self._wait_command()

    def _cpu_shares(self, env):
        """Each task's CPUs (with --bind auto and enough CPUs), else None.

        When it binds, tells the tasks how many CPUs they share
        (TF_RDMA_HOST_CPUS in `env`: a collective's `auto` spin compares the
        host's tasks with it) and says so in one line.
        """
        if self.bind == "none":
            return None
        cpus = sorted(os.sched_getaffinity(0))
        shares = cpu_shares(len(self.servers), cpus)
        if shares is None:
            self.out.say(f"not binding the {len(self.servers)} tasks to CPUs: this "
                         f"launcher may use {len(cpus)} CPU(s), fewer than the tasks")
            return None
        env.setdefault("TF_RDMA_HOST_CPUS", str(len(cpus)))  # a user's stands
        self.out.say("bound each task to its own CPUs (--bind none: unbound): " + ", ".join(
            f"{s.job}:{s.index} {_cpu_list(share)}" for s, share in zip(self.servers, shares)))
        return shares

    def _run_spmd(self, base_env, preexec, shares=None):
        """Runs the command once per worker task; returns the exit status."""
        for i, server in enumerate(self.servers):
            if self.signal is not None:
                return self._signal_status()
            env = dict(base_env)
            env["PYTHONUNBUFFERED"] = "1"
            env["TF_CONFIG"] = json.dumps(
                {"cluster": self.cluster, "task": {"type": server.job, "index": server.index}}
            )
            one_cpu_interop_threads(env, shares and shares[i])
            try:
                server.start(self.command, env, self.out,
                             _bound(preexec, shares and shares[i]))
            except (OSError, subprocess.SubprocessError) as err:
                self.out.say(f"could not run {_one_line(self.command)}: "
                             f"{_start_error(err, shares and shares[i])}")
                return 126 if isinstance(err, PermissionError) else 127
            self.pids.append(server.proc.pid)
        self.out.say(
            f"running {_one_line(self.command)} as {len(self.servers)} tasks of "
            f"{json.dumps(self.cluster)}"
        )
        while True:
            if self.signal is not None:
                self.out.say(f"{_signal_name(self.signal)}: stopping every task")
                return self._signal_status()
            done = [s for s in self.servers if s.proc.poll() is not None]
            for server in done:
                if server.proc.returncode != 0:
                    server.join_output(2.0)
                    self._report_failure(
                        server,
                        f"{server.task} exited with status "
                        f"{_describe_status(server.proc.returncode)}; stopping the other tasks",
                    )
                    return exit_status(server.proc.returncode)
            if len(done) == len(self.servers):
                return 0
            time.sleep(0.05)

    def _wait_ready(self):
        """Waits for every ready line; returns None when all are ready, else a status."""
        deadline = time.monotonic() + self.timeout_start
        pending = list(self.servers)
        while pending:
            if self.signal is not None:
                self.out.say(f"interrupted while starting the cluster ({_signal_name(self.signal)})")
                return self._signal_status()
            for server in list(pending):
                if server.ready.is_set():
                    if server.bad_ready_line is not None:
                        self.out.say(
                            f"the server for {server.task} reported itself ready as another task: "
                            f"{server.bad_ready_line!r}"
                        )
                        return 1
                    pending.remove(server)
                elif server.proc.poll() is not None:
                    server.join_output(2.0)
                    if server.ready.is_set():
                        continue  # it printed the line and then exited: caught next round
                    self._report_failure(
                        server,
                        f"the server for {server.task} exited with status "
                        f"{_describe_status(server.proc.returncode)} before it was ready",
                    )
                    return 1
            if not pending:
                break
            if time.monotonic() >= deadline:
                server = pending[0]
                self._report_failure(
                    server,
                    f"the server for {server.task} was not ready after {self.timeout_start:g} s "
                    f"({len(pending)} of {len(self.servers)} servers not ready); "
                    "raise --timeout-start if it is just slow",
                )
                return 1
            pending[0].ready.wait(0.05)
        # A server that printed its line and then died is a failure too.
        for server in self.servers:
            if server.proc.poll() is not None:
                server.join_output(2.0)
                self._report_failure(
                    server,
                    f"the server for {server.task} exited with status "
                    f"{_describe_status(server.proc.returncode)} right after it was ready",
                )
                return 1
        return None

    def _wait_command(self):
        while True:
            try:
                returncode = self.cmd.wait(0.1)
            except subprocess.TimeoutExpired:
                returncode = None
            if returncode is not None:
                self._join_command_output()
                return exit_status(returncode)
            if self.signal is not None:
                self.out.say(f"{_signal_name(self.signal)}: stopping the command and the cluster")
                return self._signal_status()
            for server in self.servers:
                if server.proc.poll() is not None:
                    if self.cmd.poll() is not None:
                        return exit_status(self.cmd.returncode)
                    server.join_output(2.0)
                    self._report_failure(
                        server,
                        f"the server for {server.task} exited with status "
                        f"{_describe_status(server.proc.returncode)} while the command was "
                        "running; stopping the command",
                    )
                    return 1

    def _join_command_output(self, timeout=2.0):
        """Waits (bounded: a child of the command may hold its stderr open)
        until the command's stderr is forwarded to its end."""
        if self.cmd_stderr is not None:
            self.cmd_stderr.join(timeout)

    def _report_failure(self, server, message):
        lines = list(server.tail)
        if lines:
            self.out.say(f"{message}. Its last stderr lines:")
            for line in lines:
                self.out.write(f"    {server.label}{line}")
        else:
            self.out.say(f"{message}. It wrote nothing on stderr.")

    # -- teardown ------------------------------------------------------------------

    def _teardown(self):
        procs = [(s.task, s.proc) for s in self.servers if s.proc is not None]
        if self.cmd is not None:
            procs.insert(0, ("the command", self.cmd))
        terminated = set()
        for name, proc in procs:
            if proc.poll() is None:
                _send(proc, signal.SIGTERM)
                terminated.add(name)
        # Wait for all of them, up to the grace period; another SIGINT/SIGTERM
        # in the meantime (a second Ctrl-C) skips the rest of it.
        signals_before = self.signal_count
        deadline = time.monotonic() + TERM_GRACE_S
        while time.monotonic() < deadline and self.signal_count == signals_before:
            if all(proc.poll() is not None for _, proc in procs):
                break
            time.sleep(0.02)
        killed = []
        for name, proc in procs:
            if proc.poll() is None:
                _send(proc, signal.SIGKILL)
                killed.append(name)
        for _, proc in procs:
            try:
                proc.wait(5.0)
            except subprocess.TimeoutExpired:
                pass
        self._join_command_output()
        if killed:
            why = (
                f"after {TERM_GRACE_S:g} s without exiting"
                if self.signal_count == signals_before
                else "(interrupted again)"
            )
            self.out.say(f"killed {', '.join(killed)} {why}")
        for server in self.servers:
            if server.proc is None:
                continue
            server.join_output(2.0)
            code = server.proc.returncode
            if server.task in terminated and server.task not in killed and code not in (0, None):
                self.out.say(
                    f"the server for {server.task} exited with status "
                    f"{_describe_status(code)} at shutdown"
                )
        self._remove_shm()

    def _remove_shm(self):
        """Removes the segments the launched processes left in /dev/shm.

        The engine's own collector does it (kernels/common/region.h, through
        tf_rdma._native: no TensorFlow here), for these pids only: a segment
        goes only if no process holds its lock, since pids are reused and a
        process that drew one since holds a lock on each segment it owns.
        """
        if not self.pids or not os.path.isdir(_SHM_DIR):
            return
        try:
            collected = _native.remove_stale_segments(owner_pids=self.pids)
        except LibraryError as err:
            self.out.say(f"could not remove leaked shared-memory segments: {err}")
            return
        for error in collected["errors"]:
            self.out.say(f"could not remove {_SHM_DIR}/{error}")
        if collected["removed"]:
            self.out.say(f"removed {len(collected['removed'])} leaked shared-memory segment(s) "
                         f"from {_SHM_DIR}")


def _one_line(command, limit=200):
    """The command as a shell would read it, on one line and not too long."""
    text = shlex.join(command).replace("\r", "\\r").replace("\n", "\\n")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _send(proc, signum):
    try:
        proc.send_signal(signum)
    except (ProcessLookupError, OSError):
        pass


def _signal_name(signum):
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _describe_status(returncode):
    if returncode is not None and returncode < 0:
        return f"{128 - returncode} (killed by {_signal_name(-returncode)})"
    return str(returncode)


if __name__ == "__main__":
    sys.exit(main())
