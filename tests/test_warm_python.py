"""tests/warm_python.py, the warm start of the tests' run.py processes: a child of its server ends as a cold
``python`` process does, with the same output, exit code, environment, working folder, argv and sys.path."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import warm_python

PROGRAM = r"""
import atexit, json, os, sys, threading, time
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "path": sys.path[:2], "env": os.environ.get("PROBE"),
                  "main": __name__, "stdin": sys.stdin.read()}))
print("to stderr", file=sys.stderr)
threading.Thread(target=lambda: (time.sleep(0.3), print("thread joined"))).start()
atexit.register(lambda: print("atexit ran"))
how = sys.argv[1]
if how == "exit3":
    sys.exit(3)
if how == "message":
    sys.exit("a message")
if how == "raise":
    raise ValueError("uncaught")
if how == "kill":
    import signal
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)
"""


@pytest.fixture
def env(tmp_path):
    e = {**os.environ, "PROBE": "probed", "PYTHONPATH": str(tmp_path / "extra"), "OMP_NUM_THREADS": "1"}
    return e


@pytest.mark.parametrize("how", ["ok", "exit3", "message", "raise", "kill"])
def test_a_warm_child_ends_as_a_cold_process(env, tmp_path, how):
    argv = [sys.executable, "-c", PROGRAM, how]
    assert warm_python.eligible(argv, env)
    warm = warm_python.run(argv, cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, timeout=120)
    cold = subprocess.run(argv, cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=120)
    assert warm.returncode == cold.returncode == {"ok": 0, "exit3": 3, "message": 1, "raise": 1, "kill": -15}[how]
    assert warm.stdout == cold.stdout
    if how != "kill":
        assert warm.stdout.splitlines()[-2:] == ["thread joined", "atexit ran"]
    said = warm.stdout.splitlines()[0]
    assert '"cwd": "%s"' % tmp_path in said and '"env": "probed"' in said and '"main": "__main__"' in said
    assert '"path": ["", "%s"]' % (tmp_path / "extra") in said and '"argv": ["-c", "%s"]' % how in said
    assert warm.stderr.splitlines()[0] == cold.stderr.splitlines()[0] == "to stderr"
    if how == "raise":
        assert warm.stderr.splitlines()[-1] == cold.stderr.splitlines()[-1] == "ValueError: uncaught"
    if how == "message":
        assert warm.stderr.splitlines()[-1] == "a message"


def test_a_script_runs_as_main_with_its_folder_first_on_the_path(env, tmp_path):
    script = tmp_path / "script.py"
    script.write_text("import sys; print(__name__, sys.argv, sys.path[0])\n")
    argv = [sys.executable, str(script), "x=1"]
    warm = warm_python.run(argv, cwd=tmp_path, env=env, timeout=120)
    assert warm.returncode == 0 and warm.stdout == f"__main__ {[str(script), 'x=1']} {tmp_path}\n"


def test_a_timeout_kills_the_child(env, tmp_path):
    with pytest.raises(subprocess.TimeoutExpired):
        warm_python.run([sys.executable, "-c", "import time; time.sleep(60)"], cwd=tmp_path, env=env, timeout=1)


def test_what_the_server_cannot_start_as_a_cold_process_would_is_started_cold(env):
    argv = [sys.executable, "-c", "pass"]
    assert not warm_python.eligible(argv, {**env, "OMP_NUM_THREADS": "2"})  # torch read it at its import
    assert not warm_python.eligible(argv, {**env, "TORCHINDUCTOR_CACHE_DIR": "/elsewhere"})
    assert not warm_python.eligible(argv, env, start_new_session=True)  # a process group of its own
    assert not warm_python.eligible(["/bin/echo", "x"], env)
    assert warm_python.eligible(argv, {**env, "PYTHONPATH": "/anywhere", "WANDB_MODE": "offline"})
