"""The report of ``tf-rdma inspect`` as rows of strings.

The transfer table, the per-pair totals, the inferred placements and the
summary, each as text cells or lines: the text renderer prints them as
aligned tables, the HTML renderer as HTML tables (and the graph renderer
labels its edges with :func:`human_bytes`).
"""

from tf_rdma.inspect.report import summary_dict

__all__ = ["short", "human_bytes", "endpoint_text", "transfer_table",
           "pair_table", "summary_lines", "placement_rows"]


def short(task):
    """The short name of a task: ``worker:0`` for ``/job:worker/replica:0/task:0``."""
    from tf_rdma.graph_passes.transfers import short_task  # pylint: disable=import-outside-toplevel
    return short_task(task)


def human_bytes(n):
    """``n`` bytes for a reader: ``"512 B"``, ``"1.5 MiB"``; ``"?"`` for None."""
    if n is None:
        return "?"
    if n < 1024:
        return f"{n} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
    return f"{n} B"  # pragma: no cover


def endpoint_text(report):
    """The tasks that run an endpoint, as the report's header says them."""
    tasks = report.args.endpoint_tasks if report.args is not None else None
    if tasks is None:
        return "every task but the caller's"
    return ", ".join(short(t) for t in tasks) or "none"


def transfer_table(report):
    """(header, rows) of the transfer table, as strings."""
    header = ("#", "src node", "dst node", "src task", "dst task", "dtype",
              "shape", "bytes", "class", "region", "offset")
    rows = []
    for r in report.rows:
        e = r.edge
        rows.append((str(r.number), r.src_node, ", ".join(r.dst_nodes),
                     short(e.src), short(e.dst), e.dtype or "-",
                     r.shape_text, r.bytes_text, e.kind, r.region_text,
                     r.offset_text))
    return header, rows


def pair_table(report):
    """(header, rows) of the per-pair totals, as strings."""
    header = ("src task", "dst task", "edges", "static", "dynamic", "control",
              "kept", "tf_rdma bytes/step", "kept bytes/step", "region bytes",
              "credit bytes")
    rows = []
    for p in report.pairs:
        rows.append((
            short(p.src), short(p.dst), str(sum(p.counts.values())),
            str(p.counts["static"]), str(p.counts["dynamic"]),
            str(p.counts["control"]), str(p.counts["kept"]),
            str(p.planned_bytes), str(p.kept_bytes),
            str(p.region.nbytes) if p.region else "-",
            str(p.region.credit_bytes) if p.region else "-"))
    return header, rows


def summary_lines(report):
    """The summary as lines of text."""
    s = summary_dict(report)
    c = s["counts"]
    b = s["bytes_per_step"]
    lines = [
        f"cross-task edges: {s['cross_task_edges']} ({c['static']} static, "
        f"{c['dynamic']} dynamic, {c['control']} control, {c['kept']} kept)",
        f"per step through tf_rdma: {b['tf_rdma']} bytes ({human_bytes(b['tf_rdma'])}) "
        f"in {c['static']} static slot{'s' if c['static'] != 1 else ''}"
        + (f" + {c['control']} control token{'s' if c['control'] != 1 else ''}"
           if c["control"] else ""),
    ]
    if c["dynamic"]:
        lines.append(
            f"dynamic: {c['dynamic']} edge{'s' if c['dynamic'] != 1 else ''}, "
            f"size known only at run time (metadata slot + payload that grows):")
        for g in s["reasons"]["dynamic"]:
            lines.append(f"  {g['reason']}: {', '.join(g['edges'])}")
    if c["kept"]:
        unknown = b["kept_unknown_edges"]
        lines.append(
            f"kept on TensorFlow's path: {c['kept']} edge"
            f"{'s' if c['kept'] != 1 else ''}, {b['kept_known']} bytes "
            f"({human_bytes(b['kept_known'])}) per step"
            + (f" + {unknown} of unknown size" if unknown else "") + ":")
        for g in s["reasons"]["kept"]:
            lines.append(f"  {g['reason']}: {', '.join(g['edges'])}")
    lines.append(
        f"memory: {s['region_bytes']} bytes ({human_bytes(s['region_bytes'])}) of "
        f"data regions on the receivers, {s['credit_bytes']} bytes of credit "
        f"regions on the senders (depth {s['depth']})"
        + (", plus the payload areas of the dynamic slots, which grow on demand"
           if c["dynamic"] else ""))
    return lines


def placement_rows(report):
    """(header, rows): where the nodes at the ends of transfers run, for the
    ones no ``tf.device`` put there (the pass chose their task)."""
    placements = report.analysis.placements
    names = []
    for e in report.analysis.edges:
        for name in (e.producer, *(c for c, _ in e.consumers)):
            if name not in names and placements[name].inferred:
                names.append(name)
    rows = [(n, short(placements[n].task), placements[n].reason)
            for n in sorted(names)]
    return ("node", "task", "why there"), rows
