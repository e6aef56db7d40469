"""The one base of every error a user can cause, and the exit codes it maps to.

Every sentence meant for the user (a bad flag, config, rule or trace file, an agent that does not
answer) is raised as a `UserError` subclass carrying its exit code, so `gpuscope.cli.main` catches one
type and prints one line. Standard library only: every layer may import it.

>>> class NoAgent(UserError):
...     exit_code = EXIT_UNAVAILABLE
>>> e = NoAgent("No gpuscope agent answers at http://127.0.0.1:9471.")
>>> (str(e), e.exit_code, isinstance(e, UserError))
('No gpuscope agent answers at http://127.0.0.1:9471.', 1, True)
"""

from __future__ import annotations

EXIT_OK, EXIT_UNAVAILABLE, EXIT_USAGE = 0, 1, 2

__all__ = ["EXIT_OK", "EXIT_UNAVAILABLE", "EXIT_USAGE", "Unavailable", "UsageError", "UserError"]


class UserError(Exception):
    """One sentence for the user, and the exit code the command ends with (2: bad usage or input)."""

    exit_code: int = EXIT_USAGE


class UsageError(UserError):
    """A flag, argument or file the user gave cannot be used: exit 2."""


class Unavailable(UserError):
    """What was asked for is not there (no driver, no store, no agent, no data in the range): exit 1."""

    exit_code = EXIT_UNAVAILABLE
