"""``tf-rdma simulate`` (also ``python -m tf_rdma.collectives.simulate``).

Prints the predicted time of every algorithm for each size and number of
ranks, a "claims" section that checks linear pipelining's two claims (cost
nearly flat in P; up to twice the bandwidth of recursive halving/doubling
for broadcast), and with ``--png`` and ``--json`` writes plots and the
numbers.
"""

import argparse
import json
import math
import sys
import time as _time

from tf_rdma.collectives import cost
from tf_rdma.collectives.simulate.plots import plot
from tf_rdma.collectives.simulate.predict import check_bus
from tf_rdma.collectives.simulate.sweeps import (claims, format_size,
                                                 format_time, parse_ranks,
                                                 parse_size, sweep)
from tf_rdma.subcommand import Command

__all__ = ["COMMAND", "add_arguments", "run", "main"]

_PREFIX = "tf-rdma simulate: "


def _claims_text(c):
    n, p0, p1 = format_size(c["nbytes"]), c["P_small"], c["P_large"]
    t = c["times"]
    lines = [f"claims (simulated, {n}):",
             f"  1. lp nearly flat in P (P = {p0} -> {p1}, x{p1 / p0:g}; "
             f"a log P cost grows x{c['log2_ratio']:.3g}):"]
    for kind in ("broadcast", "allreduce"):
        lp, tree = c["growth"][(kind, "lp")], c["growth"][(kind, "tree")]
        lines.append(
            f"     {kind:9}: lp x{lp:.2f} ({format_time(t[(kind, 'lp')][p0])} -> "
            f"{format_time(t[(kind, 'lp')][p1])}), tree x{tree:.2f} "
            f"({format_time(t[(kind, 'tree')][p0])} -> "
            f"{format_time(t[(kind, 'tree')][p1])}): "
            + ("holds" if lp < c["log2_ratio"] and lp < tree / 2
               else "does NOT hold here"))
    lines.append(
        f"     at P = {p1}, {c['lp_latency_share']:.0%} of lp broadcast's "
        f"time is its latency term (P-2+n/b)*alpha; the rest, the bandwidth "
        f"term, barely depends on P")
    best = c["best_P"]
    r = c["rhd_over_lp"][best]
    each = ", ".join(f"P={P}: x{v:.2f}" for P, v in c["rhd_over_lp"].items())
    lines.append(
        f"  2. lp broadcast vs rhd (scatter + allgather): rhd takes up to "
        f"x{r:.2f} lp's time (at P = {best}) -> lp has up to {r:.2f}x its "
        f"bandwidth; the paper (a free copy out): up to 2x; this model: "
        f"up to x{c['rhd_over_lp_bound']:.2f}. "
        + ("holds" if r >= 1.5 else "does NOT hold here"))
    lines.append(f"     rhd/lp by P: {each}")
    return lines


_USAGE = ("%(prog)s [-h] [--kind KINDS] [--algorithms ALGS] [--sizes SIZES] "
          "[--ranks RANKS] [--alpha S] [--beta S/B] [--gamma S/B] "
          "[--delta S/B] [--bus F] [--depth N] [--png DIR] [--json PATH] "
          "[--no-claims]")

_DESCRIPTION = """\
Simulate the tf_rdma collectives (lp, ring, tree, rhd, oneshot) block by
block under the alpha-beta-gamma-delta cost model: a block of s bytes costs its sender
alpha + s*beta, its receiver s*gamma to reduce it or s*delta to copy it out
of the channel, and a channel holds --depth blocks. Prints the simulated time of every algorithm per kind, size
and number of ranks, the closed-form model's time next to it, and a claims
section (lp nearly flat in P; lp broadcast up to ~2x rhd's bandwidth).
"""

_EPILOG = """\
examples:
  %(prog)s --kind broadcast,allreduce --sizes 1MiB,64MiB --ranks 2-1024
  %(prog)s --sizes 64MiB --ranks 2,4,8 --json sim.json --png plots/

exit status: 0 on success, 1 on an error (e.g. --png without matplotlib),
2 on a usage error.
"""


