"""``tensor_cache``: ``functools.lru_cache`` for pure functions of Python values that return tensors (index plans,
permutations, position tables), which is safe under torch's fake tensors.

A plain ``lru_cache`` keeps whatever the first call made. Made under a ``FakeTensorMode`` (the bench's FLOP and
memory estimate, ``torch.compile``'s tracing, ``torch.library.opcheck``), that is a fake tensor, which every later
real call then got (and a cached real tensor broke the fake call: "Please convert all Tensors to FakeTensors
first"). Here a call under a fake mode computes its own and leaves the cache alone; under ``torch.compile`` dynamo
traces the function itself, as it did through ``lru_cache``.

A call under ``torch.inference_mode`` (Lightning's ``trainer.test`` and ``trainer.validate``; a fit's validation
runs under ``no_grad``) makes its tensors outside it: an inference tensor in the cache broke every later training
step of the process that saved it for backward ("Inference tensors cannot be saved for backward"; ``attn=focal`` on a
grid), wherever an evaluation made a plan before training first needed it: a ``validate`` before a ``fit``, or a
multirun job training at a size that only an earlier job's test had used (segmentation tests whole images). Normal
tensors serve inference mode as they are.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch


def under_fake_mode() -> bool:
    """Whether a ``FakeTensorMode`` is active (tensors made now would be fake)."""
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None


def tensor_cache(maxsize: int | None = 64) -> Callable:
    """Decorator: ``functools.lru_cache(maxsize)`` of the function, bypassed under a fake mode or torch.compile."""

    def wrap(fn: Callable) -> Callable:
        cached = functools.lru_cache(maxsize=maxsize)(fn)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            if torch.compiler.is_compiling() or under_fake_mode():
                return fn(*args, **kwargs)
            if torch.is_inference_mode_enabled():
                with torch.inference_mode(False):  # normal tensors in the cache (module docstring)
                    return cached(*args, **kwargs)
            return cached(*args, **kwargs)

        call.cache_clear, call.cache_info = cached.cache_clear, cached.cache_info
        return call

    return wrap
