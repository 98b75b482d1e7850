"""The one exception type for user-facing failures.

Anything a user can fix (a missing dataset, a corrupt file, an unknown variant,
an impossible option) raises :class:`UserError` with a short message that says
what was expected and how to fix it. ``run.py`` catches it, prints the message
and exits with code 2. Bugs stay ordinary exceptions with their tracebacks.

It subclasses ``ValueError`` so that library users who only know the standard
exception hierarchy can still catch it.
"""


class UserError(ValueError):
    """A failure the user can fix; the message says how."""
