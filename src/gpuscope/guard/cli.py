"""Placeholder while this command is being built (session 4); replaced by the real module."""

from __future__ import annotations

import argparse

HELP = "(being built)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pass


def run(args: argparse.Namespace) -> int:
    from ..cli import UsageError

    raise UsageError("This command is not built yet.")
