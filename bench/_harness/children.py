"""The processes an orchestrator starts: one child, or P workers as a group.

An orchestrator never imports TensorFlow; it measures by starting children
(a client inside a ``tf-rdma launch`` cluster, or P worker processes that
meet through ``BENCH_CLUSTER``) and reading back what they report. Each
child runs under a hard time limit, so that a hung transfer ends the run
with the child's last output instead of hanging it.
"""

import argparse
import collections
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from _harness.worker import CLUSTER_ENV

#: The checkout bench/ is in.
REPO = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))

# tf-rdma launch's own line once its servers are up: echoed with the
# children's progress, so that the wait for TensorFlow's start is visible.
_CLUSTER_READY = "tf-rdma launch: cluster ready"


def child_env():
    """``os.environ`` for a child, with the checkout on its PYTHONPATH.

    Put first unless PYTHONPATH already names it, so that a source checkout
    works without an install: the children import the checkout's tf_rdma,
    with the op library built in it.
    """
    env = dict(os.environ)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if REPO not in paths:
        env["PYTHONPATH"] = os.pathsep.join([REPO] + paths)
    return env


def launch_env(transport=None):
    """``child_env()`` for a child with a cluster of its own, or none.

    Without the caller's TF_CONFIG (``tf-rdma launch`` gives its servers
    and its command their own), the servers on ``transport`` when given,
    and TensorFlow's INFO logs off unless set.
    """
    env = child_env()
    env.pop("TF_CONFIG", None)
    if transport:
        env["TF_RDMA_TRANSPORT"] = transport
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return env


def launch_command(client, workers, ps=0, coordinator=False, bind=None,
                   timeout_start=None):
    """The command line that runs ``client`` in a local ``tf-rdma launch``
    cluster of ``workers`` workers and ``ps`` ps tasks (with
    ``coordinator``, as a ParameterServerStrategy coordinator; ``bind``:
    the launcher's ``--bind``; ``timeout_start``: seconds the servers may
    take to start)."""
    cmd = [sys.executable, "-m", "tf_rdma.cli", "launch", "-n", str(workers)]
    if ps:
        cmd += ["--ps", str(ps)]
    if coordinator:
        cmd.append("--coordinator")
    if bind:
        cmd += ["--bind", bind]
    if timeout_start:
        cmd += ["--timeout-start", str(int(timeout_start))]
    return cmd + ["--"] + list(client)


# --- one child: a client, with its progress and its result line ---


def emit_result(prefix, doc):
    """The child's side of a result: one line ``prefix + JSON`` on stdout."""
    print(prefix + json.dumps(doc), flush=True)


def _pump(stream, sink, echo, tail):
    """Reads ``stream`` to its end: keeps, echoes and remembers its lines."""
    for line in iter(stream.readline, ""):
        if sink is not None:
            sink.append(line)
        text = line.rstrip("\n")
        tail.append(text)
        if echo(text):
            print(text, file=sys.stderr, flush=True)
    stream.close()


