"""Warm interpreters for the tests' ``python run.py ...`` processes.

A run.py process spends its first seconds importing torch, Lightning (with torchmetrics, which imports
torchvision and torch._dynamo) and Hydra: 5-6 s of a tiny test run on a fast 2-core machine, 9-12 s on a slower one
(an AMD EPYC here), and the suite starts a few hundred of them. :func:`run` starts such a process from a warm one
instead: a server process per pytest worker (started at the first call, ended with the worker) imports those
libraries once, and forks a child for each call (:func:`popen`, the same as a ``subprocess.Popen``: for a run
that the test signals or runs beside others). The child is set up as a fresh interpreter's would be (its
environment, working folder, ``sys.argv``, ``sys.path`` with the script's folder and ``PYTHONPATH`` first,
stdin/stdout/stderr on the call's files), runs the script as ``__main__`` (``runpy``, as ``python script.py`` does)
and ends as the interpreter ends: non-daemon threads joined, ``atexit`` handlers run, an uncaught exception's
traceback on stderr and exit code 1, ``SystemExit``'s code, a signal's ``-N``. Nothing of the project is imported
before the fork: each child imports ``suite``, ``tasks``, ... from the checkout as a cold process does.

What a child does not get that a cold process would: a hash seed of its own (the children of one server share its
``PYTHONHASHSEED``), and the import-time reading of the environment of the preloaded libraries (torch's
``OMP_NUM_THREADS`` and the like). A call whose environment differs from the server's in such a variable
(``OMP_*``, ``TORCH*``, ``TRITON*``, ``PYTHON*`` other than ``PYTHONPATH``/``PYTHONUNBUFFERED``/...), that asks
for ``subprocess`` options beyond ``cwd``, ``env``, ``stdin``, ``timeout`` and the captured text output, or runs
something else than a script or ``-c`` program of this interpreter, runs cold, as does every call under
``TESTS_COLD_PROCESSES=1`` (the suite's real-process path, unchanged otherwise). The tests of what a cold start
does (tests/test_bad_inputs.py ``refused``, the demo runs, the DDP and signal tests' own ``Popen``) do not use it.

This module is also the server's program (``python warm_python.py serve <socket>``).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PRELOAD = ("torch", "numpy", "lightning", "lightning.pytorch", "torchmetrics", "torchvision", "hydra", "omegaconf")
# Environment variables that the interpreter or a preloaded library reads when it starts or is imported: a call
# whose value differs from the server's runs cold.
READ_AT_START = ("PYTHON", "OMP_", "MKL_", "KMP_", "OPENBLAS", "TORCH", "PYTORCH", "TRITON", "CUDA", "NVIDIA", "LD_")
NOT_READ_AT_START = ("PYTHONPATH", "PYTHONUNBUFFERED", "PYTHONWARNINGS")
SERVER_ENV = {"OMP_NUM_THREADS": "1"}  # what the tests' runs have on the 2-core CI machine (tests/test_run.py env)


def _read_at_start(env: dict) -> dict:
    return {k: v for k, v in env.items() if k.startswith(READ_AT_START) and k not in NOT_READ_AT_START}


# --- the test process's side ------------------------------------------------------------------------------------------
_server: tuple[subprocess.Popen, str, dict] | None = None


def _start_server() -> tuple[subprocess.Popen, str, dict]:
    global _server
    if _server is not None and _server[0].poll() is None:
        return _server
    folder = tempfile.mkdtemp(prefix="warm-python-")
    path = os.path.join(folder, "server.sock")
    env = {**os.environ, **SERVER_ENV}
    proc = subprocess.Popen([sys.executable, __file__, "serve", path], env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=open(os.path.join(folder, "server.log"), "w"))
    deadline = time.monotonic() + 300
    while not os.path.exists(path):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the warm python server did not start: {Path(folder, 'server.log').read_text()}")
        time.sleep(0.05)
    _server = (proc, path, _read_at_start(env))
    import atexit
    import shutil

    atexit.register(shutil.rmtree, folder, ignore_errors=True)  # runs after the kill: last registered, first run
    atexit.register(proc.kill)
    return _server


def eligible(argv: list[str], env: dict | None, **popen) -> bool:
    """Whether :func:`run` may start ``argv`` from the warm server (module docstring)."""
    if os.environ.get("TESTS_COLD_PROCESSES") == "1" or sys.platform != "linux" or popen:
        return False
    if len(argv) < 2 or argv[0] != sys.executable or not (argv[1] == "-c" or argv[1].endswith(".py")):
        return False
    wanted = _read_at_start(os.environ if env is None else env)
    # the running server's (this process's environment may have changed since it started), else the one to start
    alive = _server is not None and _server[0].poll() is None
    return wanted == (_server[2] if alive else _read_at_start({**os.environ, **SERVER_ENV}))


def run(argv: list[str], *, cwd=None, env: dict | None = None, stdin=None, timeout: float | None = None,
        capture_output: bool = True, text: bool = True, **popen) -> subprocess.CompletedProcess:
    """``subprocess.run(argv, cwd=, env=, stdin=, timeout=, capture_output=True, text=True)``, started warm where
    :func:`eligible` (else exactly that call)."""
    cold = dict(cwd=cwd, env=env, stdin=stdin, timeout=timeout, capture_output=capture_output, text=text, **popen)
    if not (capture_output and text and stdin in (None, subprocess.DEVNULL) and eligible(argv, env, **popen)):
        return subprocess.run(argv, **cold)
    _, path, _ = _start_server()
    with tempfile.TemporaryDirectory(prefix="warm-run-") as scratch:
        out, err = os.path.join(scratch, "stdout"), os.path.join(scratch, "stderr")
        request = {"argv": argv[1:], "cwd": os.fspath(cwd or os.getcwd()),
                   "env": dict(os.environ if env is None else env), "stdout": out, "stderr": err}
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(path)
        reader = conn.makefile("r")
        try:
            conn.sendall((json.dumps(request) + "\n").encode())
            pid = int(reader.readline())
            conn.settimeout(timeout)
            try:
                line = reader.readline()
            except (TimeoutError, socket.timeout):
                os.kill(pid, 9)
                raise subprocess.TimeoutExpired(argv, timeout, _read(out), _read(err)) from None
        finally:
            reader.close()
            conn.close()
        if not line:
            raise RuntimeError("the warm python server ended while running " + " ".join(argv))
        return subprocess.CompletedProcess(argv, int(line), _read(out), _read(err))


class WarmProcess:
    """A child of the warm server as a ``subprocess.Popen`` of it would be used: ``pid``, ``poll``, ``wait``,
    ``send_signal`` / ``terminate`` / ``kill`` (to the child itself: it has no process group of its own) and
    ``communicate``, its output to ``subprocess.DEVNULL`` or ``subprocess.PIPE`` (read when it has ended), stderr
    also to ``subprocess.STDOUT``. The server reports its exit code (a signal's ``-N``) when it ends; a thread of
    this process waits for that report."""

    def __init__(self, argv: list[str], cwd, env: dict | None, stdout, stderr):
        import threading

        _, path, _ = _start_server()
        self.args, self.returncode = argv, None
        self._scratch = tempfile.TemporaryDirectory(prefix="warm-popen-")
        piped = {"stdout": stdout == subprocess.PIPE, "stderr": stderr == subprocess.PIPE}
        self._paths = {name: os.path.join(self._scratch.name, name) if piped[name] else None for name in piped}
        out = self._paths["stdout"] or os.devnull
        err = out if stderr == subprocess.STDOUT else self._paths["stderr"] or os.devnull
        request = {"argv": argv[1:], "cwd": os.fspath(cwd or os.getcwd()),
                   "env": dict(os.environ if env is None else env), "stdout": out, "stderr": err}
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._conn.connect(path)
        self._reader = self._conn.makefile("r")
        self._conn.sendall((json.dumps(request) + "\n").encode())
        self.pid = int(self._reader.readline())
        self._ended = threading.Event()
        threading.Thread(target=self._wait_for_the_report, daemon=True).start()

    def _wait_for_the_report(self) -> None:
        try:
            line = self._reader.readline()
        except OSError:
            line = ""
        finally:
            self._reader.close()
            self._conn.close()
        self.returncode = int(line) if line else -9  # no report: the server itself is gone, and its children
        self._ended.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:  # after the report its pid may be another process's
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(15)

    def kill(self) -> None:
        self.send_signal(9)

    def communicate(self, timeout: float | None = None) -> tuple[str | None, str | None]:
        self.wait(timeout)
        return tuple(None if path is None else _read(path) for path in self._paths.values())


def popen(argv: list[str], *, cwd=None, env: dict | None = None, stdin=None, stdout=None, stderr=None,
          text: bool = False, **popen) -> subprocess.Popen | WarmProcess:
    """``subprocess.Popen(argv, cwd=, env=, stdin=, stdout=, stderr=, text=)``, started warm (a
    :class:`WarmProcess`) where :func:`eligible` and its input is nothing, its output DEVNULL or PIPE (stderr also
    STDOUT) as text; else exactly that call."""
    outputs = (subprocess.DEVNULL, subprocess.PIPE)
    if not (stdin in (None, subprocess.DEVNULL) and stdout in outputs and stderr in (*outputs, subprocess.STDOUT)
            and (text or subprocess.PIPE not in (stdout, stderr)) and eligible(argv, env, **popen)):
        return subprocess.Popen(argv, cwd=cwd, env=env, stdin=stdin, stdout=stdout, stderr=stderr, text=text,
                                **popen)
    return WarmProcess(argv, cwd, env, stdout, stderr)


def _read(path: str) -> str:
    try:
        return Path(path).read_bytes().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return ""


# --- the server ------------------------------------------------------------------------------------------------------
_OWN_PYTHONPATH = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]  # the server's own


def serve(path: str) -> None:
    import importlib
    import select

    import threading

    for name in PRELOAD:
        importlib.import_module(name)
    if threading.active_count() != 1:  # a fork copies only the forking thread: the server must have no other
        raise RuntimeError(f"threads after the imports: {threading.enumerate()}")
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)  # the client waits for this name: the server is ready
    children: dict[int, socket.socket] = {}
    while os.getppid() == parent:  # the pytest worker that started it is gone: so is the server
        ready, _, _ = select.select([listener], [], [], 0.05)
        if ready:
            conn, _ = listener.accept()
            request = json.loads(conn.makefile("r").readline())
            pid = os.fork()
            if pid == 0:
                listener.close()
                for other in children.values():
                    other.close()
                conn.close()
                _child(request)  # never returns
            conn.sendall(f"{pid}\n".encode())
            children[pid] = conn
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
                except OSError:  # the test gave up on it (a timeout)
                    pass
                conn.close()


def _child(request: dict) -> None:
    """Become ``python *request["argv"]`` and exit as it would."""
    import runpy
    import signal
    import threading
    import traceback
    import types

    code = 1
    try:
        written = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        for fd, name, mode in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], written),
                               (2, request["stderr"], written)):
            if fd == 2 and name == request["stdout"] and name != os.devnull:  # stderr=STDOUT: one file, one offset
                os.dup2(1, 2)
                continue
            opened = os.open(name, mode, 0o644)
            os.dup2(opened, fd)
            os.close(opened)
        unbuffered = bool(request["env"].get("PYTHONUNBUFFERED"))
        for stream in (sys.stdout, sys.stderr):
            stream.reconfigure(line_buffering=True, write_through=unbuffered)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        signal.signal(signal.SIGINT, signal.default_int_handler)
        argv = request["argv"]
        # sys.path as a cold start makes it: the script's folder, then PYTHONPATH's entries, then the installation's
        extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        rest = [p for p in sys.path[1:] if p not in extra and p not in _OWN_PYTHONPATH]
        if argv[0] == "-c":
            sys.path[:] = ["", *extra, *rest]
            sys.argv = ["-c", *argv[2:]]
            main = types.ModuleType("__main__")
            main.__dict__["__builtins__"] = __builtins__
            sys.modules["__main__"] = main
            exec(compile(argv[1], "<string>", "exec"), main.__dict__)
        else:
            script = os.path.abspath(argv[0])
            sys.path[:] = [os.path.dirname(script), *extra, *rest]
            sys.argv = [script, *argv[1:]]
            runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as stop:
        if stop.code is None:
            code = 0
        elif isinstance(stop.code, int):
            code = stop.code
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:  # the interpreter ends by the signal itself
        traceback.print_exc()
        code = -signal.SIGINT
    except BaseException:  # noqa: BLE001 - as the interpreter: the traceback, exit code 1
        traceback.print_exc()
        code = 1
    try:
        threading._shutdown()  # the interpreter joins non-daemon threads, then runs the atexit handlers
        import atexit

        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code & 0xFF)


if __name__ == "__main__" and sys.argv[1:2] == ["serve"]:
    serve(sys.argv[2])
