"""The schedules of kernels/engine/collective.cc, played on the :class:`Engine`.

One function per algorithm (lp, ring, tree, rhd, oneshot), each taking the engine,
the kind (broadcast, reduce, allreduce, allgather), the message size and the
number of ranks, and calling the engine's patterns in the order the C++
engine runs the ranks' operations, with root 0.
"""

import numpy as np

from tf_rdma.collectives import cost

__all__ = ["SCHEDULES"]

# ---------------------------------------------------------------------------
# The schedules (kernels/engine/collective.cc), root 0.

def _chunks(n, P):
    off = np.arange(P + 1, dtype=np.int64) * n // P
    return np.diff(off)


def _ring(e, kind, n, P):
    r = np.arange(P)
    nxt, prv = (r + 1) % P, (r - 1) % P
    size = _chunks(n, P)

    # Steps before `first` are done already (the turn did the first).
    def allgather_phase(shift, sizes, first=0):
        for s in range(first, P - 1):
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
    if kind == "allreduce":
        # The reduce-scatter's last step and the allgather's first run as
        # one loop over blocks (Runner::RingTurn), the rest as exchanges.
        for s in range(P - 2):
            e.exchange(r, nxt, prv, size[(r - s) % P], size[(r - s - 1) % P],
                       True)
        e.programs(_ring_turn_programs(size, P, e.b, e.gamma, e.delta))
        allgather_phase(1, size, first=1)
        return
    for s in range(P - 1):  # reduce-scatter
        e.exchange(r, nxt, prv, size[(r - s) % P], size[(r - s - 1) % P], True)
    for q in range(1, P):  # reduce: every rank sends its chunk to the root
        e.p2p(q, 0, int(size[(q + 1) % P]), False)


def _ring_turn_programs(size, P, b, gamma, delta):
    """Every rank's program of ring's turn (Runner::RingTurn): per block k,
    send k of chunk r+2, receive k of chunk r+1 and reduce it in, send that
    block on, receive k of chunk r (copied out)."""
    progs = []
    for r in range(P):
        nxt, prv = (r + 1) % P, (r - 1) % P
        send = int(size[(r + 2) % P])
        reduced = int(size[(r + 1) % P])
        gathered = int(size[r])
        prog = []
        for k in range(-(-max(send, reduced, gathered) // b)):
            at = k * b
            if at < send:
                prog.append(("send", nxt, min(b, send - at)))
            if at < reduced:
                n = min(b, reduced - at)
                prog.append(("recv", prv, n, gamma))
                prog.append(("send", nxt, n))
            if at < gathered:
                prog.append(("recv", prv, min(b, gathered - at), delta))
        progs.append(prog)
    return progs


def _lp(e, kind, n, P):
    if kind == "broadcast":
        e.chain(np.arange(P), n, False)
    elif kind == "reduce":
        e.chain(np.r_[np.arange(1, P), 0], n, True)
    elif kind == "allreduce":
        e.combined_chain(n)
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


#: Algorithm name -> its schedule: ``schedule(engine, kind, nbytes, P)``.
def _oneshot(e, kind, n, P, root=0):
    # Every rank's program (Runner::OneShot): per block, the sends to the
    # other ranks in the order r+1, r+2, ..., then the receives in rank
    # order; allreduce holds the first of the first two operands (no cost)
    # and reduces the pair in one pass, then each further one, its own
    # block in its place in the order.
    b = e.b
    total = n * P if kind == "allgather" else n
    progs = [[] for _ in range(P)]
    if kind == "allgather":
        for s in [min(b, n - at) for at in range(0, n, b)]:
            for r in range(P):
                progs[r] += [("send", (r + i) % P, s) for i in range(1, P)]
                progs[r] += [("recv", q, s, e.delta)
                             for q in range(P) if q != r]
        e.programs(progs)
        return
    for at in range(0, total, b):
        s = min(b, total - at)
        for r in range(P):
            if kind == "broadcast":
                if r == root:
                    progs[r] += [("send", (r + i) % P, s) for i in range(1, P)]
                else:
                    progs[r].append(("recv", root, s, e.delta))
                continue
            if kind == "allreduce":
                progs[r] += [("send", (r + i) % P, s) for i in range(1, P)]
            elif r != root:
                progs[r].append(("send", root, s))
                continue
            for q in range(P):
                if q == r:
                    if r >= 2:  # its own block, reduced in in rank order
                        progs[r].append(("compute", s, e.gamma))
                    continue
                held = q == 0 and r >= 2  # held for the pair with rank 1
                progs[r].append(("recv", q, s, 0.0 if held else e.gamma))
    e.programs(progs)


SCHEDULES = {"lp": _lp, "ring": _ring, "tree": _tree, "rhd": _rhd,
             "oneshot": _oneshot}
