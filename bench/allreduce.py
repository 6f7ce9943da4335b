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
    ``tf.function``, for A in lp, ring, tree, rhd and auto. Each (algorithm,
    size) has its own instance name. ``TF_RDMA_TRANSPORT`` is passed on
    (shm by default on one host: ``auto``).
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

Timing, the same for every system: every rank builds its input once per
size, calls each variant twice as warm-up (the first call traces the
function and sets up the collective), then does --runs rounds; in a round
every variant is timed once (variants interleaved, so a slow phase of the
machine hits them all). Before every timed call the ranks synchronise with a
4-byte allreduce of the same system (``MPI_Barrier`` for Open MPI), then
each rank times its call until the result is there (for TensorFlow the
eager call of the ``tf.function`` returns when its output is computed). The
time of a run is the slowest rank's time (max over ranks: the allreduce is
done when every rank has the sum); ``median_s`` and ``min_s`` are over those
per-run maxima. Rank 0's own median is kept as ``rank0_median_s``.

Every rank's input is ``(i mod 251) + rank`` at element i, so the sum is
exact in float32 and known; the output of the first and the last call of
every variant is compared element by element on every rank. A variant whose
op fails is dropped from that set of processes; one that gives a wrong
result keeps being called (so that the ranks stay in step) but is left out
of the results; both are reported.
"""

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time

from _harness.children import (add_local_cluster, add_process_arguments,
                               make_tf_rdma_job, run_processes, work_dir,
                               worker_env)
from _harness.report import (Run, print_table, result_entry, save_json,
                             slowest_rank, verdict, write_json)
from _harness.units import MiB, human_size, human_time, parse_size
from _harness.worker import (MWMS, group_cluster, mwms_ring,
                             set_tf_config)

DEFAULT_SIZES = (MiB, 16 * MiB, 64 * MiB, 256 * MiB)
QUICK_SIZES = (MiB, 64 * MiB)
DEFAULT_RANKS = (2, 4)
QUICK_RANKS = (2,)
DEFAULT_RUNS = 10
QUICK_RUNS = 3
WARMUP = 2

ALGORITHMS = ("lp", "ring", "tree", "rhd", "auto")
SYSTEM_KINDS = ("tf_rdma", "mwms", "mpi")
OPENMPI = "openmpi"
OP = "allreduce"
MOD = 251  # the inputs are (i mod MOD) + rank: exact sums in float32

LOG_PREFIX = "[allreduce] "

# Targets from the issue, at 64 MiB and P = 2; printed, never asserted.
TARGET_VS_MWMS = 5.0
TARGET_VS_MPI = 1.2
# What the issue measured on its machine, printed next to the verdict.
REFERENCE = {MWMS: 0.212, OPENMPI: 0.037}


def log(message):
    print(LOG_PREFIX + message, file=sys.stderr, flush=True)


def system_names(kind, algorithms):
    if kind == "tf_rdma":
        return [f"tf_rdma-{a}" for a in algorithms]
    return [MWMS if kind == "mwms" else OPENMPI]


# --- worker (one rank of one system) ---


class _Rank:
    """What every system's worker shares: inputs, checks, the timing loop."""

    def __init__(self, args, rank, nranks, system):
        self.args = args
        self.rank = rank
        self.nranks = nranks
        self.system = system
        self.doc = {"system": system, "rank": rank, "P": nranks,
                    "pid": os.getpid(), "info": {}, "times": {},
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

    def run(self, variants_for_size, sync):
        """variants_for_size(size, x) -> {name: call}; call() -> result."""
        import numpy as np
        for size in self.args.sizes:
            x, expected = self.inputs(size)
            variants = variants_for_size(size, x)
            times = {name: [] for name in variants}

            def error(name, message):
                self.doc["errors"].setdefault(name, {})[str(size)] = message
                print(f"{LOG_PREFIX}rank {self.rank}: {name} at "
                      f"{human_size(size)}: {message}", file=sys.stderr,
                      flush=True)

            for r in range(WARMUP + self.args.runs):
                for name in list(variants):
                    try:
                        sync()
                        t0 = time.perf_counter()
                        y = variants[name]()
                        dt = time.perf_counter() - t0
                    except Exception as err:  # noqa: BLE001 -- reported
                        # The op failed (the peers' calls fail too): the
                        # variant is dropped on this rank.
                        error(name, f"{type(err).__name__}: {err}"[:2000])
                        del variants[name]
                        times.pop(name)
                        continue
                    if r == 0 or r == WARMUP + self.args.runs - 1:
                        got = np.asarray(y).reshape(-1)
                        if not np.array_equal(got, expected):
                            # Reported (and left out of the results), but
                            # still called, so that the ranks stay in step.
                            bad = int(np.argmax(got != expected))
                            error(name, f"wrong result: element {bad} is "
                                        f"{float(got[bad])}, expected "
                                        f"{float(expected[bad])}")
                        del got
                    del y
                    if r >= WARMUP:
                        times[name].append(dt)
            for name, ts in times.items():
                self.doc["times"].setdefault(name, {})[str(size)] = ts
            self.save()  # partial results survive a later timeout
            del variants, x, expected
        self.doc["done"] = True
        self.save()


def worker_tf_rdma(args):
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

    @tf.function
    def barrier(t):
        return C.all_reduce(t, name="bench_sync", algorithm="tree",
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

    def variants_for_size(size, x_np):
        x = tf.constant(x_np)
        out = {}
        for alg in args.algorithms:
            fn = make(alg, size)
            out[f"tf_rdma-{alg}"] = lambda fn=fn: fn(x)
        return out

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
    me.run(variants_for_size, sync)


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

    comm.Barrier()
    me.run(variants_for_size, comm.Barrier)
    comm.Barrier()


def worker_main(args):
    return {"tf_rdma": worker_tf_rdma, "mwms": worker_mwms,
            "mpi": worker_mpi}[args.worker](args) or 0


# --- orchestrator ---


def _tf_rdma_missing():
    """Why tf_rdma's collectives cannot run here, or None."""
    try:
        import importlib.util
        import tf_rdma.ops  # noqa: F401 -- loads the op library (and TF)
        spec = importlib.util.find_spec("tf_rdma.collectives")
    except Exception as err:  # noqa: BLE001 -- reported as the reason
        return f"import tf_rdma failed: {type(err).__name__}: {err}"
    if spec is None:
        return "tf_rdma.collectives does not exist in this checkout"
    with open(spec.origin) as f:
        if "def all_reduce" not in f.read():
            return "tf_rdma.collectives has no all_reduce yet"
    return None


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
    if kind == "mpi":
        cmds = [["mpirun", "--allow-run-as-root", "--oversubscribe",
                 "-n", str(nranks)] + worker]
    else:
        add_local_cluster(env, nranks, log)
        if kind == "tf_rdma":
            make_tf_rdma_job(env, args.transport)
        cmds = [worker + ["--rank", str(r)] for r in range(nranks)]
    return run_processes(f"{kind} P={nranks}", cmds, env, out, args.timeout,
                         log, args.verbose)


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
            results.append(result_entry(
                name, OP, size, per_run, nranks,
                rank0_median_s=statistics.median(
                    rank0["times"][name][str(size)][:len(per_run)])))
    return results, errors


def busbw(size, nranks, seconds):
    """NCCL-style bus bandwidth (GB/s): size / time * 2(P-1)/P."""
    return size / seconds * 2 * (nranks - 1) / nranks / 1e9


def best_tf_rdma(by, size, nranks):
    found = [(r["median_s"], s) for (s, sz, p), r in by.items()
             if s.startswith("tf_rdma-") and sz == size and p == nranks]
    return min(found) if found else (None, None)


def print_tables(results, sizes, ranks):
    by = {(r["system"], r["size_bytes"], r["P"]): r for r in results}
    order = system_names("tf_rdma", ALGORITHMS) + [MWMS, OPENMPI]
    present = [s for s in order if any(r["system"] == s for r in results)]
    for nranks in ranks:
        if not any(r["P"] == nranks for r in results):
            continue
        print()
        print(f"allreduce (sum, float32), P = {nranks}: median time per "
              f"call, slowest rank")
        header = ["size"] + present + ["best tf_rdma", "busbw GB/s",
                                       "vs mwms", "vs openmpi"]
        rows = []
        for size in sizes:
            row = [human_size(size)]
            for s in present:
                r = by.get((s, size, nranks))
                row.append(human_time(r["median_s"]) if r else "-")
            best, name = best_tf_rdma(by, size, nranks)
            mwms = by.get((MWMS, size, nranks))
            mpi = by.get((OPENMPI, size, nranks))
            row.append(name[len("tf_rdma-"):] if name else "-")
            row.append(f"{busbw(size, nranks, best):.2f}" if best else "-")
            row.append(f"{mwms['median_s'] / best:.1f}x"
                       if best and mwms else "-")
            row.append(f"{mpi['median_s'] / best:.2f}x"
                       if best and mpi else "-")
            rows.append(row)
        print_table(header, rows)


def check_lines(results):
    """The issue's targets at 64 MiB, P = 2 (printed, never asserted)."""
    by = {(r["system"], r["size_bytes"], r["P"]): r for r in results}
    size, nranks = 64 * MiB, 2
    best, name = best_tf_rdma(by, size, nranks)
    if best is None:
        return ["64 MiB, P=2: no tf_rdma result, no verdict"]
    lines = []
    for system, target in ((MWMS, TARGET_VS_MWMS), (OPENMPI, TARGET_VS_MPI)):
        r = by.get((system, size, nranks))
        ref = (f"; reference machine: {human_time(REFERENCE[system])}")
        if r is None:
            lines.append(f"64 MiB, P=2: tf_rdma best ({name}) "
                         f"{human_time(best)} vs {system}: not measured "
                         f"(target >= {target:g}x){ref}")
            continue
        x = r["median_s"] / best
        lines.append(f"64 MiB, P=2: tf_rdma best ({name}) {human_time(best)}"
                     f" vs {system} {human_time(r['median_s'])}: {x:.2f}x "
                     f"(target >= {target:g}x): {verdict(x >= target)}{ref}")
    return lines


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
        system_names("tf_rdma", ALGORITHMS) + [MWMS, OPENMPI])}
    results.sort(key=lambda r: (r["P"], r["size_bytes"],
                                order.get(r["system"], 99)))
    for kind in SYSTEM_KINDS:
        for key, value in (info.get(kind) or {}).items():
            if key != "transport":
                run.machine.setdefault(key, value)
    print(f"{run.headline('allreduce benchmark')}; runs={args.runs} after "
          f"{WARMUP} warm-up; time of a run = slowest rank")
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
    for line in check_lines(results):
        print("check: " + line)
    run.finish()
    if args.json:
        config = {"runs": args.runs, "warmup": WARMUP,
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
                  "block_bytes": args.block_bytes,
                  "auto": auto,
                  "skipped": skipped, "failed": failed,
                  "errors": errors,
                  **run.timing()}
        write_json(args.json, run.document(config, results))
        print(f"wrote {args.json}")
    return 1 if failed or errors else 0


