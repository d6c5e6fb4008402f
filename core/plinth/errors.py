"""Errors a user can cause and fix (bad file, missing key, unknown model).

The CLI prints these as one line without a traceback; everything else is a bug.
"""


class UserError(Exception):
    """A problem with the user's input, worded to say what failed, where, and what to do."""
