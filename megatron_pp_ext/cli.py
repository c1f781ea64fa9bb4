"""``python -m megatron_pp_ext <command> ...``: one subcommand per module in ``commands/``.

To add a command, write ``commands/<name>.py`` with ``register(subparsers)`` and
``run(args) -> int``, and add ``<name>`` to ``COMMANDS``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

COMMANDS = ["simulate", "demo", "select", "compare", "plan", "train", "verify"]


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one ``error:`` line and exit 2, like every other error."""

    def error(self, message):
        sys.stderr.write(f"error: {message} (see '{self.prog} --help')\n")
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="python -m megatron_pp_ext",
        description="Pipeline-parallel schedules for Megatron-Core: simulate, compare, run.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"{__package__}.commands.{name}").register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:  # `... | head`: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (ValueError, OSError) as exc:  # ScheduleError is a ValueError
        message = " ".join(str(exc).split()) or type(exc).__name__
        print(f"error: {message}", file=sys.stderr)
        return 2
