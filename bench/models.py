#!/usr/bin/env python3
"""Real networks end to end: parameter-server and data-parallel training of
CNNs, an LSTM and a Transformer against gRPC, MultiWorkerMirroredStrategy
and the same step without communication.

Usage::

    python bench/models.py [--quick] [--models vgg16 resnet50 ...]
                           [--modes ps dp] [--workers 2] [--ps 1]
                           [--json PATH] [--png PATH]

What it measures
----------------
The networks of ``bench/_harness/networks.py`` at their bench size (VGG-16,
ResNet-50 and MobileNetV2 on 32x32 images, Inception-v3 on 75x75, an LSTM
language model and a 4-layer Transformer encoder over 64 tokens; 16
examples per worker and step), on synthetic data, in two modes:

``ps`` (parameter-server training)
    TensorFlow 2's ``ParameterServerStrategy`` with a ``ClusterCoordinator``,
    ``--workers`` workers and ``--ps`` ps tasks, the network built with
    Keras 2 (``tf_keras``) in the strategy's scope: ``bench/ps.py --models
    NETWORKS`` measures ``pss-grpc`` (the step as a plain ``tf.function``:
    every ps <-> worker tensor over gRPC), ``pss-tf_rdma`` (the same step
    under ``tf_rdma.rewrite``) and ``ceiling`` (the same step on per-worker
    copies of the variables: no transfers, no ps task), window by window in
    turn on one cluster. See bench/ps.py for how.
``dp`` (data-parallel training)
    ``--workers`` worker processes training the Keras 3 network with the
    step ``model.fit`` runs (forward, loss, gradients, the optimizer's
    all-reduce and update; written as TensorFlow's multi-worker tutorial's
    custom loop, because Keras 3.15's ``fit`` fails under a multi-worker
    MWMS): ``bench/train.py --model NETWORK`` measures ``mwms-ring``
    (MultiWorkerMirroredStrategy, TensorFlow's collectives over gRPC),
    ``tf_rdma-auto`` (RdmaStrategy) and ``nocomm`` (the same workers, each
    applying its own gradients: the all-reduce skipped). See bench/train.py.

Each child prints its progress as it goes; this script gathers their JSON
documents into one table, one row per network:

- params, and the bytes a step moves: PS, every ps <-> worker byte of a
  step (tf_rdma's counters); DP, the gradient bytes each worker hands to
  the all-reduce;
- each system's samples/s (all workers together) and, beside it, its share
  of its mode's ceiling (ceiling step time / its step time).

The goals, printed as check lines and never asserted: PS tf_rdma and DP
RdmaStrategy each within 10% of their ceiling, and ahead of gRPC / MWMS
wherever communication is a visible share of the step (the baseline's step
at least 10% longer than the ceiling's). A missed share prints what bounds
it, from the children's measurements: for PS, bench/ps.py's bounds of the
machine (the CPU all tasks need per step spread over the CPUs, and the step
that involves the ps tasks with nothing to move); for DP, what the step as
it runs now allows (the workers' CPU per step, their collectives' spinning
included, spread over the CPUs: not a bound of the machine). The
children's own check lines (their other targets) follow.

``--png PATH`` draws the shares as grouped bars (matplotlib);
``--json PATH`` writes the table's rows with both children's documents.
The script never imports TensorFlow.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

from _harness import networks
from _harness.children import child_env
from _harness.report import Run, print_table, verdict, write_json
from _harness.units import human_size

LOG_PREFIX = "[models] "
MODES = ("ps", "dp")
HERE = os.path.dirname(os.path.abspath(__file__))

TARGET_SHARE = 0.9     # of the ceiling, both modes
VISIBLE = 1.1          # baseline step / ceiling step: communication shows

PS_SYSTEMS = ("pss-grpc", "pss-tf_rdma", "ceiling")
DP_SYSTEMS = ("mwms-ring", "tf_rdma-auto", "nocomm")


def log(message):
    print(LOG_PREFIX + message, file=sys.stderr, flush=True)


def run_child(label, cmd, timeout):
    """Runs a bench; its progress (stderr) shows, its report is kept.

    Returns:
      ``(stdout lines, None)``, or ``(lines, why it failed)``.
    """
    log(f"{label}: {' '.join(os.path.relpath(c) if c.endswith('.py') else c for c in cmd[1:])}")
    try:
        proc = subprocess.run(cmd, env=child_env(), stdout=subprocess.PIPE,
                              text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as e:
        out = e.stdout or ""
        if isinstance(out, bytes):
            out = out.decode(errors="replace")
        return out.splitlines(), f"did not end within {timeout:.0f} s"
    lines = proc.stdout.splitlines()
    if proc.returncode != 0:
        return lines, f"exit status {proc.returncode}"
    return lines, None


def read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def run_ps(args, workdir):
    """bench/ps.py over every network; its JSON document (or None) and
    what went wrong."""
    path = os.path.join(workdir, "ps.json")
    cmd = [sys.executable, os.path.join(HERE, "ps.py"), "--workers",
           str(args.workers), "--ps", *map(str, args.ps), "--models",
           *args.models, "--json", path] + (["--quick"] if args.quick else [])
    lines, failure = run_child("ps", cmd, args.timeout * len(args.models))
    return read_json(path), lines, failure


def run_dp(args, network, workdir):
    """bench/train.py on one network; its JSON document (or None), its
    check lines and what went wrong."""
    path = os.path.join(workdir, f"dp-{network}.json")
    cmd = [sys.executable, os.path.join(HERE, "train.py"), "--model",
           network, "--ranks", str(args.workers), "--systems", "mwms",
           "tf_rdma", "nocomm", "--json", path] + (
               ["--quick"] if args.quick else [])
    lines, failure = run_child(f"dp {network}", cmd, args.timeout)
    return read_json(path), lines, failure


def ps_rows(doc, network):
    """{ps tasks: {system: result}} of one network in bench/ps.py's JSON."""
    out = {}
    for r in (doc or {}).get("results", []):
        if r.get("model") == network and r["system"] in PS_SYSTEMS:
            out.setdefault(r["ps"], {})[r["system"]] = r
    return out


