#!/usr/bin/env python3
"""Allreduce benchmark: tf_rdma's collectives vs MultiWorkerMirroredStrategy
vs Open MPI, P local processes.

Usage::

    python bench/allreduce.py [--json PATH] [--sizes 1M 16M ...] [--ranks 2 4]
                              [--runs N] [--quick]

The script is its own orchestrator and never imports TensorFlow itself. For
every P in --ranks and every system it starts a fresh set of P processes
(this file again, in ``--worker`` mode), each with a hard time limit; the
processes sum a float32 tensor of every size across the P ranks and write
their per-call times to a file, which the orchestrator collects:

``tf_rdma-<algorithm>`` (one set of P processes for all algorithms)
    Every process runs ``tf_rdma.start_endpoint(task, cluster)`` (no
    TensorFlow server, no client) and calls
    ``tf_rdma.collectives.all_reduce(x, algorithm=A, name=...)`` inside a
    ``tf.function``, for A in ``tf_rdma.collectives.ALGORITHMS`` (read at
    run time) and auto. Each (algorithm, size) has its own instance name.
    ``TF_RDMA_TRANSPORT`` is passed on (shm by default on one host:
    ``auto``).
``tf_rdma-empty`` (the dispatch; in the same processes and loop)
    The same ``tf.function`` around ``all_reduce`` of ``tf.zeros([0])``
    (``tree``, 64-byte blocks), timed in every round next to the others: what
    calling a tf_rdma collective costs with no data to move (TensorFlow's op
    dispatch and the op's own bookkeeping), which Open MPI through mpi4py
    does not pay. Its entries have op ``dispatch``; ``size_bytes`` is the
    size of the round it was timed in. Never a candidate for "best tf_rdma".
``mwms-ring``
    ``tf.distribute.MultiWorkerMirroredStrategy`` with
    ``CommunicationImplementation.RING`` (TensorFlow's collectives over
    gRPC), ``TF_CONFIG`` set per process: a ``tf.function`` runs
    ``strategy.run`` of ``get_replica_context().all_reduce(SUM, x)``, which
    is how Keras sums gradients under that strategy (one
    ``CollectiveReduceV2``).
``openmpi``
    ``mpirun --allow-run-as-root --oversubscribe -n P`` of this file,
    ``comm.Allreduce(x, y, op=MPI.SUM)`` through mpi4py on numpy arrays
    (Open MPI picks its algorithm; on one host the data moves through its
    shared-memory transport, vader). Skipped, with the reason printed, when
    ``mpirun`` or mpi4py is missing.
``floor`` (the copy floor)
    The memcpy-bound cost of the bytes the bandwidth-optimal schedule
    (reduce-scatter + allgather, as ring does it) must move and add, for an
    out-of-place allreduce of n bytes whose input and output are each
    rank's private memory and whose ranks exchange through shared memory.
    Rank r owns chunk r (n/P bytes) of the result. Per rank, per call:

    1. writes the P-1 chunks of its input that others own into their
       owners' shared memory: (P-1)/P * n bytes copied;
    2. reduces its own chunk: P-1 adds of n/P bytes (each reads two
       operands and writes one), the first from its input and a peer's
       chunk into its output, so its reduced chunk lands in its output:
       (P-1)/P * n bytes added;
    3. writes its reduced chunk into every peer's shared memory:
       (P-1)/P * n bytes copied;
    4. copies the P-1 reduced chunks it received into its output:
       (P-1)/P * n bytes copied.

    So 3 (P-1)/P * n bytes of copies and (P-1)/P * n bytes of adds per rank
    (at P = 2 and 64 MiB: three 32 MiB copies and one 32 MiB add), every
    rank at the same time. The ``floor`` system is P processes (started
    like the others, so they share the cores and the memory bus the same
    way) doing exactly that with numpy: ``np.copyto`` for the copies and
    ``np.add(a, b, out=c)`` for the adds, on a numpy input and output and
    on inboxes mapped from files in /dev/shm (one per rank: P slots of
    ceil(n/P) elements, slot j for what rank j sends). The four steps run
    block by block (``--floor-block``, 1 MiB of every chunk at a time; 0:
    each step over whole chunks), as a pipelined schedule runs them, so
    that a block's sum is still in cache when it is sent. The ranks do not
    wait for each other between the steps (a schedule that moves data
    must, so the floor cannot be reached exactly), only for the sync
    before each timed call, a one-byte barrier over loopback TCP; so its
    output is not the sum and is not checked.

Timing, the same for every system: every rank builds its input once per
size, calls each variant twice as warm-up (the first call traces the
function and sets up the collective), then does --runs rounds (at least
SMALL_RUNS = 300 for sizes up to 1 MiB); up to 1 MiB every variant is timed
once in a round (variants interleaved, so a slow phase of the machine hits
them all), above it each variant's calls come in a block of their own, as
Open MPI's loop (see schedule()).
Before every timed call the ranks synchronise with a 4-byte allreduce of
the same system (``MPI_Barrier`` for Open MPI, the TCP barrier for the
floor), then each rank times its call until the result is there (for
TensorFlow the eager call of the ``tf.function`` returns when its output is
computed). The time of a run is the slowest rank's time (max over ranks:
the allreduce is done when every rank has the sum); ``median_s`` and
``min_s`` are over those per-run maxima. Rank 0's own median is kept as
``rank0_median_s``.

After the rounds, every variant of a size up to SMALL_SIZE (1 MiB) is also
timed back to back: BURSTS bursts of BURST_CALLS calls (after BURST_WARMUP
more), with the ranks' barrier only before each burst; per burst, each rank's
time / BURST_CALLS, and ``median_back_to_back_s`` is the median over the
bursts of the slowest rank's. A timed call after a barrier is charged how the
ranks left the barrier (where they outnumber the cores, which of them waits
for a core and which for a peer); a loop of calls pays what the calls cost
the cores.

Around every timed call each rank also reads its process's CPU time (every
thread's, ``time.process_time``). Per run, for the slowest rank:
``median_cpu_s`` is that CPU time, and ``median_off_cpu_s`` the time minus
it (at least that long none of the rank's threads was on a CPU: asleep
waiting for a peer, or waiting for a core that another process holds; near 0
where the ranks have cores of their own and do not wait for each other).

Every rank's input is ``(i mod 251) + rank`` at element i, so the sum is
exact in float32 and known; the output of the first and the last call of
every variant is compared element by element on every rank. A variant whose
op fails is dropped from that set of processes; one that gives a wrong
result keeps being called (so that the ranks stay in step) but is left out
of the results; both are reported.

After the tables come the check lines (printed, never asserted) of the
targets, each with the numbers, the ratio, the target and "met", "MISSED"
or "not measured", and where one is missed the bound the run has for it:

* 64 MiB, P = 2: best tf_rdma >= 5x ``mwms-ring`` and >= 1.2x Open MPI
  (the first targets);
* issue 17: 64 MiB, P = 2: best tf_rdma <= 1.3x the floor and >= 1.8x
  Open MPI; P = 4: >= 1.5x Open MPI; 1 MiB, P = 2 and 4: >= 1.5x Open MPI;
  4 KiB and 64 KiB, P = 2 and 4: best tf_rdma - dispatch <= Open MPI's
  time. The bounds: Open MPI / floor (how much faster than Open MPI a
  tf_rdma at the floor would be; from 8 MiB, where the engine streams a
  result's last copies and the floor's numpy copies do not, a tf_rdma call
  can come in a little under the floor, so there it is a reference, not a
  bound) and Open MPI / dispatch (a call costs at least its dispatch); at
  the small sizes, where each part of the call's time after the dispatch
  goes; the CPU and off-CPU times of the call, the
  empty call and Open MPI (where an empty call, which waits for no peer,
  spends longer off a CPU than Open MPI's whole call takes, the difference
  cannot resolve Open MPI's time); the same difference back to back; and,
  where every rank has a CPU, the exchange without TensorFlow (tf_rdma's
  oneshot driven from C, Open MPI's Allreduce from its loop, back to back,
  hot and with the L2 cache's bytes written before every call, as an op's
  dispatch leaves the caches), with the least a call through TensorFlow
  pays beyond its dispatch: that cooled exchange less the empty call's
  time in the engine.
  Where the ranks outnumber the CPUs (P = 4 on 2), first the least the
  difference can be with an exchange that costs nothing: every rank's way
  into the op runs inside the first rank's call, so that call takes at
  least (P x the empty call's way in + its way back) / CPUs, while the
  dispatch taken off is one rank's (``_shared_cpus_bound``); and for the
  speedups over Open MPI there, the least a call can take with every
  rank's way in and the floor's copies and adds on the shared CPUs.
"""

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time

from _harness.children import (REPO, add_bind_argument, add_local_cluster,
                               add_process_arguments, make_tf_rdma_job,
                               run_processes, work_dir, worker_env)
from _harness.report import (Run, print_table, result_entry, save_json,
                             slowest_rank, verdict)
from _harness.units import KiB, MiB, human_size, human_time, parse_size
from _harness.worker import (MWMS, group_cluster, mwms_ring,
                             set_tf_config)

