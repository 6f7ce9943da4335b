"""``@tf_rdma.rewrite``: run a multi-task tf.function with tf_rdma transfers.

The decorator traces the user's ``tf.function`` as TensorFlow would (once
per input signature, in the caller's context), and its rewrite once per
input signature and *calling device*: the ``tf.device`` scope of the call,
else this program's CPU. The ops nobody placed run on that device, so a
function called on two tasks needs two plans; a ``ClusterCoordinator``
traces a step once and calls it under whichever worker it picked
(docs/parameter-server.md). Tracing a rewrite, a wrapper ``tf.function``
with the user function's signature

1. exports the user function's graph with the shapes TensorFlow inferred;
2. runs the graph passes (tf_rdma.graph_passes.rewrite) with the calling
   device as the caller: every node gets a task, every cross-task edge is
   classified, the rewritable ones get slots in a :class:`~tf_rdma.Plan` and
   are swapped for TfRdmaSend/TfRdmaRecv;
3. imports the rewritten graph into its own trace, feeding the user
   function's argument placeholders with its own arguments and the captured
   placeholders with the captured values (variable handles, constants), and
   returns the imported outputs in the user function's output structure.

Calls then run the rewritten graph through TensorFlow's distributed runtime
as usual: gRPC dispatches the function to each task, tf_rdma moves the
tensors. The regions are set up by the ops themselves on the first call (each
task's endpoint opens its part of the plan; a peer with another plan hash is
refused with both hashes in the error).

Calls may come from several threads at once: every transfer carries the id
TensorFlow gives the call (its step id), so a call only ever receives its own
tensors, and at most ``depth`` calls of one plan run at a time (more wait
here), so that calls never wait for each other's slot copies. A
function with tf_rdma collectives in it runs one call at a time: a
collective's ranks must run the calls of one instance in the same order, and
only this process sees the order of its calls.
"""

import functools
import inspect
import threading
import warnings

import tensorflow as tf
from tensorflow.python.eager import context, def_function

from tf_rdma import measured as measured_lib
from tf_rdma.doctor import transports
from tf_rdma.errors import ConfigError, PlanError
from tf_rdma.graph_passes import rewrite as passes
from tf_rdma.graph_passes.transfers import KEPT
from tf_rdma.ops import timeout_to_ms

__all__ = ["rewrite", "RewrittenFunction", "RewrittenConcreteFunction",
           "ClientComputeWarning"]


def rewrite(fn=None, *, depth=2, timeout=None, endpoint_tasks=None,
            name=None):
    """Makes every rewritable cross-task tensor of ``fn`` move through tf_rdma.

    Use as ``@tf_rdma.rewrite`` or ``@tf_rdma.rewrite(depth=3)`` above (or
    around) a ``tf.function``; a plain Python function is wrapped in
    ``tf.function`` first.

    Args:
      fn: The function to rewrite.
      depth: Copies per slot, 1 to 64: how many calls of the function on
        one device may run at once (further calls from other threads wait
        for one to end).
      timeout: Seconds any tf_rdma op may wait before failing with
        ``tf.errors.DeadlineExceededError``; None uses ``TF_RDMA_TIMEOUT`` on
        each task.
      endpoint_tasks: Task names that run a tf_rdma endpoint (e.g.
        ``["worker:0", "ps:0"]``); edges to other tasks stay on gRPC. None
        means every task except this program's own (the client's, which
        may differ from the device a call runs on) and those of job
        ``localhost``.
      name: Base of the plan name (default: the function's name).

    Returns:
      A :class:`RewrittenFunction`.
    """
    if fn is None:
        return functools.partial(rewrite, depth=depth, timeout=timeout,
                                 endpoint_tasks=endpoint_tasks, name=name)
    return RewrittenFunction(fn, depth=depth, timeout=timeout,
                             endpoint_tasks=endpoint_tasks, name=name)


