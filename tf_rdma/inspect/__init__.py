"""``tf-rdma inspect``: the transfer plan of a graph, without a cluster.

Reads a graph (a traced ``MODULE.py:FUNCTION``, a SavedModel signature or a
GraphDef file), runs the same graph passes as ``@tf_rdma.rewrite``
(:func:`tf_rdma.graph_passes.rewrite.analyze`) and prints what they found:
every cross-task edge with its class, size and slot, the totals per task
pair, and a summary of how many bytes move per step and why the rest stays
on TensorFlow's own path. ``--format`` picks text, JSON, Graphviz DOT or a
self-contained HTML page. docs/inspect.md is the user's guide.

One module per job:

* :mod:`~tf_rdma.inspect.load`: the input, read and traced into a GraphDef
  (:class:`~tf_rdma.inspect.load.Loaded`); :class:`~tf_rdma.inspect.load.InspectError`
  for input that cannot be.
* :mod:`~tf_rdma.inspect.report`: the passes run, and their result as a
  :class:`~tf_rdma.inspect.report.Report` (rows, task pairs, summary).
* :mod:`~tf_rdma.inspect.tables`: the report as rows of strings, shared by
  the text and HTML renderers.
* :mod:`~tf_rdma.inspect.render_text`, :mod:`~tf_rdma.inspect.render_json`,
  :mod:`~tf_rdma.inspect.render_graph` (DOT, and the SVG drawing),
  :mod:`~tf_rdma.inspect.render_html`: one renderer per ``--format``.
* :mod:`~tf_rdma.inspect.local_cluster`: ``--cluster`` (or ``TF_CONFIG``):
  in-process local servers for the tasks a script creates variables on at
  import time.
* :mod:`~tf_rdma.inspect.command`: the command line (``COMMAND``).

Nothing here is imported by ``import tf_rdma``; building the ``tf-rdma``
parser imports :mod:`~tf_rdma.inspect.command` and what it names, none of
which loads TensorFlow until a graph is read.
"""
