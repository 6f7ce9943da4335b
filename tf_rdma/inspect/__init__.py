"""``tf-rdma inspect``: the transfer plan of a graph, without a cluster."""
