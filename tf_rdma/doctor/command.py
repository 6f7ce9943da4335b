"""``tf-rdma doctor``: the command line (options, output, exit status).

Exit status: 0 when the doctor ran (with or without RDMA), 1 with
``--require-rdma`` when no usable RDMA device was found (or the self-test
failed), 2 for usage errors.
"""

import json
import sys

from tf_rdma.doctor.report import build_report, format_text
from tf_rdma.errors import ConfigError
from tf_rdma.subcommand import Command

__all__ = ["COMMAND", "add_arguments", "run", "main"]

_USAGE = "tf-rdma doctor [--json] [--self-test] [--require-rdma] [--cluster JSON] [--task TASK] [--plan-bytes N]"
_DESCRIPTION = """\
Report what this machine offers tf_rdma: pyverbs, the kernel's RDMA support,
/dev/infiniband, RDMA devices with their ports and GID tables, the memlock
limit, and which transport tf_rdma picks for each pair of tasks of a cluster.
"""
_EPILOG = """\
exit status: 0 the report was made (with or without RDMA); 1 with
--require-rdma when there is no usable RDMA device or the self-test failed;
2 usage errors.

examples:
  tf-rdma doctor
  tf-rdma doctor --json
  tf-rdma doctor --cluster '{"worker": ["localhost:2222", "localhost:2223"]}' --task worker:0
  tf-rdma doctor --self-test --require-rdma --plan-bytes 268435456
"""


def add_arguments(parser):
    """Adds the ``doctor`` options to an argparse parser.

    Args:
        parser: The subcommand's ``argparse.ArgumentParser``.
    """
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--self-test", action="store_true",
                        help="on an active RDMA port: loopback RC QP, RDMA write of 1 MiB, verified")
    parser.add_argument("--require-rdma", action="store_true",
                        help="exit with status 1 when no usable RDMA device is found "
                             "(or the self-test fails)")
    parser.add_argument("--cluster", metavar="JSON",
                        help="ClusterSpec as JSON ({\"worker\": [\"host:port\", ...]}, or a whole "
                             "TF_CONFIG) for the transport choice; default: TF_CONFIG")
    parser.add_argument("--reach", action="store_true",
                        help="also connect to every other task's gRPC and tf_rdma endpoint "
                             "ports (3 s each, all at once) and say which answer")
    parser.add_argument("--task", metavar="TASK",
                        help="this task (worker:0 or /job:worker/task:0); default: TF_CONFIG's task, "
                             "else every pair")
    parser.add_argument("--plan-bytes", metavar="N", default="0",
                        help="bytes the plans in use register, checked against ulimit -l "
                             "and the free space of /dev/shm (default 0: not checked)")
    parser.add_argument("--no-dist-packages", action="store_true",
                        help="do not look for the distribution's pyverbs when import pyverbs fails")


def run(args, parser=None):
    """Runs ``tf-rdma doctor``.

    Args:
        args: The parsed arguments (see :func:`add_arguments`).
        parser: The parser, for usage errors (exit status 2).

    Returns:
        The exit status: 0, or 1 with ``--require-rdma`` and no usable RDMA
        (or a failed self-test).
    """
    def usage(message):
        if parser is not None:
            parser.error(message)
        print(f"tf-rdma doctor: error: {message}", file=sys.stderr)
        raise SystemExit(2)

    text = str(args.plan_bytes).strip()
    if not text.isdigit():
        usage(f"--plan-bytes {args.plan_bytes!r} is not a non-negative integer number of bytes")
    try:
        report = build_report(cluster_json=args.cluster, task=args.task, plan_bytes=int(text),
                              run_self_test=args.self_test,
                              allow_dist_packages=not args.no_dist_packages,
                              reach=args.reach)
    except ConfigError as err:
        usage(str(err))
    if args.json:
        json.dump(report, sys.stdout, indent=2, sort_keys=True)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(format_text(report))
    sys.stdout.flush()
    if args.require_rdma:
        # What tf_rdma needs is the engine's verdict; pyverbs only inspects.
        if not (report["rdma"]["usable"] or report["transports"]["verbs"]["available"]):
            return 1
        if report["self_test"]["ran"] and not report["self_test"]["ok"]:
            return 1
    return 0


def main(argv=None):
    """Runs the doctor on its own (``python -m tf_rdma.doctor``).

    Args:
        argv: The arguments, without the program name.

    Returns:
        The exit status.
    """
    return COMMAND.main(argv, prog="tf-rdma doctor")


#: ``tf-rdma doctor``, for the ``tf-rdma`` parser (tf_rdma.cli).
COMMAND = Command(
    name="doctor",
    help="report RDMA devices, pyverbs, memlock, kernel support and the transport choice",
    usage=_USAGE,
    description=_DESCRIPTION,
    epilog=_EPILOG,
    add_arguments=add_arguments,
    run=run,
)

