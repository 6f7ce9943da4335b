"""``tf-rdma doctor``: what this machine offers tf_rdma, and why."""
