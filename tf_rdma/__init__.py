"""tf_rdma: cheap cross-task tensor traffic for TensorFlow 2.

Importing tf_rdma is cheap: it loads neither TensorFlow nor the op library,
so the `tf-rdma` tools (launch, doctor, simulate) and the graph passes start
without them. The op library is loaded into TensorFlow, once, and checked
against the installed TensorFlow, when the first name that needs it is used
(``tf_rdma.ops``, ``tf_rdma.rewrite``, an endpoint, the collectives, the
strategy).

Main entry points:
    tf_rdma.Server          a TensorFlow task with a tf_rdma endpoint
    tf_rdma.start_endpoint  the endpoint alone, for non-server processes
    tf_rdma.Plan, Transfer  the static memory plan of cross-task tensors
    tf_rdma.ops.send/recv   the zero-copy transfer ops
    tf_rdma.rewrite         decorator: a multi-task tf.function's tensors via tf_rdma
                            (ParameterServerStrategy steps too: docs/parameter-server.md)
    tf_rdma.collectives     allreduce/broadcast/reduce/allgather (lp, ring, tree, rhd, oneshot)
    tf_rdma.distribute      RdmaStrategy: data-parallel Keras fit and custom loops
    tf_rdma.stats           the transfer counters: bytes, transfers, waits per peer
    tf_rdma.keras           StatsCallback: MB/s and wait fractions in Keras' logs
"""

import importlib
import sys

from tf_rdma import errors

__version__ = "0.1.0"

# Each public name and the module that defines it, imported on first use.
# (tf_rdma.server this way also lets `python -m tf_rdma.server` run it as
# __main__ without a second copy in sys.modules.)
_LAZY = {
    "Plan": "tf_rdma.graph_passes.plan",
    "Transfer": "tf_rdma.graph_passes.plan",
    "RewrittenFunction": "tf_rdma.decorator",
    "ClientComputeWarning": "tf_rdma.decorator",
    "rewrite": "tf_rdma.decorator",
    "Endpoint": "tf_rdma.server",
    "Server": "tf_rdma.server",
    "endpoint_info": "tf_rdma.server",
    "start_endpoint": "tf_rdma.server",
    "stats": "tf_rdma.counters",
}
_LAZY_MODULES = ("ops", "collectives", "distribute", "keras")

__all__ = ["errors", *_LAZY_MODULES, *_LAZY]


_hooked = False


def _hook_tensorflow():
    """Installs tf_rdma's hooks into TensorFlow's tracing once TensorFlow is
    imported (tf_rdma/_auto_control_deps.py: ops that run in any order,
    results computed where they are produced).

    The op library's loader installs them too, but it runs while the first
    function that uses tf_rdma ops is being traced: too late for that
    function, whose result then went through the client on every call (the
    `with` around a trace looks up its `__exit__` when it starts). Any
    tf_rdma name used before that trace (a Plan, the decorator) installs
    them in time; importing tf_rdma after TensorFlow does too. Without
    TensorFlow loaded this does nothing: importing tf_rdma stays cheap.
    """
    global _hooked
    if _hooked or "tensorflow" not in sys.modules:
        return
    _hooked = True
    from tf_rdma import _auto_control_deps  # pylint: disable=g-import-not-at-top
    try:
        _auto_control_deps.register_order_insensitive_ops()
    except errors.LibraryError:
        pass  # an unsupported TensorFlow: loading the library says so


def __getattr__(name):
    _hook_tensorflow()
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _LAZY_MODULES:
        return importlib.import_module(f"tf_rdma.{name}")
    raise AttributeError(f"module 'tf_rdma' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))


_hook_tensorflow()
