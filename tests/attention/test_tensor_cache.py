"""attention.tensor_cache: the cached index plans and tables are real tensors for real calls and fake ones under a
FakeTensorMode, whichever came first (the bench's FLOP estimate runs each mixer on fake tensors before timing it:
a plain lru_cache handed focal attention's fake window plan to the timed run, which failed)."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from attention.pointops import _kernel_order
from attention.tensor_cache import tensor_cache
from attention.variants.focal import grid_plan
from tasks.nets.backbones.eamlp import sinusoid_table


def test_fake_and_real_calls_never_share_a_cached_tensor():
    calls = []

    @tensor_cache(maxsize=4)
    def plan(n: int) -> torch.Tensor:
        calls.append(n)
        return torch.arange(n) * 2

    with FakeTensorMode():
        fake = plan(5)
    real = plan(5)
    assert isinstance(fake, FakeTensor) and not isinstance(real, FakeTensor)
    assert torch.equal(real, torch.arange(5) * 2)
    assert plan(5) is real and calls == [5, 5]  # real calls are cached; the fake one was not kept
    with FakeTensorMode():
        assert isinstance(plan(5), FakeTensor)  # a cached real tensor is not handed to a fake call
    assert plan.cache_info().currsize == 1


def test_the_suites_cached_plans_under_a_fake_mode_first():
    """Focal attention's window plan, pointnet2_ops' tie order and EAMLP's position table: first made under a fake
    mode, then for real, each call gets its own kind of tensor."""
    for cached, args in [(grid_plan, (9, 10, 4, 2, 3, 3, torch.device("cpu"), "mask")),
                         (_kernel_order, (100, torch.device("cpu"))), (sinusoid_table, (7, 6))]:
        cached.cache_clear()
        with FakeTensorMode():
            fake = cached(*args)
        real = cached(*args)
        fake, real = (t if isinstance(t, tuple) else (t,) for t in (fake, real))
        for f, r in zip(fake, real, strict=True):
            assert isinstance(f, FakeTensor) and not isinstance(r, FakeTensor), cached.__name__
            assert (f.shape, f.dtype) == (r.shape, r.dtype), cached.__name__


def test_a_plan_first_made_under_inference_mode_is_a_normal_tensor_that_training_can_save():
    """Lightning's test and validate run under torch.inference_mode: a plan cached there was an inference tensor,
    and every later training step of the process that saved it for backward failed (attn=focal on a grid, in a fit
    after a validate, as the test suite's own in-process runs do)."""
    @tensor_cache(maxsize=4)
    def plan(n: int) -> torch.Tensor:
        return torch.arange(n)

    with torch.inference_mode():
        made = plan(3)
        assert plan(3) is made and not made.is_inference()
    weights = torch.ones(3, requires_grad=True)
    (weights * plan(3)).sum().backward()  # saves the cached tensor for backward
    assert torch.equal(weights.grad, torch.arange(3.0))


def test_every_variant_trains_after_an_evaluation_under_inference_mode():
    import attention
    from attention import Grid, Points

    torch.manual_seed(0)
    for name in attention.names():
        for make in (lambda: Grid(8, 8), lambda: Points(torch.randn(2, 64, 3))):
            mixer, x = attention.build(name, 32), torch.randn(2, 64, 32)
            with torch.inference_mode():
                mixer(x, make())
            mixer(x.requires_grad_(), make()).sum().backward()
            assert x.grad is not None and torch.isfinite(x.grad).all(), name
