"""What an orchestrator records and prints: the machine, the run, results.

Every bench writes the same JSON shape (bench/README.md, "JSON"):
``{"bench", "date", "machine", "config", "results"}``, where each entry of
``results`` is ``{"system", "op", "size_bytes", "P", "median_s", "min_s",
"runs"}`` plus keys of its own. ``Run`` holds the parts every run has
(date, machine, wall time, load average); the rest is the bench's.
"""

import datetime
import json
import os
import platform
import statistics
import time


def machine_info():
    """The machine a result was measured on, for the JSON's ``machine``.

    CPU model (of the first processor), cores, memory, kernel, transparent
    huge pages (they change copy bandwidth), numpy's version and the RDMA
    devices. Files that cannot be read leave their keys out.
    """
    info = {"cores": os.cpu_count(),
            "memory_bytes": None, "kernel": platform.release(),
            "os": platform.platform(), "python": platform.python_version(),
            "hostname": platform.node()}
    fields = {"model name": "cpu_model", "cpu family": "cpu_family",
              "model": "cpu_model_number", "cpu MHz": "cpu_mhz"}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in fields:
                    info[fields[key]] = value.strip()
                if not line.strip():
                    break  # the first processor is enough
    except OSError:
        pass
    info.setdefault("cpu_model", "unknown")
    for name in ("enabled", "shmem_enabled"):
        try:
            with open(f"/sys/kernel/mm/transparent_hugepage/{name}") as f:
                info[f"thp_{name}"] = f.read().strip()
        except OSError:
            pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    info["memory_bytes"] = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    try:
        import numpy
        info["numpy"] = numpy.__version__
    except ImportError:
        pass
    info["rdma_devices"] = sorted(os.listdir("/sys/class/infiniband")) if \
        os.path.isdir("/sys/class/infiniband") else []
    return info


def loadavg():
    """The 1, 5 and 15 minute load averages, rounded; None where unknown."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def utc_now():
    """The date of a run: now, UTC, to the second, ISO 8601."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds")


class Run:
    """One orchestrator run: its date, the machine, wall clock and load.

    Made when the run starts. Other work on the machine shows directly in
    the numbers, so a run that starts on a busy machine (a 1-minute load
    average above half the cores) says so on ``log``. ``finish`` stops the
    clock and prints the report's last line.

    Attributes:
      name: The bench's name, the JSON's ``bench``.
      date: ``utc_now()`` at the start.
      machine: ``machine_info()``; a bench may add its children's versions.
      load_start, load_end: ``loadavg()`` at the start and at ``finish``.
      elapsed_s: Wall seconds from the start to ``finish``.
    """

    def __init__(self, name, log):
        self.name = name
        self.started = time.perf_counter()
        self.date = utc_now()
        self.machine = machine_info()
        self.load_start = loadavg()
        self.load_end = None
        self.elapsed_s = None
        cores = os.cpu_count()
        if self.load_start and self.load_start[0] > 0.5 * (cores or 1):
            log(f"note: the machine is busy (load average "
                f"{self.load_start[0]:.1f} on {cores} cores); other work "
                f"skews the numbers")

    def headline(self, title):
        """The report's first line: ``title``, the date and the CPU."""
        return (f"{title}, {self.date}; {self.machine['cpu_model']}, "
                f"{self.machine['cores']} cores")

    def finish(self):
        """Stops the clock, reads the load again, prints the total time."""
        self.elapsed_s = time.perf_counter() - self.started
        self.load_end = loadavg()
        start = self.load_start[0] if self.load_start else "?"
        end = self.load_end[0] if self.load_end else "?"
        print(f"total time {self.elapsed_s:.0f} s; load average at start "
              f"{start}, at end {end} ({os.cpu_count()} cores)")

    def timing(self):
        """The ``config`` keys of the run's load and wall time."""
        return {"loadavg_start": self.load_start,
                "loadavg_end": self.load_end,
                "elapsed_s": round(self.elapsed_s, 1)}

    def document(self, config, results, **more):
        """The JSON document of the run: the shape every bench shares."""
        return {"bench": self.name, "date": self.date,
                "machine": self.machine, "config": config,
                "results": results, **more}

    def save(self, path, config, results, **more):
        """Writes the run's :meth:`document` to ``path`` and says so."""
        write_json(path, self.document(config, results, **more))
        print(f"wrote {path}")


def result_entry(system, op, size, times, P, **extra):
    """One entry of ``results``: median and min of the timed samples.

    Args:
      system, op: What was measured (bench/README.md names them per bench).
      size: The bytes the op moves (int).
      times: Seconds of each timed sample (at least one).
      P: Processes or tasks that took part.
      **extra: Keys of the bench's own, after the shared ones.
    """
    return {"system": system, "op": op, "size_bytes": int(size), "P": int(P),
            "median_s": statistics.median(times), "min_s": min(times),
            "runs": len(times), **extra}


def slowest_rank(per_rank):
    """The time of each run of a collective step: its slowest rank's.

    A collective is done when every rank has its result, so run i took the
    largest of the ranks' i-th times. Runs that some rank lacks (it failed
    or was stopped) are dropped.

    Args:
      per_rank: One list of per-run seconds per rank.

    Returns:
      ``[max over ranks of run i]`` for the runs every rank has.
    """
    runs = min(len(times) for times in per_rank)
    return [max(times[i] for times in per_rank) for i in range(runs)]


def verdict(ok):
    """The word a check line ends with: targets are printed, never asserted."""
    return "met" if ok else "MISSED"


def print_table(header, rows):
    """Prints a table: the first column left-aligned, the others right.

    Args:
      header: The column titles.
      rows: Lists of cell strings, as many as the header.
    """
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]

    def fmt(cells):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths)))
    print(fmt(header))
    print(fmt(["-" * w for w in widths]))
    for row in rows:
        print(fmt(row))


def write_json(path, doc, indent=2):
    """Writes ``doc`` to ``path`` as JSON, its folder made if missing."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=indent)
        f.write("\n")


def save_json(path, doc):
    """Replaces ``path`` with ``doc`` as JSON, in one step.

    Written to ``path.tmp`` first and renamed over ``path``, so that the
    orchestrator, which reads the file after a worker ends or is stopped
    mid-write, finds the last whole document, never half of one.
    """
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, path)