class RewrittenFunction:
    """A ``tf.function`` whose cross-task tensors go through tf_rdma.

    Call it like the original function, or hand it to
    ``ClusterCoordinator.schedule``. Attributes:

      plan: the :class:`~tf_rdma.Plan` of the latest trace.
      analyses: every trace's :class:`~tf_rdma.graph_passes.rewrite.Analysis`
        (one per input signature and calling task).
    """

    def __init__(self, fn, depth=2, timeout=None, endpoint_tasks=None,
                 name=None):
        if not callable(fn):
            raise PlanError(f"tf_rdma.rewrite needs a function, got {fn!r}")
        if not hasattr(fn, "get_concrete_function"):
            fn = tf.function(fn)
        self._fn = fn
        self._depth = depth
        self._timeout_ms = timeout_to_ms(timeout)
        self._endpoint_tasks = endpoint_tasks
        python_fn = getattr(fn, "python_function", fn)
        self._python_fn = python_fn
        self._name = name or getattr(python_fn, "__name__", "function")
        self.analyses = []
        # The rewrite of each of the user's concrete functions per calling
        # device (_CallerFunction), made on the first call there.
        self._callers = {}
        self._trace_lock = threading.Lock()
        # Calls of a function with tf_rdma collectives, one at a time (set by
        # the first trace that finds one).
        self._has_collectives = False
        self._one_call = threading.Lock()
        self._warned_client_compute = False
        functools.update_wrapper(self, python_fn)

    def __call__(self, *args, **kwargs):
        inner = self._fn.get_concrete_function(*args, **kwargs)
        return self._for_caller(inner).call(args, kwargs)

    def get_concrete_function(self, *args, **kwargs):
        """The rewritten function for these arguments.

        The user's function is traced here, in the caller's context (a
        strategy's scope creates its variables); the rewrite is traced for
        each task the returned function is called on, on its first call
        there (or when its ``graph`` is asked for, for the current device).
        """
        inner = self._fn.get_concrete_function(*args, **kwargs)
        return RewrittenConcreteFunction(self, inner, args, kwargs)

    def experimental_get_tracing_count(self):
        """How many rewritten functions were traced (all calling tasks)."""
        return len(self.analyses)

    _get_tracing_count = experimental_get_tracing_count  # ClusterCoordinator's metric

    @property
    def python_function(self):
        return self._fn.python_function

    @property
    def plan(self):
        """The Plan of the latest trace.

        Raises:
          PlanError: If the function was never called or traced.
        """
        if not self.analyses:
            raise PlanError(
                f"{self._name!r} has no plan yet: call it first (plans are "
                f"made per input signature and calling task; "
                f"get_concrete_function(...).graph traces it for this one)")
        return self.analyses[-1].plan

    @property
    def plans(self):
        return [a.plan for a in self.analyses]

    def explain(self, file=None, cluster=None, measured=False, last=20):
        """Prints the plans, the kept edges and each task pair's transport.

        Args:
          file: Where to print (default: stdout).
          cluster: The cluster (dict job → addresses or a
            ``tf.train.ClusterSpec``), to predict the transport of pairs this
            process has not connected; default: TF_CONFIG's.
          measured: Also show, for every planned transfer, what its last
            traced calls took on the sending and on the receiving task
            (asked of those tasks; see :mod:`tf_rdma.measured`).
          last: With `measured`, how many of the newest calls per side.

        Returns:
          The printed text.
        """
        if not self.analyses:
            text = f"{self._name}: not traced yet"
        else:
            text = "\n\n".join(a.summary() for a in self.analyses)
            pairs = sorted({(t.src, t.dst) for a in self.analyses
                            for t in a.plan.transfers})
            lines = ["transports:"]
            try:
                for row in transports.plan_transports(pairs, cluster):
                    lines.append(f"  {row['src']} -> {row['dst']}: "
                                 f"{row['transport'] or '?'} ({row['status']}: "
                                 f"{row['reason']})")
            except ConfigError as err:
                lines.append(f"  not predicted: {err}")
            text += "\n\n" + "\n".join(lines)
            if measured:
                transfers = [t for a in self.analyses for t in a.plan.transfers]
                text += "\n\n" + "\n".join(
                    measured_lib.measured_lines(transfers, last))
        print(text, file=file)
        return text

    def _for_caller(self, inner):
        """The rewrite of ``inner`` for the device calling now."""
        caller = _caller_device()
        key = (inner, caller)
        found = self._callers.get(key)
        if found is None:
            with self._trace_lock:
                found = self._callers.get(key)
                if found is None:
                    found = _CallerFunction(self, caller, inner)
                    self._callers[key] = found
        return found

    def _trace(self, inner, caller_device):
        """Traces the rewrite of ``inner`` for ``caller_device`` (in a wrapper)."""
        graph = inner.graph
        outer = tf.compat.v1.get_default_graph()
        captured = list(inner.captured_inputs)
        internal = list(graph.internal_captures)
        user_inputs = graph.inputs[:len(graph.inputs) - len(internal)]
        outer_inputs = list(outer.inputs)
        if len(outer_inputs) != len(user_inputs):
            raise PlanError(
                f"tf_rdma.rewrite: {self._name!r} takes {len(user_inputs)} "
                f"tensor inputs but its wrapper got {len(outer_inputs)}; "
                f"arguments that are not tensors must be hashable Python "
                f"values")
        client_device = _client_device()
        # Arguments the wrapper got as real (eager) tensors — a tf.Variable
        # argument arrives as its handle — are captured like the closure's
        # captures, and both keep the device where they live.
        arg_devices = {}
        input_map = {}
        for placeholder, value in (list(zip(user_inputs, outer_inputs))
                                   + list(zip(internal, captured))):
            if not tf.is_symbolic_tensor(value):
                if getattr(value, "device", ""):
                    arg_devices[placeholder.op.name] = value.device
                value = outer.capture(value)
            input_map[placeholder.name] = value
        graph_def = graph.as_graph_def(add_shapes=True)
        collective = {"TfRdmaCollective", "TfRdmaAllGatherV"}
        if any(n.op in collective for n in graph_def.node) or any(
                n.op in collective for f in graph_def.library.function
                for n in f.node_def):
            self._has_collectives = True
        analysis = passes.analyze(
            graph_def, caller_device=caller_device, arg_devices=arg_devices,
            endpoint_tasks=self._endpoint_tasks, depth=self._depth,
            name=self._name, client_device=client_device)
        self._warn_if_client_computes(analysis)
        rewritten = passes.rewrite_graph(analysis, self._timeout_ms)
        self.analyses.append(analysis)

        outputs = tf.graph_util.import_graph_def(
            rewritten, input_map=input_map,
            return_elements=[t.name for t in graph.outputs],
            name="rewritten")
        if analysis.planned and outputs:
            outputs = _no_gradient_across(outputs, list(input_map.values()),
                                          self._name)
        flat = tf.nest.flatten(inner.structured_outputs,
                               expand_composites=True)
        imported = iter(outputs)
        flat = [next(imported) if isinstance(x, tf.Tensor) else x
                for x in flat]
        return tf.nest.pack_sequence_as(inner.structured_outputs, flat,
                                        expand_composites=True)

    def _warn_if_client_computes(self, analysis):
        """Warns (once per function) when the program's own task computes.

        The client runs no tf_rdma endpoint, so every tensor between it and
        the other tasks stays on gRPC, and a step meant for the workers
        leaves them idle: what a function does whose ops nobody placed when
        it is called from the program's own task, or whose ops use variables
        that live there.
        """
        if self._warned_client_compute:
            return
        ops = analysis.client_computes()
        if not ops:
            return
        self._warned_client_compute = True
        kinds = sorted({analysis.view.nodes[n].op for n in ops})
        kept = sum(1 for e in analysis.edges if e.kind == KEPT
                   and analysis.client_task in (e.src, e.dst))
        warnings.warn(
            f"tf_rdma.rewrite: {len(ops)} op(s) of {self._name!r} "
            f"({', '.join(kinds[:6])}{', ...' if len(kinds) > 6 else ''}) "
            f"compute on {analysis.client_task}, the program's own task, "
            f"which has no tf_rdma endpoint: {kept} tensor(s) between it and "
            f"the other tasks stay on gRPC. Ops that nobody placed run on "
            f"the task that calls the function (place them with tf.device, "
            f"or schedule the function with a ClusterCoordinator, which calls "
            f"it on a worker); ops that use a variable run where the variable "
            f"lives. explain() lists the edges kept", ClientComputeWarning,
            stacklevel=2)


