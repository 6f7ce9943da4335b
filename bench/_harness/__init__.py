"""What the benchmarks in bench/ share, one module per job.

The scripts run as ``python bench/<name>.py``. Python then puts bench/ first
on ``sys.path``, so ``from _harness.units import human_time`` works with no
path code, in an orchestrator and in every child it starts from bench/.
No bench script imports another one; what two of them need lives here.

- ``units``: byte and time units: ``parse_size`` (the ``--sizes``
  argument), the one byte formatter ``human_size`` and the one time
  formatter ``human_time``.
- ``report``: what an orchestrator records and prints: the machine, the
  load average, the run's date and wall clock (``Run``), result entries,
  the check verdict, the table printer and JSON files.
- ``children``: the processes an orchestrator starts: their environment,
  one child with its progress echoed and its result line read back
  (``run_child``), and groups of P worker processes under one time limit
  (``run_processes``).
- ``worker``: the inside of such a worker: its cluster, ``TF_CONFIG`` and
  the MultiWorkerMirroredStrategy baseline.
- ``nic``: which RDMA NIC a verbs run used: the host's device or softnic,
  the emulated one (``--nic``), and the label that says which, taken from
  the libibverbs the running servers loaded.

Nothing here imports TensorFlow: an orchestrator never loads it, only its
children do.
"""
