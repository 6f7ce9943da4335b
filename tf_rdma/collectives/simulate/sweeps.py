"""Sweeps of the simulator over kinds, algorithms, sizes and ranks, and
linear pipelining's two claims checked in it.

Also how sizes, numbers of ranks and times are written: parsed from the
command line's text (:func:`parse_size`, :func:`parse_ranks`) and formatted
for its tables (:func:`format_size`, :func:`format_time`).
"""

import math
import re

from tf_rdma.collectives import cost
from tf_rdma.collectives.simulate.predict import simulate

__all__ = ["parse_size", "parse_ranks", "format_size", "format_time",
           "sweep", "claims"]

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10,
          "m": 1 << 20, "mb": 1000 ** 2, "mib": 1 << 20, "g": 1 << 30,
          "gb": 1000 ** 3, "gib": 1 << 30}


def parse_size(text):
    """Parses "64MiB", "1M", "512KiB", "4096" into bytes (an int >= 0).

    Raises:
        ValueError: If the text is not a number with an optional unit.
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS:
        raise ValueError(f"size {text!r} is not a number of bytes with an "
                         f"optional unit (B, KiB, MiB, GiB, KB, MB, GB)")
    return int(float(m.group(1)) * _UNITS[unit])


def parse_ranks(text):
    """Parses "2,4,8" or "2-1024" (powers of two from 2 to 1024) into ints."""
    out = []
    for part in str(text).split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d+)-(\d+)", part)
        if m:
            lo, hi = int(m.group(1)), int(m.group(2))
            if lo < 1 or hi < lo:
                raise ValueError(f"ranks range {part!r} must be LO-HI with "
                                 f"1 <= LO <= HI")
            v = lo
            while v <= hi:
                out.append(v)
                v *= 2
        elif part.isdigit() and int(part) >= 1:
            out.append(int(part))
        else:
            raise ValueError(f"ranks {part!r} is not a positive integer or a "
                             f"range LO-HI")
    return out


def format_size(n):
    """``1MiB``, ``64KiB``, ``100B``: the largest unit that divides ``n``."""
    for unit, f in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= f and n % f == 0:
            return f"{n // f}{unit}"
    return f"{n}B"


def format_time(t):
    """Seconds for a table: ``1.234 s``, ``12.345 ms``, ``56.7 us``."""
    if t >= 1:
        return f"{t:.3f} s"
    if t >= 1e-3:
        return f"{t * 1e3:.3f} ms"
    return f"{t * 1e6:.1f} us"


def sweep(kinds, algorithms, sizes, ranks, params=cost.DEFAULT_PARAMS,
          depth=cost.DEFAULT_DEPTH, bus=0.0):
    """Simulates every combination; returns a list of result dicts.

    Each dict has kind, algorithm, size_bytes, P, block_bytes, simulated_s
    and model_s (the closed form of :func:`cost.time`, which has no bus).
    """
    rows = []
    for kind in kinds:
        for n in sizes:
            for P in ranks:
                b = cost.block_size(n * P if kind == "allgather" else n, P,
                                    params)
                for a in algorithms:
                    rows.append({
                        "kind": kind, "algorithm": a, "size_bytes": n, "P": P,
                        "block_bytes": b,
                        "simulated_s": simulate(kind, a, n, P, b, params,
                                                depth, bus),
                        "model_s": cost.time(kind, a, n, P, b, params,
                                             depth or 1 << 40),
                    })
    return rows


def claims(params=cost.DEFAULT_PARAMS, nbytes=64 << 20, ranks=None,
           depth=cost.DEFAULT_DEPTH, bus=0.0):
    """Checks linear pipelining's two claims in the simulator.

    1. LP's cost is nearly flat in P: from the smallest to the largest P of
       ``ranks``, LP broadcast and allreduce of ``nbytes`` grow by a small
       factor, the pipelined binomial tree by about log2 P.
    2. LP broadcast has up to ~2x the bandwidth of rhd broadcast (scatter +
       allgather moves the message twice): rhd time / lp time at each P.

    Args:
        params: The model's :class:`cost.Params`.
        nbytes: The message size (a large one: the claims are about
            bandwidth).
        ranks: Numbers of ranks (default 2, 4, ..., 1024).
        depth: Blocks a channel holds.
        bus: See :func:`simulate`.

    Returns:
        A dict with ``nbytes``, ``P_small``, ``P_large``; ``times`` mapping
        (kind, algorithm) to {P: seconds}; ``growth`` mapping (kind,
        algorithm) to time(P_large) / time(P_small); ``log2_ratio``
        (log2 P_large / log2 P_small, the growth of a log P cost);
        ``lp_latency_share`` (the part of lp broadcast's time at P_large that
        is its α term); ``rhd_over_lp`` mapping P to rhd / lp broadcast
        time; ``best_P``, the P where that ratio is largest; and
        ``rhd_over_lp_bound``, its large-n limit (2β+δ)/(β+δ) (2 with a free
        copy out, 1.5 with δ = β).
    """
    ranks = sorted(set(ranks or parse_ranks("2-1024")))
    if len(ranks) < 2:
        raise ValueError(f"ranks {ranks!r}: the claims need two numbers of "
                         f"ranks at least")
    p0, p1 = ranks[0], ranks[-1]
    times = {}
    for kind in ("broadcast", "allreduce"):
        for a in ("lp", "tree"):
            times[(kind, a)] = {P: simulate(kind, a, nbytes, P, None, params,
                                            depth, bus) for P in (p0, p1)}
    growth = {k: v[p1] / v[p0] for k, v in times.items()}
    ratio = {}
    for P in ranks:
        lp = simulate("broadcast", "lp", nbytes, P, None, params, depth, bus)
        ratio[P] = simulate("broadcast", "rhd", nbytes, P, None, params,
                            depth, bus) / lp
    b = cost.block_size(nbytes, p1, params)
    latency = (p1 - 2 + -(-nbytes // b)) * params.alpha
    return {"nbytes": nbytes, "P_small": p0, "P_large": p1, "times": times,
            "growth": growth,
            "log2_ratio": math.log2(p1) / math.log2(max(2, p0)),
            "lp_latency_share": latency / times[("broadcast", "lp")][p1],
            "rhd_over_lp": ratio, "best_P": max(ratio, key=ratio.get),
            "rhd_over_lp_bound": (2 * params.beta + params.delta)
                                 / (params.beta + params.delta)}
