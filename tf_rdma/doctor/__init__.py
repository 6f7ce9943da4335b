"""``tf-rdma doctor``: what this machine offers tf_rdma, and why.

The report covers, in this order:

* **op library**: whether tf_rdma's op library is there and loads into the
  installed TensorFlow (:mod:`~tf_rdma.doctor.system`).
* **pyverbs**: whether it imports and from where; **kernel**:
  ``/sys/class/infiniband`` and the RDMA kernel modules;
  **/dev/infiniband**: the character devices and whether this user may open
  them; **devices**: every RDMA device with its ports and GID tables
  (:mod:`~tf_rdma.doctor.rdma`).
* **memlock** and **/dev/shm** against the bytes a plan needs
  (:mod:`~tf_rdma.doctor.system`).
* **transports**: which transport tf_rdma picks for each pair of tasks of a
  ClusterSpec (``--cluster`` or ``TF_CONFIG``), and why
  (:mod:`~tf_rdma.doctor.transports`; ``@tf_rdma.rewrite``'s ``explain()``
  uses it too).
* **self-test** (``--self-test``): on a machine with an active port, an
  RDMA write of 1 MiB through a loopback queue pair, verified byte by byte
  (:mod:`~tf_rdma.doctor.self_test`).

:mod:`~tf_rdma.doctor.report` gathers them into one dict (its shape:
``tf_rdma/doctor_schema.json``, docs/doctor.md) and renders it as text;
:mod:`~tf_rdma.doctor.command` is the command line (``COMMAND``), also run
as ``python -m tf_rdma.doctor``.

The inventory uses only the standard library (plus pyverbs where it
imports) and ``tf_rdma.settings`` / ``tf_rdma.cluster``; whether verbs is
usable is asked of the engine (:func:`~tf_rdma.doctor.transports.engine_verbs_status`,
which loads the op library and so TensorFlow).
"""
