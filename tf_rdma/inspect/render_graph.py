"""The transfers as a graph: Graphviz DOT (``--format dot``) and the SVG
drawing that the HTML page embeds.

Both draw the nodes at either end of a transfer, grouped by task (a DOT
cluster, an SVG column), and one edge per consumer, styled by class (static,
dynamic, control, kept) and labelled with the row number, the size and the
class.
"""

import html
import re

from tf_rdma.inspect.tables import human_bytes, short

__all__ = ["KIND_STYLE", "render_dot", "svg"]


# Colours: one per task (background of the task's nodes) and one per class.
_TASK_COLOURS = ("#a5d8ff", "#b2f2bb", "#ffd8a8", "#d0bfff", "#fcc2d7",
                 "#99e9f2", "#ffec99", "#eebefa", "#c0eb75", "#ffc9c9")
_TASK_BORDERS = ("#1971c2", "#2f9e44", "#e8590c", "#6741d9", "#c2255c",
                 "#0c8599", "#f08c00", "#9c36b5", "#66a80f", "#e03131")
KIND_STYLE = {  # colour, DOT style, SVG dash array
    "static": ("#1c7ed6", "solid", ""),
    "dynamic": ("#f76707", "dashed", "7,4"),
    "control": ("#868e96", "dotted", "2,3"),
    "kept": ("#e03131", "bold", "1,0"),
}


def _tasks(report):
    tasks = set()
    for e in report.analysis.edges:
        tasks.update((e.src, e.dst))
    return sorted(tasks)


def _graph_nodes(report):
    """``{task: [node, ...]}``: the nodes at either end of a transfer."""
    placements = report.analysis.placements
    nodes = {}
    for e in report.analysis.edges:
        for name in (e.producer, *(c for c, _ in e.consumers)):
            task = placements[name].task
            lst = nodes.setdefault(task, [])
            if name not in lst:
                lst.append(name)
    return nodes


def _ordered_nodes(report):
    """:func:`_graph_nodes`, each column ordered to cut edge crossings.

    A few sweeps of the barycentre heuristic: a node moves to the mean
    relative position of the nodes it exchanges tensors with.
    """
    nodes = _graph_nodes(report)
    neighbours = {}
    for e in report.analysis.edges:
        for c, _ in e.consumers:
            neighbours.setdefault(e.producer, set()).add(c)
            neighbours.setdefault(c, set()).add(e.producer)
    for _ in range(4):
        where = {}
        for lst in nodes.values():
            for i, n in enumerate(lst):
                where[n] = (i + 0.5) / len(lst)
        for task, lst in nodes.items():
            lst.sort(key=lambda n: sum(where[m] for m in neighbours[n])
                     / len(neighbours[n]) * 0.999 + where[n] * 0.001)
    return nodes


def _edge_label(row):
    e = row.edge
    size = "0 B" if e.kind == "control" else human_bytes(e.nbytes)
    return f"#{row.number} {size} {e.kind}"


