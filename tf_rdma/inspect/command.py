"""``tf-rdma inspect``: the transfer plan of a graph, without a cluster.

The command line: the options, running the loader, the passes and a
renderer, and the exit status. Errors in the input (not a graph, no such
function, a malformed pbtxt, a graph with nothing crossing tasks) are
reported as one message on stderr with a non-zero exit status, never a
traceback (``--traceback`` shows it).

Building the parser imports neither TensorFlow nor the graph passes (the
option checks import the passes when they run).
"""

import argparse
import sys
import traceback

from tf_rdma.inspect.load import InspectError
from tf_rdma.inspect.render_graph import LAYOUTS, GraphvizError, render_dot
from tf_rdma.inspect.render_html import render_html
from tf_rdma.inspect.render_json import render_json
from tf_rdma.inspect.render_text import render_text
from tf_rdma.inspect.report import build_report
from tf_rdma.subcommand import Command

__all__ = ["COMMAND", "add_arguments", "run", "render", "FORMATS",
           "EXIT_ERROR", "EXIT_NO_TRANSFERS"]

_PREFIX = "tf-rdma inspect: "

#: Exit status for input that cannot be read, traced or analysed.
EXIT_ERROR = 1
#: Exit status for a graph in which no edge crosses tasks.
EXIT_NO_TRANSFERS = 3

FORMATS = ("text", "json", "dot", "html")
DEFAULT_CALLER_DEVICE = "/job:localhost/replica:0/task:0"

_USAGE = ("%(prog)s [-h] [--signature EXPR] [--signature-key KEY] "
          "[--caller-device DEV] [--endpoint-tasks TASKS] [--cluster JOBS] "
          "[--depth N] [--graph-layout {auto,graphviz,columns}] "
          "[--format {text,json,dot,html}] [--output PATH] [--traceback] INPUT")

_DESCRIPTION = """\
Show the tf_rdma transfer plan of a graph: every tensor that crosses from one
task to another, whether it gets a preallocated slot (static), takes the
dynamic path (shape known only at run time), is a control edge, or stays on
TensorFlow's own path (kept, with the reason), and where each slot lives.

INPUT is one of
  MODULE.py:FUNCTION   a Python file and a function in it (tf.function,
                       @tf_rdma.rewrite or plain; FUNCTION may be dotted,
                       e.g. model.step); it is traced, no cluster needed
  pkg.module:FUNCTION  the same for an importable module (a module that
                       creates variables on other tasks at import time
                       needs --cluster, or TF_CONFIG, to run them locally)
  DIR                  a SavedModel directory
  FILE.pb, FILE.pbtxt  a GraphDef, binary or text
"""

_EPILOG = """\
--signature is a Python expression evaluated with only `tf` in scope: a list
(positional arguments), a dict (keyword arguments) or a single tf.TensorSpec,
for example
  --signature "[tf.TensorSpec([32, 64], tf.float32)]"
  --signature "{'x': tf.TensorSpec([None, 64], tf.float32), 'training': False}"

exit status:
  0 the plan was printed, 1 the input could not be read, traced or analysed,
  2 bad arguments, 3 no edge of the graph crosses tasks.

examples:
  tf-rdma inspect model.py:train_step --signature "[tf.TensorSpec([32, 784])]"
  tf-rdma inspect exported_model/ --format html --output plan.html
  tf-rdma inspect train.py:train_step --cluster worker:2,ps:1   # variables on ps:0 at import
  tf-rdma inspect graph.pbtxt --endpoint-tasks worker:0,worker:1 --format dot | dot -Tsvg > plan.svg
"""


# --------------------------------------------------------------------------- arguments


def _depth(text):
    from tf_rdma.graph_passes.plan import MAX_DEPTH  # pylint: disable=import-outside-toplevel
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not 1 <= value <= MAX_DEPTH:
        raise argparse.ArgumentTypeError(
            f"must be in [1, {MAX_DEPTH}], got {value}")
    return value


def _endpoint_tasks(text):
    from tf_rdma.errors import PlanError  # pylint: disable=import-outside-toplevel
    from tf_rdma.graph_passes.plan import canonical_task  # pylint: disable=import-outside-toplevel
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise argparse.ArgumentTypeError("no task given; e.g. worker:0,worker:1")
    try:
        return [canonical_task(t) for t in names]
    except PlanError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _caller_device(text):
    from tf_rdma.graph_passes.graph import task_of  # pylint: disable=import-outside-toplevel
    if task_of(text) is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} names no job; expected e.g. {DEFAULT_CALLER_DEVICE!r}")
    return text


