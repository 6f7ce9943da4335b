"""How the verbs transport moves bytes: copies avoided and writes in flight.

Two worker processes over TF_RDMA_TRANSPORT=verbs — the host's RDMA device,
or softnic, the emulated NIC (tests/softnic/, `make softnic`), when the host
has none: then every number is labelled EMULATED and says nothing about
hardware (docs/verbs.md says what only hardware can show).

- ``copies``: the sender sends one static --size tensor --steps times, with
  implicit on-demand paging (``TF_RDMA_VERBS_ODP=auto``: read where it lies)
  and without (``off``: staged). Reported per setting: time per send, the
  sender's CPU seconds per GB sent (every thread of the process, the
  emulated NIC's included) and the pair counters (bytes staged / in place).
- ``in-flight``: 1 and --threads threads each send --writes small tensors on
  their own slot to the same peer, softnic sending each request --delay-us
  after its post (a long wire latency, so that writes that wait for each
  other's round trips show). Reported: writes per second and the most
  writes the pair had in flight.

    python bench/verbs_path.py [--size 64M] [--steps 20] [--threads 4]
                               [--writes 100] [--delay-us 1000] [--json PATH]
"""

import argparse
import json
import os
import sys

from _harness import nic
from _harness.children import (add_local_cluster, add_process_arguments,
                               make_tf_rdma_job, run_processes, work_dir,
                               worker_env)
from _harness.report import Run, print_table, save_json, write_json
from _harness.units import human_size, human_time, parse_size
from _harness.worker import group_cluster


# --- inside a worker ---


def worker(args):
    import numpy as np
    import tensorflow as tf
    import tf_rdma
    import threading
    import time

    cluster = group_cluster()
    sender = args.rank == 0
    task = f"worker:{args.rank}"
    tf_rdma.start_endpoint(task, cluster)

    def counters():
        info = tf_rdma.endpoint_info()
        pairs = [p for p in info["pairs"] if p["writer"] == info["task"]]
        return pairs[0].get("counters", {}) if pairs else {}

    doc = {"rank": args.rank, "device": tf_rdma.endpoint_info()["verbs"]}
    if args.scenario == "copies":
        n = args.size // 4
        plan = tf_rdma.Plan([tf_rdma.Transfer("t", "worker:0", "worker:1",
                                              "float32", [n])],
                            name="copies", depth=1)
        value = tf.constant(np.full(n, 1.5, dtype=np.float32))
        if sender:
            tf_rdma.ops.send(value, plan, "t")  # warm-up: connects
            before, cpu0, t0 = counters(), time.process_time(), time.perf_counter()
            for _ in range(args.steps):
                tf_rdma.ops.send(value, plan, "t")
            wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
            after = counters()
            doc.update(wall_s=wall, cpu_s=cpu,
                       counters={k: after[k] - before.get(k, 0) for k in after})
        else:
            for _ in range(args.steps + 1):
                tf_rdma.ops.recv(plan, "t")
    else:
        n = 1024  # 4 KiB
        plans = [tf_rdma.Plan([tf_rdma.Transfer(f"t{i}", "worker:0", "worker:1",
                                                "float32", [n])],
                              name=f"f{i}", depth=2)
                 for i in range(args.threads)]

        warm = threading.Barrier(args.threads + 1)

        def run(i):
            x = tf.fill([n], float(i))
            for w in range(args.writes + 1):  # the first connects: untimed
                if sender:
                    tf_rdma.ops.send(x, plans[i], f"t{i}")
                else:
                    tf_rdma.ops.recv(plans[i], f"t{i}")
                if w == 0:
                    warm.wait()

        threads = [threading.Thread(target=run, args=(i,))
                   for i in range(args.threads)]
        for t in threads:
            t.start()
        warm.wait()
        t0 = time.perf_counter()
        for t in threads:
            t.join()
        doc.update(wall_s=time.perf_counter() - t0, counters=counters())
    save_json(os.path.join(args.out, f"rank{args.rank}.json"), doc)


# --- the orchestrator ---


