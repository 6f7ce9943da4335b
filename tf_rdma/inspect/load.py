"""``tf-rdma inspect``: the transfer plan of a graph, without a cluster.

Reads a graph from one of

* ``MODULE.py:FUNCTION`` (or ``package.module:FUNCTION``): imports the module
  and traces the function (a ``tf.function``, a ``@tf_rdma.rewrite``
  function or a plain Python function), with ``--signature`` when it takes
  arguments. Tracing records the ``tf.device`` placements; no cluster is
  needed.
* a SavedModel directory: loads it and takes one signature (``--signature-key``,
  default ``serving_default``); the signature's wrapper call is inlined, so the
  graph analysed is the saved function's own.
* a GraphDef file, binary (``.pb``) or text (``.pbtxt``). A GraphDef without
  ``_output_shapes`` is imported into TensorFlow and exported again with
  shapes where that works.

It then runs the same graph passes as ``@tf_rdma.rewrite``
(:func:`tf_rdma.graph_passes.rewrite.analyze`) and prints what they found:
every cross-task edge with its class, size and slot, the totals per task
pair, and a summary of how many bytes move per step and why the rest stays
on TensorFlow's own path. ``--format`` picks text, JSON, Graphviz DOT or a
self-contained HTML page.

Errors in the input (not a graph, no such function, a malformed pbtxt, a
graph with nothing crossing tasks) are reported as one message on stderr with
a non-zero exit status, never a traceback (``--traceback`` shows it).
"""

import argparse
import dataclasses
import html
import importlib
import importlib.util
import inspect as pyinspect
import json
import os
import re
import sys
import traceback

from tf_rdma.subcommand import Command

__all__ = ["COMMAND", "add_arguments", "run", "InspectError", "EXIT_ERROR",
           "EXIT_NO_TRANSFERS"]

_PREFIX = "tf-rdma inspect: "

#: Exit status for input that cannot be read, traced or analysed.
EXIT_ERROR = 1
#: Exit status for a graph in which no edge crosses tasks.
EXIT_NO_TRANSFERS = 3

FORMATS = ("text", "json", "dot", "html")
DEFAULT_CALLER_DEVICE = "/job:localhost/replica:0/task:0"

