#!/usr/bin/env python3
"""Soak: many steps of a rewritten function, every tensor checked, resources watched.

Usage::

    python bench/soak.py                          # 100,000 steps over shm, then tcp
    python bench/soak.py --transport shm --steps 20000 --sample-every 500
    python bench/soak.py --help

What runs (per transport): two ``python -m tf_rdma.server`` tasks
(``worker:0``, ``worker:1``) with ``TF_RDMA_TRANSPORT`` set to the transport,
and one client (this script with ``--client``) that calls, ``--steps`` times,
one ``tf.function`` under ``@tf_rdma.rewrite`` with four kinds of traffic:

``static``
    worker:0 -> worker:1, int64 ``[3 + STATIC_WORDS]``: a static edge.
``dynamic``
    worker:0 -> worker:1, int64 ``[3 + n]`` with ``n`` a function of the step
    (0 to ``DYNAMIC_MAX_WORDS``, period ``DYNAMIC_PERIOD`` steps, so the
    payload area reaches its final size within the warm-up): a dynamic edge.
``back``
    worker:1 -> worker:0, int64 ``[3 + BACK_WORDS]``, computed from what
    worker:1 received: a static edge the other way, so each step is a round
    trip.
``allreduce``
    a ``tf_rdma.collectives.all_reduce`` (ring) of an int64 vector between
    the two tasks.

Every tensor of an edge is ``[step, key, checksum, payload...]``: the sender
computes ``checksum = H(step, key, payload)`` (a position-weighted sum, so a
swapped, truncated or changed word changes it) and the receiver recomputes
it with the step it expects (which it gets as a function argument, over
gRPC, not from tf_rdma) and the edge's key. So a stale tensor (another
step's), a duplicate, a tensor of another edge (misrouted), a truncated
dynamic tensor or changed bytes all count as a mismatch. The collective's
inputs are known functions of (step, rank), so each rank compares the sum
it gets with the exact sum it computes itself. ``--inject-corruption
STEP:EDGE`` changes one word of that edge's tensor at that step on the
sending task, after its checksum was computed: it exists to prove that the
check can fail (tests/test_soak.py).

Every ``--sample-every`` steps the client samples, for each task and for
itself, the resident set (``VmRSS`` in ``/proc/<pid>/status``), the open
file descriptors (``/proc/<pid>/fd``), the threads (``Threads``, and their
names from ``/proc/<pid>/task/*/comm``, so that a change says which pool
moved) and the ``/dev/shm`` segments the task owns (``tfrdma.<pid>.*``:
count, bytes). The servers run on this host, so ``/proc/<pid>`` of a task
is what the task would read as ``/proc/self``. The client also records its
number of Python objects (``python_objects``), which tells Python-level
growth from native growth.

Pass criteria (printed, and the exit status), for each task, from the first
sample at or after the warm-up (default: the first 10% of the steps, and at
least one period of the dynamic sizes) to the last: 0 mismatches; RSS growth
below ``--max-rss-growth`` percent (default 1); segments and segment bytes
equal to their post-warm-up values at every later sample; fds within
``--fd-slack`` (default 1) of theirs; threads equal too, except gRPC's
EventEngine pool (``event_engine``), which grows and shrinks with the
machine's load by design and may move by ``--elastic-thread-slack``
(default 4). The client's numbers are
recorded and plotted but not judged: its process is TensorFlow's eager
client, not tf_rdma's data path. A corrupted allreduce input is seen by
both ranks, so it counts as two mismatches.

Output: a summary per transport on stdout (TensorFlow's own logs are
silenced: ``TF_CPP_MIN_LOG_LEVEL=2``), ``bench/results/soak-<transport>.json``
(the samples, mismatches, steps/s, the machine, the verdict) and a PNG plot
of RSS, fds, threads and /dev/shm bytes against the step next to it
(skipped, with a message, when matplotlib is missing). Like the other
benches, the orchestrator never imports TensorFlow; the servers' logs are
kept in a temporary directory and shown when a run fails (``--verbose``:
always).
"""

import argparse
import collections
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from _harness import report
from _harness.children import REPO, child_env
from _harness.report import loadavg, save_json, utc_now, write_json
from _harness.units import MiB

RESULTS_DIR = os.path.join(REPO, "bench", "results")
LOG_PREFIX = "[soak] "

# --- the traffic: sizes, keys, and the checksum (shared by both sides) ---

STATIC_WORDS = 4093          # int64 payload words of the static edge (~32 KiB)
DYNAMIC_MAX_WORDS = 16384    # the dynamic edge's largest payload (128 KiB)
DYNAMIC_PERIOD = 257         # steps after which the dynamic sizes repeat
BACK_WORDS = 509             # worker:1 -> worker:0 (~4 KiB)
ALLREDUCE_WORDS = 8191       # the collective's vector (~64 KiB)
HEADER_WORDS = 3             # [step, key, checksum]
PAYLOAD_MODULUS = 65521      # payload words are < 2^16: the checksum cannot overflow
CHECKSUM_MODULUS = (1 << 61) - 1

#: Key of every tensor kind; part of the checksum, so a tensor that arrives
#: on the wrong edge is a mismatch.
EDGE_KEYS = {"static": 1, "dynamic": 2, "back": 3, "allreduce": 4}
TASKS = ("worker:0", "worker:1")

# --- defaults ---

