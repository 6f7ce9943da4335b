"""The transfers as a graph: Graphviz DOT (``--format dot``) and the SVG
drawing that the HTML page embeds (laid out by Graphviz's `dot` where it is
installed, else by the built-in column layout; ``--graph-layout``).

Both draw the nodes at either end of a transfer, grouped by task (a DOT
cluster, an SVG column), and one edge per consumer, styled by class (static,
dynamic, control, kept) and labelled with the row number, the size and the
class.
"""

import html
import math
import re
import shutil
import subprocess
from xml.etree import ElementTree

from tf_rdma.inspect.tables import human_bytes, short

__all__ = ["KIND_STYLE", "LAYOUTS", "GraphvizError", "render_dot", "draw",
           "svg", "graphviz_svg", "columns_svg", "dot_program"]


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


def render_dot(report, for_svg=False):
    """Graphviz DOT: one cluster per task, transfer edges labelled.

    Args:
      report: the :class:`~tf_rdma.inspect.report.Report`.
      for_svg: the variant :func:`graphviz_svg` lays out: every cluster,
        node and edge gets an ``id`` (``task_I``, ``node_I``,
        ``transfer_ROW_K``) to find it in the SVG again, and there is no
        graph title or tooltip (the page has both).
    """
    tasks = _tasks(report)
    colour = {t: i % len(_TASK_COLOURS) for i, t in enumerate(tasks)}
    nodes = _graph_nodes(report)
    ops = {n.name: n.op for n in report.analysis.graph_def.node}
    plan = report.plan
    title = (f"tf_rdma plan {plan.name} ({report.source}): "
             f"{plan.bytes_per_step} bytes/step")
    lines = ["digraph tf_rdma_plan {"]
    if not for_svg:
        lines.append(f"  label={_dot_id(title)}; labelloc=t; rankdir=LR; fontname=Helvetica;")
    else:
        lines.append("  rankdir=LR; fontname=Helvetica; newrank=true; ranksep=0.9;")
    lines += [
        "  node [shape=box, style=\"rounded,filled\", fontname=Helvetica, fontsize=10];",
        "  edge [fontname=Helvetica, fontsize=9];",
    ]
    node_ids = {}
    order = {t: i for i, t in enumerate(tasks)}
    placements = report.analysis.placements
    for t_index, task in enumerate(tasks):
        i = colour[task]
        lines.append(f"  subgraph {_dot_cluster(task)} {{")
        extra = f" id=\"task_{t_index}\";" if for_svg else ""
        lines.append(f"    label={_dot_id(short(task))}; style=\"rounded,filled\"; "
                     f"fillcolor=\"#f8f9fa\"; color=\"{_TASK_BORDERS[i]}\";{extra}")
        for name in nodes.get(task, []):
            label = f"{name}\n({ops.get(name, '?')})"
            node_ids[name] = f"node_{len(node_ids)}"
            extra = f", id=\"{node_ids[name]}\"" if for_svg else ""
            lines.append(
                f"    {_dot_id(name)} [label={_dot_id(label)}, "
                f"fillcolor=\"{_TASK_COLOURS[i]}\", color=\"{_TASK_BORDERS[i]}\"{extra}];")
        if for_svg and nodes.get(task):
            lines.append("    {rank=same; " + "; ".join(_dot_id(n) for n in nodes[task]) + "}")
        lines.append("  }")
    if for_svg:
        firsts = [nodes[t][0] for t in tasks if nodes.get(t)]
        for a, b in zip(firsts, firsts[1:]):
            lines.append(f"  {_dot_id(a)} -> {_dot_id(b)} [style=invis, weight=0];")
    for row in report.rows:
        e = row.edge
        colour_k, style, _ = KIND_STYLE[e.kind]
        label = f"{e.key}\n{_edge_label(row)}"
        tooltip = e.reason or e.kind
        for k, consumer in enumerate(row.dst_nodes):
            if for_svg:
                # The label is a node on the edge (producer -> label ->
                # consumer), outside every cluster: dot's router keeps other
                # edges out of it, as out of any node.
                ident = f"transfer_{row.number}_{k}"
                lines.append(
                    f"  {ident}_label [shape=plaintext, style=filled, "
                    f"fillcolor=white, margin=\"0.04,0.02\", fontsize=9, "
                    f"fontcolor=\"{colour_k}\", label={_dot_id(label)}, "
                    f"id=\"{ident}_label\"];")
                legs = (f"color=\"{colour_k}\", style={style}")
                if order[placements[e.producer].task] < order[placements[consumer].task]:
                    lines.append(f"  {_dot_id(e.producer)} -> {ident}_label [{legs}, "
                                 f"dir=none, id=\"{ident}_tail\"];")
                    lines.append(f"  {ident}_label -> {_dot_id(consumer)} [{legs}, "
                                 f"id=\"{ident}_head\"];")
                else:
                    # Right to left: written left to right, drawn backwards,
                    # so that every edge ranks the tasks in name order.
                    lines.append(f"  {ident}_label -> {_dot_id(e.producer)} [{legs}, "
                                 f"dir=none, id=\"{ident}_tail\"];")
                    lines.append(f"  {_dot_id(consumer)} -> {ident}_label [{legs}, "
                                 f"dir=back, id=\"{ident}_head\"];")
                continue
            lines.append(
                f"  {_dot_id(e.producer)} -> {_dot_id(consumer)} "
                f"[label={_dot_id(label)}, color=\"{colour_k}\", "
                f"fontcolor=\"{colour_k}\", style={style}, "
                f"tooltip={_dot_id(tooltip)}];")
    lines.append("}")
    return "\n".join(lines) + "\n"


