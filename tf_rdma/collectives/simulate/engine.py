"""A discrete-event simulator of the tf_rdma collectives under the α-β-γ-δ model.

It plays the schedules of kernels/engine/collective.cc block by block: every
rank runs its program one operation after another, and

* sending a block of s bytes keeps the sender busy for α + s·β; the block is
  in the receiver's channel when the send ends;
* receiving a block waits until it is there; reducing it (in place, from
  the channel) costs the receiver s·γ, copying it out of the channel into
  its buffer s·δ;
* a channel (one direction between two ranks) holds ``depth`` blocks: the
  sender of the k-th block on a channel first waits until the receiver has
  consumed (finished receiving) block k - depth.

There is no contention between different channels (every link and every
rank's memory bandwidth are independent), which is the model's assumption,
not the simulator's; the optional ``bus`` of :func:`simulate` adds a crude
shared memory bus (a lower bound on the time from the total copy and
reduction work of all ranks). The result is the time at which the last rank
finishes.

Run it as ``python -m tf_rdma.collectives.simulate`` or ``tf-rdma simulate``
(``--help`` for the options); it prints the predicted time of every
algorithm for each size and number of ranks, a "claims" section that checks
linear pipelining's two claims (cost nearly flat in P; up to twice the
bandwidth of recursive halving/doubling for broadcast), and with ``--png``
and ``--json`` writes plots and the numbers.

The simulator is pure Python + numpy (matplotlib only for ``--png``, imported
when asked for) and never imports TensorFlow itself.
"""

import argparse
import json
import math
import os
import re
import sys
import time as _time

import numpy as np

from tf_rdma.collectives import cost
from tf_rdma.subcommand import Command

__all__ = ["simulate", "predicted_order", "predicted_times", "sweep",
           "claims", "add_arguments", "run", "main", "parse_size",
           "parse_ranks", "COMMAND"]

_PREFIX = "tf-rdma simulate: "

# Above this many ranks the channel table is a dict instead of a P x P array.
_DENSE_CHANNEL_TABLE_MAX_P = 2048


# ---------------------------------------------------------------------------
# How the simulation is computed.
#
# A literal event loop (a heap of events, one per block send and receive)
# would take minutes at P = 1024: a ring allreduce there is 2(P-1) steps of
# P sends and P receives each, about four million events in Python. The
# schedules, though, are made of four patterns, and within each pattern the
# dependencies between the ranks' operations are simple enough to compute a
# whole set of them at once with numpy, exactly, without reordering anything
# the model would order differently:
#
# * Exchange (ring steps, rhd steps, the fold): in iteration k every rank
#   sends its block k (after its own receive of block k-1 and after the
#   credit of its outgoing channel), then receives block k from its source,
#   which was sent in the same iteration. Vectorised over ranks, one Python
#   iteration per block.
# * Chain flow (lp): rank i of the chain receives block k from rank i-1 and
#   forwards it to rank i+1. For one block k the send-end times S_i obey
#   S_i = max(S_{i-1} + g + h, t_i + g + h, C_i + h) (g: the receive, a
#   reduction or a copy out; t_i: the rank's clock, C_i: the credit of its
#   outgoing channel), a running maximum:
#   S_i = i·a + cummax_j(z_j - j·a) with a = g + h. One Python iteration per
#   block, vectorised over the chain.
# * Tree flow (tree): for one block, the ranks of one depth of the binomial
#   tree at once; a rank's sequential sends to its children (or receives
#   from them) are again a running maximum along its children. One Python
#   iteration per block and tree level.
# * Point to point (scatter from a root, gather to a root, tree gather): one
#   sender, one receiver, both doing nothing else meanwhile: a scalar loop.
#
# The algorithms call these patterns in an order that respects every rank's
# program order and puts every block's send before its receive, so each
# time is computed once, from times already known. Channel credits carry
# over from one pattern to the next (the ring's reduce-scatter and
# allgather use the same channels).


