"""The α-β-γ-δ cost model of the tf_rdma collectives, in closed form.

Four numbers describe the machine:

* α (``alpha``), seconds: the fixed cost of one block sent (the write, the
  completion word, the wake-up of the receiver);
* β (``beta``), seconds per byte: the time a sender spends per byte it sends;
* γ (``gamma``), seconds per byte: the time a receiver spends per byte it
  reduces into its buffer (reading the block in place in the channel);
* δ (``delta``), seconds per byte: the time a receiver spends per byte it
  copies out of the channel into its buffer (a receive that does not
  reduce). On shared memory that is a second memcpy, about β; by default
  δ = β.

Sending a block of ``s`` bytes keeps the sender busy for ``α + s·β``; the
block is in the receiver's channel at that moment. Reducing it costs the
receiver ``s·γ``, copying it out ``s·δ`` (see docs/collectives-model.md for
the rules and the limits: no contention between ranks for memory
bandwidth, among others).

:func:`time` gives the time of one collective for each kind and algorithm of
kernels/engine/collective.cc, as a formula of the message size ``n``, the
number of ranks ``P`` and the block size ``b``; :func:`block_size` gives the
block size the engine uses by default (the b* of linear pipelining), and
:func:`choose` the cheapest algorithm. The discrete-event simulator
(:mod:`tf_rdma.collectives.simulate`) plays the same schedules block by block
under the same model; the formulas here are exact where the derivation in
docs/collectives-model.md says so (LP broadcast, ring allreduce and
allgather, ...) and close approximations elsewhere; tests/test_cost_model.py
checks both against each other.

This module is pure Python (no TensorFlow, no numpy), so that the simulator
and ``algorithm="auto"`` can use it cheaply.
"""

import dataclasses
import functools
import math
import operator

__all__ = [
    "ALGORITHMS", "DEFAULT_DEPTH", "DEFAULT_PARAMS", "KINDS", "MAX_BLOCK",
    "MIN_BLOCK", "Params", "block_size", "choose", "time", "times",
    "check_algorithm", "check_int", "check_kind", "check_params", "tree_shape",
]

KINDS = ("allreduce", "broadcast", "reduce", "allgather")
ALGORITHMS = ("lp", "ring", "tree", "rhd", "oneshot")

#: Smallest and largest default block, bytes (block_size clamps b* to these).
#: The largest is 1 MiB because blocks that fit in the cache are faster than
#: the model says: a block is reduced (or copied out) right after the peer
#: wrote it, so a small one is still in the last-level cache. Measured on
#: the 2-vCPU VM (64 MiB allreduce, P = 2, every algorithm): 12.7-14.1 ms
#: with blocks of 256 KiB to 1 MiB, 17-21 ms with 2 to 8 MiB
#: (docs/benchmarks.md), where the calibrated α put b* at 8 MiB.
MIN_BLOCK = 64 << 10
MAX_BLOCK = 1 << 20
#: Blocks a channel holds by default (the engine's depth).
DEFAULT_DEPTH = 4


def _check_positive_finite(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} {value!r} must be a positive finite number, "
                         f"got a {type(value).__name__}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} {value!r} must be a positive finite number")


@dataclasses.dataclass(frozen=True)
class Params:
    """The machine as the cost model sees it.

    ``Params(alpha, beta, gamma)`` (the three-parameter form of earlier
    versions) still works: δ then defaults to β, the shared-memory case
    where both the sender's copy into the channel and the receiver's copy
    out of it are a memcpy.

    Attributes:
        alpha: Seconds per block sent (latency of one write + notice).
        beta: Seconds per byte sent (the sender's copy into the channel).
        gamma: Seconds per byte reduced by a receiver (in place, from the
            channel).
        delta: Seconds per byte a receiver copies out of the channel into
            its buffer (a receive that does not reduce). Default (None):
            equal to ``beta``.

    Raises:
        ValueError: If a value is not a positive finite number; the message
            names the parameter and the value.
    """

    alpha: float
    beta: float
    gamma: float
    delta: float = None

    def __post_init__(self):
        for field in ("alpha", "beta", "gamma"):
            _check_positive_finite(field, getattr(self, field))
        if self.delta is None:
            object.__setattr__(self, "delta", self.beta)
        _check_positive_finite("delta", self.delta)