DEFAULT_SIZES = (4 * KiB, 64 * KiB, MiB, 16 * MiB, 64 * MiB, 256 * MiB)
QUICK_SIZES = (4 * KiB, MiB, 64 * MiB)
DEFAULT_RANKS = (2, 4)
QUICK_RANKS = (2,)
DEFAULT_RUNS = 10
QUICK_RUNS = 3
WARMUP = 2
#: Messages up to this size get at least SMALL_RUNS timed rounds: a call
#: costs well under a millisecond, and their medians move by 100 µs from run
#: to run on a 2-vCPU machine with a handful of rounds. The 4 KiB target
#: is a difference of two medians of about 110 µs that must come within
#: Open MPI's 4 µs: with 50 rounds it moved from 1.2 to 6.5 µs in six runs
#: (P = 2, 2026-12-06 09:58 to 10:06), with 300 from 1.4 to 4.8 µs in five
#: (10:06 to 10:08).
SMALL_SIZE = 1 << 20
SMALL_RUNS = 300
#: After its rounds, every variant of a size up to SMALL_SIZE is also timed
#: back to back: BURSTS bursts (after BURST_WARMUP more) of BURST_CALLS
#: calls each, the ranks synchronised only before a burst.
BURSTS = 5
BURST_WARMUP = 1
BURST_CALLS = 50
#: At the small sizes (DISPATCH_SIZES, where P <= the CPUs) the
#: exchange is also timed without TensorFlow: tf_rdma's LOOP_ALGORITHM
#: driven from C (tfrdma_allreduce_loop) and Open MPI's Allreduce from its
#: Python loop, LOOP_ROUNDS rounds of LOOP_CALLS calls back to back, each
#: round once "hot" (nothing between the calls) and once "cooled" (the L2
#: cache's bytes written before every call, as an op's dispatch through
#: TensorFlow leaves the caches).
LOOP_ALGORITHM = "oneshot"
LOOP_CALLS = 1000
LOOP_ROUNDS = 3
LOOP_MODES = ("hot", "cooled")



def _tf_rdma_algorithms():
    """``tf_rdma.collectives.ALGORITHMS`` of the checkout bench/ is in.

    Importing it is cheap: tf_rdma.collectives imports TensorFlow only when
    a collective is made. The checkout goes first on ``sys.path``, as on the
    workers' PYTHONPATH, so that the orchestrator offers the algorithms the
    workers have. Empty (and tf_rdma is then skipped with the reason) when
    it cannot be imported.
    """
    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    try:
        from tf_rdma.collectives import ALGORITHMS as found
    except Exception:  # noqa: BLE001 -- _tf_rdma_missing says why
        return ()
    return tuple(found)


# tf_rdma's explicit algorithms, then "auto" (the cost model's choice).
ALGORITHMS = _tf_rdma_algorithms() + ("auto",)
FLOOR = "floor"
SYSTEM_KINDS = ("tf_rdma", "mwms", "mpi", FLOOR)
OPENMPI = "openmpi"
DISPATCH = "tf_rdma-empty"  # all_reduce of tf.zeros([0]): the dispatch
OP = "allreduce"
DISPATCH_OP = "dispatch"
# What config.floor and config.dispatch of the JSON say.
FLOOR_DEFINITION = (
    "per rank, concurrently on P processes: 3 (P-1)/P n bytes of np.copyto "
    "(its input's chunks into peers' /dev/shm inboxes, its reduced chunk "
    "into theirs, their reduced chunks into its output) and (P-1)/P n bytes "
    "of np.add(a, b, out=c) (its own chunk), the four steps block by block "
    "(config.floor_block bytes of every chunk at a time; 0: whole chunks); "
    "no waits between the steps; time = slowest rank after a TCP barrier")
DISPATCH_DEFINITION = (
    "tf_rdma-empty: all_reduce of tf.zeros([0]) (tree, 64-byte blocks) in "
    "a tf.function, timed in the same rounds as the algorithms")
SHM_DIR = "/dev/shm"  # where the floor's ranks map their inboxes
# The part of the floor's work per rank that the other ranks must have done
# before a rank can end: all but their last step (a copy of the chunks they
# received into their own output), one of four steps of equal bytes of
# which one is an add, so at most a quarter of the work.
FLOOR_NEEDED_BY_PEERS = 0.75
MOD = 251  # the inputs are (i mod MOD) + rank: exact sums in float32

LOG_PREFIX = "[allreduce] "

# The first targets, at 64 MiB and P = 2; printed, never asserted.
TARGET_VS_MWMS = 5.0
TARGET_VS_MPI = 1.2
# Issue 17's targets (printed, never asserted): best tf_rdma at most
# TARGET_FLOOR x the floor at 64 MiB, P = 2; at least x Open MPI per
# (size, P); best tf_rdma - dispatch at most Open MPI's time at the small
# sizes.
TARGET_FLOOR = 1.3
TARGETS_VS_MPI = {(64 * MiB, 2): 1.8, (64 * MiB, 4): 1.5,
                  (MiB, 2): 1.5, (MiB, 4): 1.5}
DISPATCH_SIZES = (4 * KiB, 64 * KiB)
DISPATCH_RANKS = (2, 4)
# What the issue measured on its machine, printed next to the verdict.
REFERENCE = {MWMS: 0.212, OPENMPI: 0.037}


def log(message):
    print(LOG_PREFIX + message, file=sys.stderr, flush=True)


def system_names(kind, algorithms):
    if kind == "tf_rdma":
        return [f"tf_rdma-{a}" for a in algorithms]
    return [{"mwms": MWMS, "mpi": OPENMPI, FLOOR: FLOOR}[kind]]


# --- worker (one rank of one system) ---


def schedule(size, names, calls):
    """The order of a size's timed calls: ``(call index, variant)`` pairs.

    Up to SMALL_SIZE the variants take turns, one call each per round, so
    that a slow phase of the machine hits them all: their differences are
    µs, which a drift between blocks of calls would blur, and all their
    buffers fit in the caches together. Above it each variant makes all its
    calls in a block of its own, as Open MPI's loop does: taking turns,
    each call would find the caches full of the other variants' results
    (one of the size per variant and rank), which no loop of one
    collective pays (on a VM with a 300 MiB L3, ring at 64 MiB and P = 2
    took 12.1 ms among four algorithms and 9.9 to 10.5 ms alone).
    """
    if size <= SMALL_SIZE:
        return [(r, name) for r in range(calls) for name in names]
    return [(r, name) for name in names for r in range(calls)]


def rounds(size, runs):
    """Timed rounds for a message of ``size`` bytes: ``runs``, and at least
    SMALL_RUNS up to SMALL_SIZE."""
    return max(runs, SMALL_RUNS) if size <= SMALL_SIZE else runs


def cache_bytes(level=2, default=MiB):
    """The size of CPU 0's level-``level`` data or unified cache (sysfs);
    ``default`` where the kernel does not say."""
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for index in sorted(os.listdir(base)):
            def read(key):
                with open(os.path.join(base, index, key)) as f:
                    return f.read().strip()
            if read("level") == str(level) and read("type") != "Instruction":
                return parse_size(read("size"))
    except (OSError, ValueError, argparse.ArgumentTypeError):
        pass
    return default


