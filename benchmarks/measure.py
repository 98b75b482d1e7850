"""Shared measurement code: device-synchronised timing, peak memory, FLOP and byte counts, scaling fits,
the machine's own limits and a description of the machine.

Peak memory is the most memory allocated at once during one step beyond what was allocated before it
(parameters, inputs, upstream gradient). On CUDA that is ``torch.cuda.max_memory_allocated``. On CPU it is
read from ``torch.profiler`` (``profile_memory=True``): every allocation and free of the CPU allocator is an
event with its byte count; their running sum, in time order, peaks at the reported value.

:class:`OpCounter` counts what a step's aten ops move (the bytes of every input and output of every non-view
op: the traffic of a machine that keeps nothing in cache between ops) and the peak of the bytes held by op
outputs still alive. Run under :class:`~torch._subclasses.fake_tensor.FakeTensorMode`, it estimates a step's
memory and FLOPs without allocating or computing anything.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import tempfile
import time
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

MiB = 2 ** 20
GiB = 2 ** 30


# --------------------------------------------------------------------------------------------
# Time
# --------------------------------------------------------------------------------------------

def sync(device) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def publish(text: str, out, default, quick: bool) -> None:
    """A benchmark's markdown table: printed by a ``--quick`` run given no ``--out``, else written to ``out`` (or
    ``default``)."""
    if quick and out is None:
        print(text)
        return
    out = out or default
    out.write_text(text)
    print(f"written to {out}")


def step_times(step, device, warmup: int, repeats: int, min_seconds: float = 0.0,
               max_repeats: int = 200) -> list[float]:
    """Seconds of each timed call of ``step`` after ``warmup`` untimed ones, device-synchronised: ``repeats``
    calls, and more while they add up to less than ``min_seconds`` (at most ``max_repeats``), so that the
    median of a fast step is not one scheduler hiccup."""
    for _ in range(warmup):
        step()
    times = []
    while len(times) < repeats or (sum(times) < min_seconds and len(times) < max_repeats):
        sync(device)
        start = time.perf_counter()
        step()
        sync(device)
        times.append(time.perf_counter() - start)
    return times


def median_ms(step, device, warmup: int, repeats: int) -> float:
    """Median wall time of ``step`` in milliseconds over ``repeats`` runs after ``warmup`` ones."""
    return 1e3 * statistics.median(step_times(step, device, warmup, repeats))


# --------------------------------------------------------------------------------------------
# Peak memory
# --------------------------------------------------------------------------------------------

def host_profile(step, device, rows: int = 20) -> str:
    """One call of ``step`` (after warm-up) under torch.profiler: "<n> aten ops, host <ms>, GPU <ms>" (host: every
    op's self CPU time, the profiler's overhead included, so compare steps, not the absolute numbers; GPU: the
    kernels' own time, as the profiler's table totals it, an op's self device time repeating its kernels'), then
    its ops by self CPU time. Where a step is bound by its launches, this names the ops to fuse or drop."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.device(device).type == "cuda" else [])
    sync(device)
    with profile(activities=activities) as prof:
        step()
        sync(device)
    events = prof.key_averages()
    aten = sum(e.count for e in events if e.key.startswith("aten::"))
    host_us = sum(e.self_cpu_time_total for e in events)
    gpu_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    return (f"{aten} aten ops, host {host_us / 1e3:.1f} ms, GPU {gpu_us / 1e3:.1f} ms\n"
            + events.table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=60))


def profiler_peak_bytes(step) -> int:
    """Peak of the running sum of the CPU allocator's allocation (+) and free (-) events during ``step``."""
    from torch.profiler import ProfilerActivity, profile

    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # read when the profiler first starts: no per-run log lines
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    mem = sorted(((e["ts"], e["args"]["Bytes"]) for e in events
                  if e.get("name") == "[memory]" and e["args"].get("Device Type", 0) == 0),
                 key=lambda event: event[0])  # stable: events within one microsecond keep their recorded order
    total = peak = 0
    for _, nbytes in mem:
        total += nbytes
        peak = max(peak, total)
    return peak


def cuda_peak_bytes(step) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def peak_bytes(step, device) -> int:
    """The most memory allocated at once during ``step`` beyond what was allocated before it."""
    return cuda_peak_bytes(step) if str(device).startswith("cuda") else profiler_peak_bytes(step)


PEAK_METHOD = {
    "cuda": "`torch.cuda.max_memory_allocated` during one forward + backward, minus the memory allocated before it",
    "cpu": ("the peak of the running sum of the CPU allocator's allocation/free events recorded by `torch.profiler` "
            "(`profile_memory=True`) during one forward + backward, i.e. the most memory allocated at once beyond "
            "the parameters, the input and the upstream gradient"),
}


def available_bytes(device) -> int:
    """Memory a run may use: free device memory on CUDA, MemAvailable (or the total) on CPU."""
    if str(device).startswith("cuda"):
        free, _ = torch.cuda.mem_get_info()
        return free
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


# --------------------------------------------------------------------------------------------
# What ops compute and move
# --------------------------------------------------------------------------------------------

