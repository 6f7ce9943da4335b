"""``tf-rdma timeline``: the timeline files of all tasks on one clock, and a Gantt chart.

With ``TF_RDMA_TIMELINE=<dir>`` every tf_rdma process writes its trace
events (sends, recvs, collectives and their phases) to a Chrome-trace file
``<dir>/<job>-<index>.<pid>.json`` (kernels/common/timeline.h). Each file
counts time on its own process's clock. :func:`merge` puts the files of all
tasks on the clock of one reference task; :func:`plot` draws the result as
a Gantt chart (a PNG, with matplotlib). docs/observability.md, "Timeline".

Joining the clocks. Each process measures its peers' clocks over the
control connection, as NTP does: it sends its time t1, the peer notes its
receive time t2 and send time t3, the reply lands at t4; the peer's clock
minus ours is ``((t2 - t1) + (t3 - t4)) / 2``, exact if both legs took
equally long and off by at most ``rtt / 2`` (``rtt = (t4 - t1) - (t3 - t2)``)
otherwise. The files hold these measurements (``tf_rdma_clock_offset``
metadata). :func:`merge` keeps, for each pair of tasks, the measurement with
the smallest round trip (from either end), and reaches every task from the
reference along the path whose summed bounds are smallest (Dijkstra on
``rtt / 2``): a task that measured only a middle task is placed through it,
with both bounds added. The bound is what the merge reports per task; events
of two tasks closer in time than the sum of their bounds may appear in
either order. Clock drift during the run (a few µs per second between
unsynchronized hosts; none between processes of one host) is not corrected.

Cost: reading and writing the JSON (about 250 bytes per event); the merge
is linear in the events.

Python API: ``merge(paths, reference=None) -> dict`` and
``plot(merged, path)``; the command line: ``tf-rdma timeline merge`` and
``tf-rdma timeline plot``.
"""

import heapq
import json
import os
import re
import sys

from tf_rdma.errors import TfRdmaError
from tf_rdma.subcommand import Command

__all__ = ["TimelineError", "merge", "plot", "read", "timeline_files",
           "COMMAND", "main"]

#: The names of the files the engine writes: <task>.<pid>.json, or
#: <task>.<pid>.<n>.json after a restart of the endpoint in one process.
FILE_PATTERN = re.compile(r"^[A-Za-z0-9_.-]+\.\d+(\.\d+)?\.json$")

#: The events of the ops and of the phases inside them, in legend order.
OPS = ("tf_rdma.send", "tf_rdma.recv", "tf_rdma.collective")
PHASES = ("tf_rdma.credit_wait", "tf_rdma.write", "tf_rdma.data_wait",
          "tf_rdma.reduce", "tf_rdma.copy", "tf_rdma.release")
_COLORS = {
    "tf_rdma.send": "#c6dbef", "tf_rdma.recv": "#c7e9c0",
    "tf_rdma.collective": "#d9d9d9",
    "tf_rdma.credit_wait": "#fd8d3c", "tf_rdma.write": "#2171b5",
    "tf_rdma.data_wait": "#de2d26", "tf_rdma.reduce": "#6a51a3",
    "tf_rdma.copy": "#8c6d31", "tf_rdma.release": "#31a354",
}


class TimelineError(TfRdmaError, ValueError):
    """Timeline files that cannot be merged or plotted; the message says which and why."""


def canonical(task):
    """``worker:1`` or ``/job:worker/task:1`` as ``/job:worker/task:1``."""
    if task.startswith("/job:"):
        return task
    job, sep, index = task.rpartition(":")
    if not sep or not job or not index.isdigit():
        raise TimelineError(f"task {task!r} is not job:index or "
                            f"/job:<job>/task:<index>")
    return f"/job:{job}/task:{index}"


def short(task):
    """``/job:worker/task:1`` as ``worker:1``."""
    m = re.fullmatch(r"/job:([^/]+)/task:(\d+)", task)
    return f"{m.group(1)}:{m.group(2)}" if m else task


def timeline_files(paths):
    """The timeline files that `paths` name: files as given, and in directories
    the files named like the engine's (``<task>.<pid>.json``).

    Raises:
        TimelineError: A path does not exist, or no file was found.
    """
    files = []
    for path in paths:
        if os.path.isdir(path):
            found = sorted(os.path.join(path, name) for name in os.listdir(path)
                           if FILE_PATTERN.match(name))
            files += found
        elif os.path.exists(path):
            files.append(path)
        else:
            raise TimelineError(f"{path}: no such file or directory")
    if not files:
        raise TimelineError(
            f"no timeline files (named <task>.<pid>.json) in "
            f"{', '.join(paths) or 'the arguments'}: was TF_RDMA_TIMELINE set "
            f"for the run?")
    return files