class _Rank:
    """What every system's worker shares: inputs, checks, the timing loop."""

    def __init__(self, args, rank, nranks, system):
        self.args = args
        self.rank = rank
        self.nranks = nranks
        self.system = system
        self.doc = {"system": system, "rank": rank, "P": nranks,
                    "pid": os.getpid(), "info": {}, "times": {},
                    "waits": {}, "starts": {}, "inside": {}, "cpu": {},
                    "back_to_back": {}, "back_to_back_errors": {},
                    "loop": {}, "loop_errors": {},
                    "errors": {}, "done": False}
        self.path = os.path.join(args.out, f"{system}.rank{rank}.json")

    def save(self):
        save_json(self.path, self.doc)

    def inputs(self, size):
        import numpy as np
        n = size // 4
        base = (np.arange(n, dtype=np.int32) % MOD).astype(np.float32)
        x = base + np.float32(self.rank)
        p = self.nranks
        base *= np.float32(p)
        base += np.float32(p * (p - 1) // 2)  # sum over ranks of rank
        return x, base  # the input and the expected sum

    def run(self, variants_for_size, sync, expected_for=None, probe=None):
        """Times every variant at every size; saves the times.

        Args:
          variants_for_size: ``(size, x) -> {name: call}``; ``call()``
            returns the variant's result.
          sync: Called before every timed call and every burst: the ranks'
            barrier.
          expected_for: ``(name, expected) -> array or None``: what the
            result of variant ``name`` must equal, given the sum
            (``expected``); None: not checked. Default: the sum.
          probe: ``() -> dict or None``, read after each timed call: the
            engine's last collective call
            (``tf_rdma.stats()["last_collective"]``). Where it is the timed
            call (admitted and ended within the caller's readings around
            it), its wait for peers and its admission and end on the
            caller's clock are saved next to its time. Never read between
            the barrier and the call: where the ranks share CPUs, a read
            there would hold a CPU that a peer's call needs (at P = 4 on 2
            vCPUs it added about 200 us to a 4 KiB call). None: neither is
            recorded.
        """
        import numpy as np
        for size in self.args.sizes:
            x, expected_sum = self.inputs(size)
            variants = variants_for_size(size, x)
            expect = {name: (expected_for(name, expected_sum) if expected_for
                             else expected_sum) for name in variants}
            times = {name: [] for name in variants}
            waits = {name: [] for name in variants}
            starts = {name: [] for name in variants}
            inside = {name: [] for name in variants}
            cpu = {name: [] for name in variants}

            def error(name, message):
                self.doc["errors"].setdefault(name, {})[str(size)] = message
                print(f"{LOG_PREFIX}rank {self.rank}: {name} at "
                      f"{human_size(size)}: {message}", file=sys.stderr,
                      flush=True)

            runs = rounds(size, self.args.runs)
            for r, name in schedule(size, list(variants), WARMUP + runs):
                if name in variants:
                    try:
                        sync()
                        c0 = time.process_time()
                        t0 = time.perf_counter()
                        y = variants[name]()
                        t1 = time.perf_counter()
                        c1 = time.process_time()
                    except Exception as err:  # noqa: BLE001 -- reported
                        # The op failed (the peers' calls fail too): the
                        # variant is dropped on this rank.
                        error(name, f"{type(err).__name__}: {err}"[:2000])
                        del variants[name]
                        times.pop(name)
                        waits.pop(name)
                        starts.pop(name)
                        inside.pop(name)
                        cpu.pop(name)
                        continue
                    dt = t1 - t0
                    last = probe() if probe else None
                    expected = expect[name]
                    if expected is not None and (
                            r == 0 or r == WARMUP + runs - 1):
                        got = np.asarray(y).reshape(-1)
                        # A wrong result is reported (and left out of the
                        # results), but still called, so that the ranks
                        # stay in step.
                        if got.shape != expected.shape:
                            error(name, f"wrong result: {got.size} "
                                        f"elements, expected "
                                        f"{expected.size}")
                        elif not np.array_equal(got, expected):
                            bad = int(np.argmax(got != expected))
                            error(name, f"wrong result: element {bad} is "
                                        f"{float(got[bad])}, expected "
                                        f"{float(expected[bad])}")
                        del got
                    del y
                    if r >= WARMUP:
                        times[name].append(dt)
                        # perf_counter is CLOCK_MONOTONIC on Linux: one
                        # clock for every process of the host.
                        starts[name].append(t0)
                        cpu[name].append(c1 - c0)
                        if last and t0 <= last["began"] <= \
                                last["ended"] <= t1:
                            waits[name].append(last["waited"])
                            inside[name].append([last["began"],
                                                 last["ended"]])
            for name, ts in times.items():
                self.doc["times"].setdefault(name, {})[str(size)] = ts
                if waits[name] and len(waits[name]) == len(ts):
                    self.doc["waits"].setdefault(name, {})[str(size)] = \
                        waits[name]
                self.doc["starts"].setdefault(name, {})[str(size)] = \
                    starts[name]
                self.doc["cpu"].setdefault(name, {})[str(size)] = cpu[name]
                if len(inside[name]) == len(ts):
                    self.doc["inside"].setdefault(name, {})[str(size)] = \
                        inside[name]
            self.save()  # partial results survive a later timeout
            if size <= SMALL_SIZE:
                self._back_to_back(size, variants, sync)
                self.save()
            del variants, x, expected_sum, expect
        self.doc["done"] = True
        self.save()

    def _back_to_back(self, size, variants, sync):
        """Times bursts of calls with no barrier between them.

        A timed call after a barrier is charged how the ranks leave the
        barrier; where they outnumber the cores, that decides which of the
        ranks' calls waits for a core and which for a peer. A loop of
        calls (a training loop's) pays instead what the calls cost the
        cores; a burst measures that: per call, its time / BURST_CALLS.

        A call that fails ends the size's bursts on this rank (its peers'
        calls fail or time out too, and the ranks would no longer meet in
        the same barrier); the error is kept in ``back_to_back_errors``
        and printed, and the rounds' times stand.
        """
        for name, call in variants.items():
            per_call = []
            try:
                for b in range(BURST_WARMUP + BURSTS):
                    sync()
                    t0 = time.perf_counter()
                    for _ in range(BURST_CALLS):
                        call()
                    if b >= BURST_WARMUP:
                        per_call.append(
                            (time.perf_counter() - t0) / BURST_CALLS)
            except Exception as err:  # noqa: BLE001 -- reported
                message = f"{type(err).__name__}: {err}"[:2000]
                self.doc["back_to_back_errors"].setdefault(
                    name, {})[str(size)] = message
                print(f"{LOG_PREFIX}rank {self.rank}: {name} at "
                      f"{human_size(size)} back to back: {message}",
                      file=sys.stderr, flush=True)
                return
            self.doc["back_to_back"].setdefault(name, {})[str(size)] = \
                per_call

    def loops(self, name, loop, sync):
        """Times the exchange alone at the small sizes (LOOP_CALLS).

        Args:
          name: The system the loop's times go with in the results.
          loop: ``(size, cool_bytes, calls) -> (starts, ends)``: ``calls``
            calls back to back, ``cool_bytes`` written before each, and
            each call's start and end (CLOCK_MONOTONIC seconds, the clock
            of ``time.perf_counter``).
          sync: The ranks' barrier, before every loop.

        Only with ``--loops``, which the orchestrator passes where the
        ranks have a CPU each: where they share CPUs a loop measures who
        waits for a core. A loop that fails ends the loops on this rank
        (kept in ``loop_errors`` and printed).
        """
        if not self.args.loops:
            return
        cool = cache_bytes()
        for size in self.args.sizes:
            if size not in DISPATCH_SIZES:
                continue
            found = {mode: {"starts": [], "ends": [], "cool_bytes": cool_bytes}
                     for mode, cool_bytes in zip(LOOP_MODES, (0, cool))}
            try:
                for _ in range(LOOP_ROUNDS):
                    for times in found.values():
                        sync()
                        starts, ends = loop(size, times["cool_bytes"],
                                            LOOP_CALLS)
                        times["starts"] += starts
                        times["ends"] += ends
            except Exception as err:  # noqa: BLE001 -- reported
                message = f"{type(err).__name__}: {err}"[:2000]
                self.doc["loop_errors"].setdefault(name, {})[str(size)] = \
                    message
                print(f"{LOG_PREFIX}rank {self.rank}: {name} at "
                      f"{human_size(size)} without TensorFlow: {message}",
                      file=sys.stderr, flush=True)
                return
            self.doc["loop"].setdefault(name, {})[str(size)] = found
            self.save()


def worker_tf_rdma(args):
    import numpy as np
    import tensorflow as tf

    import tf_rdma
    import tf_rdma.collectives as C

    cluster = group_cluster()
    rank, nranks = args.rank, args.nranks
    me = _Rank(args, rank, nranks, "tf_rdma")
    me.doc["info"] = {"tensorflow": tf.__version__,
                      "tf_rdma": getattr(tf_rdma, "__version__", "?"),
                      "transport": os.environ.get("TF_RDMA_TRANSPORT",
                                                  "auto")}
    me.save()
    tf_rdma.start_endpoint(f"/job:worker/task:{rank}", cluster)

    one = tf.zeros([1], tf.float32)

    # The barrier lets every rank go at once, as MPI_Barrier does: a oneshot
    # allreduce, where each rank writes to every other and leaves when all
    # have written (on the op's thread, the inline path). A tree barrier
    # lets the root go one hop and an engine thread's wake-up before the
    # others, a skew (5 to 10 us at P = 2) the timed call would be charged.
    @tf.function
    def barrier(t):
        return C.all_reduce(t, name="bench_sync", algorithm="oneshot",
                            block_bytes=64)

    def sync():
        barrier(one).numpy()

    def make(alg, size):
        name = f"bench_allreduce_{alg}_{size}"

        @tf.function(autograph=False)
        def fn(t):
            return C.all_reduce(t, algorithm=alg, name=name,
                                block_bytes=args.block_bytes)
        return fn

    empty = tf.zeros([0], tf.float32)

    def make_empty(size):
        # The dispatch: the same function and call as a variant, with no
        # data (tree with small blocks: the cost model has no choice to make
        # for 0 bytes).
        name = f"bench_allreduce_empty_{size}"

        @tf.function(autograph=False)
        def fn(t):
            return C.all_reduce(t, algorithm="tree", name=name,
                                block_bytes=64)
        return fn

    def variants_for_size(size, x_np):
        x = tf.constant(x_np)
        out = {}
        for alg in args.algorithms:
            fn = make(alg, size)
            out[f"tf_rdma-{alg}"] = lambda fn=fn: fn(x)
        fn = make_empty(size)
        out[DISPATCH] = lambda: fn(empty)
        return out

    def expected_for(name, expected):
        return np.zeros([0], np.float32) if name == DISPATCH else expected

    sync()
    if args.calibrate and hasattr(C, "calibrate"):
        # What "auto" decides with: rank 0's measured alpha, beta, gamma.
        params = C.calibrate()
        me.doc["info"]["auto_params"] = {
            k: getattr(params, k) for k in ("alpha", "beta", "gamma")}
    if "auto" in args.algorithms:
        try:
            from tf_rdma.collectives import cost
            me.doc["info"]["auto_choice"] = {
                str(size): list(cost.choose("allreduce", size, nranks,
                                            C.model_params()))
                for size in args.sizes}
        except Exception as err:  # noqa: BLE001 -- informational only
            me.doc["info"]["auto_choice"] = f"unknown ({err})"
    me.save()

    def probe():
        # Its "waited" is the busy clocks' growth over the call: the time
        # at least one of its data waits was in progress, plus the same for
        # its credit waits. The summed waits would count a oneshot's
        # concurrent waits for its P - 1 peers each.
        return tf_rdma.stats()["last_collective"]

    me.run(variants_for_size, sync, expected_for, probe)
    if LOOP_ALGORITHM in args.algorithms:
        me.loops(f"tf_rdma-{LOOP_ALGORITHM}",
                 _engine_loop(C.default_group().tasks, rank), sync)


def _engine_loop(tasks, rank):
    """tf_rdma's exchange without TensorFlow (:meth:`_Rank.loops`' loop):
    LOOP_ALGORITHM's allreduce (sum) of ones, driven from C by the op
    library's ``tfrdma_allreduce_loop``, which checks the last result."""
    import ctypes

    from tf_rdma import _loader

    run = _loader.load().c.tfrdma_allreduce_loop
    group = "\n".join(tasks).encode()

    def loop(size, cool_bytes, calls):
        times = (ctypes.c_int64 * (2 * calls))()
        err = ctypes.create_string_buffer(1024)
        code = run(group, rank, LOOP_ALGORITHM.encode(), size // 4, size,
                   calls, cool_bytes, times, err, len(err))
        if code:
            raise RuntimeError(f"tfrdma_allreduce_loop failed (code {code}): "
                               f"{err.value.decode(errors='replace')}")
        return ([t / 1e9 for t in times[0::2]],
                [t / 1e9 for t in times[1::2]])
    return loop


def worker_mwms(args):
    import tensorflow as tf

    rank, nranks = args.rank, args.nranks
    set_tf_config(group_cluster(), rank)
    me = _Rank(args, rank, nranks, "mwms")
    me.doc["info"] = {"tensorflow": tf.__version__}
    me.save()
    strategy = mwms_ring(tf)
    if strategy.num_replicas_in_sync != nranks:
        raise SystemExit(f"MWMS has {strategy.num_replicas_in_sync} "
                         f"replicas, expected {nranks}")

    def make():
        @tf.function(autograph=False)
        def fn(t):
            def replica_fn(v):
                # An op made here gets the replica's device (the strategy
                # needs one; the function's argument has none), and
                # Identity hands its input buffer on without a copy.
                v = tf.identity(v)
                return tf.distribute.get_replica_context().all_reduce(
                    tf.distribute.ReduceOp.SUM, v)
            return strategy.run(replica_fn, args=(t,))
        return fn

    barrier = make()
    one = tf.zeros([1], tf.float32)

    def sync():
        barrier(one).numpy()

    def variants_for_size(size, x_np):
        x = tf.constant(x_np)
        fn = make()
        return {MWMS: lambda: fn(x)}

    sync()
    me.run(variants_for_size, sync)


def worker_mpi(args):
    import numpy as np
    from mpi4py import MPI

    import mpi4py

    comm = MPI.COMM_WORLD
    me = _Rank(args, comm.Get_rank(), comm.Get_size(), "mpi")
    me.doc["info"] = {"mpi4py": mpi4py.__version__,
                      "mpi": MPI.Get_library_version().splitlines()[0]
                      .strip().strip("\0")}
    me.save()

    def variants_for_size(size, x):
        y = np.empty_like(x)

        def call():
            comm.Allreduce(x, y, op=MPI.SUM)
            return y
        return {OPENMPI: call}

    def loop(size, cool_bytes, calls):
        # The Python loop a user of mpi4py writes; a numpy write to every
        # 64-byte line of the cooling buffer before each call.
        x = np.ones(size // 4, np.float32)
        y = np.empty_like(x)
        lines = np.zeros(cool_bytes, np.uint8)[::64]
        starts, ends = [], []
        for _ in range(calls):
            if cool_bytes:
                lines += 1
            t0 = time.perf_counter()
            comm.Allreduce(x, y, op=MPI.SUM)
            ends.append(time.perf_counter())
            starts.append(t0)
        if not np.all(y == comm.Get_size()):
            raise RuntimeError(f"wrong sum: {y[:4]}..., expected "
                               f"{comm.Get_size()} everywhere")
        return starts, ends

    comm.Barrier()
    me.run(variants_for_size, comm.Barrier)
    me.loops(OPENMPI, loop, comm.Barrier)
    comm.Barrier()


class _TcpBarrier:
    """A barrier of P processes over loopback TCP (the floor's sync).

    Rank 0 listens on ``address`` and keeps one connection per other rank;
    a barrier is one byte from every other rank to rank 0, then one byte
    back to each.
    """

    def __init__(self, rank, nranks, address, timeout=120.0):
        import socket
        host, port = address.rsplit(":", 1)
        self.rank = rank
        self.peers = []
        if rank == 0:
            with socket.create_server((host, int(port)),
                                      backlog=nranks) as server:
                server.settimeout(timeout)
                for _ in range(nranks - 1):
                    conn, _ = server.accept()
                    self.peers.append(conn)
        else:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    conn = socket.create_connection((host, int(port)),
                                                    timeout=timeout)
                    break
                except ConnectionRefusedError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)  # rank 0 is not listening yet
            self.peers.append(conn)
        for conn in self.peers:
            conn.settimeout(timeout)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    @staticmethod
    def _recv1(conn):
        if not conn.recv(1):
            raise ConnectionError("a rank of the floor closed its barrier "
                                  "connection (it exited)")

    def __call__(self):
        if self.rank == 0:
            for conn in self.peers:
                self._recv1(conn)
            for conn in self.peers:
                conn.sendall(b"g")
        else:
            self.peers[0].sendall(b"a")
            self._recv1(self.peers[0])

    def close(self):
        for conn in self.peers:
            conn.close()


def _map_inbox(path, nbytes, create):
    """A float32 numpy array over the /dev/shm file ``path`` (made if
    ``create``, of ``nbytes``)."""
    import mmap

    import numpy as np
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            os.ftruncate(fd, nbytes)
        mm = mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)  # the mapping keeps the file's memory
    return np.frombuffer(mm, dtype=np.float32)