def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class OpCounter(TorchDispatchMode):
    """Bytes moved by aten ops and the peak of the bytes held by live op outputs.

    ``bytes_moved``: the sum over every op that is not a view (nor returns an input's storage without writing
    it) of the bytes of its tensor inputs and outputs, i.e. what a machine moves that reads each op's inputs
    from memory and writes its outputs back (no reuse of caches between ops; an op's internal traffic, e.g. a
    matmul's re-reads, is not counted).
    ``peak``: the most bytes at once in storages created by ops during the mode and still referenced (by
    Python, by autograd's saved tensors); storages that existed before the mode (parameters, inputs) are
    not counted. Works on real and on fake tensors.
    """

    def __init__(self):
        super().__init__()
        self.bytes_moved = 0
        self.kernels = 0  # the ops counted in bytes_moved: about the kernels a GPU would launch
        self.live = 0
        self.peak = 0
        self._seen = WeakIdKeyDictionary()

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if outs and not func.is_view:
            # an op returning one of its inputs' storages moves nothing unless it writes it (in-place, out=)
            storages = {id(t.untyped_storage()) for t in ins}
            if func._schema.is_mutable or not any(id(t.untyped_storage()) in storages for t in outs):
                self.bytes_moved += sum(_nbytes(t) for t in ins + outs)
                self.kernels += 1
        for t in outs:
            storage = t.untyped_storage()
            if storage in self._seen:
                continue
            nbytes = storage.nbytes()
            self._seen[storage] = nbytes
            self.live += nbytes
            weakref.finalize(storage, self._free, nbytes)
        self.peak = max(self.peak, self.live)
        return out


def fit_exponent(ns, values) -> float:
    """Least-squares slope of log(value) against log(n): value ~ a * n^slope. NaN for fewer than two points."""
    pts = [(math.log(n), math.log(v)) for n, v in zip(ns, values) if v is not None and v > 0 and n > 0]
    if len({x for x, _ in pts}) < 2:
        return float("nan")
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)


# --------------------------------------------------------------------------------------------
# The machine's own limits
# --------------------------------------------------------------------------------------------

def matmul_flops_per_s(device, dtype=torch.float32, n: int = 4096, repeats: int = 5) -> float:
    """Peak FLOP/s of a square n x n matrix product in ``dtype`` (2 n^3 FLOPs), the best of ``repeats``."""
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(n, n, generator=gen).to(device=device, dtype=dtype) for _ in range(2))
    out = torch.empty(n, n, device=device, dtype=dtype)
    best = min(step_times(lambda: torch.mm(a, b, out=out), device, warmup=1, repeats=repeats))
    return 2 * n ** 3 / best


def copy_bytes_per_s(device, nbytes: int = 512 * MiB, repeats: int = 5) -> float:
    """Peak memory bandwidth of a large copy (bytes read + bytes written per second), the best of ``repeats``."""
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    best = min(step_times(lambda: dst.copy_(src), device, warmup=1, repeats=repeats))
    return 2 * nbytes / best


# --------------------------------------------------------------------------------------------
# The machine
# --------------------------------------------------------------------------------------------

def cpu_name() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


LOCK = Path(__file__).resolve().parents[1] / "requirements" / "lock.txt"


def locked_versions(lock: Path = LOCK) -> dict:
    """{canonical name: Version} of every pin in the lock file (`make install` installs exactly these)."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
    from packaging.version import Version

    pins = {}
    for line in lock.read_text().splitlines():
        line = line.split("#", 1)[0].strip()  # comments and pip-compile's `# via` lines
        if not line:
            continue
        req = Requirement(line)
        specs = list(req.specifier)
        if len(specs) != 1 or specs[0].operator != "==":
            raise ValueError(f"{lock}: {line!r} is not one exact pin (name==version); regenerate it with `make lock`")
        pins[canonicalize_name(req.name)] = Version(specs[0].version)
    return pins


def lock_mismatches(lock: Path = LOCK) -> list[str]:
    """Every locked package whose installed version differs from the lock's (a local build 2.14.1+cpu
    differs from 2.14.1), as 'name: installed X, lock Y'; empty in the environment `make install` builds."""
    from importlib import metadata

    from packaging.version import Version

    wrong = []
    for name, version in sorted(locked_versions(lock).items()):
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            installed = None
        if installed is None or Version(installed) != version:
            wrong.append(f"{name}: installed {installed or 'nothing'}, lock {version}")
    return wrong


def environment_line() -> str:
    """The library versions a table was measured with, and whether they are the lock's."""
    import lightning
    import numpy
    import torchvision

    libs = (f"python {platform.python_version()}, torch {torch.__version__}, torchvision {torchvision.__version__}, "
            f"numpy {numpy.__version__}, lightning {lightning.__version__}")
    wrong = lock_mismatches()
    where = (f"`{LOCK.parent.name}/{LOCK.name}` exactly" if not wrong else
             f"NOT `{LOCK.parent.name}/{LOCK.name}` ({len(wrong)} package(s) differ: {'; '.join(wrong[:3])})")
    return f"{libs}; environment: {where}"


def machine_info(device) -> dict:
    """CPU, cores, torch threads, GPU, library versions and the date, for a benchmark's header."""
    import numpy

    info = {"cpu": cpu_name(), "cores": cpu_count(), "threads": torch.get_num_threads(),
            "device": str(device), "gpu": torch.cuda.get_device_name() if str(device).startswith("cuda") else None,
            "python": platform.python_version(), "torch": torch.__version__, "numpy": numpy.__version__,
            "cuda": torch.version.cuda if str(device).startswith("cuda") else None,
            "os": f"{platform.system()} {platform.release()}",
            "date": time.strftime("%Y-%m-%d %H:%M")}
    try:
        import lightning

        info["lightning"] = lightning.__version__
    except ImportError:  # pragma: no cover - lightning is a dependency
        pass
    info["environment"] = environment_line()
    return info