def ps_check(doc, network, ps):
    """bench/ps.py's check entry for one network and ps count, or None."""
    for c in (doc or {}).get("checks", []):
        if c["model"] == network and c["ps"] == ps:
            return c
    return None


def ps_shape_info(doc, network):
    """The network's entry of bench/ps.py's per-shape details, or {}."""
    for shape in (doc or {}).get("config", {}).get("shapes", []):
        for m in shape.get("models", []):
            if m["model"] == network:
                return m
    return {}


def share(ceiling, system):
    return ceiling["median_s"] / system["median_s"]


def cell(result, ceiling, samples):
    """A table cell: samples/s and, but for the ceiling, its share."""
    if result is None:
        return "-"
    text = f"{samples:.0f}"
    if ceiling is not None and result is not ceiling:
        text += f" ({100 * share(ceiling, result):.0f}%)"
    return text


def goal_line(mode, network, ours, base, ceiling, bound):
    """The check line of one mode and network against the goals.

    Args:
      mode: "PS" or "DP".
      ours, base, ceiling: The tf_rdma, baseline and ceiling results.
      bound: ``(text, cap)``: what bounds tf_rdma's share here, or None.
    """
    kept = share(ceiling, ours)
    line = (f"check: {mode} {network}: {ours['system']} "
            f"{100 * kept:.0f}% of the ceiling (goal >= "
            f"{100 * TARGET_SHARE:.0f}%): {verdict(kept >= TARGET_SHARE)}")
    if kept < TARGET_SHARE and bound is not None:
        text, cap = bound
        if cap is None:  # not the machine's bound: the step's as it runs
            line += f"; as the step runs now: {text}"
        else:
            line += (f"; {'out of reach here' if cap < TARGET_SHARE else 'bound'}"
                     f": {text}")
    visible = base["median_s"] >= VISIBLE * ceiling["median_s"]
    speedup = base["median_s"] / ours["median_s"]
    if visible:
        line += (f"; {speedup:.2f}x {base['system']} (communication is "
                 f"{100 * (1 - ceiling['median_s'] / base['median_s']):.0f}%"
                 f" of its step; goal: ahead): {verdict(speedup > 1)}")
    else:
        line += (f"; {speedup:.2f}x {base['system']} (whose step is within "
                 f"{100 * (VISIBLE - 1):.0f}% of the ceiling's: no goal)")
    return line


def ps_bound(check):
    """What bench/ps.py measured bounds tf_rdma's share: (text, cap)."""
    bound = (check or {}).get("bound") or {}
    caps = {k: v for k, v in (("CPU", bound.get("share_cpu")),
                              ("the empty step", bound.get("share_dispatch")))
            if v is not None}
    if not caps:
        return None
    text = ", ".join(f"at most {100 * v:.0f}% by {k}" for k, v in caps.items())
    return text, min(caps.values())


