"""``tf-rdma inspect --format text``: tables and a summary, for a terminal."""

from tf_rdma.inspect.tables import (endpoint_text, pair_table, placement_rows,
                                    short, summary_lines, transfer_table)

__all__ = ["render_text"]


def _table(header, rows, right=()):
    widths = [max(len(str(r[i])) for r in (header, *rows)) for i in range(len(header))]

    def fmt(row):
        cells = [str(c).rjust(w) if i in right else str(c).ljust(w)
                 for i, (c, w) in enumerate(zip(row, widths))]
        return "  ".join(cells).rstrip()

    return [fmt(header), fmt(tuple("-" * w for w in widths))] + [fmt(r) for r in rows]


def _header_lines(report):
    a = report.analysis
    plan = a.plan
    lines = [
        f"tf-rdma inspect: {report.source}",
        f"plan {plan.name} (hash {plan.short_hash}), depth {plan.depth}, "
        f"caller {short(a.caller_task)}, endpoints: {endpoint_text(report)}",
    ]
    for note in (report.loaded.notes if report.loaded else []):
        lines.append(f"note: {note}")
    return lines


def render_text(report):
    """Tables and a summary, for a terminal."""
    lines = _header_lines(report)
    lines.append("")
    lines.append(f"transfers ({len(report.rows)} cross-task edges)")
    header, rows = transfer_table(report)
    lines.extend(_table(header, rows, right=(0, 7, 10)))
    lines.append("")
    lines.append("per task pair")
    header, rows = pair_table(report)
    lines.extend(_table(header, rows, right=tuple(range(2, 11))))
    header, rows = placement_rows(report)
    if rows:
        lines.append("")
        lines.append("inferred placements (transfer ends that no tf.device placed)")
        lines.extend(_table(header, rows))
    lines.append("")
    lines.append("summary")
    lines.extend("  " + line for line in summary_lines(report))
    return "\n".join(lines) + "\n"