class _Engine:
    """Clocks of the P ranks and the state of the channels between them."""

    def __init__(self, P, block, params, depth):
        self.P = P
        self.b = int(block)
        self.alpha = params.alpha
        self.beta = params.beta
        self.gamma = params.gamma
        self.delta = params.delta
        self.work = 0.0  # per-byte work of all ranks: sends, receives
        self.depth = depth  # None: channels without a limit
        self.clock = np.zeros(P)
        if P <= _DENSE_CHANNEL_TABLE_MAX_P:
            self._table = np.full(P * P, -1, np.int64)
        else:
            self._table = None
            self._dict = {}
        self._nchan = 0
        cap = 64
        self.count = np.zeros(cap, np.int64)  # blocks sent on each channel
        if depth is not None:
            self.cons = np.full((cap, depth), -np.inf)  # consumed, by k % depth

    # -- channels -----------------------------------------------------------

    def _grow(self, need):
        cap = len(self.count)
        if need <= cap:
            return
        while cap < need:
            cap *= 2
        count = np.zeros(cap, np.int64)
        count[:len(self.count)] = self.count
        self.count = count
        if self.depth is not None:
            cons = np.full((cap, self.depth), -np.inf)
            cons[:len(self.cons)] = self.cons
            self.cons = cons

    def channels(self, src, dst):
        """Channel ids of the pairs (src[i], dst[i]), allocated on first use."""
        key = np.asarray(src, np.int64) * self.P + np.asarray(dst, np.int64)
        if self._table is not None:
            ids = self._table[key]
            new = ids < 0
            if new.any():
                fresh = np.unique(key[new])
                self._table[fresh] = np.arange(self._nchan,
                                               self._nchan + len(fresh))
                self._nchan += len(fresh)
                self._grow(self._nchan)
                ids = self._table[key]
            return ids
        out = np.empty(len(key), np.int64)
        for i, k in enumerate(key.tolist()):
            j = self._dict.get(k)
            if j is None:
                j = self._dict[k] = self._nchan
                self._nchan += 1
            out[i] = j
        self._grow(self._nchan)
        return out

    def credit(self, ids):
        """When each channel may take its next block (-inf: at once)."""
        if self.depth is None:
            return np.full(len(ids), -np.inf)
        return self.cons[ids, self.count[ids] % self.depth]

    def consumed(self, ids, when):
        """Records that the next block of each channel was consumed."""
        if self.depth is not None:
            self.cons[ids, self.count[ids] % self.depth] = when
        self.count[ids] += 1

    # -- the four patterns --------------------------------------------------

    def exchange(self, ranks, to, frm, send_bytes, recv_bytes, reduce):
        """Every rank in ``ranks`` runs Exchange(to, send, frm, recv).

        For k = 0, 1, ...: send block k of its send range to ``to``, then
        receive block k of its receive range from ``frm`` (reducing it in if
        ``reduce``, else copying it out). A size of 0 means no send (or no
        receive).
        """
        ranks = np.asarray(ranks, np.int64)
        to = np.asarray(to, np.int64)
        frm = np.asarray(frm, np.int64)
        sbytes = np.asarray(send_bytes, np.int64)
        rbytes = np.asarray(recv_bytes, np.int64)
        m = len(ranks)
        if m == 0:
            return
        pos = np.full(self.P, -1, np.int64)
        pos[ranks] = np.arange(m)
        src = np.where(rbytes > 0, pos[frm], 0)  # index of the sender
        dst = np.where(sbytes > 0, pos[to], 0)   # index of the receiver
        recv = rbytes > 0
        send = sbytes > 0
        if (np.any(src[recv] < 0) or np.any(to[src[recv]] != ranks[recv])
                or np.any(sbytes[src[recv]] != rbytes[recv])
                or np.any(dst[send] < 0)):
            raise AssertionError("simulator bug: unmatched exchange")
        b = self.b
        nbs = -(-sbytes // b)
        nbr = -(-rbytes // b)
        ids = self.channels(ranks, to)
        c = self.clock[ranks].copy()
        per = self.gamma if reduce else self.delta
        self.work += float(sbytes.sum()) * self.beta + float(rbytes.sum()) * per
        kmax = int(max(nbs.max(), nbr.max()))
        for k in range(kmax):
            sm = nbs > k
            s = np.minimum(b, sbytes - k * b)
            start = np.maximum(c, self.credit(ids))
            end = start + self.alpha + s * self.beta
            c = np.where(sm, end, c)
            rm = nbr > k
            r = np.minimum(b, rbytes - k * b)
            got = np.maximum(c, end[src]) + r * per
            c = np.where(rm, got, c)
            si = np.flatnonzero(sm)
            self.consumed(ids[si], c[dst[si]])
        self.clock[ranks] = c

    def chain(self, order, nbytes, reduce):
        """Flow along the chain ``order``: each block from i-1 to i+1."""
        order = np.asarray(order, np.int64)
        L = len(order)
        if L < 2 or nbytes <= 0:
            return
        ids = self.channels(order[:-1], order[1:])  # link i: i -> i+1
        c = self.clock[order].copy()
        idx = np.arange(L - 1, dtype=np.float64)
        b = self.b
        per = self.gamma if reduce else self.delta
        self.work += (L - 1) * nbytes * (self.beta + per)
        for k in range(-(-nbytes // b)):
            s = min(b, nbytes - k * b)
            h = self.alpha + s * self.beta
            g = s * per
            a = g + h
            credit = self.credit(ids)
            z = np.empty(L - 1)
            z[0] = max(c[0], credit[0]) + h
            if L > 2:
                z[1:] = np.maximum(c[1:L - 1] + a, credit[1:] + h)
            sent = idx * a + np.maximum.accumulate(z - idx * a)
            got = np.maximum(c[1:], sent) + g  # receive ends, ranks 1..L-1
            c[0] = sent[0]
            c[1:L - 1] = sent[1:]
            c[L - 1] = got[-1]
            self.consumed(ids, got)
        self.clock[order] = c

    def tree(self, root, nbytes, up, reduce):
        """Flow over the binomial tree rooted at ``root``.

        ``up``: receive each block from the children (in order), then send
        it to the parent; else receive it from the parent, then send it to
        the children (in order).
        """
        if nbytes <= 0 or self.P < 2:
            return
        levels = _tree_levels(self.P)
        P = self.P

        def actual(v):
            return (v + root) % P

        plan = []
        for nodes, kids, nkids, parent in levels:
            a_nodes = actual(nodes)
            a_kids = np.where(kids >= 0, actual(np.maximum(kids, 0)), -1)
            has_parent = parent >= 0
            p_ids = np.full(len(nodes), -1, np.int64)
            if has_parent.any():
                a_par = actual(parent[has_parent])
                if up:
                    p_ids[has_parent] = self.channels(a_nodes[has_parent], a_par)
                else:
                    p_ids[has_parent] = self.channels(a_par, a_nodes[has_parent])
            k_ids = np.full(kids.shape, -1, np.int64)
            valid = kids >= 0
            if valid.any():
                rows = np.broadcast_to(a_nodes[:, None], kids.shape)[valid]
                if up:
                    k_ids[valid] = self.channels(a_kids[valid], rows)
                else:
                    k_ids[valid] = self.channels(rows, a_kids[valid])
            plan.append((a_nodes, a_kids, nkids, has_parent, p_ids, k_ids,
                         valid))
        if up:
            plan = plan[::-1]
        arrive = np.full(P, -np.inf)  # when block k reached its receiver
        b = self.b
        per = self.gamma if reduce else self.delta
        self.work += (P - 1) * nbytes * (self.beta + per)
        for k in range(-(-nbytes // b)):
            s = min(b, nbytes - k * b)
            h = self.alpha + s * self.beta
            g = s * per
            for a_nodes, a_kids, nkids, has_parent, p_ids, k_ids, valid in plan:
                c = self.clock[a_nodes]
                J = a_kids.shape[1]
                rows = np.arange(len(a_nodes))
                if up:
                    if J:
                        # t_j = max(t_{j-1}, A_j) + g, t_{-1} = c
                        j = np.arange(J, dtype=np.float64)
                        A = np.where(valid, arrive[np.maximum(a_kids, 0)],
                                     -np.inf)
                        t = (j + 1) * g + np.maximum(
                            c[:, None], np.maximum.accumulate(A - j * g, axis=1))
                        self.consumed(k_ids[valid], t[valid])
                        c = np.where(nkids > 0,
                                     t[rows, np.maximum(nkids - 1, 0)], c)
                    if has_parent.any():
                        hp = np.flatnonzero(has_parent)
                        sent = np.maximum(c[hp], self.credit(p_ids[hp])) + h
                        c[hp] = sent
                        arrive[a_nodes[hp]] = sent
                else:
                    if has_parent.any():
                        hp = np.flatnonzero(has_parent)
                        got = np.maximum(c[hp], arrive[a_nodes[hp]]) + g
                        c[hp] = got
                        self.consumed(p_ids[hp], got)
                    if J:
                        j = np.arange(J, dtype=np.float64)
                        C = np.full(k_ids.shape, -np.inf)
                        C[valid] = self.credit(k_ids[valid])
                        # x_j = max(x_{j-1}, C_j) + h, x_{-1} = c
                        x = (j + 1) * h + np.maximum(
                            c[:, None], np.maximum.accumulate(C - j * h, axis=1))
                        arrive[a_kids[valid]] = x[valid]
                        c = np.where(nkids > 0,
                                     x[rows, np.maximum(nkids - 1, 0)], c)
                self.clock[a_nodes] = c

    def p2p(self, src, dst, nbytes, reduce):
        """``src`` sends nbytes to ``dst``, which receives them; nothing else
        happens on either rank meanwhile."""
        if nbytes <= 0:
            return
        ch = int(self.channels([src], [dst])[0])
        D = self.depth
        m = int(self.count[ch])
        ring = list(self.cons[ch]) if D is not None else None
        cs = float(self.clock[src])
        cd = float(self.clock[dst])
        b = self.b
        alpha, beta = self.alpha, self.beta
        gamma = self.gamma if reduce else self.delta
        self.work += nbytes * (beta + gamma)
        for k in range(-(-nbytes // b)):
            s = min(b, nbytes - k * b)
            if D is not None:
                slot = (m + k) % D
                cs = max(cs, ring[slot])
            cs += alpha + s * beta
            cd = max(cd, cs) + s * gamma
            if D is not None:
                ring[slot] = cd
        self.count[ch] = m + -(-nbytes // b)
        if D is not None:
            self.cons[ch] = ring
        self.clock[src] = cs
        self.clock[dst] = cd


_levels_cache = {}


def _tree_levels(P):
    """The binomial tree of P ranks (relative to its root), by depth.

    Returns a list, depth 0 (the root) first, of (nodes, children matrix
    padded with -1, number of children, parent or -1), numpy arrays.
    """
    got = _levels_cache.get(P)
    if got is not None:
        return got
    kids = cost.tree_shape(P)
    depth = np.array([bin(v).count("1") for v in range(P)])
    levels = []
    for d in range(int(depth.max()) + 1):
        nodes = np.flatnonzero(depth == d)
        J = max(len(kids[v]) for v in nodes)
        mat = np.full((len(nodes), J), -1, np.int64)
        for i, v in enumerate(nodes):
            mat[i, :len(kids[v])] = kids[v]
        nk = np.array([len(kids[v]) for v in nodes], np.int64)
        parent = np.where(nodes > 0, nodes - (nodes & -nodes), -1)
        levels.append((nodes, mat, nk, parent))
    _levels_cache[P] = levels
    return levels


# ---------------------------------------------------------------------------
# The schedules (kernels/engine/collective.cc), root 0.

def _chunks(n, P):
    off = np.arange(P + 1, dtype=np.int64) * n // P
    return np.diff(off)


def _ring(e, kind, n, P):
    r = np.arange(P)
    nxt, prv = (r + 1) % P, (r - 1) % P
    size = _chunks(n, P)

    def allgather_phase(shift, sizes):
        for s in range(P - 1):
            e.exchange(r, nxt, prv, sizes[(r + shift - s) % P],
                       sizes[(r + shift - s - 1) % P], False)

    if kind == "allgather":
        allgather_phase(0, np.full(P, n, np.int64))
        return
    if kind == "broadcast":
        for q in range(1, P):
            e.p2p(0, q, int(size[(q + 1) % P]), False)
        allgather_phase(1, size)
        return
    for s in range(P - 1):  # reduce-scatter
        e.exchange(r, nxt, prv, size[(r - s) % P], size[(r - s - 1) % P], True)
    if kind == "allreduce":
        allgather_phase(1, size)
        return
    for q in range(1, P):  # reduce: every rank sends its chunk to the root
        e.p2p(q, 0, int(size[(q + 1) % P]), False)


def _lp(e, kind, n, P):
    if kind == "broadcast":
        e.chain(np.arange(P), n, False)
    elif kind == "reduce":
        e.chain(np.r_[np.arange(1, P), 0], n, True)
    elif kind == "allreduce":
        e.chain(np.arange(P), n, True)
        e.chain(np.arange(P - 1, -1, -1), n, False)
    else:
        # Down: piece j flows from rank j to P-1 (rank v forwards pieces
        # 0..v-1, then sends its own); up: piece j flows from rank j to 0
        # (rank v sends its own, then forwards v+1..P-1). Every rank does
        # its down part before its up part, as in the engine.
        for j in range(P - 1):
            e.chain(np.arange(j, P), n, False)
        for j in range(1, P):
            e.chain(np.arange(j, -1, -1), n, False)


def _tree(e, kind, n, P):
    if kind == "broadcast":
        e.tree(0, n, up=False, reduce=False)
    elif kind == "reduce":
        e.tree(0, n, up=True, reduce=True)
    elif kind == "allreduce":
        e.tree(0, n, up=True, reduce=True)
        e.tree(0, n, up=False, reduce=False)
    else:
        # Gather the subtrees to rank 0 (children before parents: deeper
        # ranks first), then broadcast all P pieces.
        kids = cost.tree_shape(P)
        for v in sorted(range(P), key=lambda v: -bin(v).count("1")):
            for c in kids[v]:
                low = c & -c
                e.p2p(c, v, (min(P, c + low) - c) * n, False)
        e.tree(0, P * n, up=False, reduce=False)


def _rhd(e, kind, n, P):
    active = 1 << (P.bit_length() - 1)
    extra = P - active
    j = np.arange(active)
    old = np.where(j < extra, 2 * j, j + extra)  # new rank -> rank
    folded = np.arange(2 * extra)
    odd, even = folded[1::2], folded[0::2]

    def pair(src_ranks, dst_ranks, nbytes, reduce):
        # src[i] sends nbytes to dst[i] (disjoint pairs), as one exchange.
        ranks = np.r_[src_ranks, dst_ranks]
        k = len(src_ranks)
        to = np.r_[dst_ranks, src_ranks]
        sz = np.r_[np.full(k, nbytes), np.zeros(k, np.int64)]
        rz = np.r_[np.zeros(k, np.int64), np.full(k, nbytes)]
        e.exchange(ranks, to, to, sz, rz, reduce)

    if kind == "allgather":
        if extra:
            pair(odd, even, n, False)
        first = np.where(j < extra, 2 * j, j + extra)
        end = np.where(j < extra, 2 * j + 2, j + extra + 1)
        d = 1
        while d < active:
            mine = j - j % d
            theirs = (j ^ d) - (j ^ d) % d
            give = (end[mine + d - 1] - first[mine]) * n
            take = (end[theirs + d - 1] - first[theirs]) * n
            e.exchange(old, old[j ^ d], old[j ^ d], give, take, False)
            d *= 2
        if extra:
            pair(even, odd, P * n, False)
        return
    # Halving ranges: per step, per new rank, [lo, hi) before the step.
    ranges = []
    lo = np.zeros(active, np.int64)
    hi = np.full(active, n, np.int64)
    d = active // 2
    while d >= 1:
        ranges.append((lo.copy(), hi.copy(), d))
        mid = lo + (hi - lo) // 2
        upper = (j & d) != 0
        lo, hi = np.where(upper, mid, lo), np.where(upper, hi, mid)
        d //= 2
    final = hi - lo
    if kind != "broadcast":
        if extra:
            pair(odd, even, n, True)
        for wlo, whi, d in ranges:
            mid = wlo + (whi - wlo) // 2
            upper = (j & d) != 0
            keep = np.where(upper, whi - mid, mid - wlo)
            give = (whi - wlo) - keep
            e.exchange(old, old[j ^ d], old[j ^ d], give, keep, True)
        if kind == "reduce":
            for k in range(1, active):
                e.p2p(int(old[k]), 0, int(final[k]), False)
            return
    else:
        for k in range(1, active):
            e.p2p(0, int(old[k]), int(final[k]), False)
    for wlo, whi, d in reversed(ranges):  # doubling
        mid = wlo + (whi - wlo) // 2
        upper = (j & d) != 0
        own = np.where(upper, whi - mid, mid - wlo)
        other = (whi - wlo) - own
        e.exchange(old, old[j ^ d], old[j ^ d], own, other, False)
    if extra:
        pair(even, odd, n, False)


_SCHEDULES = {"lp": _lp, "ring": _ring, "tree": _tree, "rhd": _rhd}


def _check_bus(bus):
    if isinstance(bus, bool) or not isinstance(bus, (int, float)) or \
            not math.isfinite(bus) or bus < 0:
        raise ValueError(f"bus {bus!r} must be a finite number >= 0")
    return float(bus)


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
    bus = _check_bus(bus)
    if block_bytes is None:
        block_bytes = cost.block_size(
            nbytes * P if kind == "allgather" else nbytes, P, params)
    block_bytes = cost.check_int("block_bytes", block_bytes, 1)
    if P == 1 or nbytes == 0:
        return 0.0
    e = _Engine(P, block_bytes, params, depth)
    _SCHEDULES[algorithm](e, kind, nbytes, P)
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


# ---------------------------------------------------------------------------
# Sweeps, claims and the command line.

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


def _fmt_size(n):
    for unit, f in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= f and n % f == 0:
            return f"{n // f}{unit}"
    return f"{n}B"


def _fmt_time(t):
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


def _claims_text(c):
    n, p0, p1 = _fmt_size(c["nbytes"]), c["P_small"], c["P_large"]
    t = c["times"]
    lines = [f"claims (simulated, {n}):",
             f"  1. lp nearly flat in P (P = {p0} -> {p1}, x{p1 / p0:g}; "
             f"a log P cost grows x{c['log2_ratio']:.3g}):"]
    for kind in ("broadcast", "allreduce"):
        lp, tree = c["growth"][(kind, "lp")], c["growth"][(kind, "tree")]
        lines.append(
            f"     {kind:9}: lp x{lp:.2f} ({_fmt_time(t[(kind, 'lp')][p0])} -> "
            f"{_fmt_time(t[(kind, 'lp')][p1])}), tree x{tree:.2f} "
            f"({_fmt_time(t[(kind, 'tree')][p0])} -> "
            f"{_fmt_time(t[(kind, 'tree')][p1])}): "
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
Simulate the tf_rdma collectives (lp, ring, tree, rhd) block by block under
the alpha-beta-gamma-delta cost model: a block of s bytes costs its sender
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
        return _check_bus(float(text))
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


def _plot(rows, kinds, algorithms, sizes, ranks, outdir):
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt  # pylint: disable=import-outside-toplevel

    os.makedirs(outdir, exist_ok=True)
    written = []
    by = {(r["kind"], r["algorithm"], r["size_bytes"], r["P"]): r["simulated_s"]
          for r in rows}
    def save(panels, xs, xlabel, curve, title, path):
        """One figure: a panel per value of `panels`, time against `xs`."""
        fig, axes = plt.subplots(1, len(panels),
                                 figsize=(4.5 * len(panels), 4), squeeze=False)
        for ax, panel in zip(axes[0], panels):
            for a in algorithms:
                ax.plot(xs, [curve(a, panel, x) for x in xs], marker="o",
                        label=a)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel(xlabel)
            ax.set_ylabel("simulated time (s)")
            ax.set_title(title(panel))
            ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)

    for kind in kinds:
        save(sizes, ranks, "P (ranks)",
             lambda a, n, P, kind=kind: by[(kind, a, n, P)],
             lambda n, kind=kind: f"{kind}, {_fmt_size(n)}",
             os.path.join(outdir, f"{kind}_vs_P.png"))
        save(ranks, sizes, "message size (bytes)",
             lambda a, P, n, kind=kind: by[(kind, a, n, P)],
             lambda P, kind=kind: f"{kind}, P = {P}",
             os.path.join(outdir, f"{kind}_vs_size.png"))
    return written


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
            print(f"\n{kind}, {_fmt_size(n)}"
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
                    cells.append(f"{_fmt_time(r['simulated_s']):>10} "
                                 f"({_fmt_time(r['model_s']):>9})")
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
        for path in _plot(rows, args.kind, args.algorithms, args.sizes,
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
    help="simulate the collectives (lp, ring, tree, rhd) under the "
         "alpha-beta-gamma cost model",
    usage=_USAGE,
    description=_DESCRIPTION,
    epilog=_EPILOG,
    add_arguments=add_arguments,
    run=run,
)


if __name__ == "__main__":
    sys.exit(main())
