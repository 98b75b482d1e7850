"""Eager calls of this package's ``torch.library`` ops without the ops' dispatch.

The ops (dilated attention, attention over indexed keys, FPS, kNN, PCT's neighbourhoods) are ``torch.library`` ops
so that torch.compile, fake tensors and the FLOP counter see one leaf with a fake kernel and a FLOP formula. An
eager call pays the dispatch for nothing: torch.library's autograd wrapper (which fills defaults and redispatches
twice) cost 110-140 us a forward + backward on the CPU, 3x what a plain ``torch.autograd.Function`` costs, and a
call without autograd 20-40 us more than its kernel. On a GPU a step of small kernels is bound by the host, and
PCT's step makes six such calls, dilated attention one per step of each layer. So eager calls run the op's own
kernel (and autograd, as a Function: ``attention.functional._eager_function``) directly.
"""

from __future__ import annotations

import contextlib

import torch


def skips_dispatch(*tensors: torch.Tensor) -> bool:
    """Whether a call of one of the package's ops on ``tensors`` may run the op's kernel (and autograd) directly:
    eager code (not traced by torch.compile; no dispatch or function mode, such as a ``FakeTensorMode``, the FLOP
    counter or a ``torch.device`` context; no functorch transform) on plain tensors. Anything else sees the op."""
    return not (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack()
                or torch._C._len_torch_function_stack() or torch._C._are_functorch_transforms_active()
                or any(type(t) is not torch.Tensor or t.is_meta for t in tensors))


def below_autograd():
    """Where an op's kernel runs in :func:`skips_dispatch`'s calls: below autograd and its view and in-place
    tracking, as it runs inside its ``torch.library`` op. The kernels read their inputs and write only tensors they
    made, so nothing there needs version counters; the torch kernels' in-place ops on views took 15% of dilated
    attention's torch kernel with them (CPU, 4 heads at 4 rates on 8 x 8)."""
    return torch._C._AutoDispatchBelowADInplaceOrView()


def autocast_off(device_type: str):
    """``torch.autocast(device_type, enabled=False)`` where autocast is on for that device, else a null context: the
    written-out functions run in their forward's dtype also when called (or their backward run) inside the caller's
    autocast block, and entering an autocast context costs a few microseconds of host time that a GPU step of small
    kernels would pay for nothing when autocast is off. "meta" and other devices without autocast get the null
    context."""
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()
