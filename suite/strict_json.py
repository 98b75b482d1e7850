"""JSON that every reader reads: Python's ``json`` writes a NaN or infinite float as the bare tokens ``NaN`` /
``Infinity``, which JSON (RFC 8259) does not have, and jq, JavaScript's ``JSON.parse``, Go and strict readers
refuse the whole file for one of them. :func:`strict` writes such a float ``null``, as JavaScript does: the files
the suite writes (``metrics.json``, ``report.json``, the benchmarks' ``.json``) go through it.
"""

from __future__ import annotations

import json
import math


def strict(value):
    """``value`` with every non-finite float inside it (dict values, list and tuple items) ``None``."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict(v) for v in value]
    return value


def dumps(value, **kwargs) -> str:
    """``json.dumps`` of :func:`strict` ``(value)``; ``allow_nan=False`` makes a value that escaped it an error."""
    return json.dumps(strict(value), allow_nan=False, **kwargs)