def _csv(allowed, what):
    def parse(text):
        items = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in items if x not in allowed]
        if bad or not items:
            raise argparse.ArgumentTypeError(
                f"{what} {text!r}: each must be one of {', '.join(allowed)}")
        return items
    return parse


def _arg(parse, what):
    def f(text):
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    f.__name__ = what
    return f


def _positive_float(name):
    def f(text):
        try:
            v = float(text)
        except ValueError:
            v = float("nan")
        if not math.isfinite(v) or v <= 0:
            raise argparse.ArgumentTypeError(
                f"--{name} {text!r} must be a positive finite number")
        return v
    return f


def _bus_arg(text):
    try:
        return check_bus(float(text))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--bus {text!r} must be a finite number >= 0") from None


def _depth_arg(text):
    if text.isdigit() and int(text) >= 1:
        return int(text)
    if text == "inf":
        return None
    raise argparse.ArgumentTypeError(
        f"--depth {text!r} must be an integer >= 1 or 'inf'")


def add_arguments(parser):
    """Adds the ``simulate`` options to an argparse parser."""
    d = cost.DEFAULT_PARAMS
    parser.add_argument(
        "--kind", type=_csv(cost.KINDS, "--kind"),
        default=["broadcast", "allreduce"],
        help="comma-separated kinds (default broadcast,allreduce; also "
             "reduce, allgather)")
    parser.add_argument(
        "--algorithms", type=_csv(cost.ALGORITHMS, "--algorithms"),
        default=list(cost.ALGORITHMS),
        help="comma-separated algorithms (default lp,ring,tree,rhd)")
    parser.add_argument(
        "--sizes", type=_arg(lambda t: [parse_size(x) for x in t.split(",")],
                             "sizes"),
        default=[1 << 20, 64 << 20],
        help="comma-separated message sizes, e.g. 1MiB,64MiB (default); "
             "for allgather each rank's piece")
    parser.add_argument(
        "--ranks", type=_arg(parse_ranks, "ranks"),
        default=parse_ranks("2-1024"),
        help="comma-separated numbers of ranks, or LO-HI for the powers of "
             "two between (default 2-1024)")
    parser.add_argument("--alpha", type=_positive_float("alpha"),
                        default=d.alpha,
                        help=f"seconds per block sent (default {d.alpha:g})")
    parser.add_argument("--beta", type=_positive_float("beta"), default=d.beta,
                        help=f"seconds per byte sent (default {d.beta:g})")
    parser.add_argument("--gamma", type=_positive_float("gamma"),
                        default=d.gamma,
                        help=f"seconds per byte reduced (default {d.gamma:g})")
    parser.add_argument("--delta", type=_positive_float("delta"),
                        default=None,
                        help="seconds per byte a receiver copies out of a "
                             "channel (default: --beta)")
    parser.add_argument("--bus", type=_bus_arg, default=0.0,
                        help="shared memory bus: the simulated time is at "
                             "least F times all ranks' per-byte work (1: "
                             "copies run one at a time; default 0: no bus)")
    parser.add_argument("--depth", type=_depth_arg, default=cost.DEFAULT_DEPTH,
                        help=f"blocks a channel holds, or inf (default "
                             f"{cost.DEFAULT_DEPTH})")
    parser.add_argument("--png", metavar="DIR", default=None,
                        help="write time-vs-P and time-vs-size plots per kind "
                             "into DIR (needs matplotlib)")
    parser.add_argument("--json", metavar="PATH", default=None,
                        help="write the parameters and every result as JSON")
    parser.add_argument("--no-claims", action="store_true",
                        help="skip the claims section (it simulates lp, tree "
                             "and rhd at the largest size over --ranks)")


