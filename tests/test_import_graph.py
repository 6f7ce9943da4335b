"""The module-level import graph of tf_rdma/ and graph_passes/.

How the graph is built: every ``.py`` file under ``tf_rdma/`` and
``graph_passes/`` is parsed with :mod:`ast` (nothing is imported or run).
``graph_passes/`` is named ``tf_rdma.graph_passes.*``, as it is installed
(a ``tf_rdma/graph_passes`` link to it, where a source tree has one, is
skipped so that no file is read twice). Each ``import`` and ``from ... import`` statement
anywhere in a file, at the top or inside a function, class or ``if``, is an
edge from that file's module to the module it names: ``import a.b.c`` and
``from a.b import c`` point at ``a.b.c`` when that is a module of ours (else
at ``a.b``), relative imports are resolved against the file's package. An
edge goes to the named module only, not to the packages above it (which
Python also runs): the ``__init__`` of a package that re-exports its
submodules would otherwise close a cycle with each of them. Imports through
``importlib`` (``tf_rdma/__init__.py``'s lazy names) are not statements and
are not edges.

What is asserted:

* the graph of our own modules has no cycle (a function-level import counts
  as much as a top-level one: it hides the cycle from Python at import time,
  not from the reader);
* ``graph_passes`` (the layer below the user API, design.md section 2) imports
  nothing from ``tf_rdma`` but itself, and no TensorFlow at module level
  (outside functions), directly or through a module it imports at module
  level, so that the passes load without it. The exceptions that stand
  today are listed below with their reasons.
"""

import ast
import os

import pytest

pytestmark = pytest.mark.fast  # in `make test-fast`: parses files, runs none

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "tf_rdma"
PASSES = "tf_rdma.graph_passes"

# Known exceptions to the graph_passes rules, each with the reason it stands;
# delete an entry when its import goes away.
PASSES_MAY_IMPORT = {
    # The error hierarchy (TfRdmaError and its subclasses, PlanError among
    # them) is one leaf module with no imports of its own; the passes raise
    # PlanError so that callers catch every tf_rdma error as TfRdmaError.
    "tf_rdma.errors",
}
PASSES_TF_AT_MODULE_LEVEL = {
    # These passes read and write GraphDef protobufs (types_pb2, graph_pb2,
    # op_def_registry ...) and import them at module level; importing a
    # tensorflow.core module imports TensorFlow. transfers.py does so
    # through graph.py; plan.py and buckets.py load without TensorFlow.
    "tf_rdma.graph_passes.graph",
    "tf_rdma.graph_passes.placement",
    "tf_rdma.graph_passes.rewrite",
    "tf_rdma.graph_passes.transfers",
}


def _module_files():
    """{module name: path} of every Python file of tf_rdma/ and graph_passes/."""
    found = {}
    for top, name in (("tf_rdma", PACKAGE), ("graph_passes", PASSES)):
        root = os.path.join(REPO, top)
        for directory, subdirs, files in os.walk(root):
            subdirs[:] = sorted(d for d in subdirs if d != "__pycache__" and not os.path.islink(
                os.path.join(directory, d)))
            rel = os.path.relpath(directory, root)
            parts = [name] + ([] if rel == "." else rel.split(os.sep))
            for f in sorted(files):
                if not f.endswith(".py"):
                    continue
                stem = f[:-3]
                module = ".".join(parts if stem == "__init__" else parts + [stem])
                found[module] = os.path.join(directory, f)
    return found


def _imports(path, module, is_package):
    """[(imported module name, at module level)] for every import of a file.

    ``from a.b import c`` gives ``a.b.c`` (which :func:`_graph` shortens to
    ``a.b`` when ``c`` is not a module but a name defined in ``a.b``).
    """
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    package = module if is_package else module.rpartition(".")[0]
    out = []

    def visit(node, top):
        if isinstance(node, ast.Import):
            out.extend((alias.name, top) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module
            out.extend((f"{prefix}.{alias.name}", top) for alias in node.names)
        inner = top and not isinstance(
            node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(tree, True)
    return out


def _graph(top_level_only=False):
    """({module: {our modules it imports}}, {module: [(import, top level)]}).

    With ``top_level_only``, the edges are the module-level imports only
    (what importing the module runs).
    """
    files = _module_files()
    edges, raw = {}, {}
    for module, path in files.items():
        raw[module] = _imports(path, module, path.endswith("__init__.py"))
        targets = set()
        for name, top in raw[module]:
            if top_level_only and not top:
                continue
            while name and name not in files:  # the longest name that is a module of ours
                name = name.rpartition(".")[0]
            if name and name != module:
                targets.add(name)
        edges[module] = targets
    return edges, raw


def _cycles(edges):
    """Every cycle as a list of modules (Tarjan's strongly connected components)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []
    counter = [0]

    def connect(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            connect(v)
    return out


def test_the_scan_sees_both_trees():
    edges, _ = _graph()
    assert "tf_rdma.cli" in edges and "tf_rdma.graph_passes.plan" in edges
    assert "tf_rdma.graph_passes.rewrite" in edges["tf_rdma.decorator"]


def test_no_import_cycle():
    edges, _ = _graph()
    cycles = _cycles(edges)
    detail = []
    for component in cycles:
        members = set(component)
        detail.append(" ; ".join(f"{m} -> {', '.join(sorted(edges[m] & members))}"
                                 for m in component))
    assert not cycles, "import cycles:\n  " + "\n  ".join(detail)


def _loads_tensorflow(module, top_edges, raw, seen=None):
    """The import chain by which importing ``module`` loads TensorFlow, or None."""
    seen = set() if seen is None else seen
    seen.add(module)
    for name, top in raw[module]:
        if top and name.split(".")[0] in ("tensorflow", "keras"):
            return [module, name]
    for target in sorted(top_edges[module]):
        if target not in seen:
            chain = _loads_tensorflow(target, top_edges, raw, seen)
            if chain:
                return [module] + chain
    return None


def test_graph_passes_import_only_themselves_and_no_tensorflow_at_module_level():
    edges, raw = _graph()
    top_edges, _ = _graph(top_level_only=True)
    outside, tensorflow = [], []
    for module, targets in edges.items():
        if not module.startswith(PASSES):
            continue
        for target in targets:
            if not (target == PASSES or target.startswith(PASSES + ".")) \
                    and target not in PASSES_MAY_IMPORT:
                outside.append(f"{module} imports {target}")
        if module not in PASSES_TF_AT_MODULE_LEVEL:
            chain = _loads_tensorflow(module, top_edges, raw)
            if chain:
                tensorflow.append(" -> ".join(chain))
    assert not outside, outside
    assert not tensorflow, tensorflow
    # An exception that no longer applies is deleted from the list.
    stale = [m for m in PASSES_TF_AT_MODULE_LEVEL
             if not _loads_tensorflow(m, top_edges, raw)]
    assert not stale, stale
