"""The simulator's engine: the clocks of P ranks and the channels between them.

:class:`Engine` computes, under the model's rules (see the package's
docstring), when every operation of the four patterns the schedules are
made of ends: an exchange between pairs of ranks, a flow along a chain, a
flow over a binomial tree, and a point-to-point transfer. The schedules
(:mod:`tf_rdma.collectives.simulate.schedules`) call them in program order.
"""

import collections

import numpy as np

from tf_rdma.collectives import cost

__all__ = ["Engine"]

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
# * Programs (oneshot, and lp allreduce with channels of fewer than 3
#   blocks): every rank's list of sends and receives, run literally by a
#   worklist scheduler (a rank runs until an operation waits for a block or
#   a credit, and is run again when that channel moves): exact for any
#   schedule, one Python step per operation.
# * The combined chain (lp allreduce): in iteration t rank v reduces block t
#   up the chain, then passes block t - 2(P-1-v) down it. The up halves are
#   a chain flow; a down half depends only on earlier iterations while the
#   channels hold 3 or more blocks. One Python iteration per block.
#
# The algorithms call these patterns in an order that respects every rank's
# program order and puts every block's send before its receive, so each
# time is computed once, from times already known. Channel credits carry
# over from one pattern to the next (the ring's reduce-scatter and
# allgather use the same channels).


class Engine:
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
            self._chain_block(c, ids, idx, min(b, nbytes - k * b), per)
        self.clock[order] = c

    def _chain_block(self, c, ids, idx, s, per):
        """One block of s bytes along a chain: updates the chain's clocks c
        (in chain order) and consumes it on the links ``ids``."""
        L = len(c)
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

    def combined_chain(self, nbytes):
        """lp allreduce: up the chain 0..P-1 reducing, down it copying, as
        one pipeline (Runner::LpAllReduce)."""
        P, b = self.P, self.b
        if self.depth is not None and self.depth < 3:
            self.programs(_combined_chain_programs(
                P, nbytes, b, self.gamma, self.delta))
            return
        nb = -(-nbytes // b)
        v = np.arange(P)
        lag = 2 * (P - 1 - v)
        up = self.channels(v[:-1], v[1:])      # v -> v+1
        down = self.channels(v[1:], v[:-1])    # v+1 -> v
        c = self.clock.copy()
        idx = np.arange(P - 1, dtype=np.float64)
        base = self.count[down].copy()
        sent_down = {}      # (v+1, block): when v+1 finished sending it to v
        consumed_down = {}  # (v, block): when v finished copying it out
        self.work += (P - 1) * nbytes * (2 * self.beta + self.gamma
                                         + self.delta)
        for t in range(nb + int(lag[0])):
            if t < nb:  # up: block t, a chain flow with reduction
                self._chain_block(c, up, idx, min(b, nbytes - t * b),
                                  self.gamma)
            j = t - lag  # down: block j at every rank with 0 <= j < nb
            for r in np.flatnonzero((j >= 0) & (j < nb)):
                k = int(j[r])
                s = min(b, nbytes - k * b)
                if r < P - 1:  # receive from r+1 (sent 2 iterations ago)
                    c[r] = max(c[r], sent_down.pop((r + 1, k))) + \
                        s * self.delta
                    consumed_down[(r, k)] = c[r]
                if r > 0:  # send to r-1, once it consumed block k - depth
                    start = c[r]
                    if self.depth is not None:
                        if k >= self.depth:
                            start = max(start, consumed_down.pop(
                                (r - 1, k - self.depth)))
                        else:
                            start = max(start, float(self.cons[
                                down[r - 1], (base[r - 1] + k) % self.depth]))
                    c[r] = start + self.alpha + s * self.beta
                    sent_down[(r, k)] = c[r]
        if self.depth is not None:
            for k in range(max(0, nb - self.depth), nb):
                for r in range(P - 1):
                    self.cons[down[r], (base[r] + k) % self.depth] = \
                        consumed_down[(r, k)]
        self.count[down] += nb
        self.clock[:] = c

    def programs(self, programs):
        """Runs every rank's program literally.

        ``programs[r]`` is rank r's list of operations in its order:
        ``("send", to, nbytes)``, ``("recv", frm, nbytes, per_byte)``,
        where per_byte is the receiver's cost per byte (γ to reduce, δ to
        copy out, 0 to hold the block for a later operation), or
        ``("compute", nbytes, per_byte)``: work on the rank's own data.
        """
        P, D = self.P, self.depth
        pairs = sorted({(r, op[1]) if op[0] == "send" else (op[1], r)
                        for r, prog in enumerate(programs) for op in prog
                        if op[0] != "compute"})
        if not pairs:
            return
        ids = self.channels([a for a, _ in pairs], [d for _, d in pairs])
        chan = {pair: int(i) for pair, i in zip(pairs, ids)}
        nsent = {i: int(self.count[i]) for i in chan.values()}
        ncons = dict(nsent)
        pending = {i: collections.deque() for i in chan.values()}
        waiting = {i: [] for i in chan.values()}  # ranks blocked on it
        pc = [0] * P
        clock = [float(x) for x in self.clock]
        ready = collections.deque(r for r in range(P) if programs[r])
        queued = [bool(programs[r]) for r in range(P)]

        def wake(i):
            for r in waiting[i]:
                if not queued[r]:
                    queued[r] = True
                    ready.append(r)
            waiting[i].clear()

        while ready:
            r = ready.popleft()
            queued[r] = False
            prog = programs[r]
            while pc[r] < len(prog):
                op = prog[pc[r]]
                if op[0] == "compute":
                    clock[r] += op[1] * op[2]
                    self.work += op[1] * op[2]
                    pc[r] += 1
                    continue
                if op[0] == "send":
                    i = chan[(r, op[1])]
                    m = nsent[i]
                    start = clock[r]
                    if D is not None:
                        if m - D >= ncons[i]:
                            waiting[i].append(r)
                            break
                        start = max(start, float(self.cons[i, m % D]))
                    clock[r] = start + self.alpha + op[2] * self.beta
                    pending[i].append(clock[r])
                    nsent[i] = m + 1
                    self.work += op[2] * self.beta
                else:
                    i = chan[(op[1], r)]
                    if not pending[i]:
                        waiting[i].append(r)
                        break
                    clock[r] = max(clock[r], pending[i].popleft()) + \
                        op[2] * op[3]
                    if D is not None:
                        self.cons[i, ncons[i] % D] = clock[r]
                    ncons[i] += 1
                    self.work += op[2] * op[3]
                pc[r] += 1
                wake(i)
        if any(pc[r] < len(programs[r]) for r in range(P)):
            raise AssertionError("simulator bug: the programs deadlock")
        for i in chan.values():
            self.count[i] = nsent[i]
        self.clock[:] = clock

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


def _combined_chain_programs(P, nbytes, b, gamma, delta):
    """Every rank's program of the combined lp allreduce (any depth)."""
    nb = -(-nbytes // b)
    progs = []
    for v in range(P):
        prog = []
        lag = 2 * (P - 1 - v)
        for t in range(nb + lag):
            if t < nb:
                s = min(b, nbytes - t * b)
                if v > 0:
                    prog.append(("recv", v - 1, s, gamma))
                if v < P - 1:
                    prog.append(("send", v + 1, s))
            if t >= lag:
                s = min(b, nbytes - (t - lag) * b)
                if v < P - 1:
                    prog.append(("recv", v + 1, s, delta))
                if v > 0:
                    prog.append(("send", v - 1, s))
        progs.append(prog)
    return progs