# Defaults for shared memory on a small (2-core) VM: about 20 µs per block
# (a write, a notice and a wake-up through the engine), 4 GB/s of memcpy into
# the peer's region, 3 GB/s of element-wise reduction, 4 GB/s of memcpy out
# of the channel (δ = β: the same memcpy). They are used only until
# tf_rdma.collectives.calibrate() measures the real ones on the group.
DEFAULT_PARAMS = Params(alpha=20e-6, beta=1.0 / 4e9, gamma=1.0 / 3e9,
                        delta=1.0 / 4e9)


# The argument checks of this module's functions, public because the
# simulator (tf_rdma.collectives.simulate) takes the same arguments and
# reports them with the same messages. Each raises ValueError naming the
# argument and the value.


def check_kind(kind):
    """Raises ValueError unless ``kind`` is one of :data:`KINDS`."""
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r} is not one of {', '.join(KINDS)}")


def check_algorithm(algorithm):
    """Raises ValueError unless ``algorithm`` is one of :data:`ALGORITHMS`."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm {algorithm!r} is not one of "
                         f"{', '.join(ALGORITHMS)}")


def check_int(name, value, minimum):
    """Returns ``value`` (an int or numpy integer, not a bool or float) if
    it is at least ``minimum``; else raises ValueError naming ``name``."""
    try:
        if isinstance(value, bool):
            raise TypeError
        value = operator.index(value)  # int or numpy integer, not float
    except TypeError:
        raise ValueError(f"{name} {value!r} must be an integer >= {minimum}"
                         ) from None
    if value < minimum:
        raise ValueError(f"{name} {value!r} must be an integer >= {minimum}")
    return value


def check_params(params):
    """Raises ValueError unless ``params`` is a :class:`Params`."""
    if not isinstance(params, Params):
        raise ValueError(f"params {params!r} must be a "
                         f"tf_rdma.collectives.cost.Params")


def block_size(nbytes, P, params=DEFAULT_PARAMS):
    """The default block size: linear pipelining's optimum b*.

    An LP broadcast of n bytes in blocks of b costs about
    ``(P-2+n/b)·(α + b·(β+δ))`` for P >= 3 (a middle rank copies each block
    out, δ, then sends it on, α + b·β); its derivative in b vanishes at
    ``b* = sqrt(n·α / ((P-2)·(β+δ)))``: larger blocks lengthen the
    pipeline's fill (b(P-2)·(β+δ)), smaller ones pay α more often (n/b·α).
    At P = 2 the fill is one block's copy, b·min(β, δ), and the denominator
    is min(β, δ) (it is the larger of the two for P >= 3). b* is clamped to
    [MIN_BLOCK, MAX_BLOCK] and rounded down to a multiple of 64 bytes, so
    that a block is whole elements of every dtype and cache-line aligned;
    where that covers the whole message, the block is n rounded *up* to a
    multiple of 64 (at least 64), so that a small message is one block (400
    bytes: one block of 448, not 384 and then 16; one block is what the
    collectives' inline path takes).

    Args:
        nbytes: Message size in bytes (>= 0). For allgather, :func:`choose`
            passes the gathered size P·n.
        P: Number of ranks (>= 1); P = 1 is treated like P = 2.
        params: The model's :class:`Params`.

    Returns:
        The block size in bytes, an int >= 64 and a multiple of 64.

    Raises:
        ValueError: On a negative or non-integer ``nbytes`` or ``P`` < 1.
    """
    nbytes = check_int("nbytes", nbytes, 0)
    P = check_int("P", P, 1)
    check_params(params)
    fill = max((P - 2) * (params.beta + params.delta),
               min(params.beta, params.delta))
    b = math.sqrt(max(nbytes, 1) * params.alpha / fill)
    b = int(min(max(b, MIN_BLOCK), MAX_BLOCK)) // 64 * 64
    if b >= nbytes:  # the whole message: one block
        return max(64, -(-nbytes // 64) * 64)
    return b


def _blocks(nbytes, b):
    return -(-nbytes // b)


# ---------------------------------------------------------------------------
# Helpers shared by the formulas. A "transfer" of x bytes in blocks of b
# keeps its sender busy for ceil(x/b)·α + x·β; its receiver spends x·γ
# reducing it or x·δ copying it out.

def _send(x, b, p):
    return _blocks(x, b) * p.alpha + x * p.beta if x > 0 else 0.0


def _pipe_block(n, b):
    """(number of blocks, mean block bytes) of an n-byte message."""
    nb = _blocks(n, b)
    return nb, n / nb


def _pair(x, b, p, per, depth):
    # One rank sends x bytes to another, which spends `per` seconds per byte
    # receiving them (γ or δ): a two-stage flow shop of ceil(x/b) - 1 blocks
    # of b bytes and a last one of r, exactly. With a channel of one block
    # the sender waits for every receive, so the stages add up; else the
    # longest of the three paths (sends then the last receive; the first
    # send then all receives; all full sends, then the last two receives).
    if x <= 0:
        return 0.0
    nb = _blocks(x, b)
    r = x - (nb - 1) * b
    hb, gb = p.alpha + b * p.beta, b * per
    hr, gr = p.alpha + r * p.beta, r * per
    if nb == 1:
        return hr + gr
    if depth == 1:
        return (nb - 1) * (hb + gb) + hr + gr
    return max((nb - 1) * hb + hr + gr, hb + (nb - 2) * gb + gb + gr,
               (nb - 1) * hb + gb + gr)


def _transfer(x, b, p, depth):
    # One rank sends x bytes to another, which copies them out.
    return _pair(x, b, p, p.delta, depth)


def _gather_to_root(x, senders, b, p, depth):
    # `senders` ranks each send x bytes to the root at once; the root takes
    # them one after another, copying each block out (d). The first sender
    # streams (a two-stage pipeline); each later one already has its first
    # `depth` blocks in the channel, which the root copies out at d each;
    # the rest follow at max(h, d) each.
    if senders <= 0 or x <= 0:
        return 0.0
    nb, bb = _pipe_block(x, b)
    h = p.alpha + bb * p.beta
    d = bb * p.delta
    later = min(nb, depth) * d + max(0, nb - depth) * max(h, d)
    return _transfer(x, b, p, depth) + (senders - 1) * later


@functools.lru_cache(maxsize=256)
def tree_shape(P):
    """Per relative rank v of a binomial tree of P ranks: its children.

    The tree of kernels/engine/collective.cc (rank v's parent is v with its
    lowest set bit cleared); the simulator plays its schedules on it too.
    """
    children = []
    for v in range(P):
        kids = []
        mask = 1
        while mask < P:
            if v & mask:
                break
            if v + mask < P:
                kids.append(v + mask)
            mask <<= 1
        children.append(tuple(kids))
    return tuple(children)


def _tree_bcast(P, nb, h, d):
    # Children are served in the engine's order (v+1, v+2, v+4, ...): the
    # child v+2^p gets a block p+1 sends after its parent has it, and a rank
    # has a block once it copied it out (d). The first block reaches rank v
    # after sum over the set bits p of v of (p+1) sends, plus one copy per
    # rank on the way; then the slowest rank sets the pace: the root sends
    # each block L times, a rank with m children copies it and sends it m
    # times.
    first = max(sum(p + 1 for p in range(v.bit_length()) if v >> p & 1) * h
                + bin(v).count("1") * d for v in range(P))
    kids = tree_shape(P)
    pace = max([len(kids[0]) * h] + [d + len(kids[v]) * h
                                     for v in range(1, P)])
    return first + (nb - 1) * pace


def _tree_reduce_latency(P, g, h):
    # One block up the tree: a rank adds its children's blocks in order
    # (waiting for each), then sends the sum to its parent.
    children = tree_shape(P)
    ready = [0.0] * P  # when v's block arrives at its parent
    for v in range(P - 1, -1, -1):  # children have larger relative ranks
        t = 0.0
        for c in children[v]:
            t = max(t, ready[c]) + g
        ready[v] = t + h if v else t
    return ready[0]


def _tree_gather(P, n, b, p, depth):
    # Each rank receives its children's subtrees (copying them out, d per
    # block) one child after another, then sends its own subtree's pieces
    # to its parent.
    children = tree_shape(P)
    ready = [0.0] * P  # when v has received its subtree (starts sending up)
    for v in range(P - 1, -1, -1):
        t = 0.0
        for c in children[v]:
            low = c & -c
            x = (min(P, c + low) - c) * n
            nb, bb = _pipe_block(x, b)
            h = p.alpha + bb * p.beta
            d = bb * p.delta
            # c streams from when it is ready (v copying each block behind
            # it); if v is late, `depth` blocks wait in the channel, which v
            # copies out at d each, and the rest follow at max(h, d) each.
            t = max(ready[c] + _transfer(x, b, p, depth),
                    t + min(nb, depth) * d + max(0, nb - depth) * max(h, d))
        ready[v] = t
    return ready[0]


def _pair_reduce(nb, h, g, depth):
    # One rank sends nb blocks to another that reduces (or copies out) each:
    # a two-stage pipeline, paced by the slower stage; with a channel of one
    # block the sender must wait for each receive, so the stages add up.
    if depth == 1:
        return nb * (h + g)
    return h + g + (nb - 1) * max(h, g)


def _lp(kind, n, P, b, p, depth):
    nb, bb = _pipe_block(n, b)
    h = p.alpha + bb * p.beta
    g = bb * p.gamma
    d = bb * p.delta
    # A chain of P ranks is a flow shop: head (send: h), P-2 middle ranks
    # (receive + send: g+h reducing, d+h copying), tail (receive: g or d).
    # With identical blocks the last one leaves after sum(stages) +
    # (nb-1)·max(stage).
    if P == 2:
        bcast = _transfer(n, b, p, depth)
        red = _pair(n, b, p, p.gamma, depth)
    else:
        bcast = (P - 2 + nb) * (d + h)
        red = (P - 2 + nb) * (g + h)
    if kind == "broadcast":
        return bcast
    if kind == "reduce":
        return red
    if kind == "allreduce":
        return _lp_allreduce(n, P, b, p, depth)
    # allgather: P pieces of n bytes down the chain, then back up; the up
    # stream starts at each rank as soon as its down part is done, so the
    # two overlap. Rank 1 (the busiest with rank P-2) forwards one piece
    # down (d+h per block), sends its own down and up (h, h) and forwards
    # P-2 pieces up (d+h); the ranks' waits for each other add about one
    # copy per block (fitted to the simulator: one to two, depending on
    # h/d), the fill
    # 2P-5 block times and rank 0's last copy.
    if P == 2:
        return 2 * bcast
    waits = min(1, P - 3)
    return (nb * ((P + 1) * h + (P - 1 + waits) * d) + (2 * P - 5) * (h + d)
            + d)


def _lp_allreduce(n, P, b, p, depth):
    # The reduce and broadcast chains as one pipeline (Runner::LpAllReduce):
    # block k goes up the chain reduced and straight back down copied. With
    # h = α + b·β (a send), g = b·γ (a reduction), d = b·δ (a copy out): a
    # middle rank does w = 2h + g + d per block, rank 0 h + d, rank P-1
    # g + h. At P = 2 the two ranks' work overlaps: one block's round trip
    # (2h + g + d), then the slower rank's h + d or g + h per block. For
    # P >= 3 a middle rank is busy from its first block to its last, so the
    # time is its nb·w plus what reaches it before and leaves it after: the
    # chain's fill of P - 3 further block times and rank 0's first send and
    # last copy (h + d), fitted to the simulator (within 2% from 2 blocks).
    # A rank is one CPU in the model, so on shared memory, where a send is
    # the sender's copy, this is about the two chains' total; the combined
    # schedule wins where a send costs the CPU less than its link time (an
    # RDMA NIC's write): at P = 2 it then takes max(g, d) per block against
    # the chains' g + d.
    nb, bb = _pipe_block(n, b)
    h = p.alpha + bb * p.beta
    g = bb * p.gamma
    d = bb * p.delta
    w = 2 * h + g + d
    if P == 2:
        if depth == 1:  # each block waits for the last one to come back
            return nb * w
        return w + (nb - 1) * max(h + d, g + h)
    if nb == 1:
        return (P - 1) * w
    return (nb + P - 3) * w + h + d


def _oneshot(kind, n, P, b, p, depth):
    # Per block, every rank sends straight to every rank that needs its data
    # (Runner::OneShot). allreduce and allgather are symmetric: a rank's
    # (P-1) sends end when the last of its peers' sends to it has landed,
    # then it reduces (copies out) P-1 blocks, and the next block starts
    # when every rank is done with this one: exact. broadcast: the root
    # sends P-1 copies of each block, the receivers copy out (d each) at
    # the pace of the slower; reduce: P-1 senders, the root reduces P-1
    # blocks per block (approximate: the first block's send, then the
    # slower of the sends and the root's reductions).
    if kind in ("allreduce", "allgather"):
        per = p.gamma if kind == "allreduce" else p.delta
        return (P - 1) * (_blocks(n, b) * p.alpha + n * (p.beta + per))
    nb, bb = _pipe_block(n, b)
    h = p.alpha + bb * p.beta
    # With a channel of one block a sender waits for each receive: the
    # stages add up.
    if kind == "broadcast":
        d = bb * p.delta
        if depth == 1:
            return nb * ((P - 1) * h + d)
        return (P - 1) * h + d + (nb - 1) * max((P - 1) * h, d)
    g = bb * p.gamma
    if depth == 1:
        return nb * (h + (P - 1) * g)
    return h + (P - 1) * g + (nb - 1) * max(h, (P - 1) * g)


def _ring(kind, n, P, b, p, depth):
    c = _blocks(n, P)  # the largest chunk
    step = _send(c, b, p)
    if kind == "allgather":
        return (P - 1) * (_send(n, b, p) + n * p.delta)
    if kind == "allreduce":
        return (P - 1) * (2 * step + c * (p.gamma + p.delta))
    if kind == "broadcast":
        # The root scatters P-1 chunks, the last rank copies its last block
        # out, then the allgather phase.
        return ((P - 1) * step + _pipe_block(c, b)[1] * p.delta
                + (P - 1) * (step + c * p.delta))
    # reduce: reduce-scatter, then every rank sends its chunk to the root.
    return (P - 1) * (step + c * p.gamma) + _gather_to_root(c, P - 1, b, p,
                                                            depth)


def _tree(kind, n, P, b, p, depth):
    if kind == "allgather":
        nb, bb = _pipe_block(P * n, b)
        if P == 2:  # one transfer each way, exactly
            return _transfer(n, b, p, depth) + _transfer(2 * n, b, p, depth)
        return (_tree_gather(P, n, b, p, depth)
                + _tree_bcast(P, nb, p.alpha + bb * p.beta, bb * p.delta))
    L = (P - 1).bit_length()  # ceil(log2 P): the root's number of children
    nb, bb = _pipe_block(n, b)
    h = p.alpha + bb * p.beta
    g = bb * p.gamma
    d = bb * p.delta
    bcast = (_transfer(n, b, p, depth) if P == 2
             else _tree_bcast(P, nb, h, d))
    # Reduce: the root adds L children per block (L·g), a rank with m
    # children m·g + h; the slowest sets the pace.
    inner = max((len(k) for k in tree_shape(P)[1:]), default=0)
    pace = max(L * g, inner * g + h)
    red = _tree_reduce_latency(P, g, h) + (nb - 1) * pace
    if kind == "broadcast":
        return bcast
    if kind == "reduce":
        return red
    return red + bcast


def _exchange(x, y, b, p, reduce):
    # Both partners send x bytes and receive y bytes (reducing or copying),
    # block by block: per block a send, then a receive.
    per = p.gamma if reduce else p.delta
    return _blocks(max(x, y), b) * p.alpha + x * p.beta + y * per


def _rhd(kind, n, P, b, p, depth):
    active = 1 << (P.bit_length() - 1)
    extra = P - active
    steps = active.bit_length() - 1
    nb, bb = _pipe_block(n, b)
    if kind == "allgather":
        def run(k):  # pieces held by new ranks [k, ...]: first old rank
            return 2 * k if k < extra else k + extra
        total = _transfer(n, b, p, depth) if extra else 0.0
        d = 1
        while d < active:
            worst = 0.0
            for start in range(0, active, 2 * d):
                mine = (run(start + d) - run(start)) * n
                theirs = (run(start + 2 * d) - run(start + d)) * n
                worst = max(worst, _exchange(mine, theirs, b, p, False),
                            _exchange(theirs, mine, b, p, False))
            total += worst
            d *= 2
        if extra:
            total += _transfer(P * n, b, p, depth)
        return total
    # Halving/doubling step i moves n/2^i bytes each way (both partners at
    # once: one send and one receive per block).
    halves = [-(-n // (1 << i)) for i in range(1, steps + 1)]
    fold = _pair(n, b, p, p.gamma, depth) if extra else 0.0
    unfold = _transfer(n, b, p, depth) if extra else 0.0
    halving = sum(_exchange(s, s, b, p, True) for s in halves)
    doubling = sum(_exchange(s, s, b, p, False) for s in halves)
    part = -(-n // active)
    if kind == "allreduce":
        return fold + halving + doubling + unfold
    if kind == "reduce":
        return fold + halving + _gather_to_root(part, active - 1, b, p, depth)
    # broadcast: the root scatters the parts (the last rank copies its last
    # block out), doubling, unfold.
    return ((active - 1) * _send(part, b, p) + _pipe_block(part, b)[1] * p.delta
            + doubling + unfold)


def time(kind, algorithm, nbytes, P, block_bytes=None, params=DEFAULT_PARAMS,
         depth=DEFAULT_DEPTH):
    """Predicted seconds of one collective under the α-β-γ model.

    Args:
        kind: One of :data:`KINDS`.
        algorithm: One of :data:`ALGORITHMS`.
        nbytes: Message size in bytes; for ``allgather``, each rank's piece.
        P: Number of ranks (>= 1).
        block_bytes: Block size; default :func:`block_size` (of P·nbytes for
            allgather).
        params: The model's :class:`Params`.
        depth: Blocks a channel holds (matters only where a rank receives
            from many senders one after another: ring and rhd reduce).

    Returns:
        Seconds, a float >= 0; 0.0 when P == 1 or nbytes == 0.

    Raises:
        ValueError: On an unknown kind or algorithm, or a bad ``nbytes``,
            ``P``, ``block_bytes`` or ``depth``; the message names the value.
    """
    check_kind(kind)
    check_algorithm(algorithm)
    nbytes = check_int("nbytes", nbytes, 0)
    P = check_int("P", P, 1)
    depth = check_int("depth", depth, 1)
    check_params(params)
    if block_bytes is None:
        block_bytes = block_size(nbytes * P if kind == "allgather" else nbytes,
                                 P, params)
    block_bytes = check_int("block_bytes", block_bytes, 1)
    if P == 1 or nbytes == 0:
        return 0.0
    if algorithm == "lp":
        return _lp(kind, nbytes, P, block_bytes, params, depth)
    if algorithm == "ring":
        return _ring(kind, nbytes, P, block_bytes, params, depth)
    if algorithm == "tree":
        return _tree(kind, nbytes, P, block_bytes, params, depth)
    if algorithm == "oneshot":
        return _oneshot(kind, nbytes, P, block_bytes, params, depth)
    return _rhd(kind, nbytes, P, block_bytes, params, depth)


def choose(kind, nbytes, P, params=DEFAULT_PARAMS, algorithms=ALGORITHMS):
    """The cheapest algorithm under the model, and the block size to use.

    Args:
        kind: One of :data:`KINDS`.
        nbytes: Message size in bytes (each rank's piece for allgather).
        P: Number of ranks (>= 1).
        params: The model's :class:`Params`.
        algorithms: The candidates, a subset of :data:`ALGORITHMS`.

    Returns:
        ``(algorithm, block_bytes)``: the candidate with the smallest
        :func:`time`; ties go to the one earlier in :data:`ALGORITHMS`, so
        that every rank makes the same choice.

    Raises:
        ValueError: On a bad kind, algorithm, ``nbytes`` or ``P``, or an
            empty ``algorithms``.
    """
    check_kind(kind)
    algorithms = tuple(algorithms)
    if not algorithms:
        raise ValueError(f"algorithms {algorithms!r} is empty; pick from "
                         f"{', '.join(ALGORITHMS)}")
    for a in algorithms:
        check_algorithm(a)
    nbytes = check_int("nbytes", nbytes, 0)
    P = check_int("P", P, 1)
    b = block_size(nbytes * P if kind == "allgather" else nbytes, P, params)
    best = None
    for a in sorted(set(algorithms), key=ALGORITHMS.index):
        t = time(kind, a, nbytes, P, b, params)
        # Equal up to rounding (lp, tree and rhd broadcast at P = 2 are the
        # same transfer) is a tie: the earlier algorithm keeps it.
        if best is None or t < best[0] * (1 - 1e-9):
            best = (t, a)
    return best[1], b


def times(kind, nbytes, P, params=DEFAULT_PARAMS, depth=DEFAULT_DEPTH,
          algorithms=ALGORITHMS, block_bytes=None):
    """The closed-form :func:`time` of each algorithm, as a dict.

    Args:
        kind: One of :data:`KINDS`.
        nbytes: Message size in bytes (each rank's piece for allgather).
        P: Number of ranks (>= 1).
        params: The model's :class:`Params`.
        depth: Blocks a channel holds.
        algorithms: The algorithms, a subset of :data:`ALGORITHMS`.
        block_bytes: Block size for all of them (default :func:`block_size`,
            as :func:`choose` picks it).

    Returns:
        ``{algorithm: seconds}`` in the order of ``algorithms``.
        (``tf_rdma.collectives.simulate.predicted_times`` gives the
        simulator's, exact where these are approximations.)
    """
    return {a: time(kind, a, nbytes, P, block_bytes, params, depth)
            for a in algorithms}
