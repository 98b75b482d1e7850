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


def test_a_warm_popen_is_signalled_and_reports_as_a_cold_one(env, tmp_path):
    """:func:`warm_python.popen`: the child runs beside the test, its output comes back through PIPE (stderr into
    stdout with STDOUT), a signal ends it with ``-N`` as it ends a cold process."""
    ready = tmp_path / "ready"
    program = (f"import pathlib, sys, time; print('out', flush=True); print('err', file=sys.stderr, flush=True); "
               f"pathlib.Path({str(ready)!r}).touch(); time.sleep(60)")
    argv = [sys.executable, "-c", program]
    outputs = {}
    for start in (warm_python.popen, subprocess.Popen):
        ready.unlink(missing_ok=True)
        proc = start(argv, cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                     stderr=subprocess.STDOUT, text=True)
        assert isinstance(proc, warm_python.WarmProcess) == (start is warm_python.popen)
        while not ready.exists():
            assert proc.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=0.2)
        assert proc.poll() is None
        proc.kill()
        outputs[start] = proc.communicate(timeout=60)
        assert proc.returncode == -9 and proc.poll() == -9
    assert outputs[warm_python.popen] == outputs[subprocess.Popen] == ("out\nerr\n", None)
    done = warm_python.popen([sys.executable, "-c", "import sys; sys.exit(4)"], cwd=tmp_path, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert done.wait(timeout=60) == 4 and done.communicate() == (None, None)
    proc.kill()  # after the end: nothing to signal, and no error
    cold = warm_python.popen(argv, cwd=tmp_path, env={**env, "OMP_NUM_THREADS": "2"}, stdout=subprocess.DEVNULL)
    assert isinstance(cold, subprocess.Popen)  # not eligible: started as asked
    cold.kill()
    cold.wait()