class ClientComputeWarning(UserWarning):
    """A rewritten function computes on the task of the program calling it."""


class _CallerFunction:
    """The rewrite of one of the user's concrete functions, on one device.

    A ``tf.function`` with the user function's signature and tracing rules
    (input signature, retracing), called with the call's arguments: traced
    with that device as the caller, so that its plans name the caller's task
    wherever the function's unplaced ops run (a function called on two
    workers has a plan, and slots, per worker). It rewrites ``inner``, the
    user's concrete function that the call (or get_concrete_function)
    traced in the caller's context: a strategy's scope creates the
    variables there. At most ``depth`` calls of it run at a time: further
    calls from other threads wait here for one to finish, so that calls
    never wait for each other's slot copies (each holds at most one copy of
    a slot).
    """

    def __init__(self, function, caller, inner):
        self._function = function

        def traced(*args, **kwargs):
            del args, kwargs  # the wrapper's own placeholders carry them
            return function._trace(inner, caller)

        functools.update_wrapper(traced, function._python_fn)
        traced.__signature__ = inspect.signature(function._python_fn)
        self.wrapper = tf.function(
            traced, autograph=False,
            input_signature=getattr(function._fn, "input_signature", None),
            reduce_retracing=getattr(function._fn, "_reduce_retracing", False))
        depth = function._depth
        self._in_flight = threading.BoundedSemaphore(
            depth if isinstance(depth, int) and depth >= 1 else 1)

    def call(self, args, kwargs):
        with self._in_flight:
            if not self._function._has_collectives:
                return self.wrapper(*args, **kwargs)
            with self._function._one_call:
                return self.wrapper(*args, **kwargs)