# --- SVG: the drawing of the HTML page
#
# Two layouts draw the same graph.
#
# "graphviz": where Graphviz's `dot` program is installed, a variant of the
# DOT above is laid out by `dot -Tsvg`. Each task's nodes share one rank
# (newrank, rank=same), and invisible edges order the tasks' ranks by name,
# so tasks are columns left to right as in the built-in layout. Each transfer
# is drawn as producer -> label -> consumer, its label a plain-text node
# outside every cluster: dot's router keeps edges out of nodes and out of the
# clusters they do not connect, so no edge crosses a foreign task's box nor
# runs through another edge's label, and the label sits on its own edge. A
# right-to-left transfer is written left to right with dir=back, so that no
# edge pulls the ranks out of order (which would put two tasks on one rank
# and their edges in each other's way). The SVG dot writes is parsed,
# stripped of its prolog and comments (the page stays self-contained: no
# DTD, no links), each transfer's two legs and label are gathered into one
# group, and its elements are tagged as the built-in layout tags them
# (`g.task[data-task]`, `g.transfer[data-key]`, `g.node[data-node]`) so that
# the page, its tests and any tool reading it see one structure whichever
# layout drew it.
#
# "columns": the built-in layout, used without Graphviz. Each task is a
# column (a box with its nodes stacked in it), columns side by side with a
# gap between them. An edge between adjacent columns is a cubic curve that
# stays inside the gap between them (its control points lie between its
# ends), labelled at the point of the curve nearest the middle of the gap.
# An edge between columns further apart would cross the columns between
# them, so it is routed around them: out of its node into the gap beside
# its own column, down that gap into a corridor below every task box, along
# the corridor to the gap beside its destination column, up that gap and
# into its node. Each such edge has its own lane (height) in the corridor and
# its own offset in each gap, so routed edges do not run on top of each
# other; its label sits on its corridor segment, under a column it passes
# (where no vertical leg runs). Neither kind of edge ever enters the box of a
# task it does not belong to, by construction. Labels are placed last,
# greedily: each at the first spot on its own edge (the middle of a curve
# first, keeping the label inside the gap) that no other edge runs through
# and no earlier label overlaps. The tests check all of it from the SVG's
# coordinates.

_COL_W = 230  # Width of a task column (and its node boxes + padding).
_GAP = 230  # Between columns: room for the edges and their labels.
_NODE_H = 30
_NODE_GAP = 16
_TOP = 70  # Above the first node: the task's title.
_MARGIN = 20
_LANE = 24  # Corridor lane spacing (a label above each lane's line).
_GAP_STEP = 10  # Offset between the vertical legs of routed edges in a gap.
_CORNER = 8  # Radius of a routed edge's corners.

#: The layouts of the HTML graph (``--graph-layout``); "auto" picks
#: "graphviz" where `dot` is installed, else "columns".
LAYOUTS = ("auto", "graphviz", "columns")

_SVG_NS = "http://www.w3.org/2000/svg"


class GraphvizError(Exception):
    """`dot` is not installed, failed, or wrote something unreadable."""


def dot_program():
    """The path of Graphviz's `dot`, or None where it is not installed."""
    return shutil.which("dot")