def worker_floor(args):
    """One rank of the copy floor: the memory work of a ring allreduce."""
    import numpy as np

    rank, nranks = args.rank, args.nranks
    me = _Rank(args, rank, nranks, FLOOR)
    me.doc["info"] = {"numpy": np.__version__}
    me.save()
    barrier = _TcpBarrier(rank, nranks, group_cluster()["worker"][0])
    # Rank r's inbox: P slots of ceil(n/P) elements for the largest n;
    # slot j holds what rank j writes there (a chunk of its input, then its
    # reduced chunk).
    slot = -(-max(args.sizes) // 4 // nranks)
    paths = [os.path.join(SHM_DIR, f"{args.shm_prefix}.{j}")
             for j in range(nranks)]
    mine = _map_inbox(paths[rank], nranks * slot * 4, create=True)
    barrier()  # every inbox exists
    inbox = [mine if j == rank else
             _map_inbox(paths[j], nranks * slot * 4, create=False)
             for j in range(nranks)]
    inbox = [a.reshape(nranks, slot) for a in inbox]
    barrier()  # every rank has mapped every inbox: the files can go
    os.unlink(paths[rank])
    peers = [j for j in range(nranks) if j != rank]

    def variants_for_size(size, x):
        n = x.size
        start = [j * n // nranks for j in range(nranks + 1)]
        length = [start[j + 1] - start[j] for j in range(nranks)]
        out = np.empty_like(x)
        step = args.floor_block // 4 or max(length)
        # The four steps, block by block: [b, b + step) of every chunk at a
        # time, the steps of a block one after the other, as a pipelined
        # schedule runs them. The views are made here, not in the call.
        steps = []
        for b in range(0, max(length), step):
            def part(j, b=b):
                e = max(b, min(length[j], b + step))
                return slice(b, e), slice(start[j] + b, start[j] + e)
            parts = [part(j) for j in range(nranks)]
            in_slot, own = parts[rank]
            # 1. Scatter: my input's part of chunk j into rank j's inbox,
            #    my slot.
            steps += [(np.copyto, inbox[j][rank, parts[j][0]],
                       x[parts[j][1]]) for j in peers]
            # 2. Reduce my chunk's part: P-1 adds into my output, the first
            #    from my input.
            first = x[own]
            for j in peers:
                steps.append((np.add, first, inbox[rank][j, in_slot],
                              out[own]))
                first = out[own]
            # 3. Allgather: my reduced part into every peer's inbox.
            steps += [(np.copyto, inbox[j][rank, in_slot], out[own])
                      for j in peers]
            # 4. The peers' reduced parts from my inbox into my output.
            steps += [(np.copyto, out[parts[j][1]],
                       inbox[rank][j, parts[j][0]]) for j in peers]

        def call():
            for op, *operands in steps:
                op(*operands)
            return out
        return {FLOOR: call}

    barrier()
    # The ranks do not wait for each other between the steps: the output is
    # not the sum, and is not checked.
    me.run(variants_for_size, barrier, lambda name, expected: None)
    barrier()
    barrier.close()


def worker_main(args):
    return {"tf_rdma": worker_tf_rdma, "mwms": worker_mwms,
            "mpi": worker_mpi, FLOOR: worker_floor}[args.worker](args) or 0


# --- orchestrator ---


def _tf_rdma_missing():
    """Why tf_rdma's collectives cannot run here, or None.

    Asked of a child process, as the workers will meet it: the orchestrator
    itself never loads TensorFlow (whose start-up notices would be the
    first lines a reader sees).
    """
    probe = subprocess.run(
        [sys.executable, "-c", _TF_RDMA_PROBE], cwd=REPO, env=worker_env(),
        capture_output=True, text=True, timeout=300)
    if probe.returncode == 0:
        return probe.stdout.strip() or None
    return (f"import tf_rdma failed: "
            f"{(probe.stderr.strip().splitlines() or ['?'])[-1][-300:]}")


# Prints why tf_rdma's collectives are missing (nothing: they are there).
_TF_RDMA_PROBE = """
import importlib.util
import tf_rdma.ops  # loads the op library (and TF)
spec = importlib.util.find_spec("tf_rdma.collectives")
if spec is None:
    print("tf_rdma.collectives does not exist in this checkout")
elif "def all_reduce" not in open(spec.origin).read():
    print("tf_rdma.collectives has no all_reduce yet")
"""


def _mpi_missing():
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        return ("mpirun not found (Debian: apt-get install openmpi-bin "
                "libopenmpi-dev)")
    probe = subprocess.run(
        [sys.executable, "-c", "import mpi4py; print(mpi4py.__version__)"],
        capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:
        return (f"mpi4py not importable by {sys.executable} "
                f"(pip install mpi4py): {probe.stderr.strip()[-300:]}")
    return None


def run_group(kind, nranks, args, workdir):
    """Runs one system's P processes; returns (per-rank docs, failure)."""
    out = os.path.join(workdir, f"{kind}-P{nranks}")
    os.makedirs(out)
    env = worker_env()
    worker = [sys.executable, os.path.abspath(__file__), "--worker", kind,
              "--nranks", str(nranks), "--runs", str(args.runs),
              "--out", out, "--sizes"] + [str(s) for s in args.sizes]
    if kind == "tf_rdma":
        worker += ["--algorithms"] + list(args.algorithms)
        if not args.calibrate:
            worker.append("--no-calibrate")
        if args.block_bytes:
            worker += ["--block-bytes", str(args.block_bytes)]
    if kind in ("tf_rdma", "mpi") and \
            nranks <= len(os.sched_getaffinity(0)):
        worker.append("--loops")  # a CPU per rank: time the exchange alone
    shm_prefix = f"tf_rdma_bench_floor_{os.getpid()}_P{nranks}"
    if kind == FLOOR:
        worker += ["--shm-prefix", shm_prefix, "--floor-block",
                   str(args.floor_block)]
    if kind == "mpi":
        cmds = [["mpirun", "--allow-run-as-root", "--oversubscribe",
                 "-n", str(nranks)] + worker]
    else:
        add_local_cluster(env, nranks, log)
        if kind == "tf_rdma":
            make_tf_rdma_job(env, args.transport)
        cmds = [worker + ["--rank", str(r)] for r in range(nranks)]
    try:
        # mpirun binds its own ranks (one core each where P <= cores);
        # the others are bound the same way unless --bind none.
        return run_processes(f"{kind} P={nranks}", cmds, env, out,
                             args.timeout, log, args.verbose,
                             bind=kind != "mpi" and args.bind == "auto")
    finally:
        if kind == FLOOR:  # what a rank that failed early left behind
            for r in range(nranks):
                try:
                    os.unlink(os.path.join(SHM_DIR, f"{shm_prefix}.{r}"))
                except FileNotFoundError:
                    pass


def combine(docs, nranks):
    """Per-rank times -> results (per run: the max over ranks)."""
    results, errors = [], []
    seen = set()
    for doc in docs:
        for name, by_size in doc["errors"].items():
            for size, message in by_size.items():
                if (name, size) not in seen:
                    seen.add((name, size))
                    errors.append({"system": name, "size_bytes": int(size),
                                   "P": nranks, "rank": doc["rank"],
                                   "error": message})
        # Reported, but the rounds' times of the variant stand.
        for key, what in (("back_to_back_errors", "back to back"),
                          ("loop_errors", "without TensorFlow")):
            for name, by_size in doc.get(key, {}).items():
                for size, message in by_size.items():
                    errors.append({"system": name, "size_bytes": int(size),
                                   "P": nranks, "rank": doc["rank"],
                                   "error": f"{what}: {message}"})
    if len(docs) < nranks:
        return results, errors
    names = sorted({n for d in docs for n in d["times"]})
    for name in names:
        sizes = sorted({int(s) for d in docs
                        for s in d["times"].get(name, {})})
        for size in sizes:
            if (name, str(size)) in seen:
                continue  # failed or wrong on some rank: reported instead
            per_rank = [d["times"].get(name, {}).get(str(size)) for d in docs]
            if any(not t for t in per_rank):
                continue  # some rank has no times: the variant failed there
            per_run = slowest_rank(per_rank)
            rank0 = next(d for d in docs if d["rank"] == 0)
            extra = {"payload_bytes": 0} if name == DISPATCH else {}
            waits = [d.get("waits", {}).get(name, {}).get(str(size))
                     for d in docs]
            if name != DISPATCH and all(waits):
                extra["median_waited_s"] = statistics.median(
                    _at_slowest_rank(per_rank, waits))
            cpu = [d.get("cpu", {}).get(name, {}).get(str(size))
                   for d in docs]
            if all(cpu):
                # Each call's process CPU time (every thread's). A process
                # with a thread running all the time it is timed uses at
                # least that much CPU, so time - CPU (0 if less) is a lower
                # bound on the time it had no thread on a CPU: asleep
                # waiting for its peers, or waiting for a core that another
                # process holds.
                used = _at_slowest_rank(per_rank, cpu)
                extra["median_cpu_s"] = statistics.median(used)
                extra["median_off_cpu_s"] = statistics.median(
                    max(t - c, 0.0) for t, c in zip(per_run, used))
            bursts = [d.get("back_to_back", {}).get(name, {}).get(str(size))
                      for d in docs]
            if all(bursts):
                extra["median_back_to_back_s"] = statistics.median(
                    slowest_rank(bursts))
            loops = [d.get("loop", {}).get(name, {}).get(str(size))
                     for d in docs]
            if all(loops):
                # Per call of a loop, from the later rank's start.
                for mode in LOOP_MODES:
                    ends, begins = ([x[mode][key] for x in loops]
                                    for key in ("ends", "starts"))
                    took = [[e - b for b, e in zip(bs, es)]
                            for bs, es in zip(begins, ends)]
                    extra[f"median_loop_{mode}_s"] = statistics.median(
                        _from_last_start(took, begins))
                extra["loop_cool_bytes"] = loops[0]["cooled"]["cool_bytes"]
            starts = [d.get("starts", {}).get(name, {}).get(str(size))
                      for d in docs]
            if all(starts):
                extra["median_from_last_start_s"] = statistics.median(
                    _from_last_start(per_rank, starts))
                inside = [d.get("inside", {}).get(name, {}).get(str(size))
                          for d in docs]
                if all(inside):
                    split = _split_at_the_engine(per_rank, starts, inside)
                    for part, values in zip(("in", "inside", "out"), split):
                        extra[f"median_{part}_s"] = statistics.median(values)
                    if all(cpu):
                        ways = _ways_on_a_cpu(per_rank, starts, inside, cpu)
                        for part, values in zip(("in", "out"), ways):
                            extra[f"median_{part}_on_cpu_s"] = \
                                statistics.median(values)
            results.append(result_entry(
                name, DISPATCH_OP if name == DISPATCH else OP, size, per_run,
                nranks, rank0_median_s=statistics.median(
                    rank0["times"][name][str(size)][:len(per_run)]),
                **extra))
    return results, errors


def _from_last_start(per_rank, starts):
    """Per run, from the last rank's start to the last rank's end.

    The run's own time (slowest rank) also counts how much earlier than
    its peers a rank left the barrier before the call: that skew is the
    barrier's and the caller's, not the call's. Starts are read on one
    clock (CLOCK_MONOTONIC: the ranks share the host).
    """
    runs = min(len(t) for t in per_rank + starts)
    return [max(s[i] + t[i] for s, t in zip(starts, per_rank)) -
            max(s[i] for s in starts) for i in range(runs)]


def _split_at_the_engine(per_rank, starts, inside):
    """Per run, the time from the last rank's start in three parts.

    ``in``: from the later rank's start to the later rank's admission by
    the engine (TensorFlow's dispatch of the op, and the op's own work
    before it reaches the engine); ``inside``: from there to the last
    rank's finish (tf_rdma's exchange); ``out``: from there to the last
    rank's end (the return through TensorFlow). The three add up to
    :func:`_from_last_start`'s time. ``inside`` holds each call's
    ``[began, ended]`` per rank (``tf_rdma.stats()["last_collective"]``,
    on the clock of the starts).
    """
    runs = min(len(x) for x in per_rank + starts + inside)
    parts = ([], [], [])
    for i in range(runs):
        start = max(s[i] for s in starts)
        entry = max(x[i][0] for x in inside)
        exit_ = max(x[i][1] for x in inside)
        end = max(s[i] + t[i] for s, t in zip(starts, per_rank))
        for part, value in zip(parts, (entry - start, exit_ - entry,
                                       end - exit_)):
            part.append(value)
    return parts


def _ways_on_a_cpu(per_rank, starts, inside, cpu):
    """Per run, a rank's way into the op and back, on a CPU.

    A rank's way in runs from its start to its admission by the engine,
    its way back from its finish there to its end (``inside``, as for
    :func:`_split_at_the_engine`). Each is its wall time less the time
    the rank's call had no thread on a CPU (time - process CPU time, 0 if
    less), taken off the way in first (a lower way in lowers
    :func:`_shared_cpus_bound` most). Returns two lists: per run, the
    mean over the ranks of the way in, and the way back of the rank that
    started first.
    """
    runs = min(len(x) for x in per_rank + starts + inside + cpu)
    ways_in, ways_out = [], []
    for i in range(runs):
        on_in, on_out = [], []
        for t, s, (began, ended), c in zip(
                (x[i] for x in per_rank), (x[i] for x in starts),
                (x[i] for x in inside), (x[i] for x in cpu)):
            off = max(t - c, 0.0)
            way_in, way_out = began - s, s + t - ended
            on_in.append(max(way_in - off, 0.0))
            on_out.append(max(way_out - max(off - way_in, 0.0), 0.0))
        first = min(range(len(starts)), key=lambda r: starts[r][i])
        ways_in.append(sum(on_in) / len(on_in))
        ways_out.append(on_out[first])
    return ways_in, ways_out


def _at_slowest_rank(per_rank, values):
    """Per run, ``values`` of the run's slowest rank (``values[r][i]`` goes
    with rank r's time ``per_rank[r][i]``)."""
    runs = min(len(t) for t in per_rank + values)
    out = []
    for i in range(runs):
        slowest = max(range(len(per_rank)), key=lambda r: per_rank[r][i])
        out.append(values[slowest][i])
    return out


def _shared_cpus_bound(empty, floor, nranks, cpus):
    """The least a call after a barrier can take where P ranks share c < P
    CPUs, from the empty call's parts and the floor's CPU time (``empty``,
    ``floor``: their results; ``floor`` may be None).

    Why: the target takes one dispatch off a call's time, as if the
    dispatch were each rank's own business. It is not where the ranks
    outnumber the CPUs. Take the rank that starts the timed call first:
    every other rank starts it later, so all P ranks' ways into the op
    (TensorFlow's dispatch up to the engine's admission, H) run after that
    start, and the first rank's call cannot end before the last of them
    and its own way back (O) have run, an allreduce needing every rank's
    input. That is P H + O of CPU on c CPUs: at least (P H + O) / c,
    whatever the exchange costs and however the kernel schedules them.
    The empty call waits for no peer and pays H + O, which is what the
    target subtracts. H and O are the empty call's own medians in the same
    run, so they cost what a dispatch costs with P ranks on the CPUs: per
    run the ranks' mean way in and the first rank's way back, each on a
    CPU (:func:`_ways_on_a_cpu`; a process's CPU time counts all its
    threads, TensorFlow's spinning pool threads too, so this is the cost
    at TensorFlow's default settings). The ranks must also copy and add
    the bytes the floor's ranks do (F, the floor's CPU time per rank in the
    same run) before the first rank can end, except the other ranks' last
    step, the copy of what they received into their own output: one of
    four steps of equal bytes, three of them copies and one an add, so at
    most F / 4. Hence (P H + O + F + (P - 1) 3F/4) / c. The small sizes'
    check passes no floor (F = 0): at 4 KiB and 64 KiB the floor's CPU
    time is mostly numpy's call overhead, not the bytes.

    Returns:
      None where the ranks do not outnumber the CPUs or a part is
      missing; else a dict: ``in_s`` (H), ``copies_s`` (F), ``out_s``
      (O), ``cpus`` and ``call_s`` (the least time of the call).
    """
    if nranks <= cpus or empty is None:
        return None
    way_in = empty.get("median_in_on_cpu_s")
    way_out = empty.get("median_out_on_cpu_s")
    if way_in is None or way_out is None:
        return None
    copies = (floor or {}).get("median_cpu_s") or 0.0
    work = (nranks * way_in + way_out + copies +
            (nranks - 1) * FLOOR_NEEDED_BY_PEERS * copies)
    return {"in_s": way_in, "copies_s": copies, "out_s": way_out,
            "cpus": cpus, "call_s": work / cpus}


def _shared_cpus_text(shared, nranks):
    """How :func:`_shared_cpus_bound`'s least time comes about, in words."""
    into, copies, out_of, call = (human_time(shared[k]) for k in
                                  ("in_s", "copies_s", "out_s", "call_s"))
    floor, copying = "", ""
    if shared["copies_s"]:
        share = f"{FLOOR_NEEDED_BY_PEERS:g}"
        floor = (f" and the floor's copies and adds ({copies} of CPU per "
                 f"rank; the other ranks' but their last copy, {share} of "
                 f"it),")
        copying = f" + {copies} + {nranks - 1} x {share} x {copies}"
    return (f"{nranks} ranks share {shared['cpus']} CPUs: the first rank to "
            f"start cannot finish before every rank has run TensorFlow's way "
            f"into the op (the empty call's: {into} on a CPU){floor} and the "
            f"first rank its own way back ({out_of}), so its call takes at "
            f"least ({nranks} x {into} + {out_of}{copying}) / "
            f"{shared['cpus']} = {call}")


def busbw(size, nranks, seconds):
    """NCCL-style bus bandwidth (GB/s): size / time * 2(P-1)/P."""
    return size / seconds * 2 * (nranks - 1) / nranks / 1e9


def best_tf_rdma(by, size, nranks):
    """(median, system) of the fastest tf_rdma algorithm, or (None, None).

    The dispatch (``tf_rdma-empty``) is no algorithm: never the best.
    """
    found = [(r["median_s"], s) for (s, sz, p), r in by.items()
             if s.startswith("tf_rdma-") and s != DISPATCH and sz == size
             and p == nranks]
    return min(found) if found else (None, None)


def _index(results):
    return {(r["system"], r["size_bytes"], r["P"]): r for r in results}


def _median(by, system, size, nranks):
    r = by.get((system, size, nranks))
    return r["median_s"] if r else None


def print_tables(results, sizes, ranks):
    by = _index(results)
    order = system_names("tf_rdma", ALGORITHMS) + [MWMS, OPENMPI]
    present = [s for s in order if any(r["system"] == s for r in results)]
    extra = [(s, title) for s, title in ((DISPATCH, "dispatch"),
                                         (FLOOR, "floor"))
             if any(r["system"] == s for r in results)]
    for nranks in ranks:
        if not any(r["P"] == nranks for r in results):
            continue
        print()
        print(f"allreduce (sum, float32), P = {nranks}: median time per "
              f"call, slowest rank")
        header = (["size"] + present + [title for _, title in extra]
                  + ["best tf_rdma", "busbw GB/s", "vs mwms", "vs openmpi",
                     "best/floor"])
        rows = []
        for size in sizes:
            row = [human_size(size)]
            for s in present + [s for s, _ in extra]:
                row.append(human_time(_median(by, s, size, nranks)))
            best, name = best_tf_rdma(by, size, nranks)
            mwms = _median(by, MWMS, size, nranks)
            mpi = _median(by, OPENMPI, size, nranks)
            floor = _median(by, FLOOR, size, nranks)
            row.append(name[len("tf_rdma-"):] if name else "-")
            row.append(f"{busbw(size, nranks, best):.2f}" if best else "-")
            row.append(f"{mwms / best:.1f}x" if best and mwms else "-")
            row.append(_times(mpi / best) if best and mpi else "-")
            row.append(_times(best / floor) if best and floor else "-")
            rows.append(row)
        print_table(header, rows)


def _times(x, target=None):
    """A ratio: "1.52x"; two significant digits below 0.1 ("0.0037x").

    With ``target`` (the ratio it is checked against), four decimals where
    two would read as the target itself ("1.4998x", not a missed "1.50x").
    """
    if target is not None and x != target and (
            f"{x:.2f}" == f"{target:.2f}"):
        return f"{x:.4f}x"
    return f"{x:.2f}x" if x >= 0.1 else f"{x:.2g}x"


def _check(size, nranks, target, ratio, ok, line, measured, bound=None):
    """One check: its line and what the JSON keeps of it.

    ``ok`` None: not measured (``ratio`` is then None too).
    """
    word = "not measured" if ok is None else verdict(ok)
    text = f"{human_size(size)}, P={nranks}: {line}: {word}"
    if bound and ok is False:
        text += f"; bound: {bound}"
    return {"size_bytes": size, "P": nranks, "target": target,
            "ratio": ratio, "verdict": word, "measured": measured,
            "bound": bound if ok is False else None, "line": text}


def _best_text(best, name):
    return f"best tf_rdma ({name[len('tf_rdma-'):]}) {human_time(best)}"


def _mpi_bound(mpi, floor, dispatch, shared=None, nranks=None):
    """What caps best tf_rdma's speedup over Open MPI: a call costs at least
    the floor's copies and at least its dispatch, and where the ranks
    outnumber the CPUs (``shared``, from :func:`_shared_cpus_bound`) every
    rank's dispatch and copies on the shared CPUs."""
    parts = []
    if floor:
        parts.append(f"{OPENMPI} / floor = {human_time(mpi)} / "
                     f"{human_time(floor)} = {_times(mpi / floor)} (a tf_rdma "
                     f"at the floor would be that much faster; at "
                     f"{TARGET_FLOOR:g}x the floor "
                     f"{_times(mpi / (TARGET_FLOOR * floor))})")
    if dispatch:
        parts.append(f"{OPENMPI} / dispatch = {human_time(mpi)} / "
                     f"{human_time(dispatch)} = {_times(mpi / dispatch)} (a "
                     f"call costs at least its dispatch)")
    if shared:
        parts.append(f"{_shared_cpus_text(shared, nranks)}: {OPENMPI} / "
                     f"that = {_times(mpi / shared['call_s'])}")
    return "; ".join(parts) or None


def checks(results, cpus=None):
    """Every target's check: the numbers, the ratio and the verdict.

    Printed, never asserted. Returns dicts with ``size_bytes``, ``P``,
    ``target``, ``ratio``, ``verdict`` ("met", "MISSED" or "not
    measured"), ``measured`` (the medians it used), ``bound`` (when
    missed and the run has one) and ``line`` (what is printed).

    Args:
      results: The results, as ``combine`` gives them.
      cpus: How many CPUs the ranks ran on (default: this process's
        affinity, which the ranks inherit).
    """
    if cpus is None:
        cpus = len(os.sched_getaffinity(0))
    by = _index(results)
    out = []

    # The first targets: 64 MiB, P = 2, against MWMS and Open MPI.
    size, nranks = 64 * MiB, 2
    best, name = best_tf_rdma(by, size, nranks)
    for system, target in ((MWMS, TARGET_VS_MWMS), (OPENMPI, TARGET_VS_MPI)):
        other = _median(by, system, size, nranks)
        ref = f" (reference machine: {human_time(REFERENCE[system])})"
        goal = f"best tf_rdma >= {target:g}x {system}"
        if best is None or other is None:
            missing = "tf_rdma" if best is None else system
            out.append(_check(size, nranks, goal, None, None,
                              f"{goal}: no {missing} result" + ref,
                              {"best_tf_rdma_s": best, f"{system}_s": other}))
            continue
        x = other / best
        out.append(_check(
            size, nranks, goal, x, x >= target,
            f"{_best_text(best, name)} vs {system} {human_time(other)}: "
            f"{_times(x, target)} (target >= {target:g}x){ref}",
            {"best_tf_rdma_s": best, "best": name, f"{system}_s": other}))

    # Issue 17: 64 MiB, P = 2, against the floor.
    floor = _median(by, FLOOR, size, nranks)
    goal = f"best tf_rdma <= {TARGET_FLOOR:g}x the floor"
    measured = {"best_tf_rdma_s": best, "best": name, "floor_s": floor}
    if best is None or floor is None:
        missing = "tf_rdma" if best is None else "floor"
        out.append(_check(size, nranks, goal, None, None,
                          f"{goal}: no {missing} result", measured))
    else:
        x = best / floor
        out.append(_check(
            size, nranks, goal, x, x <= TARGET_FLOOR,
            f"{_best_text(best, name)} vs floor {human_time(floor)}: "
            f"{_times(x, TARGET_FLOOR)} the floor (target <= "
            f"{TARGET_FLOOR:g}x)", measured))

    # Issue 17: speedups over Open MPI.
    for (size, nranks), target in TARGETS_VS_MPI.items():
        best, name = best_tf_rdma(by, size, nranks)
        mpi = _median(by, OPENMPI, size, nranks)
        floor = _median(by, FLOOR, size, nranks)
        dispatch = _median(by, DISPATCH, size, nranks)
        goal = f"best tf_rdma >= {target:g}x {OPENMPI}"
        measured = {"best_tf_rdma_s": best, "best": name,
                    f"{OPENMPI}_s": mpi, "floor_s": floor,
                    "dispatch_s": dispatch}
        if best is None or mpi is None:
            missing = "tf_rdma" if best is None else OPENMPI
            out.append(_check(size, nranks, goal, None, None,
                              f"{goal}: no {missing} result", measured))
            continue
        x = mpi / best
        shared = _shared_cpus_bound(by.get((DISPATCH, size, nranks)),
                                    by.get((FLOOR, size, nranks)), nranks,
                                    cpus)
        if shared:
            measured["shared_cpus"] = shared
        out.append(_check(
            size, nranks, goal, x, x >= target,
            f"{_best_text(best, name)} vs {OPENMPI} {human_time(mpi)}: "
            f"{_times(x, target)} (target >= {target:g}x)" + _estimate_wrong(
                shared and best < shared["call_s"], shared and
                shared["call_s"]),
            measured, _mpi_bound(mpi, floor, dispatch, shared, nranks)))

    # Issue 17: small sizes, the dispatch taken off.
    for size in DISPATCH_SIZES:
        for nranks in DISPATCH_RANKS:
            best, name = best_tf_rdma(by, size, nranks)
            mpi = _median(by, OPENMPI, size, nranks)
            dispatch = _median(by, DISPATCH, size, nranks)
            floor = _median(by, FLOOR, size, nranks)
            goal = f"best tf_rdma - dispatch <= {OPENMPI}'s time"
            measured = {"best_tf_rdma_s": best, "best": name,
                        "dispatch_s": dispatch, f"{OPENMPI}_s": mpi,
                        "floor_s": floor}
            if best is None or mpi is None or dispatch is None:
                missing = ("tf_rdma" if best is None else
                           OPENMPI if mpi is None else DISPATCH)
                out.append(_check(size, nranks, goal, None, None,
                                  f"{goal}: no {missing} result", measured))
                continue
            net = best - dispatch
            # A call can measure a little less than an empty one (noise): it
            # then costs nothing beyond its dispatch.
            x = max(net, 0.0) / mpi
            waited = by[(name, size, nranks)].get("median_waited_s")
            measured["best_waited_s"] = waited
            bound = ""
            # Without the floor: at these sizes its CPU time is mostly
            # numpy's call overhead, not bytes an exchange must move.
            shared = _shared_cpus_bound(by[(DISPATCH, size, nranks)], None,
                                        nranks, cpus)
            if shared is not None:
                least = shared["call_s"] - dispatch
                measured["shared_cpus"] = dict(shared, least_net_s=least)
                call = human_time(shared["call_s"])
                bound += (
                    f"{_shared_cpus_text(shared, nranks)} even with an "
                    f"exchange that costs nothing, and tf_rdma - dispatch "
                    f"is at least {call} - {human_time(dispatch)} = "
                    f"{human_time(least)}, "
                    f"{_times(max(least, 0.0) / mpi)} {OPENMPI}'s time")
                bound += (f": out of reach on {cpus} CPUs at TensorFlow's "
                          f"dispatch cost (its default settings); "
                          if least > mpi else
                          " (within the target: not what keeps it); ")
            if waited is not None and waited < net:
                rest = human_time(net - waited)
                bound += (f"of the {human_time(net)} after the dispatch the "
                          f"slowest rank waited {human_time(waited)} for its "
                          f"peers' blocks (they arrive that much later), the "
                          f"rest, {rest}, is its own work and its threads' "
                          f"hand-offs; ")
            elif waited is not None:
                # Medians do not subtract exactly: the wait is all of it.
                bound += (f"the slowest rank waited {human_time(waited)} for "
                          f"its peers' blocks, as long as all the "
                          f"{human_time(net)} after the dispatch (they arrive "
                          f"that much later); ")
            late = {system: by[(system, size, nranks)].get(
                        "median_from_last_start_s")
                    for system in (name, DISPATCH, OPENMPI)}
            measured["from_last_start_s"] = late
            if None not in late.values():
                # The same difference with every time taken from the
                # later rank's start: the barrier's exit skew off both.
                own = max(late[name] - late[DISPATCH], 0.0)
                bound += (f"from the later rank's start (the skew of the "
                          f"ranks leaving the barrier off both): "
                          f"{human_time(late[name])} - dispatch "
                          f"{human_time(late[DISPATCH])} = "
                          f"{human_time(own)} vs {OPENMPI} "
                          f"{human_time(late[OPENMPI])}, "
                          f"{_times(own / late[OPENMPI])} its time; ")
            split = {system: {part: by[(system, size, nranks)].get(
                         f"median_{part}_s") for part in ("in", "inside",
                                                          "out")}
                     for system in (name, DISPATCH)}
            measured["split_s"] = split
            if None not in split[name].values() and \
                    None not in split[DISPATCH].values():
                # tf_rdma's own part: the time inside the engine beyond
                # the empty call's; the rest is TensorFlow's.
                own = max(split[name]["inside"] - split[DISPATCH]["inside"],
                          0.0)
                rest = ((split[name]["in"] + split[name]["out"]) -
                        (split[DISPATCH]["in"] + split[DISPATCH]["out"]))
                bound += (f"inside the engine (the later rank's admission "
                          f"to the last rank's finish): "
                          f"{human_time(split[name]['inside'])} - the empty "
                          f"call's {human_time(split[DISPATCH]['inside'])} "
                          f"= {human_time(own)} vs {OPENMPI} "
                          f"{human_time(mpi)}, {_times(own / mpi)} its time "
                          f"({'within' if own <= mpi else 'over'} the "
                          f"target); TensorFlow's part around the engine, "
                          f"into the op and back (medians "
                          f"{human_time(split[name]['in'])} + "
                          f"{human_time(split[name]['out'])}), is "
                          f"{human_time(abs(rest))} "
                          f"{'more' if rest >= 0 else 'less'} than the "
                          f"empty call's; ")
            bound += _without_tensorflow(by, size, nranks, mpi,
                                         split[DISPATCH]["inside"], measured)
            cpu, off = ({system: by[(system, size, nranks)].get(key)
                         for system in (name, DISPATCH, OPENMPI)}
                        for key in ("median_cpu_s", "median_off_cpu_s"))
            measured["cpu_s"], measured["off_cpu_s"] = cpu, off
            if None not in cpu.values() and None not in off.values():
                # Where the ranks outnumber the cores they queue for them.
                # The empty call waits for no peer: its time off a CPU is
                # a wait for a core (or a wake-up), and where that alone
                # is longer than Open MPI's call, the subtraction measures
                # the scheduler more than the call.
                bound += (f"CPU time of the slowest rank (all its threads): "
                          f"{human_time(cpu[name])} - the empty call's "
                          f"{human_time(cpu[DISPATCH])} = "
                          f"{human_time(cpu[name] - cpu[DISPATCH])} vs "
                          f"{OPENMPI} {human_time(cpu[OPENMPI])}; time with "
                          f"no thread on a CPU, at least: "
                          f"{human_time(off[name])}, the empty call "
                          f"{human_time(off[DISPATCH])}, {OPENMPI} "
                          f"{human_time(off[OPENMPI])}")
                if off[DISPATCH] > mpi:
                    bound += (f" (the empty call waits for no peer: its "
                              f"slowest rank waited that long for a core or "
                              f"a wake-up, {_times(off[DISPATCH] / mpi)} "
                              f"{OPENMPI}'s time, more than the difference "
                              f"can resolve)")
                bound += "; "
            b2b = {system: by[(system, size, nranks)].get(
                       "median_back_to_back_s")
                   for system in (name, DISPATCH, OPENMPI)}
            measured["back_to_back_s"] = b2b
            if None not in b2b.values():
                own = b2b[name] - b2b[DISPATCH]
                bound += (f"back to back (bursts of {BURST_CALLS} calls, no "
                          f"barrier between them): {human_time(b2b[name])} "
                          f"- the empty call's {human_time(b2b[DISPATCH])} "
                          f"= {human_time(own)} vs {OPENMPI} "
                          f"{human_time(b2b[OPENMPI])}, "
                          f"{_times(max(own, 0.0) / b2b[OPENMPI])} its "
                          f"time; ")
            bound += (f"the dispatch alone {human_time(dispatch)} is "
                      f"{_times(dispatch / mpi)} {OPENMPI}'s "
                      f"{human_time(mpi)} (not counted by the target)")
            if floor:
                bound += (f"; floor {human_time(floor)} = "
                          f"{_times(floor / mpi)} {OPENMPI}'s time")
            out.append(_check(
                size, nranks, goal, x, net <= mpi,
                f"{_best_text(best, name)} - dispatch "
                f"{human_time(dispatch)} = {human_time(net)}"
                f"{'' if net > 0 else ' (none beyond the dispatch)'} vs "
                f"{OPENMPI} {human_time(mpi)}: {_times(x, 1.0)} its time "
                f"(target <= 1x)" + _estimate_wrong(
                    shared and net <= mpi < shared["call_s"] - dispatch,
                    shared and shared["call_s"] - dispatch),
                measured, bound))
    return out


def _without_tensorflow(by, size, nranks, mpi, empty_inside, measured):
    """The check's words on the exchange timed without TensorFlow
    (:meth:`_Rank.loops`), or "" where a loop is missing.

    Hot, the loops compare the two exchanges as a C program would call
    them. Cooled, with the caches as an op's dispatch leaves them: a call
    through TensorFlow pays at least about that cooled exchange beyond its
    dispatch, less what the empty call spends in the engine
    (``empty_inside``, the split's): where that alone is over Open MPI's
    time, the target is out of reach while the dispatch cools the caches.
    Adds the loops' medians to ``measured``.
    """
    ours = by.get((f"tf_rdma-{LOOP_ALGORITHM}", size, nranks)) or {}
    theirs = by.get((OPENMPI, size, nranks)) or {}
    keys = [f"median_loop_{mode}_s" for mode in LOOP_MODES]
    if any(entry.get(key) is None for entry in (ours, theirs)
           for key in keys):
        return ""
    (hot, cooled), (mpi_hot, mpi_cooled) = (
        [entry[key] for key in keys] for entry in (ours, theirs))
    measured["loop_s"] = {LOOP_ALGORITHM: {"hot": hot, "cooled": cooled},
                          OPENMPI: {"hot": mpi_hot, "cooled": mpi_cooled}}
    text = (f"without TensorFlow ({LOOP_CALLS} calls back to back, from the "
            f"later rank's start; tf_rdma's {LOOP_ALGORITHM} driven from C): "
            f"{human_time(hot)} vs {OPENMPI} {human_time(mpi_hot)}, "
            f"{_times(hot / mpi_hot)} its time; with "
            f"{human_size(ours['loop_cool_bytes'], exact=False)} (the L2 "
            f"cache) written before every call, as an op's dispatch leaves "
            f"the caches: {human_time(cooled)} vs {human_time(mpi_cooled)}, "
            f"{_times(cooled / mpi_cooled)} its time; ")
    if empty_inside is None:
        return text
    least = cooled - empty_inside
    measured["loop_s"]["least_net_s"] = least
    return text + (
        f"so beyond its dispatch a call through TensorFlow pays at least "
        f"about the cooled exchange less the empty call's time in the "
        f"engine, {human_time(cooled)} - {human_time(empty_inside)} = "
        f"{human_time(least)}, {_times(max(least, 0.0) / mpi)} {OPENMPI}'s "
        f"{human_time(mpi)}"
        + (": out of reach while the dispatch cools the caches; "
           if least > mpi else
           " (within the target: the rest comes with the call through "
           "TensorFlow: the engine's code and data colder than this loop "
           "leaves them, the ranks' arrival, and TensorFlow's way into the "
           "op and back); "))


def _estimate_wrong(wrong, least):
    """The words a check line adds where it is met although the shared-CPU
    estimate (:func:`_shared_cpus_bound`) said it could not be: the run
    shows the estimate too high."""
    if not wrong:
        return ""
    return (f" (the shared-CPU estimate of the least, {human_time(least)}, "
            f"was above it: wrong in this run)")


def check_lines(results):
    """The lines of ``checks`` (printed, never asserted)."""
    return [c["line"] for c in checks(results)]


def orchestrate(args):
    run = Run("allreduce", log)
    skipped = {}
    if "mpi" in args.systems:
        why = _mpi_missing()
        if why:
            skipped["mpi"] = why
    if "tf_rdma" in args.systems:
        why = _tf_rdma_missing()
        if why:
            skipped["tf_rdma"] = why
    for kind, why in skipped.items():
        log(f"skipping {kind}: {why}")
    results, errors, failed, info, auto = [], [], [], {}, {}
    with work_dir("tf_rdma_allreduce_", args.keep, log) as workdir:
        for nranks in args.ranks:
            for kind in args.systems:
                if kind in skipped:
                    continue
                log(f"{kind} P={nranks}: starting {nranks} processes "
                    f"(sizes {', '.join(human_size(s) for s in args.sizes)})")
                docs, failure = run_group(kind, nranks, args, workdir)
                got, errs = combine(docs, nranks)
                results.extend(got)
                errors.extend(errs)
                for doc in docs:
                    doc_info = dict(doc.get("info") or {})
                    picked = {k: doc_info.pop(k) for k in
                              ("auto_params", "auto_choice") if k in doc_info}
                    if picked and doc["rank"] == 0:
                        auto[str(nranks)] = picked
                    info.setdefault(kind, doc_info)
                if failure:
                    failed.append({"system": kind, "P": nranks,
                                   "why": failure})
                for r in got:
                    log(f"  {r['system']} {human_size(r['size_bytes'])}: "
                        f"{human_time(r['median_s'])} (min "
                        f"{human_time(r['min_s'])})")
    order = {s: i for i, s in enumerate(
        system_names("tf_rdma", ALGORITHMS) + [DISPATCH, MWMS, OPENMPI,
                                               FLOOR])}
    results.sort(key=lambda r: (r["P"], r["size_bytes"],
                                order.get(r["system"], 99)))
    for kind in SYSTEM_KINDS:
        for key, value in (info.get(kind) or {}).items():
            if key != "transport":
                run.machine.setdefault(key, value)
    print(f"{run.headline('allreduce benchmark')}; runs={args.runs} (at "
          f"least {SMALL_RUNS} up to 1 MiB) after {WARMUP} warm-up; time of "
          f"a run = slowest rank; "
          + ("ranks bound to their own CPUs where P <= cores (as mpirun "
             "binds its own)" if args.bind == "auto" else
             "ranks unbound (--bind none; mpirun still binds its own)"))
    print_tables(results, args.sizes, args.ranks)
    print()
    for nranks, picked in auto.items():
        choice = picked.get("auto_choice")
        if isinstance(choice, dict):
            print(f"auto at P={nranks} chose: " + ", ".join(
                f"{human_size(int(size))} {alg} (blocks of "
                f"{human_size(int(block), exact=False)})"
                for size, (alg, block) in choice.items()))
    for kind, why in skipped.items():
        print(f"skipped {kind}: {why}")
    for e in errors:
        print(f"ERROR {e['system']} at {human_size(e['size_bytes'])}, "
              f"P={e['P']} (rank {e['rank']}): {e['error']}")
    for f in failed:
        print(f"FAILED {f['system']} P={f['P']}: {f['why']}")
    cpus = len(os.sched_getaffinity(0))
    verdicts = checks(results, cpus)
    for check in verdicts:
        print("check: " + check["line"])
    run.finish()
    if args.json:
        config = {"runs": args.runs, "small_runs": SMALL_RUNS,
                  "small_size": SMALL_SIZE, "warmup": WARMUP,
                  "sizes": list(args.sizes),
                  "ranks": list(args.ranks),
                  "algorithms": list(args.algorithms),
                  "systems": list(args.systems),
                  "transport": args.transport or os.environ.get(
                      "TF_RDMA_TRANSPORT", "auto"),
                  "timing": "per run the max over ranks of the call time "
                            "after a 4-byte sync; median/min over runs",
                  "mpirun": "mpirun --allow-run-as-root --oversubscribe "
                            "-n P",
                  "calibrate": args.calibrate,
                  "bind": args.bind,
                  "cpus": cpus,
                  "block_bytes": args.block_bytes,
                  "auto": auto,
                  "skipped": skipped, "failed": failed,
                  "errors": errors,
                  "floor": FLOOR_DEFINITION,
                  "floor_block": args.floor_block,
                  "dispatch": DISPATCH_DEFINITION,
                  **run.timing()}
        run.save(args.json, config, results, checks=verdicts)
    return 1 if failed or errors else 0


# --- main ---


def _block_size(text):
    """--floor-block: a size as for --sizes, or 0 (no blocks)."""
    return 0 if text.strip() == "0" else parse_size(text)


def build_parser():
    parser = argparse.ArgumentParser(
        prog="python bench/allreduce.py",
        description=f"Allreduce benchmark: tf_rdma collectives "
                    f"({', '.join(ALGORITHMS)}) and the dispatch of an "
                    f"empty one vs MultiWorkerMirroredStrategy (RING, gRPC) "
                    f"vs Open MPI (mpi4py) vs the copy floor (numpy over "
                    f"/dev/shm), P local processes.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="See bench/README.md for how it measures.")
    parser.add_argument("--json", metavar="PATH",
                        help="also write the results as JSON to PATH")
    parser.add_argument("--sizes", nargs="+", type=parse_size, metavar="SIZE",
                        help="tensor sizes (4K 64K 1M 16M 64M 256M by "
                             "default; --quick: 4K 1M 64M)")
    parser.add_argument("--ranks", nargs="+", type=int, metavar="P",
                        help="process counts (2 4 by default; --quick: 2)")
    parser.add_argument("--runs", type=int, metavar="N",
                        help=f"timed calls per measurement after {WARMUP} "
                             f"warm-up calls (default {DEFAULT_RUNS}; "
                             f"--quick: {QUICK_RUNS}; sizes up to 1 MiB: at "
                             f"least {SMALL_RUNS})")
    parser.add_argument("--quick", action="store_true",
                        help="4 KiB, 1 MiB and 64 MiB, P = 2, few runs (a "
                             "smoke run, about 2 minutes)")
    parser.add_argument("--algorithms", nargs="+", choices=ALGORITHMS,
                        default=list(ALGORITHMS),
                        help="tf_rdma algorithms, from "
                             "tf_rdma.collectives.ALGORITHMS and auto "
                             "(default: all)")
    parser.add_argument("--systems", nargs="+", choices=SYSTEM_KINDS,
                        default=list(SYSTEM_KINDS),
                        help="systems to measure (default: all four)")
    parser.add_argument("--transport", choices=("auto", "shm", "tcp", "verbs"),
                        help="TF_RDMA_TRANSPORT for the tf_rdma processes "
                             "(default: the environment's, else auto = shm "
                             "on one host)")
    parser.add_argument("--block-bytes", type=parse_size, metavar="SIZE",
                        help="tf_rdma pipelining block for every algorithm "
                             "(default: the cost model's b* per call)")
    parser.add_argument("--no-calibrate", dest="calibrate",
                        action="store_false",
                        help="do not run tf_rdma.collectives.calibrate() "
                             "before timing (then \"auto\" decides with the "
                             "cost model's default parameters)")
    parser.add_argument("--timeout", type=float, metavar="S",
                        help="hard limit per set of processes in seconds "
                             "(default 900; --quick 300)")
    add_process_arguments(parser, SYSTEM_KINDS)
    add_bind_argument(parser)
    parser.add_argument("--floor-block", type=_block_size, default=MiB,
                        metavar="SIZE",
                        help="the floor's block: it runs its four steps "
                             "block by block, SIZE of every chunk at a time, "
                             "as a pipelined schedule does (default 1M; 0: "
                             "each step over whole chunks)")
    # Internal: the floor's /dev/shm file names (PREFIX.<rank>).
    parser.add_argument("--shm-prefix", help=argparse.SUPPRESS)
    # Internal: time the exchange without TensorFlow too (_Rank.loops).
    parser.add_argument("--loops", action="store_true",
                        help=argparse.SUPPRESS)
    return parser


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.sizes is None:
        args.sizes = list(QUICK_SIZES if args.quick else DEFAULT_SIZES)
    if args.ranks is None:
        args.ranks = list(QUICK_RANKS if args.quick else DEFAULT_RANKS)
    if args.runs is None:
        args.runs = QUICK_RUNS if args.quick else DEFAULT_RUNS
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    if any(p < 2 for p in args.ranks):
        parser.error("--ranks: every P must be at least 2")
    if args.timeout is None:
        args.timeout = 300.0 if args.quick else 900.0
    if args.worker:
        return worker_main(args)
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
