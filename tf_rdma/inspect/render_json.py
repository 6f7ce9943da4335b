"""``tf-rdma inspect --format json``: the whole report, for tools."""

import dataclasses
import json

from tf_rdma.inspect.report import summary_dict

__all__ = ["report_dict", "render_json"]


def report_dict(report):
    """Everything as a JSON-ready dict."""
    d = report.analysis.to_dict()
    slots = {s.key: s for s in report.plan.slots}
    for edge in d["edges"]:
        slot = slots.get(edge["key"])
        edge["region"] = slot.region if slot else None
        edge["offset"] = slot.offset if slot else None
        edge["stride"] = slot.stride if slot else None
    d = {
        "input": report.source,
        "caller_device": report.args.caller_device if report.args else None,
        "endpoint_tasks": (report.args.endpoint_tasks
                           if report.args is not None else None),
        **d,
        # The loader's notes (shapes, local servers), then the passes' own.
        "notes": (list(report.loaded.notes) if report.loaded else []) + d["notes"],
        "regions": [dataclasses.asdict(r) for r in report.plan.regions],
        "pairs": [{"src": p.src, "dst": p.dst, "counts": p.counts,
                   "tf_rdma_bytes": p.planned_bytes, "kept_bytes": p.kept_bytes,
                   "unknown_size_edges": p.unknown,
                   "region": p.region.name if p.region else None,
                   "region_bytes": p.region.nbytes if p.region else 0,
                   "credit_bytes": p.region.credit_bytes if p.region else 0}
                  for p in report.pairs],
        "summary": summary_dict(report),
    }
    return d


def render_json(report):
    """The report as JSON (indented, keys in a stable order)."""
    return json.dumps(report_dict(report), indent=2, default=_json_default) + "\n"


def _json_default(value):
    if isinstance(value, (tuple, set, frozenset)):
        return list(value)
    return str(value)