def run_child(label, cmd, env, *, timeout, verbose, log, log_prefix,
              result_prefix=None):
    """Runs ``cmd`` to its end under ``timeout``; returns how it ended.

    The child's stderr lines that are progress (they start with
    ``log_prefix``, or are tf-rdma launch's "cluster ready") are echoed on
    stderr as they come; with ``verbose`` every line of both streams is.
    Past ``timeout`` the child gets SIGTERM (``tf-rdma launch`` then tears
    its whole cluster down) and SIGKILL 20 s later. On Ctrl-C the child got
    the SIGINT too: it gets 20 s to stop, then the KeyboardInterrupt goes
    on. When the child fails (timed out, a nonzero exit status or, with
    ``result_prefix``, no result line) its last 60 output lines are
    printed on stderr.

    Args:
      label: Names the child in the log lines.
      cmd, env: Its command line and environment.
      timeout: Seconds it may run.
      verbose: Echo all its output.
      log: The orchestrator's progress logger.
      log_prefix: The prefix of the bench's progress lines.
      result_prefix: Where the child reports with ``emit_result``: the
        prefix of its result line on stdout.

    Returns:
      ``(status, result)``: the exit status (None when it timed out) and
      the JSON of its last result line (None without ``result_prefix`` or
      when it failed).
    """
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL)
    stdout_lines = []
    tail = collections.deque(maxlen=60)

    def echo_err(text):
        return verbose or text.startswith(log_prefix) or text.startswith(
            _CLUSTER_READY)

    threads = [
        threading.Thread(target=_pump, args=(proc.stdout, stdout_lines,
                                             lambda t: verbose, tail),
                         daemon=True),
        threading.Thread(target=_pump, args=(proc.stderr, None, echo_err,
                                             tail), daemon=True),
    ]
    for t in threads:
        t.start()
    status = None
    try:
        status = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        log(f"{label}: no result after {timeout:g} s; stopping it")
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()  # a launcher's children get SIGTERM (parent death)
            proc.wait()
    except KeyboardInterrupt:
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        raise
    for t in threads:
        t.join(5)
    result = None
    if status == 0 and result_prefix is not None:
        found = [line for line in stdout_lines
                 if line.startswith(result_prefix)]
        if found:
            result = json.loads(found[-1][len(result_prefix):])
    if status != 0 or (result_prefix is not None and result is None):
        why = ("timed out" if status is None else
               f"exit status {status}" if status else "no result line")
        log(f"{label}: failed ({why}); its last output lines:")
        for line in tail:
            print("    " + line, file=sys.stderr)
    return status, result


# --- a group: P worker processes on this host, under one limit ---


def worker_env():
    """``child_env()`` for a group's workers: TensorFlow's INFO logs off
    (unless set) and a Python stack trace on a crash."""
    env = child_env()
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.setdefault("PYTHONFAULTHANDLER", "1")
    return env


def free_ports(n):
    """tf_rdma.cluster.free_ports, or plain free ports if tf_rdma is absent.

    Returns (ports, note): note says why tf_rdma's picker was not used.
    """
    try:
        from tf_rdma.cluster import free_ports as tf_rdma_free_ports
        return tf_rdma_free_ports(n), None
    except ImportError as err:
        import socket
        socks = []
        try:
            for _ in range(n):
                s = socket.socket()
                s.bind(("127.0.0.1", 0))
                socks.append(s)
            return [s.getsockname()[1] for s in socks], str(err)
        finally:
            for s in socks:
                s.close()


def add_local_cluster(env, nranks, log):
    """Gives a group the cluster its workers meet in: P ports on 127.0.0.1.

    Sets ``env[CLUSTER_ENV]`` to ``{"worker": ["127.0.0.1:<port>", ...]}``
    (read by ``worker.group_cluster``).
    """
    ports, note = free_ports(nranks)
    if note:
        log(f"tf_rdma.cluster.free_ports unavailable ({note}); using ports "
            f"the kernel picked")
    env[CLUSTER_ENV] = json.dumps(
        {"worker": [f"127.0.0.1:{p}" for p in ports]})


def make_tf_rdma_job(env, transport=None):
    """Makes ``env`` that of one tf_rdma job: one TF_RDMA_SECRET for all its
    workers (unless set) and, if given, TF_RDMA_TRANSPORT."""
    env.setdefault("TF_RDMA_SECRET", os.urandom(16).hex())
    if transport:
        env["TF_RDMA_TRANSPORT"] = transport


