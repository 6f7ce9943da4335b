"""Data-parallel training over tf_rdma collectives: RdmaStrategy."""

from tf_rdma.distribute.cross_device_ops import (DEFAULT_BUCKET_BYTES,
                                                 RdmaCrossDeviceOps,
                                                 RdmaStrategy, resolve_cluster)

__all__ = ["RdmaStrategy", "RdmaCrossDeviceOps", "DEFAULT_BUCKET_BYTES",
           "resolve_cluster"]
