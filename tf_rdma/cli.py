"""The ``tf-rdma`` command line.

Each subcommand lives in its own module, imported when the parser is
built. None of them loads TensorFlow or the op library to build its parser
(importing tf_rdma does not either): `launch`, `simulate` and `doctor` run
without loading them, `doctor` reports an op library that does not load, and
`inspect` loads TensorFlow when it traces.

The parsers are absl's ``argparse_flags.ArgumentParser``: plain argparse
for our own options, plus absl's flags (``--flagfile``, ``--undefok``,
``--helpfull``, and the absl flags TensorFlow defines, such as
``--verbosity``) on every command.
"""

import argparse
import sys

from absl.flags import argparse_flags

__all__ = ["main", "build_parser"]

_DESCRIPTION = """\
tf_rdma: zero-copy, preallocated tensor transfers and pipelined collectives
for distributed TensorFlow over RDMA, shared memory or TCP.
"""


def _add_launch(subparsers):
    from tf_rdma import launch

    parser = subparsers.add_parser(
        "launch",
        help="start N local tf_rdma servers and run a command against them",
        usage=launch._USAGE,
        description=launch._DESCRIPTION,
        epilog=launch._EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    launch.add_arguments(parser)

    def run(args):
        return launch.run(args, parser)

    parser.set_defaults(func=run)


def _add_inspect(subparsers):
    from tf_rdma import inspect_cli

    parser = subparsers.add_parser(
        "inspect",
        help="show the transfer plan of a function, SavedModel or GraphDef",
        usage=inspect_cli._USAGE,
        description=inspect_cli._DESCRIPTION,
        epilog=inspect_cli._EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    inspect_cli.add_arguments(parser)

    def run(args):
        return inspect_cli.run(args, parser)

    parser.set_defaults(func=run)


def _add_simulate(subparsers):
    from tf_rdma.collectives import simulate

    parser = subparsers.add_parser(
        "simulate",
        help="simulate the collectives (lp, ring, tree, rhd) under the "
             "alpha-beta-gamma cost model",
        usage=simulate._USAGE,
        description=simulate._DESCRIPTION,
        epilog=simulate._EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    simulate.add_arguments(parser)

    def run(args):
        return simulate.run(args, parser)

    parser.set_defaults(func=run)


def _add_doctor(subparsers):
    from tf_rdma import doctor

    parser = subparsers.add_parser(
        "doctor",
        help="report RDMA devices, pyverbs, memlock, kernel support and the transport choice",
        usage=doctor._USAGE,
        description=doctor._DESCRIPTION,
        epilog=doctor._EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    doctor.add_arguments(parser)

    def run(args):
        return doctor.run(args, parser)

    parser.set_defaults(func=run)


def build_parser():
    """Returns the ``tf-rdma`` argument parser with every subcommand.

    Returns:
        An ``absl.flags.argparse_flags.ArgumentParser`` (an
        ``argparse.ArgumentParser``); its subcommand parsers are of the same
        class.
    """
    parser = argparse_flags.ArgumentParser(
        prog="tf-rdma",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    subparsers = parser.add_subparsers(dest="subcommand", metavar="COMMAND", title="commands")
    subparsers.required = True
    _add_launch(subparsers)
    _add_inspect(subparsers)
    _add_simulate(subparsers)
    _add_doctor(subparsers)
    return parser


def main(argv=None):
    """Runs the ``tf-rdma`` command line.

    Args:
        argv: The arguments, without the program name (default ``sys.argv[1:]``).

    Returns:
        The exit status of the subcommand. Usage errors exit with status 2
        (through ``SystemExit``).
    """
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
