"""``tf-rdma simulate --png DIR``: time-vs-P and time-vs-size plots per kind.

matplotlib is imported when a plot is made, not with this module: the
simulator runs without it.
"""

import os

from tf_rdma.collectives.simulate.sweeps import format_size

__all__ = ["plot"]


def plot(rows, kinds, algorithms, sizes, ranks, outdir):
    """Writes ``<kind>_vs_P.png`` and ``<kind>_vs_size.png`` into ``outdir``
    from :func:`~tf_rdma.collectives.simulate.sweeps.sweep` rows; returns the paths."""
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt  # pylint: disable=import-outside-toplevel

    os.makedirs(outdir, exist_ok=True)
    written = []
    by = {(r["kind"], r["algorithm"], r["size_bytes"], r["P"]): r["simulated_s"]
          for r in rows}
    def save(panels, xs, xlabel, curve, title, path):
        """One figure: a panel per value of `panels`, time against `xs`."""
        fig, axes = plt.subplots(1, len(panels),
                                 figsize=(4.5 * len(panels), 4), squeeze=False)
        for ax, panel in zip(axes[0], panels):
            for a in algorithms:
                ax.plot(xs, [curve(a, panel, x) for x in xs], marker="o",
                        label=a)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel(xlabel)
            ax.set_ylabel("simulated time (s)")
            ax.set_title(title(panel))
            ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)

    for kind in kinds:
        save(sizes, ranks, "P (ranks)",
             lambda a, n, P, kind=kind: by[(kind, a, n, P)],
             lambda n, kind=kind: f"{kind}, {format_size(n)}",
             os.path.join(outdir, f"{kind}_vs_P.png"))
        save(ranks, sizes, "message size (bytes)",
             lambda a, P, n, kind=kind: by[(kind, a, n, P)],
             lambda P, kind=kind: f"{kind}, P = {P}",
             os.path.join(outdir, f"{kind}_vs_size.png"))
    return written
