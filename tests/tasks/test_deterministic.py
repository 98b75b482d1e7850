"""tasks/deterministic.py: the deterministic formulations that replace the two ops without a deterministic CUDA
kernel under ``trainer.deterministic=true`` compute what the torch ops compute, values and gradients, against float64.

Their replacement only happens on a GPU in deterministic mode; here it is forced (``force=True``) and compared
with the torch op, which on the CPU is deterministic. That the GPU runs are then bit-for-bit repeatable is
tests/gpu/test_cuda_tasks.py's to show.
"""

import pytest
import torch
import torch.nn.functional as F

from tasks import deterministic


@pytest.mark.parametrize("shape, size", [((2, 3, 5, 7), (40, 56)), ((1, 2, 4, 4), (4, 4)), ((1, 1, 6, 3), (4, 9)),
                                         ((2, 2, 1, 5), (3, 10))])
def test_resize_bilinear_is_interpolate(shape, size):
    """Up, down, same size and a one-pixel axis: the separable matrix form equals F.interpolate's bilinear
    resampling (align_corners=False) in float64, forward and backward."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(*shape[:2], *size, generator=gen, dtype=torch.float64)
    ref = F.interpolate(x, size=size, mode="bilinear", align_corners=False)
    (ref_grad,) = torch.autograd.grad((ref * weight).sum(), x)
    out = deterministic.resize_bilinear(x, size, force=True)
    (grad,) = torch.autograd.grad((out * weight).sum(), x)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-12)


def test_resize_bilinear_keeps_the_torch_op_off_the_gpu():
    """Without a GPU in deterministic mode the torch op itself runs: bit for bit F.interpolate, float32 too."""
    x = torch.randn(2, 3, 5, 7, requires_grad=True)
    assert torch.equal(deterministic.resize_bilinear(x, (9, 11)),
                       F.interpolate(x, size=(9, 11), mode="bilinear", align_corners=False))


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("shape", [(3, 5, 11), (2, 4, 3, 6)])  # (B, parts, N), (B, K, H, W)
def test_cross_entropy_is_the_mean_over_counted_targets(shape, smoothing):
    """The per-element form with ignored targets equals F.cross_entropy's mean reduction, value and gradient."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(*shape, generator=gen, dtype=torch.float64, requires_grad=True)
    target = torch.randint(shape[1], (shape[0], *shape[2:]), generator=gen)
    target.view(-1)[::3] = 255  # ignored pixels
    ref = F.cross_entropy(logits, target, ignore_index=255, label_smoothing=smoothing)
    (ref_grad,) = torch.autograd.grad(ref, logits)
    out = deterministic.cross_entropy(logits, target, ignore_index=255, label_smoothing=smoothing, force=True)
    (grad,) = torch.autograd.grad(out, logits)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-12)
    assert torch.equal(deterministic.cross_entropy(logits, target, ignore_index=255, label_smoothing=smoothing), ref)
