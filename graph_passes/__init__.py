"""Graph passes of tf_rdma: static memory plans for cross-task transfers.

Pure Python; importing this package does not import TensorFlow.
"""

from tf_rdma.graph_passes.plan import (
    CREDIT_LINE_BYTES,
    DTYPE_SIZES,
    DYNAMIC_META_BYTES,
    FORMAT_VERSION,
    MAX_DEPTH,
    PAGE_BYTES,
    SLOT_HEADER_BYTES,
    Plan,
    RegionLayout,
    SlotLayout,
    Transfer,
    align_up,
    canonical_task,
    normalize_dtype,
)

__all__ = [
    "CREDIT_LINE_BYTES",
    "DTYPE_SIZES",
    "DYNAMIC_META_BYTES",
    "FORMAT_VERSION",
    "MAX_DEPTH",
    "PAGE_BYTES",
    "SLOT_HEADER_BYTES",
    "Plan",
    "RegionLayout",
    "SlotLayout",
    "Transfer",
    "align_up",
    "canonical_task",
    "normalize_dtype",
]
