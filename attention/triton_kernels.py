"""How the torch code calls the suite's Triton kernels: imported on first use, off for the process once they fail.

Four families of kernels run on CUDA, each beside a torch path that computes the same thing:
:mod:`attention.fps_triton` (farthest point sampling), :mod:`attention.knn_triton` (k nearest neighbours),
:mod:`attention.dilated_triton` (dilated attention on grids) and :mod:`attention.index_attention_triton`
(attention over indexed keys: focal and dilated on point sets). ``attention`` imports and runs without Triton:
a family's module is imported only when one of its kernels is wanted, and the CPU never wants one.

A kernel that fails to compile or launch (a GPU, a driver or a Triton release it does not work with) warns once,
turns its family off for the process (:attr:`Kernels.usable`) and returns None: the torch path then does that
call's work and every later one's. Running out of memory is not the kernel's fault: it raises. A caller that forces
the kernel (``fallback=False``: a ``backend="triton"`` the tests use) gets the failure raised.

Fake tensors (``FakeTensorMode``: the bench's estimates of FLOPs and memory) have no memory: a kernel launched on
one reads whatever address its "pointer" is (on an H200, an illegal memory access that left the CUDA context
unusable for the rest of the process). Every family runs inside a ``torch.library`` op (the attention ops,
``attention_suite::farthest_point_sample`` and ``::knn``) whose fake implementation takes fake tensors, so
``torch.compile`` traces the op that runs the kernel; FPS and kNN also ask :meth:`Kernels.wanted` with their tensors,
which sends fake ones to the torch path should one reach them another way.
"""

from __future__ import annotations

import importlib
import warnings

import torch

def pow2(n: int) -> int:
    """The least power of two >= n (1 for n <= 1): ``triton.next_power_of_2`` on the host. Triton's is a
    ``ConstexprFunction`` (callable inside kernels too) that costs about 1.5 us a call on the host, against 0.1 us
    here; the wrappers call it several times a launch, and on a GPU a step of small kernels is bound by its host."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for a >= 0, b > 0: ``triton.cdiv`` on the host, without its ``ConstexprFunction`` call
    (:func:`pow2`)."""
    return -(-a // b)


# What an op's backend may be: "auto" (the kernels where they work), "torch" or "triton" (forced: the tests).
BACKENDS = ("auto", "torch", "triton")
# Whether Triton imports and finds a GPU driver: None until :func:`available` first looks.
AVAILABLE: bool | None = None


def available() -> bool:
    """Whether Triton imports and finds a GPU driver (looked up once)."""
    global AVAILABLE
    if AVAILABLE is None:
        try:
            import triton

            triton.runtime.driver.active.get_current_target()
            AVAILABLE = True
        except Exception:  # not installed, no driver, no GPU: the torch paths do the work
            AVAILABLE = False
    return AVAILABLE


def real(tensors) -> bool:
    """Whether the tensors have memory a kernel can read: none of them is a fake tensor."""
    from torch._subclasses.fake_tensor import is_fake

    return not any(is_fake(t) for t in tensors)


class Kernels:
    """One family of Triton kernels: ``call(name, ...)`` runs ``<module>.<name>(...)``.

    module: the family's module (imported on the first call); op: the operation, as the warning names it;
    instead: what takes over after a failure, as the warning names it.
    """

    def __init__(self, module: str, op: str, instead: str):
        self.module, self.op, self.instead = module, op, instead
        self.usable = True  # False once a kernel of the family failed in this process

    def wanted(self, tensors=()) -> bool:
        """Whether "auto" may take the family's kernels for ``tensors``: Triton works here, none of the kernels
        failed yet and the tensors are real (:func:`real`)."""
        return self.usable and available() and real(tensors)

    def pick(self, backend: str, tensors, dtypes) -> str:
        """"triton" or "torch" for an op's ``backend`` ("auto", "torch" or "triton"): "auto" takes the kernels for
        CUDA tensors of ``dtypes`` where they are wanted, the torch path otherwise. Fake tensors may take "triton":
        for the library ops that call these kernels, their fake implementations run instead."""
        if backend not in BACKENDS:
            raise ValueError(f"{self.op}: backend={backend!r}, expected one of {BACKENDS}.")
        if backend != "auto":
            return backend
        if all(t.is_cuda and t.dtype in dtypes for t in tensors) and self.wanted():
            return "triton"
        return "torch"

    def call(self, name: str, *args, fallback: bool = True, **kwargs):
        """``<module>.<name>(*args, **kwargs)``; with ``fallback``, a failure (but out of memory) warns, turns the
        family off and returns None, without, it raises."""
        try:
            return getattr(importlib.import_module(self.module), name)(*args, **kwargs)
        except Exception as error:
            if not fallback or isinstance(error, torch.cuda.OutOfMemoryError):
                raise
            warnings.warn(f"{self.op}: the Triton kernel failed ({error!r}); {self.instead} takes over.",
                          stacklevel=3)
            self.usable = False
            return None
