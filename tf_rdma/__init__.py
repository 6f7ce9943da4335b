"""tf_rdma: cheap cross-task tensor traffic for TensorFlow 2.

Importing tf_rdma loads its op library into TensorFlow (once) and checks
that it was built for the installed TensorFlow.

Main entry points:
    tf_rdma.Server          a TensorFlow task with a tf_rdma endpoint
    tf_rdma.start_endpoint  the endpoint alone, for non-server processes
    tf_rdma.Plan, Transfer  the static memory plan of cross-task tensors
    tf_rdma.ops.send/recv   the zero-copy transfer ops
    tf_rdma.rewrite         decorator: a multi-task tf.function's tensors via tf_rdma
    tf_rdma.collectives     allreduce/broadcast/reduce/allgather (lp, ring, tree, rhd)
    tf_rdma.distribute      RdmaStrategy: data-parallel Keras fit and custom loops
"""

import importlib

from tf_rdma import _loader

_loader.load()

from tf_rdma import errors, ops  # noqa: E402
from tf_rdma.decorator import RewrittenFunction, rewrite  # noqa: E402
from tf_rdma.graph_passes.plan import Plan, Transfer  # noqa: E402

__version__ = "0.1.0"

# tf_rdma.server is imported on first use, so that `python -m tf_rdma.server`
# runs it as __main__ without a second copy in sys.modules.
_SERVER_NAMES = ("Endpoint", "Server", "endpoint_info", "start_endpoint")

__all__ = ["Plan", "RewrittenFunction", "Transfer", "errors", "ops", "rewrite"] + list(_SERVER_NAMES)


def __getattr__(name):
    if name in _SERVER_NAMES:
        return getattr(importlib.import_module("tf_rdma.server"), name)
    raise AttributeError(f"module 'tf_rdma' has no attribute {name!r}")
