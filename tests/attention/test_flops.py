"""Every SDPA kernel of the installed torch is counted by torch.utils.flop_counter, forward and backward.

The CUDA kernels cannot run here, but their meta kernels can: the flop counter sees the same op with the same
shapes on the meta device, so each kernel's count is checked against the analytic one without a GPU.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode, flop_registry

import attention
from attention.flops import sdpa_ops

B, H, N, M, D, DV = 2, 3, 5, 7, 4, 6


def _needs_lse(op) -> bool:  # the efficient and cuDNN kernels only keep what backward needs when asked to
    return any(s in op.__name__ for s in ("efficient", "cudnn"))


def _meta_qkv(d_v):
    return [torch.empty(*shape, device="meta", requires_grad=True)
            for shape in ((B, H, N, D), (B, H, M, D), (B, H, M, d_v))]


FORWARD = [op for op, backward in sdpa_ops() if not backward]
BACKWARD = [op for op, backward in sdpa_ops() if backward]


def test_the_kernels_of_this_torch_are_known_and_every_one_has_a_formula():
    names = {op.__name__ for op in FORWARD}
    assert {"_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
            "_scaled_dot_product_flash_attention"} <= names
    assert len(BACKWARD) >= 4
    assert all(op in flop_registry for op, _ in sdpa_ops())


@pytest.mark.parametrize("op", FORWARD, ids=lambda op: op.__name__)
def test_forward_kernel_counted(op):
    q, k, v = _meta_qkv(DV)
    with FlopCounterMode(display=False) as counter:
        op(q, k, v, *((None, True) if _needs_lse(op) else ()))
    assert counter.get_total_flops() == 2 * B * H * N * M * (D + DV)  # Q K^T and A V


@pytest.mark.parametrize("op", [op for op in FORWARD if any(f"{op.__name__}_backward" == b.__name__ for b in BACKWARD)],
                         ids=lambda op: op.__name__)
def test_backward_kernel_counted(op):
    backward = getattr(torch.ops.aten, f"{op.__name__}_backward").default
    if not torch._C._dispatch_has_kernel_for_dispatch_key(backward.name(), "Meta"):
        # torch 2.11's overrideable kernel (for out-of-tree privateuse1 backends) has no meta backward: nothing can
        # run it without such a backend. Its formula is still registered (the first test of this file).
        pytest.skip(f"{backward.name()} has no meta kernel in torch {torch.__version__}")
    d_v = D if "flash" in op.__name__ else DV  # the flash kernels need d == d_v
    q, k, v = _meta_qkv(d_v)
    out = op(q, k, v, *((None, True) if _needs_lse(op) else ()))[0]
    with FlopCounterMode(display=False) as counter:
        out.backward(torch.empty_like(out))
    counts = counter.get_flop_counts()["Global"]
    assert {str(key) for key in counts} == {f"aten.{op.__name__}_backward"}
    # recomputed Q K^T (d), dP and dV (d_v each), dQ and dK (d each)
    assert counter.get_total_flops() == 2 * B * H * N * M * (3 * D + 2 * d_v)


def test_self_on_cpu_counts_attention_forward_and_backward():
    """attn=self on CPU, where SDPA runs the CPU flash kernel: forward + backward equal the analytic count."""
    b, n, c, heads = 2, 12, 32, 4
    mixer = attention.build("self", dim=c, heads=heads)
    x = torch.randn(b, n, c, requires_grad=True)
    with FlopCounterMode(display=False) as counter:
        mixer(x, None).sum().backward()
    projections = 2 * b * n * c * 3 * c + 2 * b * n * c * c  # qkv and output Linear, forward
    attention_fwd = 2 * b * n * n * 2 * c  # Q K^T and A V over all heads (sum of d = C)
    attention_bwd = 2 * b * n * n * 5 * c  # recomputed Q K^T, dP, dV, dQ, dK
    assert counter.get_total_flops() == 3 * projections + attention_fwd + attention_bwd  # grad input + weight


def test_sdpa_on_cpu_dispatches_to_a_counted_kernel():
    q = k = v = torch.randn(1, 2, 16, 8)
    with FlopCounterMode(display=False) as counter:
        F.scaled_dot_product_attention(q, k, v)
    assert counter.get_total_flops() == 2 * 2 * 16 * 16 * (8 + 8)


def test_in_place_products_are_counted():
    """addmm_ and baddbmm_ count as addmm and baddbmm (torch's counter has no formula for them): offset attention's
    chunked form accumulates with them, and counted 704 of its 1,024 units at PCT's widths before. Its forward +
    backward now counts every product, by hand: forward Q K^T and A^T V; backward Q K^T again (recomputed),
    A dU, V dU^T, dS K and dS^T Q."""
    from torch.utils.flop_counter import FlopCounterMode

    from attention import functional as AF

    a, b, c = torch.randn(4, 5), torch.randn(5, 6), torch.randn(4, 6)
    with FlopCounterMode(display=False) as counter:
        c.addmm_(a, b)
        c.unsqueeze(0).baddbmm_(a.unsqueeze(0), b.unsqueeze(0))
    assert counter.get_total_flops() == 2 * (2 * 4 * 5 * 6)
    B, h, n, d, d_v = 1, 2, 64, 8, 16
    q, k = torch.randn(B, h, n, d, requires_grad=True), torch.randn(B, h, n, d, requires_grad=True)
    v = torch.randn(B, h, n, d_v, requires_grad=True)
    with FlopCounterMode(display=False) as counter:
        torch.autograd.grad(AF.OffsetChunked.apply(q, k, v, 1e-9, 16).sum(), (q, k, v))
    assert counter.get_total_flops() == 2 * B * h * n * n * (4 * d + 3 * d_v)