def dp_bound(doc, ours, nocomm):
    """The workers' CPU per step spread over the CPUs: (text, None).

    Not a bound of the machine (cap None): the workers' CPU time counts
    what their collectives spin while they wait for a peer, each on its
    own core, so it bounds the step as it runs now (bench/train.py's
    scaling line says the same).
    """
    cpus = (doc or {}).get("machine", {}).get("cores")
    if not cpus or "cpu_per_step_s" not in ours:
        return None
    cap = nocomm["median_s"] / (ours["cpu_per_step_s"] / cpus)
    return (f"the workers take {1e3 * ours['cpu_per_step_s']:.1f} ms of CPU "
            f"a step, spinning included (nocomm "
            f"{1e3 * nocomm.get('cpu_per_step_s', 0):.1f} ms), on {cpus} "
            f"CPUs: at most {100 * min(cap, 9.99):.0f}%"), None


def gather(args, ps_doc, dp_docs):
    """The table's rows and the check lines, from the children's JSON."""
    rows, lines, data = [], [], []
    for network in args.models:
        info = ps_shape_info(ps_doc, network)
        dp_doc = dp_docs.get(network)
        dp = {r["system"]: r for r in (dp_doc or {}).get("results", [])}
        dp_config = (dp_doc or {}).get("config", {})
        params = dp_config.get("params") or (
            info.get("weight_bytes", 0) // 4 or None)
        shape = "x".join(map(str, networks.input_shape(
            network, "test" if args.quick else "bench")))
        batch = networks.BATCH["test" if args.quick else "bench"]
        for ps, by in sorted(ps_rows(ps_doc, network).items()) or [(None, {})]:
            ceiling = by.get("ceiling")
            moved = (by.get("pss-tf_rdma") or {}).get("moved_bytes_per_step")
            payload = (dp.get("tf_rdma-auto") or {}).get(
                "payload_bytes_per_rank")
            entry = {"model": network, "input": shape,
                     "batch_per_worker": batch, "params": params,
                     "ps": ps, "ps_bytes_per_step": moved,
                     "dp_bytes_per_worker_step": payload, "ps_results": by,
                     "dp_results": dp}
            rows.append(
                [f"{network} ({shape}, {batch})"
                 + (f", {ps} ps" if len(args.ps) > 1 and ps else ""),
                 f"{params / 1e6:.1f} M" if params else "-",
                 " / ".join(human_size(int(b), exact=False) if b else "-"
                            for b in (moved, payload))]
                + [cell(by.get(s), ceiling, by[s]["steps_per_s"] * batch
                        if s in by else 0) for s in PS_SYSTEMS]
                + [cell(dp.get(s), dp.get("nocomm"),
                        dp[s]["samples_per_s"] if s in dp else 0)
                   for s in DP_SYSTEMS])
            if all(s in by for s in PS_SYSTEMS):
                entry["ps_share"] = share(ceiling, by["pss-tf_rdma"])
                lines.append(goal_line(
                    f"PS ({ps} ps)", network, by["pss-tf_rdma"],
                    by["pss-grpc"], ceiling,
                    ps_bound(ps_check(ps_doc, network, ps))))
            data.append(entry)
        if all(s in dp for s in DP_SYSTEMS):
            data[-1]["dp_share"] = share(dp["nocomm"], dp["tf_rdma-auto"])
            lines.append(goal_line(
                "DP", network, dp["tf_rdma-auto"], dp["mwms-ring"],
                dp["nocomm"], dp_bound(dp_doc, dp["tf_rdma-auto"],
                                       dp["nocomm"])))
    return rows, lines, data


def draw(path, data):
    """Grouped bars: each system's share of its mode's ceiling, per network."""
    try:
        import matplotlib  # pylint: disable=import-outside-toplevel
        matplotlib.use("Agg")
        from matplotlib import pyplot as plt  # pylint: disable=import-outside-toplevel
    except ImportError:
        print(f"--png needs matplotlib, which is not installed: no {path}")
        return
    systems = [("ps_results", "pss-grpc", "PS: gRPC", "ceiling"),
               ("ps_results", "pss-tf_rdma", "PS: tf_rdma", "ceiling"),
               ("dp_results", "mwms-ring", "DP: MWMS", "nocomm"),
               ("dp_results", "tf_rdma-auto", "DP: RdmaStrategy", "nocomm")]
    labels = [d["model"] + (f" ({d['ps']} ps)" if d["ps"] and len(
        {e["ps"] for e in data}) > 1 else "") for d in data]
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(data)), 4))
    width = 0.8 / len(systems)
    for k, (group, system, label, ceiling) in enumerate(systems):
        values = [share(d[group][ceiling], d[group][system])
                  if system in d[group] and ceiling in d[group] else 0
                  for d in data]
        ax.bar([i + (k - 1.5) * width for i in range(len(data))], values,
               width, label=label)
    ax.axhline(TARGET_SHARE, color="gray", linestyle="--", linewidth=1,
               label=f"goal ({100 * TARGET_SHARE:.0f}%)")
    ax.set_xticks(range(len(data)))
    ax.set_xticklabels(labels, rotation=20)
    ax.set_ylabel("share of the step without communication")
    ax.set_ylim(0, 1.2)
    ax.legend(ncol=5, fontsize=8, loc="upper center")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


