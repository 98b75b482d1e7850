"""Test helpers shared by modules (a module of its own: ``conftest`` is ambiguous on sys.path, since
tests/attention has one too)."""

from __future__ import annotations

import json
import subprocess


def once_per_worker(tmp_path_factory, name: str, build):
    """``build(out)`` -> CompletedProcess (or None), run once per xdist worker and session in ``<basetemp>/<name>``;
    later calls return ``(out, the same CompletedProcess)`` from disk.

    Module-scoped fixtures are torn down whenever a worker switches modules, and xdist does not run a module's
    tests (even one xdist_group) back to back: without this, expensive end-to-end runs were repeated."""
    out = tmp_path_factory.getbasetemp() / f"once-{name}"
    record = out.parent / f".once-{name}.json"
    if record.is_file():
        r = json.loads(record.read_text())
        return out, subprocess.CompletedProcess(r["args"], r["returncode"], r["stdout"], r["stderr"])
    out.mkdir(parents=True, exist_ok=True)
    proc = build(out) or subprocess.CompletedProcess([], 0, "", "")
    record.write_text(json.dumps({"args": [str(a) for a in proc.args], "returncode": proc.returncode,
                                  "stdout": proc.stdout, "stderr": proc.stderr}))
    return out, proc
