"""What one ``tf-rdma`` subcommand is: :class:`Command`.

Each subcommand module (``tf_rdma.launch``, ``tf_rdma.inspect.command``,
``tf_rdma.collectives.simulate.command``, ``tf_rdma.doctor.command``)
exposes one ``COMMAND``; ``tf_rdma.cli`` builds the ``tf-rdma`` parser from
the list of them, and a module that also runs on its own (``python -m``)
builds its parser from the same object. This module imports nothing of
tf_rdma, so that neither side imports the other.
"""

import argparse
import dataclasses
from typing import Callable

__all__ = ["Command"]


@dataclasses.dataclass(frozen=True)
class Command:
    """One subcommand: its help texts, its options and what runs it.

    Attributes:
        name: The word after ``tf-rdma`` (``"launch"``).
        help: One line for ``tf-rdma --help``.
        usage: The usage line (``%(prog)s`` is the program name).
        description: The text above the options, printed as written.
        epilog: The text below the options, printed as written.
        add_arguments: ``add_arguments(parser)`` adds the options to an
            ``argparse.ArgumentParser``.
        run: ``run(args, parser)`` runs the command with the parsed
            arguments and returns the exit status; ``parser`` reports usage
            errors (exit status 2).
    """

    name: str
    help: str
    usage: str
    description: str
    epilog: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace, argparse.ArgumentParser], int]

    def add_to(self, subparsers):
        """Adds this command to ``subparsers`` (of ``add_subparsers()``).

        The parser's defaults get ``func``: ``func(args)`` runs the command
        with this subcommand's parser.

        Returns:
            The subcommand's parser.
        """
        parser = subparsers.add_parser(
            self.name,
            help=self.help,
            usage=self.usage,
            description=self.description,
            epilog=self.epilog,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        self.add_arguments(parser)

        def run(args):
            return self.run(args, parser)

        parser.set_defaults(func=run)
        return parser

    def parser(self, prog):
        """A stand-alone ``argparse.ArgumentParser`` for this command alone.

        Args:
            prog: The program name its messages show (``"tf-rdma doctor"``).
        """
        parser = argparse.ArgumentParser(
            prog=prog,
            usage=self.usage,
            description=self.description,
            epilog=self.epilog,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        self.add_arguments(parser)
        return parser

    def main(self, argv, prog):
        """Parses ``argv`` with :meth:`parser` and runs the command.

        Returns:
            The exit status; usage errors exit with status 2 (``SystemExit``).
        """
        parser = self.parser(prog)
        return self.run(parser.parse_args(argv), parser)