DEFAULT_STEPS = 100000
DEFAULT_SAMPLE_EVERY = 1000
DEFAULT_WARMUP_FRACTION = 0.10
DEFAULT_MAX_RSS_GROWTH_PCT = 1.0
DEFAULT_FD_SLACK = 1
#: Thread names of pools that grow and shrink with load by design, judged
#: with a slack instead of exactly: gRPC's EventEngine work-stealing pool
#: (its "lifeguard" thread adds a worker when all are busy for a while and
#: lets extra workers go when idle). Seen: 4 -> 5 on a task while other
#: work loaded the machine.
ELASTIC_THREAD_NAMES = ("event_engine",)
DEFAULT_ELASTIC_THREAD_SLACK = 4
DEFAULT_OP_TIMEOUT_S = 60
SERVER_START_TIMEOUT_S = 180
ENDPOINT_PORT_OFFSET = 1000  # tf_rdma.cluster.DEFAULT_PORT_OFFSET (not imported: it loads TF)
MAX_MISMATCHES_KEPT = 50


def log(message):
    """Prints a progress line on stderr."""
    print(LOG_PREFIX + message, file=sys.stderr, flush=True)


# =========================================================================
# The client: builds the function, runs the steps, samples the tasks.
# =========================================================================


def build_step_function(tf, corruptions, op_timeout, path="rewrite"):
    """Returns the function of one soak step.

    Args:
      tf: The tensorflow module.
      corruptions: ``{edge: step}``: the sending task changes one word of
        that edge's tensor at that step, after computing its checksum.
      op_timeout: Seconds a tf_rdma op may wait.
      path: "rewrite" (the function under ``tf_rdma.rewrite``) or "grpc"
        (the plain ``tf.function``: TensorFlow moves the edges; the
        allreduce is still tf_rdma's). "grpc" is the reference that tells
        TensorFlow's own growth from tf_rdma's.

    Returns:
      The function. Called with an int64 scalar step, it returns
      ``(flags_w0, flags_w1)``: int32 vectors, 1 where a tensor failed its
      check, in the order of :func:`flag_layout`.
    """
    import tf_rdma
    from tf_rdma import collectives

    w0, w1 = "/job:worker/task:0", "/job:worker/task:1"
    group = [w0, w1]

    def payload(step, key, words):
        """Deterministic int64 words in [0, PAYLOAD_MODULUS) for (step, key)."""
        i = tf.range(words, dtype=tf.int64)
        return tf.math.floormod(i * 40503 + step * 7919 + key * 104729,
                                PAYLOAD_MODULUS)

    def checksum(step, key, data):
        """H(step, key, data): position-weighted sum, mod 2^61 - 1."""
        n = tf.size(data, out_type=tf.int64)
        weights = tf.math.floormod(tf.range(n) * 2654435761 + 97,
                                   2147483647) + 1  # < 2^31
        h = (tf.reduce_sum(data * weights) + step * 1000003 +
             key * 998244353 + n * 31)
        return tf.math.floormod(h, CHECKSUM_MODULUS)

    def pack(step, edge, data):
        """[step, key, checksum, data...], corrupted at the injected step."""
        key = EDGE_KEYS[edge]
        header = tf.stack([step, tf.constant(key, tf.int64),
                           checksum(step, key, data)])
        tensor = tf.concat([header, data], 0)
        return maybe_corrupt(tensor, step, edge)

    def maybe_corrupt(tensor, step, edge):
        """``tensor`` with its last word + 1 at edge's injected step, if any."""
        if edge not in corruptions:
            return tensor
        # The last word: the payload's, or the checksum's when it is empty.
        hit = tf.one_hot(tf.size(tensor) - 1, tf.size(tensor), dtype=tf.int64)
        return tensor + hit * tf.cast(
            tf.equal(step, corruptions[edge]), tf.int64)

    def bad(tensor, step, edge, words):
        """1 unless ``tensor`` is edge's tensor of this step, intact."""
        key = EDGE_KEYS[edge]
        data = tensor[HEADER_WORDS:]
        ok = tf.reduce_all(tf.stack([
            tf.equal(tf.size(tensor, out_type=tf.int64), HEADER_WORDS + words),
            tf.equal(tensor[0], step),
            tf.equal(tensor[1], key),
            tf.equal(tensor[2], checksum(step, key, data)),
        ]))
        return 1 - tf.cast(ok, tf.int32)

    def dynamic_words(step):
        """The dynamic edge's payload length at ``step``: 0 to the max, period DYNAMIC_PERIOD."""
        return tf.math.floormod(step * 7919, DYNAMIC_PERIOD) * (
            DYNAMIC_MAX_WORDS // (DYNAMIC_PERIOD - 1))

    def contribution(step, rank):
        """Rank's allreduce input: known to every rank from (step, rank)."""
        return payload(step, EDGE_KEYS["allreduce"] * 10 + rank,
                       ALLREDUCE_WORDS)

    def sent_contribution(step, rank):
        """What rank puts in: rank 0's corrupted at the injected step."""
        x = contribution(step, rank)
        return maybe_corrupt(x, step, "allreduce") if rank == 0 else x

    def allreduce_bad(y, step):
        """1 unless ``y`` is exactly the sum of both ranks' inputs of this step."""
        want = contribution(step, 0) + contribution(step, 1)
        return 1 - tf.cast(tf.reduce_all(tf.equal(y, want)), tf.int32)

    def step_fn(step):
        with tf.device(w0):
            static = pack(step, "static",
                          payload(step, EDGE_KEYS["static"], STATIC_WORDS))
            dynamic = pack(step, "dynamic",
                           payload(step, EDGE_KEYS["dynamic"],
                                   dynamic_words(step)))
            y0 = collectives.all_reduce(
                sent_contribution(step, 0),
                group=collectives.Group(group, rank=0),
                name="soak/allreduce", algorithm="ring")
        with tf.device(w1):
            static_bad = bad(static, step, "static", STATIC_WORDS)
            dynamic_bad = bad(dynamic, step, "dynamic", dynamic_words(step))
            y1 = collectives.all_reduce(
                sent_contribution(step, 1),
                group=collectives.Group(group, rank=1),
                name="soak/allreduce", algorithm="ring")
            ar1_bad = allreduce_bad(y1, step)
            # Derived from what arrived, so the step is a round trip.
            back_data = tf.math.floormod(
                static[HEADER_WORDS:HEADER_WORDS + BACK_WORDS] + 1,
                PAYLOAD_MODULUS)
            back = pack(step, "back", back_data)
            flags_w1 = tf.stack([static_bad, dynamic_bad, ar1_bad])
        with tf.device(w0):
            back_bad = bad(back, step, "back", BACK_WORDS)
            ar0_bad = allreduce_bad(y0, step)
            flags_w0 = tf.stack([back_bad, ar0_bad])
        return flags_w0, flags_w1

    if path == "grpc":
        return tf.function(step_fn)
    return tf_rdma.rewrite(tf.function(step_fn), timeout=op_timeout,
                           name="soak")


def flag_layout():
    """Which (edge, task) each returned flag is: (flags_w0, flags_w1)."""
    return ([("back", "worker:0"), ("allreduce", "worker:0")],
            [("static", "worker:1"), ("dynamic", "worker:1"),
             ("allreduce", "worker:1")])


def read_status(pid):
    """VmRSS (bytes) and Threads of a process, from /proc/<pid>/status."""
    rss = threads = None
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
            elif line.startswith("Threads:"):
                threads = int(line.split()[1])
    return rss, threads


def shm_usage(pid):
    """(segments, bytes allocated) of a process's tf_rdma segments in /dev/shm."""
    prefix = f"tfrdma.{pid}."
    count = used = 0
    try:
        names = os.listdir("/dev/shm")
    except OSError:
        return 0, 0
    for name in names:
        if not name.startswith(prefix):
            continue
        try:
            st = os.stat(os.path.join("/dev/shm", name))
        except OSError:  # removed meanwhile
            continue
        count += 1
        used += st.st_blocks * 512
    return count, used


def thread_names(pid):
    """{thread name: count} of a process (/proc/<pid>/task/*/comm).

    When the thread count moves, this says which pool moved: TensorFlow's
    (``tf_Compute``...), gRPC's (``event_engine``...) or an unnamed thread
    (``python``: the process's own name, which tf_rdma's threads keep).
    """
    names = collections.Counter()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                names[f.read().strip()] += 1
        except OSError:  # the thread ended meanwhile
            continue
    return dict(sorted(names.items()))


def sample_process(pid):
    """One sample of a process: rss, fds, threads (and their names), shm segments and bytes."""
    rss, threads = read_status(pid)
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    segments, shm_bytes = shm_usage(pid)
    return {"rss_bytes": rss, "fds": fds, "threads": threads,
            "shm_segments": segments, "shm_bytes": shm_bytes,
            "thread_names": thread_names(pid)}


def client(args):
    """Runs the steps against the servers named in TF_CONFIG; writes --out."""
    import gc

    import tensorflow as tf

    tf.get_logger().setLevel("ERROR")
    import tf_rdma  # noqa: F401 - loads the op library

    pids = json.loads(os.environ["SOAK_SERVER_PIDS"])  # {task: pid}
    pids["client"] = os.getpid()
    ready_file = os.environ.get("SOAK_READY_FILE")
    if ready_file:  # TensorFlow is imported; now wait for the servers
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while not os.path.exists(ready_file):
            if time.monotonic() > deadline:
                log(f"{args.transport}: the servers were not ready within "
                    f"{SERVER_START_TIMEOUT_S} s")
                return 1
            time.sleep(0.05)
    cluster = json.loads(os.environ["TF_CONFIG"])["cluster"]
    tf.config.experimental_connect_to_cluster(tf.train.ClusterSpec(cluster))

    corruptions = dict(parse_corruption(c) for c in args.inject_corruption)
    fn = build_step_function(tf, corruptions, args.op_timeout, args.path)
    layout = flag_layout()
    counts = {f"{edge}@{task}": 0 for flags in layout for edge, task in flags}
    mismatches = []
    samples = []
    doc = {"transport": args.transport, "path": args.path,
           "steps_asked": args.steps,
           "sample_every": args.sample_every, "pids": pids,
           "corruptions": corruptions, "samples": samples,
           "mismatch_counts": counts, "mismatches": mismatches}

    def take_sample(step, elapsed):
        row = {"step": step, "elapsed_s": round(elapsed, 3)}
        for name, pid in pids.items():
            row[name] = sample_process(pid)
        # Whether the client's growth is Python objects or native memory.
        row["client"]["python_objects"] = len(gc.get_objects())
        samples.append(row)

    def save(steps_done, elapsed, first_call_s, error=None):
        doc.update(steps_done=steps_done, elapsed_s=round(elapsed, 3),
                   first_call_s=round(first_call_s, 3), error=error)
        save_json(args.out, doc)

    t0 = time.perf_counter()
    first_call_s = 0.0
    step = 0
    error = None
    try:
        for step in range(1, args.steps + 1):
            flags_w0, flags_w1 = fn(tf.constant(step, tf.int64))
            for flags, names in zip((flags_w0.numpy(), flags_w1.numpy()),
                                    layout):
                if flags.any():
                    for flag, (edge, task) in zip(flags, names):
                        if flag:
                            counts[f"{edge}@{task}"] += 1
                            if len(mismatches) < MAX_MISMATCHES_KEPT:
                                mismatches.append({"step": step, "edge": edge,
                                                   "task": task})
            if step == 1:
                first_call_s = time.perf_counter() - t0
                plan = fn.plan if args.path == "rewrite" else None
                doc["plan"] = plan and {
                    "transfers": [{"key": t.key, "dynamic": bool(t.dynamic)}
                                  for t in plan.transfers],
                    "bytes_per_step": plan.bytes_per_step}
                take_sample(step, time.perf_counter() - t0)
            if step % args.sample_every == 0:
                elapsed = time.perf_counter() - t0
                take_sample(step, elapsed)
                save(step, elapsed, first_call_s)
                if step % args.progress_every == 0 or step == args.steps:
                    rate = (step - 1) / max(1e-9, elapsed - first_call_s)
                    last = samples[-1]
                    log(f"{args.transport}: step {step}/{args.steps}, "
                        f"{rate:.0f} steps/s, mismatches "
                        f"{sum(counts.values())}, rss "
                        + ", ".join(f"{t} {last[t]['rss_bytes'] / MiB:.1f} MiB"
                                    for t in TASKS))
    except tf.errors.OpError as e:
        error = f"step {step}: {type(e).__name__}: {e.message[:2000]}"
        log(f"{args.transport}: {error}")
        step -= 1
    elapsed = time.perf_counter() - t0
    if not samples or samples[-1]["step"] != step:
        if step >= 1:
            take_sample(step, elapsed)
    save(step, elapsed, first_call_s, error)
    return 0 if error is None else 1


def parse_corruption(text):
    """'STEP:EDGE' -> (edge, step)."""
    step, _, edge = text.partition(":")
    edge = edge or "static"
    if edge not in EDGE_KEYS or not step.isdigit() or int(step) < 1:
        raise argparse.ArgumentTypeError(
            f"--inject-corruption wants STEP:EDGE with EDGE in "
            f"{sorted(EDGE_KEYS)}, got {text!r}")
    return edge, int(step)


# =========================================================================
# The orchestrator: servers, client, verdict, JSON, plot. No TensorFlow.
# =========================================================================


def pick_ports(n):
    """n gRPC ports p with p and p + the endpoint offset both free now."""
    ports, held = [], []
    try:
        while len(ports) < n:
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
            if p + ENDPOINT_PORT_OFFSET > 65535 or p in ports:
                s.close()
                continue
            t = socket.socket()
            try:
                t.bind(("127.0.0.1", p + ENDPOINT_PORT_OFFSET))
            except OSError:
                s.close()
                t.close()
                continue
            held += [s, t]
            ports.append(p)
    finally:
        for s in held:
            s.close()
    return ports


def die_with_parent():
    """preexec_fn: SIGTERM the child when the orchestrator dies (even by
    SIGKILL), so that no server or client outlives it; a server handles
    SIGTERM as a clean shutdown that removes its /dev/shm segments."""
    import ctypes
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    except OSError:  # not glibc: no safety net, the finally blocks still stop them
        pass


def task_env(transport, op_timeout, secret):
    """The environment of the servers and the client."""
    env = child_env()
    env.pop("TF_CONFIG", None)
    env["TF_RDMA_TRANSPORT"] = transport
    env["TF_RDMA_TIMEOUT"] = str(op_timeout)
    env["TF_RDMA_SECRET"] = secret
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    env["PYTHONUNBUFFERED"] = "1"
    return env


class Servers:
    """The two tf_rdma servers of one run; logs in files under ``log_dir``."""

    def __init__(self, transport, env, log_dir):
        self.transport = transport
        self.log_dir = log_dir
        ports = pick_ports(len(TASKS))
        self.cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
        self.env = env
        self.procs = {}

    def start_processes(self):
        """Starts the server processes; False when one could not start."""
        try:
            for i, task in enumerate(TASKS):
                e = dict(self.env)
                e["TF_CONFIG"] = json.dumps(
                    {"cluster": self.cluster,
                     "task": {"type": "worker", "index": i}})
                with open(self.path(task, "out"), "w") as out, \
                        open(self.path(task, "err"), "w") as err:
                    self.procs[task] = subprocess.Popen(
                        [sys.executable, "-m", "tf_rdma.server"], env=e,
                        stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                        start_new_session=True, preexec_fn=die_with_parent)
        except OSError as e:
            log(f"{self.transport}: cannot start a server: {e}")
            return False
        return True

    def wait_ready(self, timeout=SERVER_START_TIMEOUT_S):
        """True when every server said ready within ``timeout``."""
        deadline = time.monotonic() + timeout
        waiting = set(TASKS)
        while waiting and time.monotonic() < deadline:
            for task in sorted(waiting):
                with open(self.path(task, "out")) as f:
                    if "tf_rdma server ready" in f.read():
                        waiting.discard(task)
                        continue
                if self.procs[task].poll() is not None:
                    log(f"{self.transport}: server {task} exited with "
                        f"{self.procs[task].returncode}")
                    return False
            time.sleep(0.1)
        if waiting:
            log(f"{self.transport}: servers {sorted(waiting)} not ready "
                f"within {timeout} s")
        return not waiting

    def path(self, task, kind):
        return os.path.join(self.log_dir,
                            f"{self.transport}-{task.replace(':', '')}.{kind}")

    @property
    def pids(self):
        return {task: p.pid for task, p in self.procs.items()}

    def logs(self, tail_chars=4000):
        parts = []
        for task in self.procs:
            with open(self.path(task, "err")) as f:
                parts.append(f"--- {task} (pid {self.procs[task].pid})\n"
                             + f.read()[-tail_chars:])
        return "\n".join(parts)

    def stop(self, timeout=30):
        """SIGTERM (a clean shutdown removes the segments), SIGKILL after timeout."""
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        codes = {}
        for task, p in self.procs.items():
            try:
                codes[task] = p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
                codes[task] = "killed"
        return codes


def run_transport(transport, args, log_dir):
    """Starts the servers and the client for one transport; returns its raw doc.

    The client starts with the servers and imports TensorFlow while they
    start; it connects when the orchestrator writes the ready file.
    """
    env = task_env(transport, args.op_timeout, secrets.token_hex(16))
    servers = Servers(transport, env, log_dir)
    client_proc = None
    raw = None
    started = time.perf_counter()
    phases = {}  # seconds from the start: where a run's wall time goes
    out_path = os.path.join(log_dir, f"{transport}-client.json")
    ready_path = os.path.join(log_dir, f"{transport}-ready")
    try:
        log(f"{transport}: starting worker:0, worker:1 and the client "
            f"({args.steps} steps, a sample every {args.sample_every})")
        cmd = [sys.executable, os.path.abspath(__file__), "--client",
               "--transport", transport, "--steps", str(args.steps),
               "--sample-every", str(args.sample_every),
               "--progress-every", str(args.progress_every),
               "--op-timeout", str(args.op_timeout), "--path", args.path,
               "--out", out_path]
        for c in args.inject_corruption:
            cmd += ["--inject-corruption", c]
        servers_ok = servers.start_processes()
        cenv = dict(env, TF_CONFIG=json.dumps({"cluster": servers.cluster}),
                    SOAK_SERVER_PIDS=json.dumps(servers.pids),
                    SOAK_READY_FILE=ready_path)
        client_proc = ClientProcess(cmd, cenv, args.verbose)
        if not (servers_ok and servers.wait_ready()):
            print(servers.logs(), file=sys.stderr)
            return None
        with open(ready_path, "w") as f:
            f.write("ready\n")
        phases["servers_ready_s"] = round(time.perf_counter() - started, 1)
        status = client_proc.wait(args.timeout)
        phases["client_done_s"] = round(time.perf_counter() - started, 1)
        try:
            with open(out_path) as f:
                raw = json.load(f)
        except (OSError, ValueError):
            raw = None
        if status != 0 or raw is None or raw.get("error"):
            why = ("timed out" if status is None else f"exit status {status}")
            log(f"{transport}: client failed ({why}); servers' logs:")
            print(servers.logs(), file=sys.stderr)
        elif args.verbose:
            print(servers.logs(), file=sys.stderr)
        if raw is not None:
            raw["client_status"] = status
    finally:
        if client_proc is not None:
            client_proc.stop()
        pids = servers.pids
        codes = servers.stop()
        left = [n for n in os.listdir("/dev/shm")
                if any(n.startswith(f"tfrdma.{pid}.") for pid in pids.values())]
        if raw is not None:
            raw["server_exit"] = codes
            raw["segments_left_after_shutdown"] = left
            raw["wall_s"] = round(time.perf_counter() - started, 1)
            raw["phases_s"] = phases
    return raw


class ClientProcess:
    """The client (this script with --client); its progress lines go through."""

    def __init__(self, cmd, env, verbose):
        self.verbose = verbose
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, stdin=subprocess.DEVNULL, start_new_session=True,
            preexec_fn=die_with_parent)
        self.tail = collections.deque(maxlen=40)
        self.reader = threading.Thread(target=self._pump, daemon=True)
        self.reader.start()

    def _pump(self):
        for line in iter(self.proc.stdout.readline, ""):
            text = line.rstrip("\n")
            self.tail.append(text)
            if self.verbose or text.startswith(LOG_PREFIX):
                print(text, file=sys.stderr, flush=True)

    def wait(self, timeout):
        """Its exit status, or None when it ran past ``timeout`` (then killed)."""
        try:
            status = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            log(f"client: no end after {timeout:g} s; stopping it")
            self.stop()
            status = None
        self.reader.join(5)
        if status != 0 and not self.verbose:
            print("\n".join("    " + t for t in self.tail), file=sys.stderr)
        return status

    def stop(self):
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()


