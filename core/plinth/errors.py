"""Errors a user can cause and fix (bad file, missing key, unknown model).

The CLI prints these as one line without a traceback; everything else is a bug.
"""


class UserError(Exception):
    """A problem with the user's input, worded to say what failed, where, and what to do."""


def missing_extra(what: str, extra: str, exc: ImportError) -> UserError:
    """The error for an optional dependency that is not installed: ``what`` needs ``extra``."""
    return UserError(f"{what} needs the '{extra}' extra ({exc.name} is missing): pip install 'plinth[{extra}]'")
