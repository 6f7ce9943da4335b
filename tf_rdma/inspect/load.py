"""Reads the input of ``tf-rdma inspect`` into a graph the passes can analyse.

:func:`load_input` dispatches on what ``INPUT`` names:

* ``MODULE.py:FUNCTION`` (or ``package.module:FUNCTION``): imports the module
  and traces the function (a ``tf.function``, a ``@tf_rdma.rewrite``
  function or a plain Python function), with ``--signature`` when it takes
  arguments (:func:`load_function`). Tracing records the ``tf.device``
  placements; no cluster is needed, except for variables that the module
  creates on other tasks at import time: ``--cluster`` (or ``TF_CONFIG``)
  starts in-process local servers for those first (:func:`start_cluster`,
  :mod:`tf_rdma.inspect.local_cluster`).
* a SavedModel directory: loads it and takes one signature (``--signature-key``,
  default ``serving_default``); the signature's wrapper call is inlined, so the
  graph analysed is the saved function's own (:func:`load_saved_model`,
  :func:`inline_calls`).
* a GraphDef file, binary (``.pb``) or text (``.pbtxt``). A GraphDef without
  ``_output_shapes`` is imported into TensorFlow and exported again with
  shapes where that works (:func:`load_graph_file`, :func:`with_shapes`).

Each returns a :class:`Loaded`. A problem with the input is an
:class:`InspectError`, whose message is what the user sees (one line, no
traceback). TensorFlow is imported by the functions that need it, not by
this module.
"""

import dataclasses
import importlib
import importlib.util
import inspect as pyinspect
import os
import re
import sys
import traceback

__all__ = ["InspectError", "Loaded", "load_input", "start_cluster", "load_function",
           "load_saved_model", "load_graph_file", "inline_calls",
           "with_shapes"]


class InspectError(Exception):
    """A problem with the input, reported as one line (no traceback)."""


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
        notes = start_cluster(args)
        return _noted(load_saved_model(spec, args.signature_key, args.signature,
                                       parser), notes)
    if os.path.basename(spec) in ("saved_model.pb", "saved_model.pbtxt"):
        notes = start_cluster(args)
        return _noted(load_saved_model(os.path.dirname(spec) or ".",
                                       args.signature_key, args.signature,
                                       parser), notes)
    module, sep, attr = spec.rpartition(":")
    if sep and module and not os.path.exists(spec) and (
            module.endswith(".py") or os.path.isfile(module)
            or _MODULE_RE.fullmatch(module)):
        if not attr:
            raise InspectError(f"{spec!r} names no function after the ':'")
        notes = start_cluster(args)
        try:
            loaded = load_function(module, attr, args.signature, parser)
        except InspectError as err:
            hint = _cluster_hint(str(err), notes)
            if hint:
                raise InspectError(f"{err}; {hint}") from err
            raise
        return _noted(loaded, notes)
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


def start_cluster(args):
    """Starts the local servers of ``--cluster`` (or ``TF_CONFIG``), if any.

    Only inputs that run Python (a function's module, a SavedModel's
    restore) need them; a GraphDef file is read without.

    Returns:
      ``[note]`` saying which servers were started, or ``[]``.
    """
    from tf_rdma.inspect import local_cluster  # pylint: disable=import-outside-toplevel
    jobs = getattr(args, "cluster", None)
    where = "--cluster"
    try:
        if jobs is None:
            jobs = local_cluster.cluster_from_env()
            where = "TF_CONFIG"
        if not jobs:
            return []
        local_cluster.start_local_cluster(jobs)
    except local_cluster.ClusterError as err:
        raise InspectError(str(err)) from err
    tasks = ", ".join(local_cluster.task_names(jobs))
    return [f"in-process local servers for {tasks} (from {where})"]


def _noted(loaded, notes):
    loaded.notes[:0] = notes
    return loaded


_DEVICE_ERROR_RE = re.compile(r"unknown device|/job:(?!localhost)[A-Za-z]\w*",
                              re.IGNORECASE)


def _cluster_hint(message, notes):
    """A hint to use --cluster when an import failed on a remote device."""
    if notes or "cannot import" not in message:
        return None
    if not _DEVICE_ERROR_RE.search(message):
        return None
    return ("if the module places variables on other tasks at import time, "
            "--cluster JOB:COUNT,... (e.g. --cluster worker:2,ps:1) starts "
            "in-process local servers for them first")


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
