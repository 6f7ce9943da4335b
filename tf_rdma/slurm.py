"""``tf-rdma launch --slurm``: each Slurm task of an ``srun`` step becomes one task of a
tf_rdma cluster.

::

    srun -N 2 -n 4 tf-rdma launch --slurm --spmd -- python train.py
    srun -N 2 -n 4 tf-rdma launch --slurm --ps 1 --coordinator -- python train.py

Every Slurm task runs the same command line; this module reads the step
from Slurm's environment and decides what the task is. As Horovod and
TensorFlow's ``SlurmClusterResolver`` do, it needs nothing beyond that
environment (no ``scontrol``, no shared file):

- **The cluster.** The step's nodes (``SLURM_STEP_NODELIST``, Slurm's host
  list syntax, ``node[01-03,07]``) and tasks per node
  (``SLURM_STEP_TASKS_PER_NODE``, ``2(x3),1``) give every rank's node under
  Slurm's default block distribution: ranks 0..k-1 on the first node, the
  next ones on the second. Rank r's address is its node name and port
  ``--port + SLURM_LOCALID`` (TensorFlow's endpoint port is that plus
  ``TF_RDMA_PORT_OFFSET``), so the tasks of one node never collide and every
  task computes the same cluster. A task checks that Slurm really put it
  where the block rule says (``SLURMD_NODENAME``, ``SLURM_LOCALID``) and
  refuses other distributions by name: a wrong cluster would hang, not fail.
- **Roles.** With ``--spmd`` every rank is a worker and runs the command
  with ``TF_CONFIG`` naming its task (the launcher's Python exec's it, so
  Slurm's signals reach it directly). Otherwise rank 0 runs the command
  (the ``chief`` with ``--coordinator``, a client outside the cluster
  without), ranks 1..M are the ``ps`` tasks and the rest the workers, each a
  ``python -m tf_rdma.server``.
- **Start and end (the lifeline).** Rank 0 runs its command only once every
  server is serving, and the servers must stop when the command ends (srun
  waits for every task). Rank 0 listens on its task's endpoint port (a
  coordinator or client runs no tf_rdma endpoint); each server rank dials
  it, says "ready" when its server is, and keeps the connection. When the
  command exits, rank 0 closes the connections and each server rank stops
  its server and exits 0; a rank 0 that dies closes them too. A ready line
  carries an HMAC of the task under the job secret, so that only a task of
  the job can start the command early. Cost: one connection per server.
- **The secret.** Every task needs the same ``TF_RDMA_SECRET``, and Slurm
  tasks share nothing but their environment: export it before ``srun``
  (which passes the environment on). Without one the launcher refuses to
  start rather than make a secret each task would make differently.

Errors (not inside an ``srun`` step, another distribution, a placement
that contradicts the environment, no secret) name the variable and what was
expected, and exit with status 2.
"""

import hashlib
import hmac
import json
import os
import re
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time

from tf_rdma import cluster as cluster_lib
from tf_rdma.errors import ConfigError
from tf_rdma.processes import (READY_PREFIX, TERM_GRACE_S, add_package_to_path, exit_status,
                               one_cpu_interop_threads, parent_death_signal)

__all__ = ["expand_hostlist", "tasks_per_node", "SlurmStep", "layout", "run", "DEFAULT_PORT"]

#: The first gRPC port of each node (TensorFlow's SlurmClusterResolver's default).
DEFAULT_PORT = 8888

_PREFIX = "tf-rdma launch --slurm: "


def _split_top(text, sep=","):
    """Splits at `sep` outside brackets."""
    parts, depth, start = [], 0, 0
    for i, c in enumerate(text):
        if c == "[":
            depth += 1
        elif c == "]":
            depth -= 1
            if depth < 0:
                raise ConfigError(f"host list {text!r} has a ']' without '['")
        elif c == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ConfigError(f"host list {text!r} has a '[' without ']'")
    parts.append(text[start:])
    return parts


def _expand_one(name, whole):
    """Expands the first bracket of one host pattern, then the rest."""
    open_at = name.find("[")
    if open_at < 0:
        return [name]
    close_at = name.index("]", open_at)
    head, body, tail = name[:open_at], name[open_at + 1:close_at], name[close_at + 1:]
    out = []
    for item in body.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", item)
        if not m or (m.group(2) is not None and int(m.group(2)) < int(m.group(1))):
            raise ConfigError(f"host list {whole!r}: {item!r} is not N or N-M (M >= N)")
        first, last = m.group(1), m.group(2) or m.group(1)
        width = len(first) if first.startswith("0") else 0
        for n in range(int(first), int(last) + 1):
            out.extend(head + str(n).zfill(width) + rest
                       for rest in _expand_one(tail, whole))
    return out