def add_process_arguments(parser, systems):
    """--keep, --verbose and the internal arguments of one group worker.

    Args:
      parser: The bench's argparse parser.
      systems: The choices of ``--worker`` (the kinds of worker).
    """
    parser.add_argument("--keep", action="store_true",
                        help="keep the workers' logs and result files")
    parser.add_argument("--verbose", action="store_true",
                        help="show the workers' output")
    # Internal: one rank of one system.
    parser.add_argument("--worker", choices=systems, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--nranks", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)


@contextlib.contextmanager
def work_dir(prefix, keep, log):
    """A temporary folder for the workers' logs and result files.

    Removed when the block ends, however it ends; with ``keep`` it stays
    and its path is logged.
    """
    path = tempfile.mkdtemp(prefix=prefix)
    try:
        yield path
    finally:
        if keep:
            log(f"worker logs and files kept in {path}")
        else:
            shutil.rmtree(path, ignore_errors=True)


def stop(procs):
    """SIGTERM, then SIGKILL, each still running process (by its pid)."""
    for p in procs:
        if p.poll() is None:
            try:
                p.send_signal(signal.SIGTERM)
            except OSError:
                pass
    deadline = time.monotonic() + 10
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def cpu_shares(n):
    """Each of `n` local processes' own CPUs, as ``tf-rdma launch`` binds
    its tasks (tf_rdma.launch.cpu_shares); None where there are fewer CPUs
    than processes (or tf_rdma is not importable)."""
    try:
        from tf_rdma.launch import cpu_shares as shares
    except ImportError:
        return None
    return shares(n)


def add_bind_argument(parser):
    """--bind: whether a bench binds its ranks as ``tf-rdma launch`` does."""
    parser.add_argument(
        "--bind", choices=("auto", "none"), default="auto",
        help="auto (default): bind each rank of a system to its own CPUs "
             "where there are at least as many CPUs as ranks, as tf-rdma "
             "launch binds its tasks and mpirun its ranks; none: unbound")


def run_processes(label, cmds, env, out, timeout, log, verbose=False,
                  bind=False):
    """Runs `cmds` side by side under one hard limit.

    Every process writes its output to out/proc<i>.log and its results to
    out/*.json. When one exits with an error the others get 15 s more (they
    are likely waiting for it) and are then stopped. With `bind`, process i
    runs on the i-th of cpu_shares(len(cmds)) (unbound where that is None),
    TF_RDMA_HOST_CPUS tells tf_rdma's engine how many the processes
    share, and a process bound to one CPU gets two inter-op threads, as
    under ``tf-rdma launch``. Returns (the JSON documents found in `out`, why the run failed or
    None).
    """
    logs, procs = [], []
    t0 = time.perf_counter()
    shares = cpu_shares(len(cmds)) if bind else None
    if shares is not None:
        env = dict(env, TF_RDMA_HOST_CPUS=str(sum(len(s) for s in shares)))
    try:
        for i, cmd in enumerate(cmds):
            logf = open(os.path.join(out, f"proc{i}.log"), "w")
            logs.append(logf)
            share = shares[i] if shares is not None else None
            env_i = dict(env)
            if share is not None:  # then tf_rdma is importable (cpu_shares)
                from tf_rdma.processes import one_cpu_interop_threads
                one_cpu_interop_threads(env_i, share)  # as tf-rdma launch
            procs.append(subprocess.Popen(
                cmd, env=env_i, stdout=logf, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=(None if share is None else
                            lambda share=share: os.sched_setaffinity(0, share))))
        deadline = time.monotonic() + timeout
        failure = None
        first_failed = None
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if now > deadline:
                failure = f"timed out after {timeout:g} s"
                break
            bad = [p for p in procs if p.poll() not in (None, 0)]
            if bad and first_failed is None:
                first_failed = now
            if first_failed is not None and now - first_failed > 15:
                failure = (f"a process exited with status "
                           f"{bad[0].returncode}; stopped the others")
                break
            time.sleep(0.2)
    finally:
        stop(procs)  # also on KeyboardInterrupt: no orphans
        for f in logs:
            f.close()
    codes = [p.returncode for p in procs]
    if failure is None and any(codes):
        failure = f"exit status {codes}"
    docs = []
    for name in sorted(os.listdir(out)):
        if name.endswith(".json"):
            with open(os.path.join(out, name)) as f:
                docs.append(json.load(f))
    if failure or verbose:
        if failure:
            log(f"{label}: FAILED ({failure}); last output:")
        for i in range(len(cmds)):
            with open(os.path.join(out, f"proc{i}.log")) as f:
                lines = f.read().splitlines()
            keep = lines if verbose and not failure else lines[-25:]
            for line in keep:
                print(f"    [{label} {i}] {line}", file=sys.stderr)
    log(f"{label}: {len(docs)} rank{'s' if len(docs) != 1 else ''} "
        f"reported, {time.perf_counter() - t0:.1f} s")
    return docs, failure