def _load(path):
    """The events of one file; a file cut short (no closing ']', a partial
    last line: the process was killed) is read up to its last whole event."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise TimelineError(f"{path}: cannot read it ({e})") from e
    try:
        data = json.loads(text)
    except json.JSONDecodeError as first:
        end = text.rfind("},\n")
        try:
            if not text.lstrip().startswith("[") or end < 0:
                raise first
            data = json.loads(text[:end + 1] + "]")
        except json.JSONDecodeError:
            raise TimelineError(
                f"{path}: malformed JSON ({first}); expected a Chrome trace "
                f"written by TF_RDMA_TIMELINE") from first
    if isinstance(data, dict):
        data = data.get("traceEvents")
    if not isinstance(data, list) or not all(isinstance(e, dict) for e in data):
        raise TimelineError(f"{path}: not a Chrome trace (expected a list of "
                            f"events or {{\"traceEvents\": [...]}})")
    return data


def read(path):
    """Reads one timeline file.

    Returns:
        A dict: ``task``, ``pid``, ``origin_ns`` (the clock reading its ``ts``
        counts from), ``events`` (its "X" events), ``offsets`` (a list of
        ``{peer, offset_ns, rtt_ns, measured_at_ns}``), ``dropped_events``
        (None if the file has no end: its process did not stop its timeline)
        and ``path``.

    Raises:
        TimelineError: The file is not JSON, not a Chrome trace, or was not
            written by TF_RDMA_TIMELINE (no ``tf_rdma_timeline`` metadata).
    """
    events = _load(path)
    header = next((e for e in events if e.get("ph") == "M"
                   and e.get("name") == "tf_rdma_timeline"), None)
    if header is None or "task" not in header.get("args", {}):
        raise TimelineError(f"{path}: no tf_rdma_timeline metadata: not a "
                            f"file written by TF_RDMA_TIMELINE (or a merged "
                            f"file; merge the per-task files)")
    args = header["args"]
    end = next((e for e in events if e.get("ph") == "M"
                and e.get("name") == "tf_rdma_timeline_end"), None)
    return {
        "path": path,
        "task": args["task"],
        "pid": args.get("pid", header.get("pid")),
        "origin_ns": int(args.get("origin_ns", 0)),
        "events": [e for e in events if e.get("ph") == "X"],
        "offsets": [dict(e["args"]) for e in events
                    if e.get("ph") == "M" and e.get("name") == "tf_rdma_clock_offset"],
        "dropped_events": end["args"].get("dropped_events") if end else None,
    }


def _offsets(files):
    """Each task's clock minus the reference's, through the best pairs.

    Returns:
        ``{(a, b): (offset_ns of b's clock minus a's, rtt_ns)}``: per pair
        of tasks the measurement with the smallest round trip, both ways.
    """
    best = {}
    for f in files:
        for o in f["offsets"]:
            a, b = f["task"], o.get("peer")
            if not b or b == a:
                continue
            try:
                offset, rtt = int(o["offset_ns"]), max(0, int(o["rtt_ns"]))
            except (KeyError, TypeError, ValueError):
                continue
            if (a, b) not in best or rtt < best[(a, b)][1]:
                best[(a, b)] = (offset, rtt)
                best[(b, a)] = (-offset, rtt)
    return best


def _paths_from(reference, tasks, pairs):
    """Dijkstra from `reference` on rtt/2: {task: (offset_ns, error_ns, path)}."""
    neighbours = {}
    for (a, b), (offset, rtt) in pairs.items():
        neighbours.setdefault(a, []).append((b, offset, rtt))
    done = {}
    queue = [(0.0, reference, 0, [reference])]
    while queue:
        error, task, offset, path = heapq.heappop(queue)
        if task in done:
            continue
        done[task] = (offset, error, path)
        for b, edge, rtt in neighbours.get(task, ()):
            if b not in done:
                heapq.heappush(queue, (error + rtt / 2, b, offset + edge, path + [b]))
    return {t: done[t] for t in tasks if t in done}


def _default_reference(tasks):
    for task in ("/job:chief/task:0", "/job:worker/task:0"):
        if task in tasks:
            return task
    return sorted(tasks)[0]


def merge(paths, reference=None):
    """Merges the timeline files of several tasks onto the reference task's clock.

    Args:
        paths: Timeline files, or directories holding them (see
            :func:`timeline_files`).
        reference: The task whose clock the result uses (``worker:0`` or
            ``/job:worker/task:0``); default ``/job:chief/task:0`` if present,
            else ``/job:worker/task:0``, else the first task by name.

    Returns:
        A Chrome trace (``{"traceEvents": [...], "displayTimeUnit": "ms",
        "tf_rdma": {...}}``): one pid per task (named by ``process_name``
        metadata), ``ts`` in µs from the earliest file's start on the
        reference's clock, and under ``tf_rdma``: ``reference``, ``base_ns``
        (the reference's clock at ts 0) and ``tasks``, per task ``pid``,
        ``offset_ns`` (its clock minus the reference's), ``error_ns`` (the
        bound of that offset's error), ``path`` (the tasks the offset was
        measured through), ``events``, ``dropped_events`` and ``files``.

    Raises:
        TimelineError: No files, a malformed file (named), an unknown
            reference, or a task whose clock no measurement connects to the
            reference's (named).
    """
    files = [read(p) for p in timeline_files(list(paths))]
    tasks = sorted({f["task"] for f in files})
    if reference is None:
        reference = _default_reference(tasks)
    else:
        reference = canonical(reference)
        if reference not in tasks:
            raise TimelineError(f"reference task {reference} has no timeline "
                                f"file here; tasks: {', '.join(tasks)}")
    reached = _paths_from(reference, tasks, _offsets(files))
    missing = [t for t in tasks if t not in reached]
    if missing:
        detail = "; ".join(
            f"{t} ({', '.join(f['path'] for f in files if f['task'] == t)})"
            for t in missing)
        raise TimelineError(
            f"no clock offsets connect {detail} to the reference {reference}: "
            f"neither it nor a task it can be reached through measured the "
            f"other's clock (the offsets are measured while peers are "
            f"connected: a run shorter than about a second, or a task without "
            f"tf_rdma connections, records none). Pick another --reference, "
            f"or leave those files out")
    order = [reference] + [t for t in tasks if t != reference]
    pids = {t: i + 1 for i, t in enumerate(order)}
    base = min(f["origin_ns"] - reached[f["task"]][0] for f in files)
    out = []
    for task in order:
        out.append({"ph": "M", "name": "process_name", "pid": pids[task],
                    "tid": 0, "args": {"name": task}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": pids[task],
                    "tid": 0, "args": {"sort_index": pids[task]}})
    counts = {t: 0 for t in tasks}
    dropped = {t: 0 for t in tasks}
    events = []
    for f in files:
        task = f["task"]
        shift_us = (f["origin_ns"] - reached[task][0] - base) / 1000.0
        for e in f["events"]:
            e = dict(e)
            e["pid"] = pids[task]
            e["ts"] = round(float(e.get("ts", 0.0)) + shift_us, 3)
            events.append(e)
        counts[task] += len(f["events"])
        dropped[task] += f["dropped_events"] or 0
    events.sort(key=lambda e: e["ts"])
    summary = {}
    for task in order:
        offset, error, path = reached[task]
        summary[task] = {
            "pid": pids[task], "offset_ns": offset, "error_ns": error,
            "path": path, "events": counts[task], "dropped_events": dropped[task],
            "files": [f["path"] for f in files if f["task"] == task]}
    return {"traceEvents": out + events, "displayTimeUnit": "ms",
            "tf_rdma": {"reference": reference, "base_ns": base, "tasks": summary}}


def _load_merged(merged):
    if isinstance(merged, dict):
        return merged
    try:
        with open(merged, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise TimelineError(f"{merged}: cannot read it ({e})") from e
    except json.JSONDecodeError as e:
        raise TimelineError(f"{merged}: malformed JSON ({e})") from e
    if not isinstance(data, dict) or "tf_rdma" not in data:
        raise TimelineError(f"{merged}: not a merged timeline (written by "
                            f"`tf-rdma timeline merge`)")
    return data


def plot(merged, path, title=None, start_ms=None, end_ms=None):
    """Draws a merged timeline as a Gantt chart (PNG, or any format matplotlib
    writes, by the file's extension).

    One group of rows per task, one row per thread that recorded events; an
    op (send, recv, collective) is a pale full-height bar, its phases narrower
    bars on top of it, coloured by phase; the x axis is ms on the reference
    task's clock.

    Args:
        merged: What :func:`merge` returned, or the path of a file it wrote.
        path: Where to write the picture.
        title: The chart's title (default: the tasks and the reference).
        start_ms, end_ms: Draw only this window of the merged timeline (ms
            from its start, as the x axis shows); default: all of it.

    Raises:
        TimelineError: matplotlib is missing, or `merged` is not a merged
            timeline.
    """
    try:
        import matplotlib  # pylint: disable=import-outside-toplevel
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
        from matplotlib.patches import Patch  # pylint: disable=import-outside-toplevel
    except ImportError as e:
        raise TimelineError(
            "tf-rdma timeline plot needs matplotlib, which is not installed: "
            "pip install matplotlib (it is in requirements-dev.txt)") from e
    data = _load_merged(merged)
    info = data["tf_rdma"]
    order = sorted(info["tasks"], key=lambda t: info["tasks"][t]["pid"])
    task_of = {info["tasks"][t]["pid"]: t for t in order}
    if start_ms is not None and end_ms is not None and end_ms <= start_ms:
        raise TimelineError(f"the window's end ({end_ms} ms) is not after its "
                            f"start ({start_ms} ms)")
    rows = {}  # (task, tid) -> [(name, start_ms, dur_ms)]
    for e in data["traceEvents"]:
        if e.get("ph") != "X" or e.get("pid") not in task_of:
            continue
        start, dur = e["ts"] / 1000.0, e.get("dur", 0.0) / 1000.0
        if ((start_ms is not None and start + dur < start_ms) or
                (end_ms is not None and start > end_ms)):
            continue
        rows.setdefault((task_of[e["pid"]], e.get("tid", 0)), []).append(
            (e.get("name", "?"), start, dur))
    if not rows:
        raise TimelineError("no events to draw" + (
            "" if start_ms is None and end_ms is None else
            f" between {start_ms} and {end_ms} ms"))
    keys = sorted(rows, key=lambda k: (order.index(k[0]),
                                       min(s for _, s, _ in rows[k])))
    height = min(40.0, 1.6 + 0.32 * max(1, len(keys)))
    fig, ax = plt.subplots(figsize=(12, height), dpi=80)
    labels, seen = [], set()
    for y, key in enumerate(keys):
        by_name = {}
        for name, start, dur in rows[key]:
            by_name.setdefault(name, []).append((start, dur))
        for name, spans in by_name.items():
            seen.add(name)
            op = name in OPS or name not in PHASES
            lo, h = (y - 0.4, 0.8) if op else (y - 0.25, 0.5)
            color = _COLORS.get(name, "#969696")
            ax.broken_barh(spans, (lo, h), facecolors=color, edgecolors=color,
                           linewidth=0.6, zorder=1 if op else 2)
        index = sum(1 for k in keys[:y] if k[0] == key[0])
        labels.append(f"{short(key[0])} · thread {index}")
    for y in range(1, len(keys)):
        if keys[y][0] != keys[y - 1][0]:
            ax.axhline(y - 0.5, color="black", linewidth=0.8)
    ax.set_yticks(range(len(keys)))
    ax.set_yticklabels(labels, fontsize=8)
    ax.set_ylim(len(keys) - 0.5, -0.5)
    if start_ms is not None or end_ms is not None:
        ax.set_xlim(start_ms, end_ms)
    ax.set_xlabel(f"time (ms) on {short(info['reference'])}'s clock")
    ax.grid(axis="x", linestyle=":", linewidth=0.5)
    ax.set_title(title or (f"tf_rdma timeline: {', '.join(short(t) for t in order)} "
                           f"(reference {short(info['reference'])})"), fontsize=10)
    handles = [Patch(color=_COLORS[n], label=n.split(".", 1)[1])
               for n in OPS + PHASES if n in seen]
    legend_in = 0.35  # inches under the axes for the legend's one row
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 9),
               fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, legend_in / height, 1, 1))
    fig.savefig(path)
    plt.close(fig)


_USAGE = "tf-rdma timeline {merge,plot} ..."
_DESCRIPTION = """\
The per-process timeline files that TF_RDMA_TIMELINE=<dir> makes every
tf_rdma process write (Chrome traces: <job>-<index>.<pid>.json), merged
onto one clock, and drawn as a Gantt chart.

  merge  joins the files of all tasks onto the clock of one reference task
         (offsets measured over the control connection, NTP-style) and
         prints each task's offset and its error bound
  plot   draws a merged file as a PNG Gantt chart (one row group per task,
         bars coloured by phase); needs matplotlib
"""
_EPILOG = """\
examples:
  TF_RDMA_TIMELINE=/tmp/tl tf-rdma launch ... train.py
  tf-rdma timeline merge /tmp/tl -o merged.json
  tf-rdma timeline plot merged.json -o timeline.png
  (open merged.json in https://ui.perfetto.dev or chrome://tracing)

docs/observability.md, "Timeline", says how to read them.
"""


def add_arguments(parser):
    """Adds the ``merge`` and ``plot`` subcommands to an argparse parser."""
    sub = parser.add_subparsers(dest="timeline_command", metavar="{merge,plot}")
    sub.required = True
    m = sub.add_parser(
        "merge", help="join the tasks' timeline files onto one clock",
        usage="tf-rdma timeline merge FILE_OR_DIR... -o MERGED.json [--reference TASK]",
        description="Join the timeline files of all tasks onto the clock of one "
                    "reference task. Prints one line per task: its clock's offset "
                    "from the reference's and the bound of that offset's error.")
    m.add_argument("paths", nargs="+", metavar="FILE_OR_DIR",
                   help="timeline files, or directories of them (TF_RDMA_TIMELINE)")
    m.add_argument("-o", "--output", required=True, metavar="MERGED.json",
                   help="where to write the merged Chrome trace")
    m.add_argument("--reference", metavar="TASK",
                   help="the task whose clock to use (worker:0 or /job:worker/task:0); "
                        "default chief:0, else worker:0, else the first task")
    p = sub.add_parser(
        "plot", help="draw a merged timeline as a PNG Gantt chart (matplotlib)",
        usage="tf-rdma timeline plot MERGED.json -o TIMELINE.png [--title TEXT] "
              "[--from-ms MS] [--to-ms MS]",
        description="Draw a merged timeline (tf-rdma timeline merge) as a Gantt "
                    "chart: one row group per task, one row per thread, ops as pale "
                    "bars and their phases on top, coloured by phase.")
    p.add_argument("merged", metavar="MERGED.json", help="a file written by `timeline merge`")
    p.add_argument("-o", "--output", required=True, metavar="TIMELINE.png",
                   help="the picture to write (.png; .svg and .pdf work too)")
    p.add_argument("--title", help="the chart's title")
    p.add_argument("--from-ms", type=float, metavar="MS",
                   help="draw from this time on (ms, as the x axis counts)")
    p.add_argument("--to-ms", type=float, metavar="MS", help="draw up to this time (ms)")


def run(args, parser=None):
    """Runs ``tf-rdma timeline merge`` or ``plot``; returns the exit status
    (0, or 1 with the error on stderr)."""
    try:
        if args.timeline_command == "merge":
            merged = merge(args.paths, reference=args.reference)
            with open(args.output, "w", encoding="utf-8") as f:
                json.dump(merged, f)
            info = merged["tf_rdma"]
            for task, t in info["tasks"].items():
                if task == info["reference"]:
                    via = " (reference)"
                elif len(t["path"]) > 2:
                    via = " via " + ", ".join(short(x) for x in t["path"][1:-1])
                else:
                    via = ""
                print(f"{task}: offset {t['offset_ns'] / 1e6:+.3f} ms "
                      f"± {t['error_ns'] / 1e6:.3f} ms, {t['events']} events"
                      f"{via}")
            print(f"wrote {args.output}: {len(info['tasks'])} tasks on "
                  f"{info['reference']}'s clock")
        else:
            plot(args.merged, args.output, title=args.title,
                 start_ms=args.from_ms, end_ms=args.to_ms)
            print(f"wrote {args.output}")
    except (TimelineError, OSError) as e:
        print(f"tf-rdma timeline: error: {e}", file=sys.stderr)
        return 1
    return 0


COMMAND = Command(name="timeline", help="merge the TF_RDMA_TIMELINE files of all tasks; plot them",
                  usage=_USAGE, description=_DESCRIPTION, epilog=_EPILOG,
                  add_arguments=add_arguments, run=run)


def main(argv=None):
    """``python -m tf_rdma.timeline``: the same as ``tf-rdma timeline``."""
    return COMMAND.main(sys.argv[1:] if argv is None else argv, "tf-rdma timeline")


if __name__ == "__main__":
    sys.exit(main())