def run_group(args, base_env, scenario, extra_env, log, **worker_args):
    env = dict(base_env)
    make_tf_rdma_job(env, "verbs")
    env.update(extra_env)
    add_local_cluster(env, 2, log)
    label = f"{scenario} {' '.join(f'{k}={v}' for k, v in extra_env.items())}"
    with work_dir("tf_rdma_verbs_path_", args.keep, log) as out:
        cmds = [[sys.executable, os.path.abspath(__file__), "--worker", "verbs",
                 "--rank", str(r), "--out", out, "--scenario", scenario,
                 "--size", str(args.size), "--steps", str(args.steps),
                 "--writes", str(args.writes),
                 "--threads", str(worker_args.get("threads", args.threads))]
                for r in range(2)]
        docs, failure = run_processes(label, cmds, env, out, args.timeout, log,
                                      args.verbose)
    if failure:
        raise SystemExit(f"verbs_path: {label} failed: {failure}")
    return next(d for d in docs if d["rank"] == 0)


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="See docs/verbs.md for what the numbers mean.")
    parser.add_argument("--size", type=parse_size, default=parse_size("64M"),
                        help="bytes of the static tensor (default 64M)")
    parser.add_argument("--steps", type=int, default=20,
                        help="timed sends of it (default 20)")
    parser.add_argument("--threads", type=int, default=4,
                        help="sending threads of the in-flight run (default 4)")
    parser.add_argument("--writes", type=int, default=100,
                        help="4 KiB writes per thread (default 100)")
    parser.add_argument("--delay-us", type=int, default=1000,
                        help="softnic: each request leaves this long after "
                             "its post in the in-flight run, a wire latency "
                             "(default 1000)")
    parser.add_argument("--timeout", type=float, default=300,
                        help="seconds one group may take (default 300)")
    parser.add_argument("--nic", choices=nic.MODES, default="auto",
                        help="auto: the host's RDMA device if the engine can "
                             "use one, else softnic; hardware; emulated "
                             "(default auto)")
    parser.add_argument("--only", choices=("copies", "in-flight"),
                        help="run one of the two measurements")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--scenario", choices=("copies", "in-flight"),
                        help=argparse.SUPPRESS)
    add_process_arguments(parser, ["verbs"])
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)

    log = lambda msg: print(f"verbs_path: {msg}", file=sys.stderr, flush=True)
    run = Run("verbs_path", log)
    env, selection = nic.select(args.nic, worker_env(), log)
    if env is None:
        raise SystemExit(f"verbs_path: {selection['why']}")
    results = []
    for odp in ("auto", "off") if args.only != "in-flight" else ():
        doc = run_group(args, env, "copies", {"TF_RDMA_VERBS_ODP": odp}, log)
        c, gb = doc["counters"], args.size * args.steps / 1e9
        results.append({"scenario": "copies", "odp": odp, "device": doc["device"],
                        "send_s": doc["wall_s"] / args.steps,
                        "cpu_s_per_gb": doc["cpu_s"] / gb, "counters": c})
    # softnic only: each request leaves --delay-us after its post, a latency
    # that requests in flight together pay once (the responder's own
    # TF_RDMA_SOFTNIC_DELAY_US would serialize them instead).
    delay = {"TF_RDMA_SOFTNIC_SEND_DELAY_US": str(args.delay_us)}
    for threads in sorted({1, args.threads}) if args.only != "copies" else ():
        doc = run_group(args, env, "in-flight", delay, log, threads=threads)
        writes = threads * args.writes
        results.append({"scenario": "in-flight", "threads": threads,
                        "device": doc["device"],
                        "writes_per_s": writes / doc["wall_s"],
                        "counters": doc["counters"]})
    run.finish()
    # What the workers' engines said they ran on ("softnic0 (emulated) port
    # 1, ..."), not what this process guessed: the rule of `tf-rdma doctor`.
    emulated = any("(emulated)" in r["device"] for r in results)

    system = nic.system_name("verbs", emulated)
    print(run.headline(f"verbs data path ({system})"))
    if emulated:
        print(f"*** {nic.EMULATED_NOTE} ***")
    print(f"device: {results[0]['device']}")
    if args.only != "in-flight":
        print_table(
            ["copies", "per send", "CPU s/GB", "staged", "in place"],
            [[f"{human_size(args.size)} x{args.steps}, ODP {r['odp']}",
              human_time(r["send_s"]), f"{r['cpu_s_per_gb']:.2f}",
              human_size(r["counters"].get("bytes_staged", 0)),
              human_size(r["counters"].get("bytes_in_place", 0))]
             for r in results if r["scenario"] == "copies"])
    if args.only != "copies":
        print_table(
            ["in flight", "writes/s", "max in flight", "requests", "signaled"],
            [[f"{r['threads']} thread{'s' if r['threads'] > 1 else ''}"
              + (f", {args.delay_us} us latency" if emulated else ""),
              f"{r['writes_per_s']:.0f}",
              str(r["counters"].get("max_writes_in_flight", "?")),
              str(r["counters"].get("requests", "?")),
              str(r["counters"].get("signaled", "?"))]
             for r in results if r["scenario"] == "in-flight"])
    if args.json:
        write_json(args.json, run.document(
            {"size_bytes": args.size, "steps": args.steps, "nic": selection,
             "threads": args.threads, "writes": args.writes,
             "delay_us": args.delay_us if emulated else None, **run.timing()},
            [{"system": system, **r} for r in results]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
