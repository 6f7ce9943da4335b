"""A discrete-event simulator of the tf_rdma collectives under the α-β-γ-δ model.

It plays the schedules of kernels/engine/collective.cc block by block: every
rank runs its program one operation after another, and

* sending a block of s bytes keeps the sender busy for α + s·β; the block is
  in the receiver's channel when the send ends;
* receiving a block waits until it is there; reducing it (in place, from
  the channel) costs the receiver s·γ, copying it out of the channel into
  its buffer s·δ;
* a channel (one direction between two ranks) holds ``depth`` blocks: the
  sender of the k-th block on a channel first waits until the receiver has
  consumed (finished receiving) block k - depth.

There is no contention between different channels (every link and every
rank's memory bandwidth are independent), which is the model's assumption,
not the simulator's; the optional ``bus`` of :func:`simulate` adds a crude
shared memory bus (a lower bound on the time from the total copy and
reduction work of all ranks). The result is the time at which the last rank
finishes.

Run it as ``python -m tf_rdma.collectives.simulate`` or ``tf-rdma simulate``
(``--help`` for the options); it prints the predicted time of every
algorithm for each size and number of ranks, a "claims" section that checks
linear pipelining's two claims (cost nearly flat in P; up to twice the
bandwidth of recursive halving/doubling for broadcast), and with ``--png``
and ``--json`` writes plots and the numbers.

The simulator is pure Python + numpy (matplotlib only for ``--png``, imported
when asked for) and never imports TensorFlow itself.

One module per job: :mod:`~tf_rdma.collectives.simulate.engine` (the ranks'
clocks and channels, and how whole sets of events are computed at once),
:mod:`~tf_rdma.collectives.simulate.schedules` (the algorithms' schedules),
:mod:`~tf_rdma.collectives.simulate.predict` (:func:`simulate`,
:func:`predicted_times`, :func:`predicted_order`, exported here),
:mod:`~tf_rdma.collectives.simulate.sweeps` (sweeps and the claims),
:mod:`~tf_rdma.collectives.simulate.plots` (``--png``) and
:mod:`~tf_rdma.collectives.simulate.command` (the command line).
"""

from tf_rdma.collectives.simulate.predict import (predicted_order,
                                                  predicted_times, simulate)

__all__ = ["simulate", "predicted_times", "predicted_order"]

