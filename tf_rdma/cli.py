"""The ``tf-rdma`` command line.

Each subcommand lives in its own module, which exposes one ``COMMAND``
(:class:`tf_rdma.subcommand.Command`: its help texts, options and what runs
it); :func:`commands` imports them when the parser is built, and
:func:`build_parser` adds them in one loop. None of them loads TensorFlow or
the op library to build its parser (importing tf_rdma does not either):
`launch`, `simulate`, `doctor` and `timeline` run without loading them, `doctor` reports
an op library that does not load, and `inspect` loads TensorFlow when it
traces.

The parsers are absl's ``argparse_flags.ArgumentParser``: plain argparse
for our own options, plus absl's flags (``--flagfile``, ``--undefok``,
``--helpfull``, and the absl flags TensorFlow defines, such as
``--verbosity``) on every command.
"""

import argparse
import os
import sys

from absl.flags import argparse_flags

__all__ = ["main", "build_parser", "commands"]

_DESCRIPTION = """\
tf_rdma: zero-copy, preallocated tensor transfers and pipelined collectives
for distributed TensorFlow over RDMA, shared memory or TCP.
"""


def commands():
    """The subcommands, in the order ``tf-rdma --help`` lists them.

    Returns:
        A list of :class:`tf_rdma.subcommand.Command`: each subcommand
        module's ``COMMAND``.
    """
    # pylint: disable=import-outside-toplevel
    from tf_rdma import launch
    from tf_rdma.collectives.simulate import command as simulate_command
    from tf_rdma.doctor import command as doctor_command
    from tf_rdma.inspect import command as inspect_command
    from tf_rdma import timeline

    return [launch.COMMAND, inspect_command.COMMAND, simulate_command.COMMAND, doctor_command.COMMAND,
            timeline.COMMAND]


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
    for command in commands():
        command.add_to(subparsers)
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
    # The commands that load TensorFlow (inspect, doctor, bench) print
    # tf_rdma's findings, not TensorFlow's INFO logs; TF_CPP_MIN_LOG_LEVEL=0
    # brings them back.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
