"""``tf-rdma inspect --format html``: one self-contained page.

The header, the summary, the graph (inline SVG, :mod:`tf_rdma.inspect.render_graph`)
and the tables, with the styles in the page: it opens from a file, offline.
"""

import html

from tf_rdma.inspect.render_graph import KIND_STYLE, dot_program, draw
from tf_rdma.inspect.tables import (endpoint_text, pair_table, placement_rows,
                                    short, summary_lines, transfer_table)

__all__ = ["render_html"]


_CSS = """
body { font: 14px/1.4 system-ui, -apple-system, "Segoe UI", Helvetica, Arial, sans-serif;
       margin: 24px; color: #212529; }
h1 { font-size: 20px; margin: 0 0 4px; } h2 { font-size: 16px; margin: 24px 0 8px; }
.meta { color: #495057; margin: 0 0 2px; } .note { color: #e8590c; }
.graph { overflow: auto; border: 1px solid #dee2e6; border-radius: 8px; background: #fff; }
table { border-collapse: collapse; font-size: 13px; }
th, td { border-bottom: 1px solid #dee2e6; padding: 4px 8px; text-align: left;
         vertical-align: top; }
th { background: #f1f3f5; position: sticky; top: 0; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
td.node { font-family: ui-monospace, Menlo, Consolas, monospace; font-size: 12px; }
.kind { font-weight: 600; } .kind-static .kind { color: #1c7ed6; }
.kind-dynamic .kind { color: #f76707; } .kind-control .kind { color: #868e96; }
.kind-kept .kind { color: #e03131; }
tr.edge-row:target { background: #fff3bf; }
.reason { color: #495057; font-size: 12px; }
.legend span { display: inline-block; margin-right: 16px; }
.legend i { display: inline-block; width: 28px; height: 0; border-top: 3px solid;
            vertical-align: middle; margin-right: 6px; }
svg.columns text { font: 12px system-ui, Helvetica, Arial, sans-serif; }
svg.columns .task-title { font-weight: 700; font-size: 14px; text-anchor: middle; }
svg.columns .node-label .op { fill: #495057; font-size: 10px; }
svg.columns .edge-label { font-size: 11px; font-weight: 600; text-anchor: middle;
                          paint-order: stroke; stroke: #fff; stroke-width: 4px; }
svg g.transfer:hover path { stroke-width: 4; }
svg.graphviz g.transfer text { paint-order: stroke; stroke: #fff; stroke-width: 3px; }
.layout { color: #868e96; font-size: 12px; margin: 4px 0 0; }
ul.summary { margin: 0; padding-left: 20px; }
"""


def render_html(report, layout=None):
    """One self-contained page: header, graph (inline SVG), tables, summary.

    Args:
      report: the :class:`~tf_rdma.inspect.report.Report`.
      layout: the graph's layout, one of
        :data:`~tf_rdma.inspect.render_graph.LAYOUTS`; default the report's
        ``--graph-layout``, else "auto" (Graphviz where installed).
    """
    if layout is None:
        layout = getattr(report.args, "graph_layout", None) or "auto"
    esc = html.escape
    plan = report.plan
    a = report.analysis
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>tf-rdma inspect: {esc(report.source)}</title>",
        f"<style>{_CSS}</style></head><body>",
        f"<h1>tf-rdma inspect: {esc(report.source)}</h1>",
        f'<p class="meta">plan <code>{esc(plan.name)}</code> (hash '
        f"<code>{esc(plan.short_hash)}</code>), depth {plan.depth}, caller "
        f"{esc(short(a.caller_task))}, endpoints: {esc(endpoint_text(report))}</p>",
    ]
    for note in (report.loaded.notes if report.loaded else []):
        parts.append(f'<p class="meta note">note: {esc(note)}</p>')
    parts.append('<h2>Summary</h2><ul class="summary" id="summary">')
    items = []  # (line, [sub-lines])
    for line in summary_lines(report):
        if line.startswith("  ") and items:
            items[-1][1].append(line.strip())
        else:
            items.append((line, []))
    for line, subs in items:
        inner = "".join(f"<li>{esc(x)}</li>" for x in subs)
        parts.append(f"<li>{esc(line)}" + (f"<ul>{inner}</ul>" if subs else "")
                     + "</li>")
    parts.append("</ul>")
    parts.append('<h2>Graph</h2><p class="legend">')
    for kind, (c, _, dash) in KIND_STYLE.items():
        style = "dashed" if kind == "dynamic" else "dotted" if kind == "control" else "solid"
        parts.append(f'<span><i style="border-top-color:{c};border-top-style:{style}"></i>'
                     f"{kind}</span>")
    parts.append("</p>")
    drawing, used, note = draw(report, layout)
    parts.append('<div class="graph">' + drawing + "</div>")
    caption = ("laid out by Graphviz (dot)" if used == "graphviz" else
               "built-in column layout; edges between non-adjacent tasks run "
               "below the task boxes" + (" (install Graphviz for dot's layout)"
                                         if dot_program() is None else ""))
    if note:
        caption += f"; note: {note}"
    parts.append(f'<p class="layout" id="graph-layout">{esc(caption)}</p>')
    parts.append(f'<h2>Transfers ({len(report.rows)} cross-task edges)</h2>')
    header, rows = transfer_table(report)
    numeric = {0, 7, 10}
    parts.append('<table id="transfers"><thead><tr>'
                 + "".join(f"<th>{esc(h)}</th>" for h in header)
                 + "<th>reason</th></tr></thead><tbody>")
    for row, cells in zip(report.rows, rows):
        e = row.edge
        tds = []
        for i, cell in enumerate(cells):
            cls = ("num" if i in numeric else "node" if i in (1, 2)
                   else "kind" if i == 8 else "")
            tds.append(f'<td class="{cls}">{esc(cell)}</td>' if cls
                       else f"<td>{esc(cell)}</td>")
        tds.append(f'<td class="reason">{esc(e.reason)}</td>')
        parts.append(f'<tr class="edge-row kind-{e.kind}" id="row-{row.number}" '
                     f'data-key="{esc(e.key)}">' + "".join(tds) + "</tr>")
    parts.append("</tbody></table>")
    parts.append("<h2>Per task pair</h2>")
    header, rows = pair_table(report)
    parts.append('<table id="pairs"><thead><tr>'
                 + "".join(f"<th>{esc(h)}</th>" for h in header)
                 + "</tr></thead><tbody>")
    for cells in rows:
        parts.append('<tr class="pair-row">' + "".join(
            f'<td{" class=num" if i >= 2 else ""}>{esc(c)}</td>'
            for i, c in enumerate(cells)) + "</tr>")
    parts.append("</tbody></table>")
    header, rows = placement_rows(report)
    if rows:
        parts.append("<h2>Inferred placements</h2><p class=\"meta\">Nodes at the "
                     "ends of transfers that no <code>tf.device</code> placed: "
                     "the task the pass chose, and why.</p>")
        parts.append('<table id="placements"><thead><tr>'
                     + "".join(f"<th>{esc(h)}</th>" for h in header)
                     + "</tr></thead><tbody>")
        for cells in rows:
            parts.append("<tr>" + "".join(
                f'<td{" class=node" if i == 0 else ""}>{esc(c)}</td>'
                for i, c in enumerate(cells)) + "</tr>")
        parts.append("</tbody></table>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"