def draw(report, layout="auto"):
    """The graph as an inline ``<svg>`` element, and how it was laid out.

    Args:
      report: the :class:`~tf_rdma.inspect.report.Report`.
      layout: one of :data:`LAYOUTS`.

    Returns:
      ``(svg text, layout used, note or None)``; the note says why "auto"
      fell back to "columns" when `dot` is installed but failed.

    Raises:
      GraphvizError: ``layout`` is "graphviz" and `dot` is missing or failed.
      ValueError: ``layout`` is not one of :data:`LAYOUTS`.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} is not one of {', '.join(LAYOUTS)}")
    if layout == "columns" or (layout == "auto" and dot_program() is None):
        return columns_svg(report), "columns", None
    try:
        return graphviz_svg(report), "graphviz", None
    except GraphvizError as err:
        if layout == "graphviz":
            raise
        return columns_svg(report), "columns", f"{err}; drawn with the built-in layout"


def svg(report, layout="auto"):
    """The graph as an inline ``<svg>`` element (see :func:`draw`)."""
    return draw(report, layout)[0]


def graphviz_svg(report, timeout=60):
    """The graph laid out by Graphviz's `dot`, tagged like :func:`columns_svg`.

    Raises:
      GraphvizError: `dot` is not installed, failed or timed out.
    """
    program = dot_program()
    if program is None:
        raise GraphvizError("Graphviz's dot program is not installed (Debian: "
                            "apt-get install graphviz)")
    try:
        proc = subprocess.run([program, "-Tsvg"], input=render_dot(report, for_svg=True),
                              capture_output=True, text=True, timeout=timeout,
                              check=False)
    except subprocess.TimeoutExpired as err:
        raise GraphvizError(f"dot -Tsvg took more than {timeout} s") from err
    except OSError as err:
        raise GraphvizError(f"cannot run {program}: {err}") from err
    if proc.returncode != 0:
        first = (proc.stderr.strip().splitlines() or ["no message"])[0]
        raise GraphvizError(f"dot -Tsvg failed (exit {proc.returncode}): {first}")
    try:
        root = ElementTree.fromstring(proc.stdout)
    except ElementTree.ParseError as err:
        raise GraphvizError(f"dot -Tsvg wrote no readable SVG: {err}") from err
    return _tag_graphviz(report, root)


def _tag_graphviz(report, root):
    """Tags `dot`'s SVG like the built-in layout's, and serializes it."""
    tasks = _tasks(report)
    nodes = [n for task in tasks for n in _graph_nodes(report).get(task, [])]
    ops = {n.name: n.op for n in report.analysis.graph_def.node}
    placements = report.analysis.placements
    transfers = {}
    for row in report.rows:
        for k, consumer in enumerate(row.dst_nodes):
            transfers[f"transfer_{row.number}_{k}"] = (row, consumer)
    for key in ("width", "height", "viewBox"):
        if key not in root.attrib:
            raise GraphvizError(f"dot -Tsvg wrote an <svg> without {key}")
    attrib = {k: root.attrib[k] for k in ("width", "height", "viewBox")}
    root.attrib.clear()
    root.attrib.update({"id": "plan-graph", "class": "graphviz", **attrib,
                        "role": "img", "aria-label": "transfers between tasks",
                        "data-layout": "graphviz"})
    # Each transfer is two DOT edges and a label node: gather the three into
    # one group, where the edge's single arrow-less path would have been.
    graph = root.find(f"{{{_SVG_NS}}}g")
    if graph is None:
        raise GraphvizError("dot -Tsvg wrote an <svg> without its graph group")
    parts = {}
    for g in list(graph):
        gid = g.get("id", "")
        for suffix in ("_tail", "_head", "_label"):
            if gid.startswith("transfer_") and gid.endswith(suffix):
                parts.setdefault(gid[:-len(suffix)], {})[suffix] = g
    for ident, found in parts.items():
        if ident not in transfers or len(found) != 3:
            raise GraphvizError(f"dot -Tsvg lost a part of {ident} ({sorted(found)})")
        group = ElementTree.Element(f"{{{_SVG_NS}}}g", {"id": ident})
        ElementTree.SubElement(group, f"{{{_SVG_NS}}}title")
        graph.insert(list(graph).index(found["_tail"]), group)
        for suffix in ("_tail", "_head", "_label"):
            part = found[suffix]
            graph.remove(part)
            for title in part.findall(f"{{{_SVG_NS}}}title"):
                part.remove(title)
            part.attrib.pop("class", None)
            part.set("class", "label" if suffix == "_label" else "leg")
            group.append(part)
    for g in root.iter(f"{{{_SVG_NS}}}g"):
        gid = g.get("id", "")
        title = g.find(f"{{{_SVG_NS}}}title")
        if gid.startswith("task_"):
            task = tasks[int(gid[len("task_"):])]
            g.set("class", "cluster task")
            g.set("data-task", short(task))
            text = short(task)
        elif gid.startswith("node_"):
            name = nodes[int(gid[len("node_"):])]
            g.set("class", "node")
            g.set("data-node", name)
            text = (f"{name} ({ops.get(name, '?')}) on "
                    f"{short(placements[name].task)}: {placements[name].reason}")
        elif gid in transfers:
            row, consumer = transfers[gid]
            e = row.edge
            g.set("class", f"edge transfer kind-{e.kind}")
            g.set("data-key", e.key)
            g.set("data-row", str(row.number))
            g.set("data-src", short(e.src))
            g.set("data-dst", short(e.dst))
            text = _edge_title(row, consumer)
        else:
            continue
        if title is not None:
            title.text = text
    ElementTree.register_namespace("", _SVG_NS)
    return ElementTree.tostring(root, encoding="unicode")


def _edge_title(row, consumer):
    e = row.edge
    return (f"#{row.number} {e.key}: {e.tensor} -> {consumer} "
            f"({short(e.src)} -> {short(e.dst)}), {e.dtype or '-'} "
            f"{row.shape_text}, {row.bytes_text} bytes, {e.kind}"
            + (f": {e.reason}" if e.reason else ""))


def _rounded_path(points, radius=_CORNER):
    """An SVG path through ``points`` (axis-parallel legs), corners rounded.

    Each corner is a quadratic curve whose control point is the corner
    itself, so the path never leaves the bounding box of the two legs.
    """
    out = [f"M{points[0][0]:.0f},{points[0][1]:.0f}"]
    for a, p, b in zip(points, points[1:], points[2:]):
        la = math.hypot(p[0] - a[0], p[1] - a[1])
        lb = math.hypot(b[0] - p[0], b[1] - p[1])
        r = min(radius, la / 2, lb / 2)
        if r <= 0:
            out.append(f"L{p[0]:.0f},{p[1]:.0f}")
            continue
        ax, ay = p[0] - (p[0] - a[0]) / la * r, p[1] - (p[1] - a[1]) / la * r
        bx, by = p[0] + (b[0] - p[0]) / lb * r, p[1] + (b[1] - p[1]) / lb * r
        out.append(f"L{ax:.1f},{ay:.1f} Q{p[0]:.0f},{p[1]:.0f} {bx:.1f},{by:.1f}")
    out.append(f"L{points[-1][0]:.0f},{points[-1][1]:.0f}")
    return " ".join(out)


def columns_svg(report):
    """The built-in layout: one column per task, long edges routed below."""
    tasks = _tasks(report)
    column = {t: i for i, t in enumerate(tasks)}
    colour = {t: i % len(_TASK_COLOURS) for i, t in enumerate(tasks)}
    nodes = _ordered_nodes(report)
    ops = {n.name: n.op for n in report.analysis.graph_def.node}
    placements = report.analysis.placements
    col_x = {t: _MARGIN + i * (_COL_W + _GAP) for i, t in enumerate(tasks)}
    node_w = _COL_W - 30
    pos = {}
    box_bottom = _MARGIN
    boxes = []
    for task in tasks:
        n = len(nodes.get(task, []))
        h = _TOP - 30 + n * (_NODE_H + _NODE_GAP) + 10
        boxes.append((task, col_x[task], h))
        box_bottom = max(box_bottom, _MARGIN + h)
        for j, name in enumerate(nodes.get(task, [])):
            pos[name] = (col_x[task] + 15, _TOP + j * (_NODE_H + _NODE_GAP))

    # Every (row, consumer) edge; those between non-adjacent columns get a
    # corridor lane, the shortest spans nearest the boxes.
    edges = [(row, consumer) for row in report.rows for consumer in row.dst_nodes]
    routed = sorted(
        (ed for ed in edges
         if abs(column[placements[ed[1]].task] - column[placements[ed[0].edge.producer].task]) > 1),
        key=lambda ed: (abs(column[placements[ed[1]].task]
                            - column[placements[ed[0].edge.producer].task]),
                        ed[0].number, ed[1]))
    lane = {(row.number, consumer): k for k, (row, consumer) in enumerate(routed)}
    corridor = box_bottom + 10
    height = corridor + len(routed) * _LANE + 10 + _MARGIN
    width = _MARGIN * 2 + len(tasks) * _COL_W + max(0, len(tasks) - 1) * _GAP
    gap_use = {}  # (gap index, side) -> vertical legs placed there so far

    def gap_leg(gap, side):
        # The x of a new vertical leg in gap ``gap`` (between columns gap and
        # gap+1), ``side`` 0 near its left column, 1 near its right one.
        k = gap_use.get((gap, side), 0)
        gap_use[(gap, side)] = k + 1
        off = 14 + (k * _GAP_STEP) % (_GAP // 2 - 24)
        left = _MARGIN + gap * (_COL_W + _GAP) + _COL_W
        return left + off if side == 0 else left + _GAP - off

    esc = html.escape
    out = [f'<svg id="plan-graph" class="columns" xmlns="{_SVG_NS}" '
           f'width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
           f'role="img" aria-label="transfers between tasks" data-layout="columns">',
           "<defs>"]
    for kind, (c, _, _) in KIND_STYLE.items():
        out.append(f'<marker id="arrow-{kind}" viewBox="0 0 10 10" refX="10" '
                   f'refY="5" markerWidth="7" markerHeight="7" '
                   f'orient="auto-start-reverse"><path d="M0,0L10,5L0,10z" '
                   f'fill="{c}"/></marker>')
    out.append("</defs>")
    for task, x, h in boxes:
        i = colour[task]
        out.append(
            f'<g class="task" data-task="{esc(short(task))}">'
            f'<rect x="{x}" y="{_MARGIN}" width="{_COL_W}" height="{h}" rx="10" '
            f'fill="#f8f9fa" stroke="{_TASK_BORDERS[i]}" stroke-width="2"/>'
            f'<text x="{x + _COL_W / 2}" y="{_MARGIN + 24}" class="task-title" '
            f'fill="{_TASK_BORDERS[i]}">{esc(short(task))}</text></g>')
    # First every edge's path and the points along it, then the labels: each
    # label goes to the first of its candidate spots (points on its own
    # edge, in order of preference) where no other edge runs through it and
    # no label placed before it overlaps it; if there is none, to the spot
    # with the fewest such conflicts.
    drawn = []  # (row, consumer, path d, points along it, label candidates)
    for row, consumer in edges:
        e = row.edge
        a = column[placements[e.producer].task]
        b = column[placements[consumer].task]
        sx, sy = pos[e.producer]
        dx, dy = pos[consumer]
        y1, y2 = sy + _NODE_H / 2, dy + _NODE_H / 2
        right = b > a
        x1 = sx + node_w if right else sx
        x2 = dx if right else dx + node_w
        text = _edge_label(row)
        half = _label_width(text) / 2
        if abs(b - a) == 1:
            bend = max(60, abs(x2 - x1) / 3) * (1 if right else -1)
            path = (f"M{x1:.0f},{y1:.0f} C{x1 + bend:.0f},{y1:.0f} "
                    f"{x2 - bend:.0f},{y2:.0f} {x2:.0f},{y2:.0f}")
            controls = ((x1, y1), (x1 + bend, y1), (x2 - bend, y2), (x2, y2))
            points = [_bezier(t / 64, *controls) for t in range(65)]
            # Points of the curve whose label stays inside the gap, from the
            # middle of the curve outwards.
            gap_left = col_x[tasks[min(a, b)]] + _COL_W
            spots = sorted((_bezier(t / 40, *controls) for t in range(4, 37)),
                           key=lambda p, m=(x1 + x2) / 2: abs(p[0] - m))
            candidates = [p for p in spots if gap_left + 2 <= p[0] - half
                          and p[0] + half <= gap_left + _GAP - 2] or spots[:1]
        else:
            yl = corridor + (lane[(row.number, consumer)] + 1) * _LANE
            if right:
                vx1, vx2 = gap_leg(a, 0), gap_leg(b - 1, 1)
            else:
                vx1, vx2 = gap_leg(a - 1, 1), gap_leg(b, 0)
            corners = [(x1, y1), (vx1, y1), (vx1, yl), (vx2, yl), (vx2, y2), (x2, y2)]
            path = _rounded_path(corners)
            points = _densify(corners)
            # On the corridor leg, under a column the edge passes (no
            # vertical leg runs there: they are all in gaps), the middle one
            # first; the other lanes are a lane's height away.
            passed = sorted(range(min(a, b) + 1, max(a, b)),
                            key=lambda k, m=(a + b) / 2: abs(k - m))
            candidates = [(col_x[tasks[k]] + _COL_W / 2, yl) for k in passed]
        drawn.append((row, consumer, path, points, candidates))
    placed = []  # label boxes so far
    edges_svg = []
    for row, consumer, path, _, candidates in drawn:
        e = row.edge
        c, _, dash = KIND_STYLE[e.kind]
        text = _edge_label(row)
        # The other consumers of the same transfer share its label text and
        # start: they do not count as other edges.
        others = [pts for other, _, _, pts, _ in drawn if other is not row]

        def conflicts(spot, text=text, others=others):
            box = _label_box(spot, text)
            return (sum(any(_in_box(p, box) for p in pts) for pts in others)
                    + sum(_overlap(box, other) for other in placed))

        lx, ly = min(candidates, key=lambda spot: (conflicts(spot) > 0, conflicts(spot)))
        placed.append(_label_box((lx, ly), text))
        edges_svg.append(
            f'<g class="transfer kind-{e.kind}" data-key="{esc(e.key)}" '
            f'data-row="{row.number}" data-src="{esc(short(e.src))}" '
            f'data-dst="{esc(short(e.dst))}">'
            f'<title>{esc(_edge_title(row, consumer))}</title>'
            f'<path d="{path}" fill="none" stroke="{c}" stroke-width="2" '
            + (f'stroke-dasharray="{dash}" ' if dash and dash != "1,0" else "")
            + f'marker-end="url(#arrow-{e.kind})"/>'
            f'<text x="{lx:.0f}" y="{ly - 4:.0f}" class="edge-label" '
            f'fill="{c}">{esc(text)}</text></g>')
    out.extend(edges_svg)
    for name, (x, y) in pos.items():
        i = colour[placements[name].task]
        label = name if len(name) <= 28 else "\u2026" + name[-27:]
        out.append(
            f'<g class="node" data-node="{esc(name)}"><title>{esc(name)} '
            f'({esc(ops.get(name, "?"))}) on {esc(short(placements[name].task))}: '
            f'{esc(placements[name].reason)}</title>'
            f'<rect x="{x}" y="{y}" width="{node_w}" height="{_NODE_H}" '
            f'rx="6" fill="{_TASK_COLOURS[i]}" stroke="{_TASK_BORDERS[i]}"/>'
            f'<text x="{x + 8}" y="{y + 19}" class="node-label">{esc(label)}'
            f'<tspan class="op"> {esc(ops.get(name, "?"))}</tspan></text></g>')
    out.append("</svg>")
    return "\n".join(out)


def _label_width(text):
    """A generous width of an edge label (11 px bold) in pixels."""
    return 6.6 * len(text)


def _label_box(spot, text):
    """The box of a label whose anchor (middle, on its edge) is ``spot``.

    The text's baseline is 4 px above the edge; the box reaches from its
    ascent (12 px) to its descent (3 px) and one pixel of slack each side.
    """
    x, y = spot
    half = _label_width(text) / 2
    return (x - half - 1, y - 4 - 13, x + half + 1, y - 4 + 4)


def _in_box(p, box):
    return box[0] < p[0] < box[2] and box[1] < p[1] < box[3]


def _overlap(a, b):
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def _densify(corners, step=4.0):
    """Points every ``step`` px along a polyline."""
    out = [corners[0]]
    for (ax, ay), (bx, by) in zip(corners, corners[1:]):
        n = max(1, int(math.hypot(bx - ax, by - ay) // step))
        out += [(ax + (bx - ax) * k / n, ay + (by - ay) * k / n) for k in range(1, n + 1)]
    return out


def _bezier(t, p0, p1, p2, p3):
    u = 1 - t
    x = u ** 3 * p0[0] + 3 * u * u * t * p1[0] + 3 * u * t * t * p2[0] + t ** 3 * p3[0]
    y = u ** 3 * p0[1] + 3 * u * u * t * p1[1] + 3 * u * t * t * p2[1] + t ** 3 * p3[1]
    return x, y
