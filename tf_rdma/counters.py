"""Transfer counters: ``tf_rdma.stats()`` (docs/observability.md, "Counters").

The engine counts, per peer and per transport, the payload bytes and the
tensors (or collective blocks) this process moved, and the waits its ops
had to make: a *credit wait* is a send whose copy in the reader's region
was not released yet, a *data wait* a recv whose data had not landed when it
first looked. The counters are relaxed atomic adds on the data path
(kernels/engine/stats.h); this module reads them through the op library's C
interface and shapes them as a dict.

Counters only grow, from the start of the process (across endpoint
restarts). To measure an interval, take two snapshots and subtract them
with :func:`difference`, as ``tf_rdma.keras.StatsCallback`` does per epoch.
"""

import time

from tf_rdma import _loader

__all__ = ["COUNTERS", "stats", "difference"]

#: The counters of one peer and transport, of a transport, and of the total,
#: each a key of the dicts :func:`stats` returns.
COUNTERS = ("bytes_sent", "bytes_received", "writes", "receives",
            "credit_waits", "credit_wait_seconds", "data_waits",
            "data_wait_seconds", "dynamic_regrowths")

_NANOSECOND_COUNTERS = {"credit_wait_ns": "credit_wait_seconds",
                        "data_wait_ns": "data_wait_seconds"}

#: Keys of a snapshot that are process-wide numbers, not per peer.
PROCESS_KEYS = ("credit_wait_busy_seconds", "data_wait_busy_seconds",
                "collectives_inline", "collectives_handed_off")


def _zero():
    return {name: 0.0 if name.endswith("_seconds") else 0 for name in COUNTERS}


def _counters(entry):
    """One engine entry ({"peer", "transport", counters in ns}) as COUNTERS."""
    out = {}
    for name in COUNTERS:
        if name.endswith("_seconds"):
            ns_name = next(k for k, v in _NANOSECOND_COUNTERS.items() if v == name)
            out[name] = int(entry[ns_name]) / 1e9
        else:
            out[name] = int(entry[name])
    return out


def _add(into, counters):
    for name in COUNTERS:
        into[name] += counters[name]