class RewrittenConcreteFunction:
    """The rewritten function for one input signature, on any calling task.

    What :meth:`RewrittenFunction.get_concrete_function` returns, and what a
    ``ClusterCoordinator`` runs: each call goes to the rewrite traced for the
    device it is called on (``tf.device`` scope; the coordinator calls it
    under the worker it picked), traced on the first call there.
    """

    def __init__(self, function, inner, args, kwargs):
        self._function = function
        self._inner = inner
        self._args = args
        self._kwargs = kwargs

    def __call__(self, *args, **kwargs):
        return self._function._for_caller(self._inner).call(args, kwargs)

    @property
    def graph(self):
        """The rewritten graph for the current device (traced if new)."""
        return self._function._for_caller(self._inner).wrapper \
            .get_concrete_function(*self._args, **self._kwargs).graph

    @property
    def structured_outputs(self):
        return self._inner.structured_outputs

    @property
    def structured_input_signature(self):
        return self._inner.structured_input_signature

    @property
    def function_type(self):
        return self._inner.function_type


def _client_device():
    """This program's own CPU, e.g. ``/job:chief/replica:0/task:0/device:CPU:0``."""
    return context.context().host_address_space() + "/device:CPU:0"


def _caller_device():
    """The device a call made now runs on: the ``tf.device`` scope, else ours."""
    scope = context.context().device_name
    client = _client_device()
    if not scope:
        return client
    return tf.DeviceSpec.from_string(client).make_merged_spec(
        tf.DeviceSpec.from_string(scope)).to_string()


# ClusterCoordinator.schedule takes only tf.function objects (an isinstance
# check against TensorFlow's abstract Function class): registering the
# rewritten function as one lets it schedule a rewritten step, which its
# closures call through get_concrete_function as they call any tf.function.
def_function.Function.register(RewrittenFunction)


def _no_gradient_across(outputs, inputs, name):
    """Makes differentiating *through* the rewritten function an error.

    A planned transfer has no data edge from send to recv, so a gradient
    taken outside the function would silently stop at every transfer (None
    or a partial gradient). Gradients computed inside the function are
    planned like any other tensor and are not affected. The guard takes the
    function's inputs (arguments and captured handles) too, so that every
    input has a path to the outputs through it and the tape calls it.
    """
    n = len(outputs)

    @tf.custom_gradient
    def guard(*values):
        def grad(*upstream):
            del upstream
            raise PlanError(
                f"cannot differentiate through the rewritten function "
                f"{name!r}: its tensors cross tasks through tf_rdma "
                f"transfers, which carry no gradient. Compute the gradients "
                f"inside the function (tf.GradientTape or tf.gradients in "
                f"its body); they are then planned like every other tensor")
        return [tf.identity(v) for v in values[:n]], grad

    return guard(*outputs, *inputs)
