"""Measured transfers: what the last traced calls of each transfer took.

Every traced tf_rdma event (an op and its phases, docs/observability.md) is
also kept, the newest few per tensor key, in the process that ran it
(kernels/common/recent.h). :func:`task_report` asks any task for them (or
for its counters or endpoint info) with a small op placed on that task's
device, so a client sees what its rewritten function's transfers did in the
worker servers. :func:`summarize` turns one side's events into per-call
times, and :func:`measured_lines` is what ``fn.explain(measured=True)``
prints next to the plan.

Events exist only while tf_rdma is traced: for a whole run with
``TF_RDMA_TIMELINE`` set on the workers, or inside a profiler session
(``tf.profiler.experimental.client.trace`` on the workers, or
``tf.profiler.experimental.start`` in an SPMD program). Untraced transfers
cost nothing and leave nothing to show.
"""

import json
import statistics

import tensorflow as tf

from tf_rdma import _loader

__all__ = ["task_report", "summarize", "measured_lines"]

_OPS = {"tf_rdma.send": "send", "tf_rdma.recv": "recv"}
# The phases of each side, in the order they happen.
_PHASES = {"send": ("credit_wait", "write"), "recv": ("data_wait", "release")}


def task_report(what, task=None):
    """Returns a task's tf_rdma report, parsed.

    Args:
      what: ``"recent"`` (the last traced events of each key), ``"stats"``
        (the transfer counters, as the engine writes them) or ``"info"``
        (the endpoint).
      task: The task to ask (``"/job:worker/task:1"``); None: this process.
        Another task is reached through TensorFlow (the client must be
        connected to the cluster, ``tf.config.experimental_connect_to_cluster``).

    Raises:
      ValueError: `what` is not one of the three.
    """
    if what not in ("recent", "stats", "info"):
        raise ValueError(f"what={what!r}: expected 'recent', 'stats' or 'info'")
    op = _loader.load().ops.tf_rdma_report
    if task is None:
        report = op(what=what)
    else:
        with tf.device(task):
            report = op(what=what)
    return json.loads(report.numpy().decode("utf-8", errors="replace"))


def summarize(events, side, last=20):
    """One side's calls of one key, from a "recent" report's events.

    Args:
      events: The key's events (``task_report("recent")["keys"][key]``).
      side: ``"send"`` or ``"recv"``.
      last: How many of the newest calls to summarize.

    Returns:
      None if no call of that side was traced, else a dict: ``calls`` (how
      many), ``op`` and each phase as ``{"median_us", "max_us"}`` (a phase
      summed within its call; absent if no call had it), and ``bytes``
      (of the newest call).
    """
    name = next(n for n, s in _OPS.items() if s == side)
    calls = [e for e in events if e["name"] == name][-last:]
    if not calls:
        return None
    steps = {c["step"] for c in calls}
    per_phase = {}
    for e in events:
        phase = e["name"].split(".", 1)[1]
        if e["step"] in steps and phase in _PHASES[side]:
            sums = per_phase.setdefault(phase, {})
            sums[e["step"]] = sums.get(e["step"], 0) + e["end_ns"] - e["start_ns"]

    def spread(values_ns):
        us = [v / 1e3 for v in values_ns]
        return {"median_us": statistics.median(us), "max_us": max(us)}

    out = {"calls": len(calls), "bytes": calls[-1]["bytes"],
           "op": spread([c["end_ns"] - c["start_ns"] for c in calls])}
    for phase in _PHASES[side]:
        if phase in per_phase:
            out[phase] = spread(list(per_phase[phase].values()))
    return out


def _line(side, summary):
    phases = ", ".join(f"{p} {summary[p]['median_us']:.0f}"
                       for p in _PHASES[side] if p in summary)
    return (f"{side} {summary['op']['median_us']:.0f} "
            f"(max {summary['op']['max_us']:.0f}, {summary['calls']} calls)"
            + (f": {phases}" if phases else ""))


def measured_lines(transfers, last=20, report=task_report):
    """The "measured" section of explain(): per planned transfer, its send
    (asked of the sending task) and its recv (of the receiving task).

    Args:
      transfers: The plan's transfers (``key``, ``src``, ``dst``, ``nbytes``).
      last: The newest calls to summarize per side.
      report: ``report("recent", task)``; a task that cannot be asked is
        shown with the reason.

    Returns:
      The lines to print.
    """
    reports = {}
    for task in sorted({t.src for t in transfers} | {t.dst for t in transfers}):
        try:
            reports[task] = report("recent", task)["keys"]
        except (tf.errors.OpError, ValueError) as e:
            reports[task] = str(e).splitlines()[0] if str(e) else type(e).__name__
    lines = [f"measured (the last {last} traced calls; median µs per call, "
             f"and each phase's median):"]
    seen = False
    for t in transfers:
        lines.append(f"  {t.key}  {t.src} -> {t.dst}  {t.nbytes} bytes")
        for side, task in (("send", t.src), ("recv", t.dst)):
            keys = reports[task]
            if isinstance(keys, str):
                lines.append(f"    {side}: {task} could not be asked ({keys})")
                continue
            summary = summarize(keys.get(t.key, []), side, last)
            if summary is None:
                lines.append(f"    {side}: no traced call")
            else:
                seen = True
                lines.append(f"    {_line(side, summary)}")
    if not seen:
        lines.append("  nothing traced yet: tf_rdma records its transfers only "
                     "while traced (TF_RDMA_TIMELINE set on the workers, or a "
                     "profiler session on them; docs/observability.md)")
    return lines