def _dot_id(text):
    """A DOT quoted string; newlines in ``text`` become DOT line breaks."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _dot_cluster(task):
    return "cluster_" + re.sub(r"[^A-Za-z0-9_]", "_", short(task))


def render_dot(report):
    """Graphviz DOT: one cluster per task, transfer edges labelled."""
    tasks = _tasks(report)
    colour = {t: i % len(_TASK_COLOURS) for i, t in enumerate(tasks)}
    nodes = _graph_nodes(report)
    ops = {n.name: n.op for n in report.analysis.graph_def.node}
    plan = report.plan
    title = (f"tf_rdma plan {plan.name} ({report.source}): "
             f"{plan.bytes_per_step} bytes/step")
    lines = [
        "digraph tf_rdma_plan {",
        f"  label={_dot_id(title)}; labelloc=t; rankdir=LR; fontname=Helvetica;",
        "  node [shape=box, style=\"rounded,filled\", fontname=Helvetica, fontsize=10];",
        "  edge [fontname=Helvetica, fontsize=9];",
    ]
    for task in tasks:
        i = colour[task]
        lines.append(f"  subgraph {_dot_cluster(task)} {{")
        lines.append(f"    label={_dot_id(short(task))}; style=\"rounded,filled\"; "
                     f"fillcolor=\"#f8f9fa\"; color=\"{_TASK_BORDERS[i]}\";")
        for name in nodes.get(task, []):
            label = f"{name}\n({ops.get(name, '?')})"
            lines.append(
                f"    {_dot_id(name)} [label={_dot_id(label)}, "
                f"fillcolor=\"{_TASK_COLOURS[i]}\", color=\"{_TASK_BORDERS[i]}\"];")
        lines.append("  }")
    for row in report.rows:
        e = row.edge
        colour_k, style, _ = KIND_STYLE[e.kind]
        label = f"{e.key}\n{_edge_label(row)}"
        tooltip = e.reason or e.kind
        for consumer in row.dst_nodes:
            lines.append(
                f"  {_dot_id(e.producer)} -> {_dot_id(consumer)} "
                f"[label={_dot_id(label)}, color=\"{colour_k}\", "
                f"fontcolor=\"{colour_k}\", style={style}, "
                f"tooltip={_dot_id(tooltip)}];")
    lines.append("}")
    return "\n".join(lines) + "\n"


# --- SVG

_COL_W = 230  # Width of a task column (and its node boxes + padding).
_GAP = 170  # Between columns: room for the edges and their labels.
_NODE_H = 30
_NODE_GAP = 16
_TOP = 70  # Above the first node: the task's title.
_MARGIN = 20


def svg(report):
    """The graph as an inline ``<svg>`` element: one column per task."""
    tasks = _tasks(report)
    colour = {t: i % len(_TASK_COLOURS) for i, t in enumerate(tasks)}
    nodes = _ordered_nodes(report)
    ops = {n.name: n.op for n in report.analysis.graph_def.node}
    placements = report.analysis.placements
    col_x = {t: _MARGIN + i * (_COL_W + _GAP) for i, t in enumerate(tasks)}
    pos = {}
    tallest = max((len(nodes.get(t, [])) for t in tasks), default=0)
    height = _TOP + tallest * (_NODE_H + _NODE_GAP) + _MARGIN * 2
    width = _MARGIN * 2 + len(tasks) * _COL_W + max(0, len(tasks) - 1) * _GAP
    esc = html.escape
    out = [f'<svg id="plan-graph" xmlns="http://www.w3.org/2000/svg" '
           f'width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
           f'role="img" aria-label="transfers between tasks">',
           "<defs>"]
    for kind, (c, _, _) in KIND_STYLE.items():
        out.append(f'<marker id="arrow-{kind}" viewBox="0 0 10 10" refX="10" '
                   f'refY="5" markerWidth="7" markerHeight="7" '
                   f'orient="auto-start-reverse"><path d="M0,0L10,5L0,10z" '
                   f'fill="{c}"/></marker>')
    out.append("</defs>")
    for task in tasks:
        i, x = colour[task], col_x[task]
        n = len(nodes.get(task, []))
        h = _TOP - 30 + n * (_NODE_H + _NODE_GAP) + 10
        out.append(
            f'<g class="task" data-task="{esc(short(task))}">'
            f'<rect x="{x}" y="{_MARGIN}" width="{_COL_W}" height="{h}" rx="10" '
            f'fill="#f8f9fa" stroke="{_TASK_BORDERS[i]}" stroke-width="2"/>'
            f'<text x="{x + _COL_W / 2}" y="{_MARGIN + 24}" class="task-title" '
            f'fill="{_TASK_BORDERS[i]}">{esc(short(task))}</text></g>')
        for j, name in enumerate(nodes.get(task, [])):
            pos[name] = (x + 15, _TOP + j * (_NODE_H + _NODE_GAP))
    edges_svg = []
    for row in report.rows:
        e = row.edge
        c, _, dash = KIND_STYLE[e.kind]
        for k, consumer in enumerate(row.dst_nodes):
            sx, sy = pos[e.producer]
            dx, dy = pos[consumer]
            w = _COL_W - 30
            if dx > sx:
                x1, x2 = sx + w, dx
            else:
                x1, x2 = sx, dx + w
            y1, y2 = sy + _NODE_H / 2, dy + _NODE_H / 2
            bend = max(60, abs(x2 - x1) / 3) * (1 if x2 > x1 else -1)
            path = (f"M{x1:.0f},{y1:.0f} C{x1 + bend:.0f},{y1:.0f} "
                    f"{x2 - bend:.0f},{y2:.0f} {x2:.0f},{y2:.0f}")
            # The label goes into the gap next to the source column, where no
            # node can cover it (the middle of a long edge may cross a column).
            target = x1 + (_GAP / 2 if x2 > x1 else -_GAP / 2)
            controls = ((x1, y1), (x1 + bend, y1), (x2 - bend, y2), (x2, y2))
            lx, ly = min((_bezier(t / 40, *controls) for t in range(2, 39)),
                         key=lambda p, target=target: abs(p[0] - target))
            title = (f"#{row.number} {e.key}: {e.tensor} -> {consumer} "
                     f"({short(e.src)} -> {short(e.dst)}), {e.dtype or '-'} "
                     f"{row.shape_text}, {row.bytes_text} bytes, {e.kind}"
                     + (f": {e.reason}" if e.reason else ""))
            edges_svg.append(
                f'<g class="transfer kind-{e.kind}" data-key="{esc(e.key)}" '
                f'data-row="{row.number}"><title>{esc(title)}</title>'
                f'<path d="{path}" fill="none" stroke="{c}" stroke-width="2" '
                + (f'stroke-dasharray="{dash}" ' if dash and dash != "1,0" else "")
                + f'marker-end="url(#arrow-{e.kind})"/>'
                f'<text x="{lx:.0f}" y="{ly - 4:.0f}" class="edge-label" '
                f'fill="{c}">{esc(_edge_label(row))}</text></g>')
    out.extend(edges_svg)
    for name, (x, y) in pos.items():
        i = colour[placements[name].task]
        label = name if len(name) <= 28 else "\u2026" + name[-27:]
        out.append(
            f'<g class="node" data-node="{esc(name)}"><title>{esc(name)} '
            f'({esc(ops.get(name, "?"))}) on {esc(short(placements[name].task))}: '
            f'{esc(placements[name].reason)}</title>'
            f'<rect x="{x}" y="{y}" width="{_COL_W - 30}" height="{_NODE_H}" '
            f'rx="6" fill="{_TASK_COLOURS[i]}" stroke="{_TASK_BORDERS[i]}"/>'
            f'<text x="{x + 8}" y="{y + 19}" class="node-label">{esc(label)}'
            f'<tspan class="op"> {esc(ops.get(name, "?"))}</tspan></text></g>')
    out.append("</svg>")
    return "\n".join(out)


def _bezier(t, p0, p1, p2, p3):
    u = 1 - t
    x = u ** 3 * p0[0] + 3 * u * u * t * p1[0] + 3 * u * t * t * p2[0] + t ** 3 * p3[0]
    y = u ** 3 * p0[1] + 3 * u * u * t * p1[1] + 3 * u * t * t * p2[1] + t ** 3 * p3[1]
    return x, y