def stats(task=None):
    """Returns a process's transfer counters since it started.

    Args:
        task: The task whose counters to read (``"/job:worker/task:0"``),
            through TensorFlow from a program connected to the cluster (a
            ParameterServerStrategy coordinator, a client of
            ``experimental_connect_to_cluster``); None: this process.

    A wait counts when the op could not go on at once; its time runs from
    then until the op went on (or failed). Waits of concurrent ops overlap,
    so summed wait seconds can exceed the wall time; the ``*_busy_seconds``
    keys count the wall time during which at least one op waited instead.
    Every key, its unit and when it changes: docs/observability.md.

    Loads the op library (and so TensorFlow) if it is not loaded yet. In a
    process whose endpoint never started, every counter is zero.

    Returns:
        A dict:

        - ``task`` (str): this process's task ("" before the endpoint started).
        - ``peers``: ``{peer task: {transport: counters}}``, where transport
          is "shm", "tcp", "verbs", or "none" for waits on a peer that had no
          connection (a send that could not connect, a recv whose writer never
          opened its region).
        - ``transports``: ``{transport: counters}`` summed over peers.
        - ``total``: counters summed over everything.
        - ``credit_wait_busy_seconds``, ``data_wait_busy_seconds`` (float):
          wall time during which at least one op of this process waited for
          a credit / for data.
        - ``collectives_inline``, ``collectives_handed_off`` (int): collective
          calls that completed on the op's own thread (a small oneshot
          collective whose peers were there) / on an engine thread.
        - ``last_collective``: the last collective call of this process to
          finish, ``{"instance": str, "call": int, "began": float, "ended":
          float, "waited": float}``, or None before the first. ``began``
          (the call was admitted by the engine) and ``ended`` (it finished)
          are on the clock of ``time.monotonic()`` and
          ``time.perf_counter()``, one clock for every process of the host:
          with the caller's own time around the call they split it into
          TensorFlow's part and tf_rdma's (bench/allreduce.py does).
          ``waited`` (s): how much of that time the process had a wait for
          data in progress, plus how much it had one for a credit (the two
          busy clocks' growth, added: where both kinds overlap the time
          counts twice; an op running beside the call counts too).
        - ``time`` (float): ``time.monotonic()`` when the counters were read.

        ``counters`` is a dict with the keys of :data:`COUNTERS`:
        ``bytes_sent``, ``bytes_received`` (payload bytes: the tensors' bytes,
        no headers or credits), ``writes``, ``receives`` (tensors or
        collective blocks), ``credit_waits``, ``data_waits`` (ints),
        ``credit_wait_seconds``, ``data_wait_seconds`` (floats) and
        ``dynamic_regrowths`` (int: dynamic tensors that did not fit their
        payload area, which was replaced by a larger one).

    Raises:
        LibraryError: The op library is missing or does not load.
    """
    if task is None:
        raw = _loader.read_json("tfrdma_stats")
    else:
        from tf_rdma import measured  # pylint: disable=import-outside-toplevel
        raw = measured.task_report("stats", task)
    now = time.monotonic()
    peers, transports, total = {}, {}, _zero()
    for entry in raw["peers"]:
        counters = _counters(entry)
        peers.setdefault(entry["peer"], {})[entry["transport"]] = counters
        _add(transports.setdefault(entry["transport"], _zero()), counters)
        _add(total, counters)
    last = raw.get("last_collective")
    if last is not None:
        last = {"instance": last["instance"], "call": int(last["call"]),
                "began": int(last["began_ns"]) / 1e9,
                "ended": int(last["ended_ns"]) / 1e9,
                "waited": int(last["waited_ns"]) / 1e9}
    return {"task": raw["task"], "last_collective": last,
            "peers": peers, "transports": transports,
            "total": total,
            "credit_wait_busy_seconds": int(raw["credit_wait_busy_ns"]) / 1e9,
            "data_wait_busy_seconds": int(raw["data_wait_busy_ns"]) / 1e9,
            "collectives_inline": int(raw["collectives_inline"]),
            "collectives_handed_off": int(raw["collectives_handed_off"]),
            "time": now}


def difference(after, before):
    """What the counters grew by between two :func:`stats` snapshots.

    Args:
        after: The later snapshot.
        before: The earlier snapshot of the same process.

    Returns:
        A dict shaped like :func:`stats`'s, with each counter and busy time
        the growth between the snapshots (a peer or transport that is new in
        ``after`` counts from zero), ``elapsed_seconds`` (float) in place
        of ``time``, and ``after``'s ``last_collective``.

    Raises:
        ValueError: ``before`` is not earlier than ``after`` (a counter or the
            time went down).
    """
    def minus(a, b, where):
        out = {}
        for name in COUNTERS:
            out[name] = a[name] - b.get(name, 0)
            if out[name] < 0:
                raise ValueError(f"tf_rdma counter {where}{name} went down from "
                                 f"{b[name]} to {a[name]}: `before` must be a "
                                 f"snapshot taken before `after`")
        return out

    elapsed = after["time"] - before["time"]
    if elapsed < 0:
        raise ValueError(f"`before` was taken {-elapsed:.3f} s after `after`; "
                         f"expected difference(later, earlier)")
    peers = {}
    for peer, by_transport in after["peers"].items():
        for transport, counters in by_transport.items():
            old = before["peers"].get(peer, {}).get(transport, {})
            peers.setdefault(peer, {})[transport] = minus(
                counters, old, f"peers[{peer!r}][{transport!r}].")
    transports = {t: minus(c, before["transports"].get(t, {}), f"transports[{t!r}].")
                  for t, c in after["transports"].items()}
    out = {"task": after["task"],
           "last_collective": after.get("last_collective"),
           "peers": peers, "transports": transports,
           "total": minus(after["total"], before["total"], "total."),
           "elapsed_seconds": elapsed}
    for key in PROCESS_KEYS:
        out[key] = after[key] - before[key]
    return out
