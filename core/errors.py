"""The two error channels (docs/design.md, "Conventions").

* ``UserError``: the user's input is wrong (model file, cluster file, plan file, arguments).
  The CLI prints its message as one paragraph, no traceback, and exits with ``exit_code``
  (2 by default).
* ``InfeasibleError``: a candidate configuration cannot run (does not fit memory, does not
  divide the devices, ...).  The search catches it, counts it and moves on.
"""
from __future__ import annotations


def paragraph(text: str, width: int = 100) -> str:
    """A user error's message as printed: each line filled to ``width`` columns, never broken
    inside a word or at a hyphen (paths such as ``/tmp/my-run/plan.json`` stay whole, so they
    can be copied from the terminal)."""
    import textwrap

    return "\n".join(textwrap.fill(part, width=width, break_long_words=False, break_on_hyphens=False)
                     for part in str(text).split("\n"))


class UserError(Exception):
    """Bad input from the user: what went wrong, where, and what to do about it."""

    exit_code = 2

    def __init__(self, message: str, *, exit_code: int | None = None):
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class ModelFileError(UserError):
    """A model file that is missing, does not import, lacks a function or cannot be traced."""


class ClusterFileError(UserError):
    """A cluster file that is malformed or inconsistent."""


class PlanFileError(UserError):
    """A plan file that is malformed, from another model, or for another world size."""


class NoFeasiblePlanError(UserError):
    """No plan fits memory on every device; the message says what would make one fit."""

    exit_code = 3


class InfeasibleError(Exception):
    """A candidate configuration that cannot run; raised inside the search and counted there."""
