"""Validation of data-module options: one message style for every ``data.<option>``."""

from __future__ import annotations

from attention.errors import UserError


def int_option(name: str, value, minimum: int, example) -> int:
    """``value`` as an int >= ``minimum``; UserError naming ``data.<name>`` with an example value otherwise."""
    try:
        ok = not isinstance(value, bool) and int(value) == value and int(value) >= minimum
    except (TypeError, ValueError):
        ok = False
    if not ok:
        what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise UserError(
            f"data.{name} must be {what}, got {value!r}; fix it in the data config or override it, "
            f"e.g. data.{name}={example}."
        )
    return int(value)


ON_BAD_FILE = ("error", "skip")


def on_bad_file_option(value) -> str:
    """``data.on_bad_file`` checked: "error" (stop at the first bad file) or "skip" (drop bad files and samples)."""
    if value not in ON_BAD_FILE:
        raise UserError(
            f"data.on_bad_file must be 'error' (stop at the first bad file) or 'skip' (drop bad files and "
            f"samples, counted), got {value!r}; e.g. data.on_bad_file=skip."
        )
    return str(value)