def run(args, parser=None):  # pylint: disable=unused-argument
    """Runs ``tf-rdma simulate`` with parsed arguments; returns the exit status."""
    if args.png:
        try:
            import matplotlib  # pylint: disable=import-outside-toplevel,unused-import
        except ImportError:
            print(f"{_PREFIX}--png needs matplotlib, which is not installed "
                  f"(pip install matplotlib)", file=sys.stderr)
            return 1
    try:
        params = cost.Params(args.alpha, args.beta, args.gamma, args.delta)
    except ValueError as exc:
        print(f"{_PREFIX}{exc}", file=sys.stderr)
        return 1
    start = _time.perf_counter()
    rows = sweep(args.kind, args.algorithms, args.sizes, args.ranks, params,
                 args.depth, args.bus)
    out = sys.stdout
    depth = "inf" if args.depth is None else args.depth
    print(f"alpha = {params.alpha:g} s, beta = {params.beta:g} s/B "
          f"({1 / params.beta / 1e9:.2f} GB/s), gamma = {params.gamma:g} s/B "
          f"({1 / params.gamma / 1e9:.2f} GB/s), delta = {params.delta:g} s/B "
          f"({1 / params.delta / 1e9:.2f} GB/s), depth = {depth}"
          + (f", bus = {args.bus:g}" if args.bus else ""), file=out)
    by = {(r["kind"], r["algorithm"], r["size_bytes"], r["P"]): r for r in rows}
    for kind in args.kind:
        for n in args.sizes:
            print(f"\n{kind}, {format_size(n)}"
                  + (" per rank" if kind == "allgather" else "")
                  + ": simulated (closed form)", file=out)
            head = f"{'P':>6} {'block':>10}  " + "  ".join(
                f"{a:>22}" for a in args.algorithms) + "  fastest"
            print(head, file=out)
            for P in args.ranks:
                cells = []
                best = None
                for a in args.algorithms:
                    r = by[(kind, a, n, P)]
                    cells.append(f"{format_time(r['simulated_s']):>10} "
                                 f"({format_time(r['model_s']):>9})")
                    if best is None or r["simulated_s"] < best[0]:
                        best = (r["simulated_s"], a)
                b = by[(kind, args.algorithms[0], n, P)]["block_bytes"]
                blk = f"{b / 1024:.1f}KiB" if b >= 1024 else f"{b}B"
                print(f"{P:>6} {blk:>10}  "
                      + "  ".join(cells) + f"  {best[1]}", file=out)
    result = {"params": {"alpha": params.alpha, "beta": params.beta,
                         "gamma": params.gamma, "delta": params.delta},
              "depth": args.depth, "bus": args.bus, "results": rows}
    if not args.no_claims and len(set(args.ranks)) < 2:
        print("\n(no claims section: it needs two numbers of ranks at least)",
              file=out)
    elif not args.no_claims:
        c = claims(params, max(args.sizes), args.ranks, depth=args.depth,
                   bus=args.bus)
        print("", file=out)
        for line in _claims_text(c):
            print(line, file=out)
        result["claims"] = {
            "nbytes": c["nbytes"], "P_small": c["P_small"],
            "P_large": c["P_large"], "log2_ratio": c["log2_ratio"],
            "lp_latency_share": c["lp_latency_share"],
            "growth": {f"{k}/{a}": v for (k, a), v in c["growth"].items()},
            "rhd_over_lp_broadcast": {str(P): v for P, v
                                      in c["rhd_over_lp"].items()}}
    print(f"\n({len(rows)} simulations in "
          f"{_time.perf_counter() - start:.1f} s)", file=out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}", file=out)
    if args.png:
        for path in plot(rows, args.kind, args.algorithms, args.sizes,
                          args.ranks, args.png):
            print(f"wrote {path}", file=out)
    return 0


def main(argv=None):
    """Runs the simulator's command line (``python -m ...simulate``)."""
    return COMMAND.main(sys.argv[1:] if argv is None else argv,
                        prog="python -m tf_rdma.collectives.simulate")


#: ``tf-rdma simulate``, for the ``tf-rdma`` parser (tf_rdma.cli).
COMMAND = Command(
    name="simulate",
    help="simulate the collectives (lp, ring, tree, rhd, oneshot) under the "
         "alpha-beta-gamma cost model",
    usage=_USAGE,
    description=_DESCRIPTION,
    epilog=_EPILOG,
    add_arguments=add_arguments,
    run=run,
)
