"""Which exceptions reach the user as one message and exit code 2.

``run.py`` calls :func:`as_user_error` on whatever a run raised: a :class:`UserError` anywhere in the chain
(Hydra's ``instantiate`` wraps what constructors raise) is the suite's own message; anything else stays a
traceback, because it is a bug.
"""

from __future__ import annotations

from attention.errors import UserError


def as_user_error(err: BaseException) -> UserError | None:
    """The user-facing error behind ``err``, or None when ``err`` is a bug (it keeps its traceback)."""
    cause: BaseException | None = err
    while cause is not None and not isinstance(cause, UserError):
        cause = cause.__cause__ or cause.__context__
    return cause
