"""The report of ``tf-rdma inspect``: what the renderers print.

:func:`build_report` loads the input (:mod:`tf_rdma.inspect.load`), runs the
same graph passes as ``@tf_rdma.rewrite``
(:func:`tf_rdma.graph_passes.rewrite.analyze`) and returns a :class:`Report`:
every cross-task edge as a :class:`Row` (with its slot), the totals per task
pair as a :class:`Pair`, and, through :func:`summary_dict`, how many bytes
move per step and why the rest stays on TensorFlow's own path.
"""

import argparse
import dataclasses

from tf_rdma.inspect.load import InspectError, load_input

__all__ = ["Row", "Pair", "Report", "build_report", "make_report",
           "summary_dict"]


@dataclasses.dataclass
class Row:
    """One cross-task edge, ready to print."""

    number: int
    edge: object
    slot: object  # SlotLayout or None.

    @property
    def src_node(self):
        return self.edge.tensor

    @property
    def dst_nodes(self):
        """The consumers, each once (a node may read the tensor twice)."""
        return list(dict.fromkeys(c for c, _ in self.edge.consumers))

    @property
    def shape_text(self):
        e = self.edge
        if e.kind == "control":
            return "-"
        if e.shape is None:
            return "?"
        return "[" + ", ".join("?" if d is None else str(d) for d in e.shape) + "]"

    @property
    def bytes_text(self):
        n = self.edge.nbytes
        return "?" if n is None else str(n)

    @property
    def region_text(self):
        from tf_rdma.graph_passes.transfers import short_task  # pylint: disable=import-outside-toplevel
        if self.slot is None:
            return "-"
        return f"{short_task(self.slot.src)}->{short_task(self.slot.dst)}"

    @property
    def offset_text(self):
        return "-" if self.slot is None else str(self.slot.offset)


@dataclasses.dataclass
class Pair:
    """The edges of one (src, dst) task pair and its region."""

    src: str
    dst: str
    counts: dict
    planned_bytes: int
    kept_bytes: int
    unknown: int  # Edges whose size is not known statically.
    region: object  # RegionLayout or None.


@dataclasses.dataclass
class Report:
    """Everything the renderers print."""

    source: str
    analysis: object
    loaded: object
    args: object
    rows: list
    pairs: list

    @property
    def plan(self):
        return self.analysis.plan


def build_report(args, parser=None):
    """Loads ``args.input``, runs the passes and returns a :class:`Report`."""
    from tf_rdma.graph_passes import rewrite as passes  # pylint: disable=import-outside-toplevel

    loaded = load_input(args, parser)
    depth = args.depth or loaded.depth or 2
    endpoint_tasks = args.endpoint_tasks
    if endpoint_tasks is None and loaded.endpoint_tasks is not None:
        endpoint_tasks = [_canonical(t) for t in loaded.endpoint_tasks]
    try:
        analysis = passes.analyze(
            loaded.graph_def, caller_device=args.caller_device,
            arg_devices=loaded.arg_devices, endpoint_tasks=endpoint_tasks,
            depth=depth, name=loaded.name)
    except Exception as err:  # pylint: disable=broad-except
        from tf_rdma.errors import TfRdmaError  # pylint: disable=import-outside-toplevel
        if isinstance(err, TfRdmaError):
            raise InspectError(f"cannot analyse {loaded.source}: {err}") from err
        raise
    # The report shows the settings in effect (a @tf_rdma.rewrite function's
    # own depth and endpoint tasks where the command line gave none).
    effective = argparse.Namespace(**vars(args))
    effective.depth, effective.endpoint_tasks = depth, endpoint_tasks
    return make_report(loaded.source, analysis, loaded, effective)


def _canonical(task):
    from tf_rdma.errors import PlanError  # pylint: disable=import-outside-toplevel
    from tf_rdma.graph_passes.plan import canonical_task  # pylint: disable=import-outside-toplevel
    try:
        return canonical_task(task)
    except PlanError:
        return task


def make_report(source, analysis, loaded=None, args=None):
    """Builds a :class:`Report` from an Analysis."""
    plan = analysis.plan
    slots = {s.key: s for s in plan.slots}
    rows = [Row(i + 1, e, slots.get(e.key)) for i, e in enumerate(analysis.edges)]
    regions = {(r.src, r.dst): r for r in plan.regions}
    pairs = {}
    for row in rows:
        e = row.edge
        pair = pairs.get((e.src, e.dst))
        if pair is None:
            pair = pairs[(e.src, e.dst)] = Pair(
                e.src, e.dst, {k: 0 for k in ("static", "dynamic", "control", "kept")},
                0, 0, 0, regions.get((e.src, e.dst)))
        pair.counts[e.kind] += 1
        if e.nbytes is None:
            pair.unknown += 1
        elif e.kind == "kept":
            pair.kept_bytes += e.nbytes
        elif e.kind in ("static", "control"):
            pair.planned_bytes += e.nbytes
    return Report(source, analysis, loaded, args, rows,
                  [pairs[k] for k in sorted(pairs)])


def summary_dict(report):
    """The numbers of the summary, JSON-ready."""
    plan = report.plan
    edges = report.analysis.edges
    by_kind = {k: [e for e in edges if e.kind == k]
               for k in ("static", "dynamic", "control", "kept")}
    kept_known = [e.nbytes for e in by_kind["kept"] if e.nbytes is not None]
    reasons = {}
    for kind in ("dynamic", "kept"):
        grouped = {}
        for e in by_kind[kind]:
            grouped.setdefault(_reason_group(e), []).append(e.key)
        reasons[kind] = [{"reason": r, "edges": keys}
                         for r, keys in sorted(grouped.items(),
                                               key=lambda kv: (-len(kv[1]), kv[0]))]
    return {
        "cross_task_edges": len(edges),
        "counts": {k: len(v) for k, v in by_kind.items()},
        "bytes_per_step": {
            "tf_rdma": plan.bytes_per_step,
            "kept_known": sum(kept_known),
            "kept_unknown_edges": len(by_kind["kept"]) - len(kept_known),
            "dynamic_edges": len(by_kind["dynamic"]),
        },
        "region_bytes": sum(r.nbytes for r in plan.regions),
        "credit_bytes": sum(r.credit_bytes for r in plan.regions),
        "depth": plan.depth,
        "reasons": reasons,
    }


def _reason_group(edge):
    return edge.reason or edge.kind