def orchestrate(args):
    run = Run("models", log)
    size = "test" if args.quick else "bench"
    log(f"networks {', '.join(args.models)} ({size} size, "
        f"{networks.BATCH[size]} examples per worker and step); modes "
        f"{', '.join(args.modes)}; {args.workers} workers"
        + (f", {'/'.join(map(str, args.ps))} ps" if "ps" in args.modes else ""))
    failed, child_checks = [], []
    ps_doc, dp_docs = None, {}
    with tempfile.TemporaryDirectory(prefix="tf_rdma_models_") as workdir:
        if "ps" in args.modes:
            ps_doc, lines, failure = run_ps(args, workdir)
            child_checks += [f"  ps: {line[len('check: '):]}" for line in lines
                             if line.startswith("check: ")]
            if failure:
                failed.append(f"ps: {failure}")
        if "dp" in args.modes:
            for network in args.models:
                doc, lines, failure = run_dp(args, network, workdir)
                dp_docs[network] = doc
                child_checks += [f"  dp {network}: {line[len('check: '):]}"
                                 for line in lines if line.startswith("check: ")]
                if failure:
                    failed.append(f"dp {network}: {failure}")
    rows, lines, data = gather(args, ps_doc, dp_docs)
    print(f"{run.headline('real networks')}; {args.workers} workers; "
          f"{size} size, {networks.BATCH[size]} examples per worker and step")
    print("samples/s, all workers together, and (beside it) the share of the"
          " mode's ceiling: PS no transfers (per-worker variables), DP no "
          "communication (each worker applies its own gradients); bytes/step: "
          "PS every ps <-> worker byte of a step, DP each worker's "
          "gradients")
    print()
    print_table(["model (input, batch/worker)", "params", "bytes/step PS / DP"]
                + ["PS: gRPC", "PS: tf_rdma", "PS: no transfers",
                   "DP: MWMS", "DP: RdmaStrategy", "DP: no communication"],
                rows)
    print()
    for line in lines:
        print(line)
    if child_checks:
        print("the benches' own checks:")
        for line in child_checks:
            print(line)
    for f in failed:
        print(f"FAILED {f}")
    if args.png and data:
        draw(args.png, data)
    run.finish()
    if args.json:
        config = {"models": args.models, "modes": args.modes,
                  "workers": args.workers, "ps": args.ps, "size": size,
                  "batch_per_worker": networks.BATCH[size],
                  "quick": args.quick, "target_share": TARGET_SHARE,
                  "visible": VISIBLE, "failed": failed, **run.timing()}
        write_json(args.json, run.document(
            config, data, checks=lines, ps=ps_doc, dp=dp_docs))
        print(f"wrote {args.json}")
    return 1 if failed else 0


def build_parser():
    parser = argparse.ArgumentParser(
        prog="bench/models.py",
        description="Real networks (CNNs, an LSTM, a Transformer) trained "
                    "parameter-server style (ParameterServerStrategy: gRPC, "
                    "tf_rdma, no transfers) and data-parallel (MWMS, "
                    "RdmaStrategy, no communication); one table, check "
                    "lines against the goals, a PNG.")
    parser.add_argument("--models", nargs="+", choices=networks.NAMES,
                        default=list(networks.NAMES), metavar="NETWORK",
                        help=f"networks to run (default all: "
                             f"{' '.join(networks.NAMES)})")
    parser.add_argument("--modes", nargs="+", choices=MODES,
                        default=list(MODES),
                        help="ps, dp or both (default both)")
    parser.add_argument("--workers", type=int, default=2,
                        help="workers in both modes (default 2)")
    parser.add_argument("--ps", type=int, nargs="+", default=[1],
                        help="ps tasks, one cluster each (default 1)")
    parser.add_argument("--quick", action="store_true",
                        help="the networks' test size and the children's "
                             "quick runs: a smoke run of a few minutes")
    parser.add_argument("--timeout", type=float, metavar="S",
                        help="seconds per network and mode (default 900; "
                             "--quick 300)")
    parser.add_argument("--json", metavar="PATH",
                        help="write the rows and the children's documents")
    parser.add_argument("--png", metavar="PATH",
                        help="draw the shares of the ceilings (matplotlib)")
    return parser


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.workers < 2:
        parser.error(f"--workers must be at least 2 (data-parallel training "
                     f"needs two), got {args.workers}")
    if any(p < 1 for p in args.ps):
        parser.error(f"--ps takes counts of at least 1, got {args.ps}")
    if args.timeout is None:
        args.timeout = 300.0 if args.quick else 900.0
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