def _cluster(text):
    from tf_rdma.inspect.local_cluster import parse_cluster  # pylint: disable=import-outside-toplevel
    try:
        return parse_cluster(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_arguments(parser):
    """Adds the ``inspect`` options to an argparse parser."""
    parser.add_argument(
        "input", metavar="INPUT",
        help="MODULE.py:FUNCTION, pkg.module:FUNCTION, a SavedModel directory, "
             "or a GraphDef file (.pb, .pbtxt)")
    parser.add_argument(
        "--signature", metavar="EXPR", default=None,
        help="arguments to trace FUNCTION with: a Python expression of "
             "tf.TensorSpec (see below); default: the function's own "
             "input_signature, or no arguments. For a SavedModel: picks one "
             "concrete function of a restored tf.function (--signature-key)")
    parser.add_argument(
        "--signature-key", metavar="KEY", default=None,
        help="SavedModel only: the signature to inspect (default "
             "serving_default, or the only one), or the name of a restored "
             "tf.function attribute of the saved object")
    parser.add_argument(
        "--caller-device", metavar="DEV", type=_caller_device,
        default=DEFAULT_CALLER_DEVICE,
        help="the device the function is called from; unplaced nodes, "
             f"arguments and results run there (default {DEFAULT_CALLER_DEVICE})")
    parser.add_argument(
        "--endpoint-tasks", metavar="TASKS", type=_endpoint_tasks, default=None,
        help="comma-separated tasks that run a tf_rdma endpoint, e.g. "
             "worker:0,worker:1,ps:0; edges to or from other tasks stay on "
             "gRPC (default: every task except the caller's)")
    parser.add_argument(
        "--cluster", metavar="JOBS", type=_cluster, default=None,
        help="start in-process local servers for these tasks before "
             "importing the module, e.g. worker:2,ps:1 (worker:0, worker:1, "
             "ps:0), so that a script that creates variables under "
             "tf.device('/job:ps/task:0') at import time can be inspected as "
             "it is; default: the jobs of TF_CONFIG's cluster when it is set "
             "(its addresses are not used); 'none': no servers")
    parser.add_argument(
        "--depth", metavar="N", type=_depth, default=None,
        help="copies per slot in the plan (steps in flight), 1 to 64 "
             "(default 2, or the depth of a @tf_rdma.rewrite function)")
    parser.add_argument(
        "--format", choices=FORMATS, default="text",
        help="text (default): tables and a summary; json: everything, for "
             "tools; dot: Graphviz, one cluster per task; html: one "
             "self-contained page with the graph and the table")
    parser.add_argument(
        "--graph-layout", choices=LAYOUTS, default="auto",
        help="html only: how the graph is laid out. graphviz: by Graphviz's "
             "dot (must be installed); columns: the built-in layout, one "
             "column per task; auto (default): graphviz where dot is "
             "installed, else columns")
    parser.add_argument(
        "--output", "-o", metavar="PATH", default=None,
        help="write to PATH instead of stdout")
    parser.add_argument(
        "--traceback", action="store_true",
        help="on an error, show the Python traceback too (for bug reports)")


def run(args, parser=None):
    """Runs ``tf-rdma inspect`` with parsed arguments; returns the exit status."""
    try:
        report = build_report(args, parser)
        if not report.analysis.edges:
            raise _NoTransfers(report)
        try:
            text = render(report, args.format,
                          getattr(args, "graph_layout", None) or "auto")
        except GraphvizError as err:
            raise InspectError(f"--graph-layout graphviz: {err}") from err
        _write(text, args.output)
        return 0
    except _NoTransfers as exc:
        r = exc.report
        hidden = _calls_spanning_tasks(r.analysis)
        if hidden:
            print(f"{_PREFIX}no cross-task edges at the top level of "
                  f"{r.source}: its nodes run on {_task_list(r.analysis)}, "
                  f"but {hidden}; edges inside function bodies stay on "
                  f"TensorFlow's path (inspect or rewrite the called "
                  f"function itself)", file=sys.stderr)
        else:
            print(f"{_PREFIX}no cross-task edges in {r.source}: all "
                  f"{len(r.analysis.placements)} nodes run on "
                  f"{_task_list(r.analysis)}; nothing to plan (place ops on "
                  f"other tasks with tf.device, or check --caller-device)",
                  file=sys.stderr)
        return EXIT_NO_TRANSFERS
    except InspectError as exc:
        if args.traceback:
            traceback.print_exc()
        print(f"{_PREFIX}error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print(f"{_PREFIX}interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # pylint: disable=broad-except
        from tf_rdma.errors import TfRdmaError  # pylint: disable=import-outside-toplevel
        if args.traceback:
            traceback.print_exc()
        if isinstance(exc, TfRdmaError):
            print(f"{_PREFIX}error: {exc}", file=sys.stderr)
        else:
            print(f"{_PREFIX}internal error: {type(exc).__name__}: {exc} "
                  f"(rerun with --traceback and report it)", file=sys.stderr)
        return EXIT_ERROR


#: ``tf-rdma inspect``, for the ``tf-rdma`` parser (tf_rdma.cli).
COMMAND = Command(
    name="inspect",
    help="show the transfer plan of a function, SavedModel or GraphDef",
    usage=_USAGE,
    description=_DESCRIPTION,
    epilog=_EPILOG,
    add_arguments=add_arguments,
    run=run,
)


class _NoTransfers(Exception):
    def __init__(self, report):
        super().__init__("no cross-task edges")
        self.report = report


def _calls_spanning_tasks(analysis):
    """Describes a function call whose body places ops on another task."""
    from tf_rdma.graph_passes.graph import GraphView, task_of  # pylint: disable=import-outside-toplevel
    view = GraphView(analysis.graph_def)
    for name in sorted(view.nodes):
        if not view.is_function_call(name):
            continue
        here = analysis.placements[name].task
        for fname in view.called_functions(name):
            for body_node in view.functions[fname].node_def:
                task = task_of(body_node.device)
                if task is not None and task != here:
                    return (f"{name!r} calls {fname!r}, whose node "
                            f"{body_node.name!r} runs on {task}")
    return None


def _task_list(analysis):
    from tf_rdma.graph_passes.transfers import short_task  # pylint: disable=import-outside-toplevel
    tasks = sorted({p.task for p in analysis.placements.values()})
    return ", ".join(short_task(t) for t in tasks) or "no task"


def _write(text, path):
    if path is None or path == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as err:
        raise InspectError(f"cannot write {path}: {err.strerror or err}") from err


def render(report, fmt, layout="auto"):
    """Returns the report as text in ``fmt`` (one of :data:`FORMATS`).

    ``layout`` is the HTML graph's (one of
    :data:`~tf_rdma.inspect.render_graph.LAYOUTS`); other formats ignore it.
    """
    if fmt == "html":
        return render_html(report, layout)
    return {"text": render_text, "json": render_json, "dot": render_dot}[fmt](report)