# --- main ---


def build_parser():
    parser = argparse.ArgumentParser(
        prog="python bench/allreduce.py",
        description="Allreduce benchmark: tf_rdma collectives (lp, ring, "
                    "tree, rhd, auto) vs MultiWorkerMirroredStrategy (RING, "
                    "gRPC) vs Open MPI (mpi4py), P local processes.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="See bench/README.md for how it measures.")
    parser.add_argument("--json", metavar="PATH",
                        help="also write the results as JSON to PATH")
    parser.add_argument("--sizes", nargs="+", type=parse_size, metavar="SIZE",
                        help="tensor sizes (1M 16M 64M 256M by default; "
                             "--quick: 1M 64M)")
    parser.add_argument("--ranks", nargs="+", type=int, metavar="P",
                        help="process counts (2 4 by default; --quick: 2)")
    parser.add_argument("--runs", type=int, metavar="N",
                        help=f"timed calls per measurement after {WARMUP} "
                             f"warm-up calls (default {DEFAULT_RUNS}; "
                             f"--quick: {QUICK_RUNS})")
    parser.add_argument("--quick", action="store_true",
                        help="1 MiB and 64 MiB, P = 2, few runs (a smoke "
                             "run, about 2 minutes)")
    parser.add_argument("--algorithms", nargs="+", choices=ALGORITHMS,
                        default=list(ALGORITHMS),
                        help="tf_rdma algorithms (default: all, and auto)")
    parser.add_argument("--systems", nargs="+", choices=SYSTEM_KINDS,
                        default=list(SYSTEM_KINDS),
                        help="systems to measure (default: all three)")
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
    # The orchestrator imports tf_rdma (TensorFlow) for free_ports only.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