# --- the verdict ---


def warmup_step(steps, sample_every, warmup):
    """The step of the baseline sample: the first sample at or after warm-up."""
    if warmup is None:
        # At least one period of the dynamic sizes: the dynamic edge's
        # payload area reaches its final size (and last segment) within it.
        warmup = max(int(steps * DEFAULT_WARMUP_FRACTION), DYNAMIC_PERIOD)
    first = max(sample_every, -(-warmup // sample_every) * sample_every)
    return min(first, steps - steps % sample_every or steps)


def thread_name_changes(samples, name):
    """[{step, thread, delta}]: how each named thread count moved between samples."""
    changes = []
    previous = None
    for s in samples:
        names = s[name].get("thread_names")
        if names is None:
            return []
        if previous is not None:
            for thread in sorted(set(names) | set(previous)):
                delta = names.get(thread, 0) - previous.get(thread, 0)
                if delta:
                    changes.append({"step": s["step"], "thread": thread,
                                    "delta": delta})
        previous = names
    return changes


def evaluate(raw, args):
    """The pass criteria for one transport: returns (summary dict, [failures])."""
    failures = []
    samples = raw["samples"]
    steps_done = raw["steps_done"]
    mismatches = sum(raw["mismatch_counts"].values())
    if raw.get("error"):
        failures.append(f"the run failed: {raw['error']}")
    if steps_done < raw["steps_asked"]:
        failures.append(f"only {steps_done} of {raw['steps_asked']} steps ran")
    if mismatches:
        failures.append(f"{mismatches} mismatches: " + ", ".join(
            f"{k} {v}" for k, v in raw["mismatch_counts"].items() if v))
    base_step = warmup_step(raw["steps_asked"], raw["sample_every"], args.warmup)
    after = [s for s in samples if s["step"] >= base_step]
    per_task = {}
    if len(after) < 2:
        failures.append(f"fewer than 2 samples after the warm-up (step "
                        f"{base_step}): nothing to compare")
    for name in list(TASKS) + ["client"]:
        if not after:
            break
        base, last = after[0][name], after[-1][name]
        growth = last["rss_bytes"] - base["rss_bytes"]
        pct = 100.0 * growth / base["rss_bytes"]
        series = {k: [s[name][k] for s in after]
                  for k in ("fds", "threads", "shm_segments", "shm_bytes")}
        if all("thread_names" in s[name] for s in after):
            elastic = [sum(s[name]["thread_names"].get(t, 0)
                           for t in ELASTIC_THREAD_NAMES) for s in after]
            series["threads_elastic"] = elastic
            series["threads_fixed"] = [
                sum(s[name]["thread_names"].values()) - e
                for s, e in zip(after, elastic)]
        summary = {
            "rss_start_bytes": base["rss_bytes"], "rss_end_bytes": last["rss_bytes"],
            "rss_growth_bytes": growth, "rss_growth_pct": round(pct, 4),
            "rss_max_bytes": max(s[name]["rss_bytes"] for s in after),
            **{f"{k}_start": v[0] for k, v in series.items()},
            **{f"{k}_end": v[-1] for k, v in series.items()},
            **{f"{k}_range": [min(v), max(v)] for k, v in series.items()},
            "thread_changes": thread_name_changes(after, name),
        }
        per_task[name] = summary
        if name == "client":
            continue  # recorded, not judged (see the module docstring)
        if pct >= args.max_rss_growth:
            failures.append(f"{name}: RSS grew {pct:.2f}% ({growth / MiB:+.1f} "
                            f"MiB) from step {after[0]['step']} to "
                            f"{after[-1]['step']} (limit {args.max_rss_growth:g}%)")
        limits = {"fds": args.fd_slack, "shm_segments": 0, "shm_bytes": 0}
        if "threads_fixed" in series:
            limits.update(threads_fixed=0,
                          threads_elastic=args.elastic_thread_slack)
        else:  # samples without thread names: every thread exactly
            limits.update(threads=0)
        for key, slack in limits.items():
            v = series[key]
            if max(abs(x - v[0]) for x in v) > slack:
                why = ""
                if key.startswith("threads") and summary["thread_changes"]:
                    why = "; by name: " + ", ".join(
                        f"{c['thread']} {c['delta']:+d} at step {c['step']}"
                        for c in summary["thread_changes"][:6])
                failures.append(f"{name}: {key} not flat after warm-up: "
                                f"{v[0]} at step {after[0]['step']}, then "
                                f"{min(v)} to {max(v)} (allowed +-{slack})"
                                + why)
    post = [s for s in samples if s["step"] >= base_step]
    rate_post = None
    if len(post) >= 2:
        rate_post = (post[-1]["step"] - post[0]["step"]) / max(
            1e-9, post[-1]["elapsed_s"] - post[0]["elapsed_s"])
    run_s = raw["elapsed_s"] - raw["first_call_s"]
    summary = {
        "transport": raw["transport"], "steps": steps_done,
        "steps_asked": raw["steps_asked"], "sample_every": raw["sample_every"],
        "warmup_until_step": base_step, "mismatches": mismatches,
        "mismatch_counts": raw["mismatch_counts"],
        "first_mismatches": raw["mismatches"],
        "first_call_s": raw["first_call_s"], "elapsed_s": raw["elapsed_s"],
        "steps_per_s": round((steps_done - 1) / run_s, 1) if run_s > 0 else None,
        "steps_per_s_after_warmup": round(rate_post, 1) if rate_post else None,
        "per_process": per_task,
        "segments_left_after_shutdown": raw.get("segments_left_after_shutdown"),
        "pass": not failures, "failures": failures,
    }
    return summary, failures


# --- output ---


def machine_info():
    """The machine, as every bench records it, plus TensorFlow's version
    (read from the installed package: the orchestrator does not import it)
    and the size of /dev/shm."""
    info = report.machine_info()
    try:
        from importlib import metadata
        for dist in ("tensorflow-cpu", "tensorflow"):
            try:
                info["tensorflow"] = metadata.version(dist)
                break
            except metadata.PackageNotFoundError:
                continue
    except ImportError:
        pass
    try:
        st = os.statvfs("/dev/shm")
        info["dev_shm_bytes"] = st.f_blocks * st.f_frsize
    except OSError:
        pass
    return info


def plot(raw, summary, path):
    """RSS, fds, threads and /dev/shm bytes vs step; returns the path or None."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        log(f"no plot: matplotlib cannot be imported ({e}); install it "
            f"(it is in requirements-dev.txt) and redraw with --replot JSON")
        return None
    try:
        return _draw(plt, raw, summary, path)
    except Exception as e:  # noqa: BLE001 - the JSON is written; say why no plot
        log(f"no plot: drawing {path} failed: {type(e).__name__}: {e}")
        return None


def _draw(plt, raw, summary, path):
    """The figure of :func:`plot`."""
    samples = raw["samples"]
    steps = [s["step"] for s in samples]
    everyone = list(TASKS) + ["client"]
    # The client's RSS has its own panel: on the tasks' scale it would
    # flatten their lines.
    panels = [("rss_bytes", "tasks' RSS (MiB)", 1.0 / MiB, list(TASKS)),
              ("rss_bytes", "client's RSS (MiB)", 1.0 / MiB, ["client"]),
              ("fds", "open fds", 1, everyone),
              ("threads", "threads", 1, everyone),
              ("shm_bytes", "/dev/shm bytes of its segments (MiB)", 1.0 / MiB,
               everyone)]
    colors = {name: f"C{i}" for i, name in enumerate(everyone)}
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 12), sharex=True)
    for ax, (key, label, scale, names) in zip(axes, panels):
        for name in names:
            ax.plot(steps, [s[name][key] * scale for s in samples],
                    marker=".", label=name, color=colors[name],
                    linestyle="--" if name == "client" else "-")
        ax.axvline(summary["warmup_until_step"], color="grey", linewidth=0.8,
                   linestyle=":")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    axes[0].legend(loc="best", fontsize="small")
    axes[1].legend(loc="best", fontsize="small")
    axes[-1].set_xlabel("step (dotted line: end of warm-up)")
    verdict = "PASS" if summary["pass"] else "FAIL"
    fig.suptitle(f"tf_rdma soak over {raw['transport']}: {summary['steps']} "
                 f"steps, {summary['mismatches']} mismatches, {verdict}")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def replot(json_paths):
    """Draws the PNG of each soak JSON again, next to it; returns the exit status."""
    for path in json_paths:
        with open(path) as f:
            doc = json.load(f)
        raw = {"samples": doc["samples"], "transport": doc["config"]["transport"]}
        png = plot(raw, doc["summary"], os.path.splitext(path)[0] + ".png")
        if png is None:
            return 1
        print(f"wrote {shown_path(png)}")
    return 0


def print_summary(summary):
    """A short human summary of one transport."""
    t = summary["transport"]
    print(f"soak over {t}: {summary['steps']} steps in "
          f"{summary['elapsed_s']:.0f} s ({summary['steps_per_s']} steps/s; "
          f"first call {summary['first_call_s']:.1f} s), warm-up until step "
          f"{summary['warmup_until_step']}")
    print(f"  mismatches: {summary['mismatches']}")
    header = ("process", "RSS start", "RSS end", "growth", "fds", "threads",
              "segments", "shm MiB")
    rows = []
    for name, p in summary["per_process"].items():
        def span(key):
            lo, hi = p[f"{key}_range"]
            return f"{lo}" if lo == hi else f"{lo}..{hi}"
        rows.append((name, f"{p['rss_start_bytes'] / MiB:.1f} MiB",
                     f"{p['rss_end_bytes'] / MiB:.1f} MiB",
                     f"{p['rss_growth_pct']:+.2f}%", span("fds"),
                     span("threads"), span("shm_segments"),
                     f"{p['shm_bytes_end'] / MiB:.2f}"))
    widths = [max(len(str(r[i])) for r in rows + [header])
              for i in range(len(header))]
    for r in [header] + rows:
        print("  " + "  ".join(str(c).ljust(w) for c, w in zip(r, widths)))
    if summary.get("segments_left_after_shutdown"):
        print(f"  segments left after shutdown: "
              f"{summary['segments_left_after_shutdown']}")
    if summary["pass"]:
        print(f"  PASS: 0 mismatches, RSS growth under the limit, fds, threads "
              f"and segments flat after warm-up")
    else:
        for f in summary["failures"]:
            print(f"  FAIL: {f}")


def shown_path(path):
    """``path`` relative to the working directory when it is below it."""
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def orchestrate(args):
    """Runs every transport, judges, writes JSON and PNG; returns the exit status."""
    # SIGTERM unwinds like Ctrl-C: the finally blocks stop the servers.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    transports = ["shm", "tcp"] if args.transport == "both" else [args.transport]
    machine = machine_info()
    date = utc_now()
    out_dir = args.out_dir
    os.makedirs(out_dir, exist_ok=True)
    ok = True
    with tempfile.TemporaryDirectory(prefix="tf_rdma_soak_") as log_dir:
        for transport in transports:
            load_start = loadavg()
            raw = run_transport(transport, args, log_dir)
            if raw is None or not raw.get("samples"):
                print(f"soak over {transport}: FAIL: no results (see the "
                      f"log above)")
                ok = False
                continue
            summary, failures = evaluate(raw, args)
            ok = ok and not failures
            stem = f"soak-{transport}" + ("" if args.path == "rewrite"
                                          else f"-{args.path}")
            json_path = os.path.join(out_dir, stem + ".json")
            png_path = os.path.join(out_dir, stem + ".png")
            doc = {
                "bench": "soak", "date": date, "machine": machine,
                "config": {
                    "transport": transport, "steps": args.steps,
                    "sample_every": args.sample_every,
                    "warmup_until_step": summary["warmup_until_step"],
                    "max_rss_growth_pct": args.max_rss_growth,
                    "fd_slack": args.fd_slack, "op_timeout_s": args.op_timeout,
                    "elastic_thread_names": list(ELASTIC_THREAD_NAMES),
                    "elastic_thread_slack": args.elastic_thread_slack,
                    "inject_corruption": raw.get("corruptions"),
                    "edges": {"static_words": STATIC_WORDS,
                              "dynamic_max_words": DYNAMIC_MAX_WORDS,
                              "dynamic_period": DYNAMIC_PERIOD,
                              "back_words": BACK_WORDS,
                              "allreduce_words": ALLREDUCE_WORDS,
                              "dtype": "int64"},
                    "plan": raw.get("plan"), "pids": raw.get("pids"),
                    "server_exit": raw.get("server_exit"),
                    "loadavg_start": load_start,
                    "loadavg_end": loadavg(),
                    "wall_s": raw.get("wall_s"),
                    "phases_s": raw.get("phases_s"),
                    "command": " ".join([os.path.relpath(sys.argv[0], REPO)]
                                        + sys.argv[1:]),
                },
                "summary": summary,
                "samples": raw["samples"],
            }
            doc["plot"] = None
            write_json(json_path, doc, indent=1)  # first: a failing plot loses nothing
            if not args.no_plot:
                doc["plot"] = plot(raw, summary, png_path)
                write_json(json_path, doc, indent=1)
            print_summary(summary)
            print(f"  wrote {shown_path(json_path)}"
                  + (f" and {shown_path(doc['plot'])}" if doc["plot"] else ""))
    return 0 if ok else 1


def build_parser():
    parser = argparse.ArgumentParser(
        prog="python bench/soak.py",
        description="Soak test of tf_rdma: many steps of a rewritten "
                    "function (static and dynamic edges both ways, plus an "
                    "allreduce) between two local tasks, every tensor "
                    "checksummed, RSS/fds/threads//dev/shm sampled. Exit "
                    "status 0 when every transport passes.",
        epilog="Output: bench/results/soak-<transport>.json and .png. "
               "See the module docstring for the criteria.")
    parser.add_argument("--transport", choices=("shm", "tcp", "both"),
                        default="both", help="transport(s) to soak (default both)")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS,
                        help=f"steps per transport (default {DEFAULT_STEPS})")
    parser.add_argument("--sample-every", type=int, default=DEFAULT_SAMPLE_EVERY,
                        metavar="N", help=f"steps between resource samples "
                                          f"(default {DEFAULT_SAMPLE_EVERY})")
    parser.add_argument("--warmup", type=int, metavar="STEPS",
                        help="steps of warm-up before the baseline sample "
                             "(default 10%% of --steps, at least "
                             f"{DYNAMIC_PERIOD}, the dynamic edge's period; "
                             "rounded up to a sample)")
    parser.add_argument("--max-rss-growth", type=float,
                        default=DEFAULT_MAX_RSS_GROWTH_PCT, metavar="PCT",
                        help="largest RSS growth after warm-up that passes, "
                             f"percent (default {DEFAULT_MAX_RSS_GROWTH_PCT:g})")
    parser.add_argument("--fd-slack", type=int, default=DEFAULT_FD_SLACK,
                        metavar="N", help="fds may differ from their "
                                          "post-warm-up count by N (default 1)")
    parser.add_argument("--elastic-thread-slack", type=int,
                        default=DEFAULT_ELASTIC_THREAD_SLACK, metavar="N",
                        help="threads of pools that grow with load by design "
                             f"({', '.join(ELASTIC_THREAD_NAMES)}: gRPC's) may "
                             "differ from their post-warm-up count by N "
                             f"(default {DEFAULT_ELASTIC_THREAD_SLACK}); every "
                             "other thread must stay")
    parser.add_argument("--op-timeout", type=float, default=DEFAULT_OP_TIMEOUT_S,
                        metavar="S", help="TF_RDMA_TIMEOUT of every op "
                                          f"(default {DEFAULT_OP_TIMEOUT_S})")
    parser.add_argument("--timeout", type=float, metavar="S",
                        help="hard limit on one transport's client (default "
                             "300 s + 50 ms per step)")
    parser.add_argument("--out-dir", default=RESULTS_DIR, metavar="DIR",
                        help="where the JSON and PNG go (default bench/results)")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG")
    parser.add_argument("--progress-every", type=int, metavar="N",
                        help="steps between progress lines (default: 10 "
                             "samples)")
    parser.add_argument("--path", choices=("rewrite", "grpc"),
                        default="rewrite",
                        help="rewrite (default): the function under "
                             "@tf_rdma.rewrite; grpc: the same tf.function "
                             "without it (TensorFlow moves the edges, the "
                             "allreduce stays tf_rdma's), the reference for "
                             "what TensorFlow itself grows; results in "
                             "soak-<transport>-grpc.json")
    parser.add_argument("--inject-corruption", action="append", default=[],
                        metavar="STEP:EDGE",
                        help="for tests: the sender changes one word of EDGE's "
                             f"tensor ({', '.join(EDGE_KEYS)}) at STEP after "
                             "its checksum; the run must then report it")
    parser.add_argument("--replot", nargs="+", metavar="JSON",
                        help="only draw the PNG of each soak JSON again "
                             "(next to it), then exit")
    parser.add_argument("--verbose", action="store_true",
                        help="show the client's and the servers' output")
    parser.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    return parser


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.steps < 2 or args.sample_every < 1 or args.sample_every > args.steps:
        parser.error("--steps must be >= 2 and --sample-every in [1, --steps]")
    try:
        for c in args.inject_corruption:
            parse_corruption(c)
    except argparse.ArgumentTypeError as e:
        parser.error(str(e))
    if args.progress_every is None:
        args.progress_every = args.sample_every * 10
    if args.progress_every % args.sample_every:
        parser.error("--progress-every must be a multiple of --sample-every")
    if args.client:
        return client(args)
    if args.replot:
        return replot(args.replot)
    if args.timeout is None:
        args.timeout = 300 + 0.05 * args.steps
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
