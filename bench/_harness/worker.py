"""The inside of a group's worker process (``--worker`` mode of a bench).

The orchestrator (``children.run_processes``) starts P of them with the
cluster in ``CLUSTER_ENV``; each measures, saves its results with
``report.save_json`` and exits.
"""

import json
import os

#: The environment variable that hands a group its cluster:
#: ``{"worker": ["127.0.0.1:<port>", ...]}``.
CLUSTER_ENV = "BENCH_CLUSTER"

#: The label of the MultiWorkerMirroredStrategy baseline (RING).
MWMS = "mwms-ring"


def group_cluster():
    """The group's cluster, as the orchestrator gave it."""
    return json.loads(os.environ[CLUSTER_ENV])


def set_tf_config(cluster, rank):
    """Sets TF_CONFIG for worker ``rank`` of ``cluster`` (before TensorFlow
    makes a multi-worker strategy, which reads it)."""
    os.environ["TF_CONFIG"] = json.dumps(
        {"cluster": cluster, "task": {"type": "worker", "index": rank}})


def mwms_ring(tf):
    """``MultiWorkerMirroredStrategy`` with RING communication: the
    baseline, TensorFlow's collectives over gRPC.

    Args:
      tf: The tensorflow module (the worker imports it; this module does
        not).
    """
    ce = tf.distribute.experimental
    return tf.distribute.MultiWorkerMirroredStrategy(
        communication_options=ce.CommunicationOptions(
            implementation=ce.CommunicationImplementation.RING))
