"""The simulator's entry points: the simulated time of one collective.

:func:`simulate` checks its arguments (with the cost model's checks, so the
messages match :func:`tf_rdma.collectives.cost.time`'s), builds an
:class:`~tf_rdma.collectives.simulate.engine.Engine` and plays the
algorithm's schedule on it; :func:`predicted_times` and
:func:`predicted_order` compare the algorithms.
"""

import math

from tf_rdma.collectives import cost
from tf_rdma.collectives.simulate.engine import Engine
from tf_rdma.collectives.simulate.schedules import SCHEDULES

__all__ = ["check_bus", "simulate", "predicted_times", "predicted_order"]


def check_bus(bus):
    """Returns ``bus`` as a float; raises ValueError unless it is a finite number >= 0."""
    if isinstance(bus, bool) or not isinstance(bus, (int, float)) or \
            not math.isfinite(bus) or bus < 0:
        raise ValueError(f"bus {bus!r} must be a finite number >= 0")
    return float(bus)


#: Above this many transfers (P² · blocks) oneshot is not played literally.
_ONESHOT_PLAYED_MAX = 1 << 18


def _oneshot_work(kind, n, P, p):
    # Σ bytes sent·β + bytes reduced·γ + bytes copied out·δ of all ranks.
    if kind == "allreduce":
        return P * (P - 1) * n * (p.beta + p.gamma)
    if kind == "allgather":
        return P * (P - 1) * n * (p.beta + p.delta)
    per = p.delta if kind == "broadcast" else p.gamma
    return (P - 1) * n * (p.beta + per)


def simulate(kind, algorithm, nbytes, P, block_bytes=None,
             params=cost.DEFAULT_PARAMS, depth=cost.DEFAULT_DEPTH, bus=0.0):
    """Simulated seconds of one collective, block by block.

    Args:
        kind: One of ``cost.KINDS``.
        algorithm: One of ``cost.ALGORITHMS``.
        nbytes: Message size in bytes; for allgather, each rank's piece.
        P: Number of ranks (>= 1).
        block_bytes: Block size; default :func:`cost.block_size` (of
            P·nbytes for allgather), as ``algorithm="auto"`` picks it.
        params: The model's :class:`cost.Params`.
        depth: Blocks a channel holds (>= 1), or None for no limit.
        bus: A shared memory bus, crudely: 0 (default) for none (ranks never
            slow each other down); else the result is at least ``bus`` times
            the per-byte work of all ranks together (Σ bytes sent·β +
            bytes reduced·γ + bytes copied out·δ, no α). ``bus=1``: one copy
            alone saturates the bus, so the ranks' copies and reductions
            effectively run one at a time; ``bus=0.5``: the bus carries two
            at full speed. Ignored by the closed forms of :mod:`cost`.

    Returns:
        The time in seconds at which the last rank is done (0.0 for P = 1 or
        nbytes = 0).

    Raises:
        ValueError: On a bad kind, algorithm, size, P, block size, depth or
            bus; the message names the value.
    """
    cost.check_kind(kind)
    cost.check_algorithm(algorithm)
    nbytes = cost.check_int("nbytes", nbytes, 0)
    P = cost.check_int("P", P, 1)
    if depth is not None:
        depth = cost.check_int("depth", depth, 1)
    cost.check_params(params)
    bus = check_bus(bus)
    if block_bytes is None:
        block_bytes = cost.block_size(
            nbytes * P if kind == "allgather" else nbytes, P, params)
    block_bytes = cost.check_int("block_bytes", block_bytes, 1)
    if P == 1 or nbytes == 0:
        return 0.0
    if algorithm == "oneshot" and P * P * -(-nbytes // block_bytes) > \
            _ONESHOT_PLAYED_MAX:
        # P(P-1) transfers per block, one Python step each, would take
        # minutes at hundreds of ranks; its closed form is exact for the
        # symmetric kinds (allreduce, allgather), and the test suite checks
        # the rest against the played schedule where that is cheap.
        return max(cost.time(kind, algorithm, nbytes, P, block_bytes,
                             params, depth or 1 << 40),
                   bus * _oneshot_work(kind, nbytes, P, params))
    e = Engine(P, block_bytes, params, depth)
    SCHEDULES[algorithm](e, kind, nbytes, P)
    return max(float(e.clock.max()), bus * e.work)


def predicted_times(kind, nbytes, P, params=cost.DEFAULT_PARAMS,
                    depth=cost.DEFAULT_DEPTH, algorithms=cost.ALGORITHMS,
                    block_bytes=None, bus=0.0):
    """Simulated seconds of each algorithm: a dict algorithm -> seconds.

    Args:
        kind: One of ``cost.KINDS``.
        nbytes: Message size in bytes (each rank's piece for allgather).
        P: Number of ranks.
        params: The model's :class:`cost.Params`.
        depth: Blocks a channel holds.
        algorithms: The algorithms to simulate.
        block_bytes: Block size for all of them (default: the model's b*,
            the block ``algorithm="auto"`` and an explicit algorithm without
            ``block_bytes`` use).
        bus: See :func:`simulate`.

    Returns:
        ``{algorithm: seconds}``, in the order of ``algorithms``.
    """
    return {a: simulate(kind, a, nbytes, P, block_bytes, params, depth, bus)
            for a in algorithms}


def predicted_order(kind, nbytes, P, params=cost.DEFAULT_PARAMS,
                    depth=cost.DEFAULT_DEPTH, algorithms=cost.ALGORITHMS,
                    block_bytes=None, bus=0.0):
    """The algorithms, fastest first, as the simulator predicts them.

    Args:
        kind: One of ``cost.KINDS``.
        nbytes: Message size in bytes (each rank's piece for allgather).
        P: Number of ranks.
        params: The model's :class:`cost.Params`.
        depth: Blocks a channel holds.
        algorithms: The algorithms to order.
        block_bytes: Block size for all of them (default: the model's b*).
        bus: See :func:`simulate`.

    Returns:
        A list of algorithm names, fastest first; ties in the order of
        ``cost.ALGORITHMS``.
    """
    times = predicted_times(kind, nbytes, P, params, depth, algorithms,
                            block_bytes, bus)
    # Times equal up to rounding (e.g. lp, tree and rhd broadcast at P = 2
    # are the same transfer) count as ties.
    return sorted(times, key=lambda a: (float(f"{times[a]:.9g}"),
                                        cost.ALGORITHMS.index(a)))