def expand_hostlist(text):
    """Slurm's host list syntax as names, in order.

    ``"node[01-03,07],login1"`` gives ``node01 node02 node03 node07
    login1``: a range keeps its first number's zero padding; several
    brackets in one name multiply out, left to right.

    Raises:
        ConfigError: `text` is empty or not a host list.
    """
    if not text or not text.strip():
        raise ConfigError("the host list is empty")
    names = []
    for part in _split_top(text.strip()):
        if not part:
            raise ConfigError(f"host list {text!r} has an empty name")
        names.extend(_expand_one(part, text))
    return names


def tasks_per_node(text):
    """Slurm's tasks-per-node syntax, one count per node: ``"2(x3),1"`` is
    ``[2, 2, 2, 1]``.

    Raises:
        ConfigError: `text` is not that syntax.
    """
    counts = []
    for part in (text or "").split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m or int(m.group(1)) < 1:
            raise ConfigError(f"tasks per node {text!r}: {part!r} is not N or N(xM)")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def _env_int(env, name):
    raw = env.get(name)
    if raw is None or not raw.strip().isdigit():
        raise ConfigError(f"{name}={raw!r}: expected a non-negative integer from Slurm")
    return int(raw)


class SlurmStep:
    """The srun step a task runs in, read from Slurm's environment.

    Attributes:
        rank: This task's rank in the step (``SLURM_PROCID``).
        size: The step's tasks.
        local_rank: This task's index on its node (``SLURM_LOCALID``).
        nodes: The step's node names, in Slurm's order.
        counts: The tasks of each node.
    """

    def __init__(self, rank, size, local_rank, nodes, counts, node_name=None):
        self.rank, self.size, self.local_rank = rank, size, local_rank
        self.nodes, self.counts = nodes, counts
        if len(nodes) != len(counts):
            raise ConfigError(f"{len(nodes)} node(s) ({','.join(nodes)}) but tasks per node "
                              f"for {len(counts)}")
        if sum(counts) != size:
            raise ConfigError(f"the step has {size} tasks but its nodes hold {sum(counts)} "
                              f"({counts})")
        if not 0 <= rank < size:
            raise ConfigError(f"rank {rank} is not in a step of {size} tasks")
        node, local = self.place(rank)
        if local != local_rank or (node_name is not None and node_name != node):
            raise ConfigError(
                f"Slurm placed rank {rank} on {node_name or '?'} as local task {local_rank}, "
                f"but the block distribution puts it on {node} as local task {local}: run "
                f"srun with --distribution=block (the default)")

    @classmethod
    def from_environ(cls, env=None):
        """The step of this process.

        Raises:
            ConfigError: Not inside an srun step, a distribution other than
                block, or variables that contradict each other.
        """
        env = os.environ if env is None else env
        nodelist = env.get("SLURM_STEP_NODELIST")
        per_node = env.get("SLURM_STEP_TASKS_PER_NODE")
        if nodelist is None or per_node is None:
            raise ConfigError(
                "not inside a Slurm job step (no SLURM_STEP_NODELIST or "
                "SLURM_STEP_TASKS_PER_NODE): run it under srun, e.g. srun -n 4 tf-rdma "
                "launch --slurm --spmd -- python train.py (in an sbatch script too)")
        distribution = env.get("SLURM_DISTRIBUTION", "block")
        if distribution.split(":")[0] not in ("block", ""):
            raise ConfigError(
                f"SLURM_DISTRIBUTION={distribution!r}: tf-rdma launch --slurm computes every "
                f"task's node from the block distribution; run srun with "
                f"--distribution=block")
        return cls(rank=_env_int(env, "SLURM_PROCID"),
                   size=_env_int(env, "SLURM_STEP_NUM_TASKS"
                                 if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS"),
                   local_rank=_env_int(env, "SLURM_LOCALID"),
                   nodes=expand_hostlist(nodelist), counts=tasks_per_node(per_node),
                   node_name=env.get("SLURMD_NODENAME"))

    def place(self, rank):
        """``(node, local index)`` of `rank` under the block distribution."""
        first = 0
        for node, count in zip(self.nodes, self.counts):
            if rank < first + count:
                return node, rank - first
            first += count
        raise ConfigError(f"rank {rank} is not in a step of {self.size} tasks")


def layout(step, num_ps=0, coordinator=False, spmd=False, port=DEFAULT_PORT):
    """The cluster of a step and each rank's task.

    Args:
        step: A :class:`SlurmStep`.
        num_ps: ps tasks (not with `spmd`).
        coordinator: Rank 0 is the ParameterServerStrategy coordinator, task
            ``chief:0``; without it rank 0 is a client outside the cluster.
        spmd: Every rank is a worker.
        port: The first gRPC port of each node.

    Returns:
        ``(cluster, tasks)``: the TF_CONFIG cluster and, per rank, ``(job,
        index)`` (``("client", 0)`` for a client rank 0).

    Raises:
        ConfigError: The step has too few tasks for the roles, or a port out of range.
    """
    if spmd:
        roles = [("worker", r) for r in range(step.size)]
    else:
        workers = step.size - 1 - num_ps
        if workers < 1:
            raise ConfigError(
                f"the step has {step.size} task(s): rank 0 for the command, {num_ps} ps and "
                f"at least one worker need {num_ps + 2}; run srun with -n {num_ps + 2} or more")
        roles = ([("chief" if coordinator else "client", 0)] +
                 [("ps", i) for i in range(num_ps)] + [("worker", i) for i in range(workers)])
    cluster = {}
    top = port + max(step.counts) - 1 + cluster_lib.port_offset()
    if port < 1 or top > 65535:
        raise ConfigError(f"--port {port}: the ports up to {top} (a node's tasks and their "
                          f"endpoints) must be within 1..65535")
    for rank, (job, index) in enumerate(roles):
        if job == "client":
            continue
        node, local = step.place(rank)
        cluster.setdefault(job, []).append(cluster_lib.join_address(node, port + local))
    return cluster, roles


def _ready_proof(secret, task):
    return hmac.new(secret.encode(), b"tf-rdma launch ready " + task.encode(),
                    hashlib.sha256).hexdigest()


def _say(message):
    print(_PREFIX + message, file=sys.stderr, flush=True)


def run(args, command):
    """Runs one Slurm task of ``tf-rdma launch --slurm``; returns its exit status.

    Args:
        args: The launch namespace (``num_workers`` may be None, ``num_ps``,
            ``coordinator``, ``spmd``, ``port``, ``timeout_start``).
        command: The command after ``--``.
    """
    port = args.port if args.port is not None else DEFAULT_PORT
    try:
        step = SlurmStep.from_environ()
        cluster, roles = layout(step, args.num_ps, args.coordinator, args.spmd, port)
    except ConfigError as err:
        _say(str(err))
        return 2
    workers = len(cluster.get("worker", []))
    if args.num_workers is not None and args.num_workers != workers:
        _say(f"-n {args.num_workers} disagrees with the step: its {step.size} task(s) make "
             f"{workers} worker(s); drop -n under --slurm, or run srun with another -n")
        return 2
    secret = os.environ.get("TF_RDMA_SECRET", "")
    if len(secret) < 16:
        _say("every task needs the same TF_RDMA_SECRET (at least 16 characters), "
             "and Slurm's tasks share only their environment: export one before srun, e.g. "
             "export TF_RDMA_SECRET=$(python3 -c 'import secrets; print(secrets.token_hex(16))')")
        return 2
    env = dict(os.environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env["PYTHONUNBUFFERED"] = "1"
    add_package_to_path(env)
    job, index = roles[step.rank]
    if step.rank == 0:
        _say(f"{step.size} tasks on {len(step.nodes)} node(s): {json.dumps(cluster)}")
    lifeline = _lifeline_address(step, port)
    bound = os.sched_getaffinity(0)
    if args.spmd:
        env["TF_CONFIG"] = json.dumps({"cluster": cluster,
                                       "task": {"type": job, "index": index}})
        one_cpu_interop_threads(env, bound)
        try:
            os.execvpe(command[0], command, env)
        except OSError as err:
            _say(f"could not run {command[0]}: {err}")
            return 126 if isinstance(err, PermissionError) else 127
    if step.rank == 0:
        config = {"cluster": cluster}
        if job == "chief":
            config["task"] = {"type": "chief", "index": 0}
        env["TF_CONFIG"] = json.dumps(config)
        servers = [f"{j}:{i}" for j, i in roles[1:]]
        return _run_command(command, env, lifeline, servers, secret, args.timeout_start)
    env["TF_CONFIG"] = json.dumps({"cluster": cluster, "task": {"type": job, "index": index}})
    one_cpu_interop_threads(env, bound)
    return _run_server(f"{job}:{index}", env, lifeline, secret, args.timeout_start)


def _lifeline_address(step, port):
    """Rank 0's endpoint address, ``(host, port)``: rank 0 is node 0's first task."""
    return step.nodes[0], port + cluster_lib.port_offset()


# --------------------------------------------------------------------------- rank 0


def _run_command(command, env, lifeline, servers, secret, timeout_start):
    """Rank 0: waits for every server's ready line, runs the command, then
    closes the lifelines."""
    if socket.has_dualstack_ipv6():
        listener = socket.create_server(("", lifeline[1]), family=socket.AF_INET6,
                                        dualstack_ipv6=True)
    else:
        listener = socket.create_server(("", lifeline[1]))
    ready = set()
    deadline = time.monotonic() + timeout_start
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    buffers = {}
    try:
        while ready != set(servers):
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(servers) - ready)
                _say(f"not every server was ready within {timeout_start:g} s "
                     f"(--timeout-start): waiting for {', '.join(missing)}")
                return 1
            for key, _ in sel.select(min(left, 1.0)):
                if key.fileobj is listener:
                    conn, _ = listener.accept()
                    conn.setblocking(False)
                    buffers[conn] = b""
                    sel.register(conn, selectors.EVENT_READ)
                    continue
                conn = key.fileobj
                data = conn.recv(4096)
                if not data:
                    sel.unregister(conn)
                    conn.close()
                    continue
                buffers[conn] += data
                while b"\n" in buffers[conn]:
                    line, buffers[conn] = buffers[conn].split(b"\n", 1)
                    parts = line.decode(errors="replace").split()
                    if (len(parts) == 3 and parts[0] == "ready" and parts[1] in servers and
                            hmac.compare_digest(parts[2], _ready_proof(secret, parts[1]))):
                        ready.add(parts[1])
                    elif len(parts) >= 2 and parts[0] == "failed" and parts[1] in servers:
                        _say(f"the server for {parts[1]} failed: {' '.join(parts[2:])}")
                        return 1
        sel.close()
        listener.close()  # dials of the coordinator's endpoint port are refused again
        _say(f"every server is ready; running {' '.join(command)}")
        return _run_child(command, env)
    finally:
        listener.close()
        for conn in buffers:
            conn.close()


def _run_child(command, env):
    """Runs the command; SIGTERM and SIGINT are passed on. Its exit status."""
    try:
        child = subprocess.Popen(command, env=env, preexec_fn=parent_death_signal())
    except OSError as err:
        _say(f"could not run {command[0]}: {err}")
        return 126 if isinstance(err, PermissionError) else 127
    previous = {s: signal.signal(s, lambda signum, _: child.send_signal(signum))
                for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        return exit_status(child.wait())
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


# --------------------------------------------------------------------------- server ranks


def _dial(address, deadline):
    host, port = address
    while True:
        try:
            conn = socket.create_connection((host, port), timeout=2.0)
            conn.settimeout(None)  # the lifeline is quiet for as long as the command runs
            return conn
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _run_server(task, env, lifeline, secret, timeout_start):
    """A server rank: starts the server, tells rank 0 when it is ready, stops
    it when rank 0's lifeline closes."""
    deadline = time.monotonic() + timeout_start
    try:
        conn = _dial(lifeline, deadline)
    except OSError as err:
        _say(f"{task}: could not reach rank 0 at {lifeline[0]}:{lifeline[1]} within "
             f"{timeout_start:g} s (--timeout-start): {err}")
        return 1
    job, index = task.split(":")
    server = subprocess.Popen([sys.executable, "-m", "tf_rdma.server", "--job", job, "--task",
                               index], env=env, stdout=subprocess.PIPE, text=True,
                              preexec_fn=parent_death_signal())
    stopping = threading.Event()

    def stop(signum=None, _frame=None):
        stopping.set()
        if server.poll() is None:
            server.send_signal(signal.SIGTERM)
            killer = threading.Timer(TERM_GRACE_S, server.kill)
            killer.daemon = True
            killer.start()

    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, stop)

    def forward_stdout():
        told = False
        for line in server.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            if not told and line.startswith(READY_PREFIX):
                told = True
                try:
                    conn.sendall(f"ready {task} {_ready_proof(secret, task)}\n".encode())
                except OSError:
                    stop()

    def watch_lifeline():
        try:
            while conn.recv(4096):
                pass
        except OSError:
            pass
        stop()

    threading.Thread(target=forward_stdout, daemon=True).start()
    threading.Thread(target=watch_lifeline, daemon=True).start()
    status = server.wait()
    try:
        if not stopping.is_set() and status != 0:
            conn.sendall(f"failed {task} exited with status {exit_status(status)}\n".encode())
    except OSError:
        pass
    conn.close()
    return 0 if stopping.is_set() else exit_status(status)