_USAGE = ("%(prog)s [-h] [--signature EXPR] [--signature-key KEY] "
          "[--caller-device DEV] [--endpoint-tasks TASKS] [--depth N] "
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
  pkg.module:FUNCTION  the same for an importable module
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
  tf-rdma inspect graph.pbtxt --endpoint-tasks worker:0,worker:1 --format dot | dot -Tsvg > plan.svg
"""


class InspectError(Exception):
    """A problem with the input, reported as one line (no traceback)."""


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
        "--depth", metavar="N", type=_depth, default=None,
        help="copies per slot in the plan (steps in flight), 1 to 64 "
             "(default 2, or the depth of a @tf_rdma.rewrite function)")
    parser.add_argument(
        "--format", choices=FORMATS, default="text",
        help="text (default): tables and a summary; json: everything, for "
             "tools; dot: Graphviz, one cluster per task; html: one "
             "self-contained page with the graph and the table")
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
        text = render(report, args.format)
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


# --------------------------------------------------------------------------- loading


@dataclasses.dataclass
class Loaded:
    """A graph ready for the passes."""

    graph_def: object
    source: str  # What the user asked for, for messages and headers.
    name: str  # Base of the plan name.
    arg_devices: dict = dataclasses.field(default_factory=dict)
    depth: int = None  # From a @tf_rdma.rewrite function.
    endpoint_tasks: list = None
    notes: list = dataclasses.field(default_factory=list)


_GRAPH_TEXT_EXT = (".pbtxt", ".pbtext", ".prototxt", ".txt")
_MODULE_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def load_input(args, parser=None):
    """Returns a :class:`Loaded` for ``args.input`` (dispatches on its kind)."""
    spec = args.input
    if args.signature_key is not None and not os.path.isdir(spec) and \
            os.path.basename(spec) not in ("saved_model.pb", "saved_model.pbtxt"):
        _usage(parser, "--signature-key is for SavedModel directories only")
    if os.path.isdir(spec):
        return load_saved_model(spec, args.signature_key, args.signature, parser)
    if os.path.basename(spec) in ("saved_model.pb", "saved_model.pbtxt"):
        return load_saved_model(os.path.dirname(spec) or ".", args.signature_key,
                                args.signature, parser)
    module, sep, attr = spec.rpartition(":")
    if sep and module and not os.path.exists(spec) and (
            module.endswith(".py") or os.path.isfile(module)
            or _MODULE_RE.fullmatch(module)):
        if not attr:
            raise InspectError(f"{spec!r} names no function after the ':'")
        return load_function(module, attr, args.signature, parser)
    if args.signature is not None:
        _usage(parser, "--signature is for MODULE.py:FUNCTION inputs and "
                       "restored functions of SavedModels")
    if spec.endswith(".py"):
        if not os.path.exists(spec):
            raise InspectError(f"no such file: {spec}")
        raise InspectError(
            f"{spec} is a Python file: name the function to trace as "
            f"{spec}:FUNCTION")
    if not os.path.exists(spec):
        raise InspectError(
            f"no such file or directory: {spec} (expected MODULE.py:FUNCTION, "
            f"a SavedModel directory or a GraphDef .pb/.pbtxt file)")
    return load_graph_file(spec)


def _usage(parser, message):
    if parser is not None:
        parser.error(message)
    raise InspectError(message)


# --- MODULE.py:FUNCTION


def _import_module(module_spec):
    if module_spec.endswith(".py") or os.path.isfile(module_spec):
        path = os.path.abspath(module_spec)
        if not os.path.isfile(path):
            raise InspectError(f"no such file: {module_spec}")
        stem = os.path.splitext(os.path.basename(path))[0]
        name = stem if (stem.isidentifier() and stem not in sys.modules) \
            else f"_tf_rdma_inspect_{abs(hash(path))}"
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None:
            raise InspectError(f"cannot import {module_spec}: not a Python module")
        module = importlib.util.module_from_spec(spec)
        sys.path.insert(0, os.path.dirname(path))
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except SyntaxError as err:
            raise InspectError(
                f"cannot import {module_spec}: SyntaxError: {err.msg} "
                f"(line {err.lineno})") from err
        except Exception as err:  # pylint: disable=broad-except
            raise InspectError(
                f"cannot import {module_spec}: {_describe(err, path)}") from err
        except SystemExit as err:
            raise InspectError(
                f"cannot import {module_spec}: it called sys.exit({err.code!r}) "
                f"at import (guard its main code with "
                f"`if __name__ == '__main__':`)") from err
        return module, path
    try:
        module = importlib.import_module(module_spec)
    except ModuleNotFoundError as err:
        if err.name and module_spec.startswith(err.name):
            raise InspectError(
                f"no module named {module_spec!r} (and no file "
                f"{module_spec!r}); expected MODULE.py:FUNCTION") from err
        raise InspectError(f"cannot import {module_spec}: {_describe(err)}") from err
    except SyntaxError as err:
        raise InspectError(
            f"cannot import {module_spec}: SyntaxError: {err.msg} "
            f"({err.filename}, line {err.lineno})") from err
    except Exception as err:  # pylint: disable=broad-except
        raise InspectError(f"cannot import {module_spec}: {_describe(err)}") from err
    return module, getattr(module, "__file__", None)


_USER_FRAME_RE = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+)')


def _describe(err, user_file=None):
    """``Type: message`` plus the line of ``user_file`` that raised, if any."""
    text = str(err).strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    line_no = None
    if lines and lines[0] == "in user code:":
        # AutoGraph's report: the user's frames, then the original error.
        first = lines[-1]
        for m in _USER_FRAME_RE.finditer(text):
            if user_file is None or os.path.abspath(m.group("file")) == user_file:
                line_no = (os.path.basename(m.group("file")), m.group("line"))
    else:
        # TensorFlow errors often carry a long stack in their message.
        first = lines[0] if lines else ""
    name = type(err).__name__
    if first.startswith(name + ":"):
        first = first[len(name) + 1:].strip()
    out = f"{name}: {first}" if first else name
    if line_no is None and user_file:
        frames = [f for f in traceback.extract_tb(err.__traceback__)
                  if os.path.abspath(f.filename) == user_file]
        if frames:
            line_no = (os.path.basename(user_file), frames[-1].lineno)
    if line_no is not None:
        out += f" ({line_no[0]}, line {line_no[1]})"
    return out


def _public_names(module):
    return sorted(n for n, v in vars(module).items()
                  if not n.startswith("_") and callable(v)
                  and not pyinspect.ismodule(v) and not pyinspect.isclass(v)
                  and getattr(v, "__module__", module.__name__) == module.__name__)


def load_function(module_spec, attr, signature, parser=None):
    """Imports ``module_spec``, traces ``attr`` and returns a :class:`Loaded`."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    from tf_rdma.decorator import RewrittenFunction  # pylint: disable=import-outside-toplevel

    module, path = _import_module(module_spec)
    source = f"{module_spec}:{attr}"
    obj = module
    for i, part in enumerate(attr.split(".")):
        if not part.isidentifier() or not hasattr(obj, part):
            where = module_spec if i == 0 else ".".join(attr.split(".")[:i])
            hint = ""
            if i == 0:
                names = _public_names(module)
                hint = (f"; its functions: {', '.join(names)}" if names
                        else "; it defines no functions")
            raise InspectError(f"no function {attr!r} in {where}{hint}")
        obj = getattr(obj, part)

    depth = endpoint_tasks = None
    name = attr.split(".")[-1]
    if isinstance(obj, RewrittenFunction):
        # pylint: disable=protected-access
        depth, endpoint_tasks, name = obj._depth, obj._endpoint_tasks, obj._name
        obj = obj._fn

    if hasattr(obj, "graph") and hasattr(obj, "captured_inputs") and \
            not hasattr(obj, "get_concrete_function"):
        if signature is not None:
            _usage(parser, f"{source} is a concrete function: its signature "
                           f"is fixed, drop --signature")
        concrete = obj
    else:
        if not callable(obj) or pyinspect.isclass(obj):
            raise InspectError(
                f"{source} is a {type(obj).__name__}, not a function")
        fn = obj if hasattr(obj, "get_concrete_function") else tf.function(obj)
        args, kwargs = _signature_args(signature, parser)
        if signature is None and getattr(fn, "input_signature", None) is None:
            _check_no_required_args(fn, source)
        try:
            concrete = fn.get_concrete_function(*args, **kwargs)
        except (TypeError, ValueError) as err:
            if signature is not None:
                raise InspectError(
                    f"cannot trace {source} with --signature {signature}: "
                    f"{_describe(err, path)}") from err
            raise InspectError(f"tracing {source} failed: {_describe(err, path)}") from err
        except Exception as err:  # pylint: disable=broad-except
            raise InspectError(f"tracing {source} failed: {_describe(err, path)}") from err

    graph = concrete.graph
    arg_devices = {}
    internal = list(getattr(graph, "internal_captures", []))
    for placeholder, value in zip(internal, concrete.captured_inputs):
        device = getattr(value, "device", "")
        if device:
            arg_devices[placeholder.op.name] = device
    graph_def = graph.as_graph_def(add_shapes=True)
    return Loaded(graph_def, source, name, arg_devices, depth,
                  endpoint_tasks)


def _signature_args(signature, parser):
    if signature is None:
        return (), {}
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    try:
        value = eval(signature, {"__builtins__": {}, "tf": tf}, {})  # pylint: disable=eval-used
    except SyntaxError as err:
        _usage(parser, f"--signature {signature!r} is not a Python expression: "
                       f"{err.msg}")
    except Exception as err:  # pylint: disable=broad-except
        _usage(parser, f"--signature {signature!r} failed: "
                       f"{type(err).__name__}: {err}")
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            _usage(parser, "--signature: a dict needs str keys (argument names)")
        return (), value
    if isinstance(value, (list, tuple)):
        return tuple(value), {}
    if isinstance(value, tf.TensorSpec):
        return (value,), {}
    _usage(parser, f"--signature must give a list, a dict or a tf.TensorSpec, "
                   f"got {type(value).__name__}: {value!r}")
    return (), {}  # Not reached.


def _check_no_required_args(fn, source):
    python_fn = getattr(fn, "python_function", fn)
    try:
        sig = pyinspect.signature(python_fn)
    except (TypeError, ValueError):
        return
    required = [p.name for p in sig.parameters.values()
                if p.default is p.empty and p.kind in (
                    p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if required:
        example = ", ".join("tf.TensorSpec([...], tf.float32)" for _ in required)
        raise InspectError(
            f"{source} takes arguments ({', '.join(required)}) and has no "
            f"input_signature: give their specs with --signature "
            f"\"[{example}]\"")


# --- SavedModel


def load_saved_model(path, key, signature, parser=None):
    """Loads a SavedModel and returns one of its functions as :class:`Loaded`."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    if not tf.saved_model.contains_saved_model(path):
        raise InspectError(
            f"{path} is a directory but not a SavedModel (no saved_model.pb "
            f"in it); expected MODULE.py:FUNCTION, a SavedModel directory or "
            f"a GraphDef .pb/.pbtxt file")
    try:
        loaded = tf.saved_model.load(path)
    except Exception as err:  # pylint: disable=broad-except
        raise InspectError(f"cannot load the SavedModel {path}: {_describe(err)}") from err
    signatures = dict(getattr(loaded, "signatures", {}) or {})
    base = os.path.basename(os.path.normpath(os.path.abspath(path))) or "saved_model"
    notes = []
    if key is None:
        if "serving_default" in signatures:
            key = "serving_default"
        elif len(signatures) == 1:
            key = next(iter(signatures))
        elif not signatures:
            raise InspectError(
                f"the SavedModel {path} has no signatures; name a restored "
                f"tf.function with --signature-key"
                + _restored_hint(loaded))
        else:
            raise InspectError(
                f"the SavedModel {path} has several signatures "
                f"({', '.join(sorted(signatures))}); pick one with "
                f"--signature-key")
    source = f"{path} [{key}]"
    if key in signatures and signature is not None:
        _usage(parser, f"--signature does not apply to the SavedModel signature "
                       f"{key!r}, whose inputs are fixed; it picks a concrete "
                       f"function of a restored tf.function named with "
                       f"--signature-key" + _restored_hint(loaded))
    if key in signatures:
        concrete = signatures[key]
        inline = True
    else:
        fn = getattr(loaded, key, None) if key.isidentifier() else None
        if fn is None or not hasattr(fn, "concrete_functions"):
            raise InspectError(
                f"the SavedModel {path} has no signature or restored "
                f"function {key!r}; its signatures: "
                f"{', '.join(sorted(signatures)) or 'none'}"
                + _restored_hint(loaded))
        if signature is not None:
            args, kwargs = _signature_args(signature, parser)
            try:
                concrete = fn.get_concrete_function(*args, **kwargs)
            except Exception as err:  # pylint: disable=broad-except
                raise InspectError(
                    f"{source}: no concrete function for --signature "
                    f"{signature}: {_describe(err)}") from err
            # A new trace of a restored function is a wrapper that calls the
            # saved concrete function: inline it, as for a signature.
            inline = True
        else:
            concretes = list(fn.concrete_functions)
            if len(concretes) != 1:
                specs = "; ".join(str(c.structured_input_signature)
                                  for c in concretes)
                raise InspectError(
                    f"{source} has {len(concretes)} concrete functions; pick "
                    f"one with --signature (saved: {specs})")
            concrete = concretes[0]
            inline = False
    graph = concrete.graph
    arg_devices = {}
    for placeholder, value in zip(list(graph.internal_captures),
                                  concrete.captured_inputs):
        device = getattr(value, "device", "")
        if device:
            arg_devices[placeholder.op.name] = device
    graph_def = graph.as_graph_def(add_shapes=True)
    if inline:
        # A signature is a wrapper that calls the saved function: analyse the
        # function's own graph (its body inlined), as its traced form.
        graph_def, inlined = inline_calls(graph_def)
        if inlined:
            shaped, note = with_shapes(graph_def, force=True)
            graph_def = shaped
            if note:
                notes.append(note)
    return Loaded(graph_def, source, f"{base}.{key}", arg_devices, notes=notes)


def _restored_hint(loaded):
    names = sorted(n for n in dir(loaded) if not n.startswith("_")
                   and hasattr(getattr(loaded, n, None), "concrete_functions"))
    return f"; its restored functions: {', '.join(names)}" if names else ""


def inline_calls(graph_def):
    """Inlines the top-level calls of library functions into the graph.

    Each call node ``N`` of function ``F`` is replaced by ``F``'s body with
    its nodes renamed ``N/<node>``: the argument placeholders become
    ``Identity`` nodes of the call's inputs, and ``N`` itself an
    ``IdentityN`` of the body's results (a ``NoOp`` if there are none), so
    that ``N``'s consumers do not change. Body nodes without a device get
    the call's device, as TensorFlow's placer would. Calls inside the body
    stay calls.

    Returns:
      ``(graph_def, number of calls inlined)``.
    """
    from tensorflow.core.framework import graph_pb2  # pylint: disable=import-outside-toplevel
    from tensorflow.python.framework import function_def_to_graph  # pylint: disable=import-outside-toplevel
    from tf_rdma.graph_passes.graph import CALL_OPS  # pylint: disable=import-outside-toplevel

    library = {f.signature.name: f for f in graph_def.library.function}
    out = graph_pb2.GraphDef()
    out.versions.CopyFrom(graph_def.versions)
    out.library.CopyFrom(graph_def.library)
    count = 0
    for node in graph_def.node:
        fname = None
        if node.op in CALL_OPS and node.attr["f"].func.name in library:
            fname = node.attr["f"].func.name
        elif node.op in library:
            fname = node.op
        if fname is None:
            out.node.add().CopyFrom(node)
            continue
        count += 1
        fdef = library[fname]
        body, flat_names = function_def_to_graph.function_def_to_graph_def(fdef)
        prefix = node.name + "/"
        data_inputs = [i for i in node.input if not i.startswith("^")]
        controls = [i for i in node.input if i.startswith("^")]
        args = {a.name: i for i, a in enumerate(fdef.signature.input_arg)}

        def rename(text, prefix=prefix):
            if text.startswith("^"):
                return "^" + prefix + text[1:]
            return prefix + text

        for body_node in body.node:
            new = out.node.add()
            if body_node.name in args and body_node.op == "Placeholder":
                index = args[body_node.name]
                new.name = prefix + body_node.name
                new.op = "Identity"
                new.input.append(data_inputs[index])
                new.input.extend(controls)
                new.attr["T"].type = body_node.attr["dtype"].type
                new.device = node.device
                continue
            new.CopyFrom(body_node)
            new.name = prefix + body_node.name
            del new.input[:]
            new.input.extend(rename(i) for i in body_node.input)
            if not new.device:
                new.device = node.device
        results = [prefix + flat_names[fdef.ret[a.name]]
                   for a in fdef.signature.output_arg]
        control_rets = ["^" + prefix + n for n in fdef.control_ret.values()]
        call = out.node.add(name=node.name, device=node.device)
        if results:
            call.op = "IdentityN"
            call.input.extend(results + control_rets)
            call.attr["T"].list.type.extend(
                a.type for a in fdef.signature.output_arg)
        else:
            call.op = "NoOp"
            call.input.extend(control_rets)
    return out, count


# --- GraphDef files


def load_graph_file(path):
    """Reads a binary or text GraphDef and returns a :class:`Loaded`."""
    from google.protobuf import message, text_format  # pylint: disable=import-outside-toplevel
    from tensorflow.core.framework import graph_pb2  # pylint: disable=import-outside-toplevel
    from tensorflow.core.protobuf import saved_model_pb2  # pylint: disable=import-outside-toplevel

    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as err:
        raise InspectError(f"cannot read {path}: {err.strerror or err}") from err
    text_first = path.lower().endswith(_GRAPH_TEXT_EXT)
    graph_def = None
    errors = {}

    def parse_binary():
        gd = graph_pb2.GraphDef()
        try:
            gd.ParseFromString(data)
        except message.DecodeError as err:
            errors["binary"] = f"not a binary GraphDef ({err})"
            return None
        return gd

    def parse_text():
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            errors["text"] = "not a text GraphDef (not UTF-8 text)"
            return None
        try:
            return text_format.Parse(text, graph_pb2.GraphDef())
        except text_format.ParseError as err:
            errors["text"] = f"malformed text GraphDef (pbtxt), line {err}"
            return None

    for parse in ((parse_text, parse_binary) if text_first
                  else (parse_binary, parse_text)):
        graph_def = parse()
        if graph_def is not None and _looks_like_graph(graph_def):
            break
        if graph_def is not None:
            kind = "text" if parse is parse_text else "binary"
            errors.setdefault(kind, "parses, but has no nodes")
            graph_def = None
    if graph_def is None:
        saved = saved_model_pb2.SavedModel()
        try:
            saved.ParseFromString(data)
            if saved.meta_graphs and saved.meta_graphs[0].graph_def.node:
                raise InspectError(
                    f"{path} is a SavedModel proto: pass its directory "
                    f"({os.path.dirname(path) or '.'}) instead")
        except message.DecodeError:
            pass
        main_kind = "text" if text_first else "binary"
        problem = errors.get(main_kind) or next(iter(errors.values()))
        raise InspectError(f"{path} is not a graph: {problem}")
    base = os.path.splitext(os.path.basename(path))[0] or "graph"
    shaped, note = with_shapes(graph_def)
    return Loaded(shaped, path, base, notes=[note] if note else [])


def _looks_like_graph(graph_def):
    if not graph_def.node:
        return False
    return all(n.name and n.op for n in graph_def.node)


def with_shapes(graph_def, force=False):
    """Returns ``(graph_def with _output_shapes, note or None)``.

    A graph whose nodes all carry ``_output_shapes`` is returned as is
    (unless ``force``). Otherwise it is imported into a ``tf.Graph``, which
    runs shape inference, and exported with ``add_shapes=True``; if that
    fails the original comes back with a note (every edge is then dynamic).
    """
    if not force and all("_output_shapes" in n.attr for n in graph_def.node):
        return graph_def, None
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    try:
        graph = tf.Graph()
        with graph.as_default():
            tf.graph_util.import_graph_def(graph_def, name="")
        return graph.as_graph_def(add_shapes=True), None
    except Exception as err:  # pylint: disable=broad-except
        first = (str(err).strip().splitlines() or [""])[0]
        return graph_def, (
            f"shapes unknown: TensorFlow could not import the graph to infer "
            f"them ({type(err).__name__}: {first}); edges without "
            f"_output_shapes are classed dynamic")


# --------------------------------------------------------------------------- report


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


# --------------------------------------------------------------------------- rendering


def render(report, fmt):
    """Returns the report as text in ``fmt`` (one of :data:`FORMATS`)."""
    return {"text": render_text, "json": render_json, "dot": render_dot,
            "html": render_html}[fmt](report)


def _short(task):
    from tf_rdma.graph_passes.transfers import short_task  # pylint: disable=import-outside-toplevel
    return short_task(task)


def _human(n):
    if n is None:
        return "?"
    if n < 1024:
        return f"{n} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
    return f"{n} B"  # pragma: no cover


def _table(header, rows, right=()):
    widths = [max(len(str(r[i])) for r in (header, *rows)) for i in range(len(header))]

    def fmt(row):
        cells = [str(c).rjust(w) if i in right else str(c).ljust(w)
                 for i, (c, w) in enumerate(zip(row, widths))]
        return "  ".join(cells).rstrip()

    return [fmt(header), fmt(tuple("-" * w for w in widths))] + [fmt(r) for r in rows]


def _endpoint_text(report):
    tasks = report.args.endpoint_tasks if report.args is not None else None
    if tasks is None:
        return "every task but the caller's"
    return ", ".join(_short(t) for t in tasks) or "none"


def _header_lines(report):
    a = report.analysis
    plan = a.plan
    lines = [
        f"tf-rdma inspect: {report.source}",
        f"plan {plan.name} (hash {plan.short_hash}), depth {plan.depth}, "
        f"caller {_short(a.caller_task)}, endpoints: {_endpoint_text(report)}",
    ]
    for note in (report.loaded.notes if report.loaded else []):
        lines.append(f"note: {note}")
    return lines


def transfer_table(report):
    """(header, rows) of the transfer table, as strings."""
    header = ("#", "src node", "dst node", "src task", "dst task", "dtype",
              "shape", "bytes", "class", "region", "offset")
    rows = []
    for r in report.rows:
        e = r.edge
        rows.append((str(r.number), r.src_node, ", ".join(r.dst_nodes),
                     _short(e.src), _short(e.dst), e.dtype or "-",
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
            _short(p.src), _short(p.dst), str(sum(p.counts.values())),
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
        f"per step through tf_rdma: {b['tf_rdma']} bytes ({_human(b['tf_rdma'])}) "
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
            f"({_human(b['kept_known'])}) per step"
            + (f" + {unknown} of unknown size" if unknown else "") + ":")
        for g in s["reasons"]["kept"]:
            lines.append(f"  {g['reason']}: {', '.join(g['edges'])}")
    lines.append(
        f"memory: {s['region_bytes']} bytes ({_human(s['region_bytes'])}) of "
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
    rows = [(n, _short(placements[n].task), placements[n].reason)
            for n in sorted(names)]
    return ("node", "task", "why there"), rows


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
        "notes": list(report.loaded.notes) if report.loaded else [],
        **d,
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


# Colours: one per task (background of the task's nodes) and one per class.
_TASK_COLOURS = ("#a5d8ff", "#b2f2bb", "#ffd8a8", "#d0bfff", "#fcc2d7",
                 "#99e9f2", "#ffec99", "#eebefa", "#c0eb75", "#ffc9c9")
_TASK_BORDERS = ("#1971c2", "#2f9e44", "#e8590c", "#6741d9", "#c2255c",
                 "#0c8599", "#f08c00", "#9c36b5", "#66a80f", "#e03131")
_KIND_STYLE = {  # colour, DOT style, SVG dash array
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
    size = "0 B" if e.kind == "control" else _human(e.nbytes)
    return f"#{row.number} {size} {e.kind}"


def _dot_id(text):
    """A DOT quoted string; newlines in ``text`` become DOT line breaks."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _dot_cluster(task):
    return "cluster_" + re.sub(r"[^A-Za-z0-9_]", "_", _short(task))


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
        lines.append(f"    label={_dot_id(_short(task))}; style=\"rounded,filled\"; "
                     f"fillcolor=\"#f8f9fa\"; color=\"{_TASK_BORDERS[i]}\";")
        for name in nodes.get(task, []):
            label = f"{name}\n({ops.get(name, '?')})"
            lines.append(
                f"    {_dot_id(name)} [label={_dot_id(label)}, "
                f"fillcolor=\"{_TASK_COLOURS[i]}\", color=\"{_TASK_BORDERS[i]}\"];")
        lines.append("  }")
    for row in report.rows:
        e = row.edge
        colour_k, style, _ = _KIND_STYLE[e.kind]
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


# --- HTML

_COL_W = 230  # Width of a task column (and its node boxes + padding).
_GAP = 170  # Between columns: room for the edges and their labels.
_NODE_H = 30
_NODE_GAP = 16
_TOP = 70  # Above the first node: the task's title.
_MARGIN = 20


def _svg(report):
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
    for kind, (c, _, _) in _KIND_STYLE.items():
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
            f'<g class="task" data-task="{esc(_short(task))}">'
            f'<rect x="{x}" y="{_MARGIN}" width="{_COL_W}" height="{h}" rx="10" '
            f'fill="#f8f9fa" stroke="{_TASK_BORDERS[i]}" stroke-width="2"/>'
            f'<text x="{x + _COL_W / 2}" y="{_MARGIN + 24}" class="task-title" '
            f'fill="{_TASK_BORDERS[i]}">{esc(_short(task))}</text></g>')
        for j, name in enumerate(nodes.get(task, [])):
            pos[name] = (x + 15, _TOP + j * (_NODE_H + _NODE_GAP))
    edges_svg = []
    for row in report.rows:
        e = row.edge
        c, _, dash = _KIND_STYLE[e.kind]
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
                     f"({_short(e.src)} -> {_short(e.dst)}), {e.dtype or '-'} "
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
            f'({esc(ops.get(name, "?"))}) on {esc(_short(placements[name].task))}: '
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
svg text { font: 12px system-ui, Helvetica, Arial, sans-serif; }
svg .task-title { font-weight: 700; font-size: 14px; text-anchor: middle; }
svg .node-label .op { fill: #495057; font-size: 10px; }
svg .edge-label { font-size: 11px; font-weight: 600; text-anchor: middle;
                  paint-order: stroke; stroke: #fff; stroke-width: 4px; }
svg g.transfer:hover path { stroke-width: 4; }
ul.summary { margin: 0; padding-left: 20px; }
"""


def render_html(report):
    """One self-contained page: header, graph (inline SVG), tables, summary."""
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
        f"{esc(_short(a.caller_task))}, endpoints: {esc(_endpoint_text(report))}</p>",
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
    for kind, (c, _, dash) in _KIND_STYLE.items():
        style = "dashed" if kind == "dynamic" else "dotted" if kind == "control" else "solid"
        parts.append(f'<span><i style="border-top-color:{c};border-top-style:{style}"></i>'
                     f"{kind}</span>")
    parts.append("</p>")
    parts.append('<div class="graph">' + _svg(report) + "</div>")
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

