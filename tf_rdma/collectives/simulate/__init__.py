"""A discrete-event simulator of the tf_rdma collectives under the alpha-beta-gamma-delta model."""
