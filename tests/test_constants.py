"""Constants that exist in C++ and in Python agree.

The plan (graph_passes/plan.py) lays out regions that the engine
(kernels/engine/engine.h, kernels/common/region.h) reads, and the ops' dtype attributes
(kernels/ops/*.cc) must accept what the plan and the collectives accept.
Where two copies must exist, one per language, this reads the C++ source and
compares: a change to one side that misses the other fails here, not as a
misread slot on a cluster.
"""

import os
import re

import pytest

from conftest import REPO
from tf_rdma.graph_passes import plan

pytestmark = pytest.mark.fast  # in `make test-fast`: no processes, no sockets

# TensorFlow's attr names for the dtypes whose Python names differ.
TF_ATTR_NAMES = {"half": "float16", "float": "float32", "double": "float64"}


def source(path):
    with open(os.path.join(REPO, path)) as f:
        return f.read()


def cc_constant(path, name):
    m = re.search(rf"constexpr \w+ {name} = ([^;]+);", source(path))
    assert m, f"{name} not found in {path}"
    return int(eval(m.group(1), {}))  # "64", "64 * 1024": plain arithmetic


def cc_dtype_list(path, macro):
    """The dtypes of a `#define MACRO "{half, ...}"` (continued lines too)."""
    lines = iter(source(path).splitlines())
    for line in lines:
        if line.startswith(f"#define {macro}"):
            body = [line]
            while body[-1].rstrip().endswith("\\"):
                body.append(next(lines))
            break
    else:
        pytest.fail(f"{macro} not found in {path}")
    text = "".join(re.findall(r'"([^"]*)"', "\n".join(body)))
    names = [n.strip() for n in text.strip("{} ").split(",")]
    return sorted(TF_ATTR_NAMES.get(n, n) for n in names)


@pytest.mark.parametrize("python_value,header,name", [
    (plan.SLOT_HEADER_BYTES, "kernels/engine/engine.h", "kSlotHeaderBytes"),
    (plan.CREDIT_LINE_BYTES, "kernels/engine/engine.h", "kCreditLineBytes"),
    (plan.SLEEPERS_OFFSET, "kernels/common/wait.h", "kSleepersOffset"),
    (plan.MAX_DEPTH, "kernels/engine/engine.h", "kMaxSlotDepth"),
    (plan.DYNAMIC_META_BYTES, "kernels/engine/engine.h", "kDynamicMetaBytes"),
    (plan.PAGE_BYTES, "kernels/common/region.h", "kPageBytes"),
])
def test_layout_constants_agree(python_value, header, name):
    assert cc_constant(header, name) == python_value, (header, name)


def test_transfer_dtypes_agree():
    ops = cc_dtype_list("kernels/ops/send_recv_ops.cc", "TF_RDMA_TYPES")
    assert ops == sorted(plan.DTYPE_SIZES)


def test_collective_dtypes_agree():
    from tf_rdma import collectives  # loads TensorFlow

    ops = cc_dtype_list("kernels/ops/collective_ops.cc", "TF_RDMA_COLLECTIVE_TYPES")
    assert ops == sorted(collectives._DTYPES)
    assert set(collectives._DTYPES) <= set(plan.DTYPE_SIZES)
