"""``dilated``: the kernel against brute force and DilateFormer's unfold form, the module's structure.

The brute-force references below gather each query's window by explicit index
arithmetic (grids) or by sorted float64 distances (point sets) and do the
softmax by hand, independently of ``attention.functional``.
"""

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

import attention
from attention import Grid, Points, UserError
from attention import functional as AF
from benchmarks.dilated import DilateAttention, unfold_dilated_attention


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def randn(gen, *shape, dtype=torch.float64):
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)


# --------------------------------------------------------------------------------------------
# Brute-force references
# --------------------------------------------------------------------------------------------

def ref_grid(q, k, v, h, w, kernel_size, dilation, border, scale=None):
    """For each query (i, j): the keys at (i + p*r, j + q*r) by index arithmetic, softmax by hand."""
    q, k, v = q.double(), k.double(), v.double()
    B, H, N, d = q.shape
    scale = d ** -0.5 if scale is None else scale
    half = kernel_size // 2
    out = torch.zeros(B, H, N, v.shape[-1], dtype=torch.float64)
    for i in range(h):
        for j in range(w):
            logits, values = [], []
            for p in range(-half, half + 1):
                for s in range(-half, half + 1):
                    y, x = i + p * dilation, j + s * dilation
                    if 0 <= y < h and 0 <= x < w:
                        key, value = k[:, :, y * w + x], v[:, :, y * w + x]
                    elif border == "zeros":  # zero padding: a zero key and value
                        key, value = torch.zeros_like(k[:, :, 0]), torch.zeros_like(v[:, :, 0])
                    else:  # mask: not in the softmax
                        continue
                    logits.append((q[:, :, i * w + j] * key).sum(-1) * scale)  # (B, H)
                    values.append(value)
            logits = torch.stack(logits, dim=-1)  # (B, H, keys)
            e = torch.exp(logits - logits.max(dim=-1, keepdim=True).values)
            a = e / e.sum(dim=-1, keepdim=True)
            out[:, :, i * w + j] = sum(a[..., n, None] * values[n] for n in range(len(values)))
    return out


def ref_neighbours(xyz, count, rate):
    """(B, N, K') indices: every ``rate``-th of each point's ``count * rate`` nearest (float64 sort)."""
    xyz = xyz.double()
    dist = ((xyz[:, :, None] - xyz[:, None]) ** 2).sum(-1)  # (B, N, N)
    order = dist.argsort(dim=-1)
    return order[:, :, :count * rate][:, :, ::rate]


def ref_points(q, k, v, idx):
    """q (B, H, N, d), k/v (B, H, N, d), idx (B, N, K): softmax over each point's own neighbours."""
    B, H, N, d = q.shape
    out = torch.zeros(B, H, N, v.shape[-1], dtype=torch.float64)
    for b in range(B):
        for n in range(N):
            nb = idx[b, n]
            logits = (q[b, :, n, None].double() * k[b][:, nb].double()).sum(-1) * d ** -0.5  # (H, K)
            a = torch.exp(logits - logits.max(-1, keepdim=True).values)
            a = a / a.sum(-1, keepdim=True)
            out[b, :, n] = (a[..., None] * v[b][:, nb].double()).sum(1)
    return out


# --------------------------------------------------------------------------------------------
# The kernel
# --------------------------------------------------------------------------------------------

GRIDS = [(5, 9), (2, 3), (4, 4), (1, 7), (6, 1)]


@pytest.fixture(params=["gathered", "offsets"])
def torch_path(request, monkeypatch):
    """Both forms of the torch kernel: every query's k*k keys gathered at once (small inputs), and the loops over
    the window offsets in cache-sized chunks (``AF.DILATED_GATHER_ELEMENTS`` picks by size)."""
    monkeypatch.setattr(AF, "DILATED_GATHER_ELEMENTS", 1 << 62 if request.param == "gathered" else 0)
    return request.param


@pytest.mark.parametrize("border", ["zeros", "mask"])
@pytest.mark.parametrize("dilation", [1, 2, 3])
@pytest.mark.parametrize("grid", GRIDS, ids=[f"{h}x{w}" for h, w in GRIDS])
def test_kernel_matches_brute_force(grid, dilation, border, torch_path):
    h, w = grid
    gen = torch.Generator().manual_seed(100 * h + 10 * w + dilation + 1000 * (border == "mask"))
    q, k, v = (randn(gen, 2, 3, h * w, 5) for _ in range(3))
    expected = ref_grid(q, k, v, h, w, 3, dilation, border)
    assert rel_err(AF.dilated_attention(q, k, v, grid, 3, dilation, border), expected) < 1e-12
    out32 = AF.dilated_attention(q.float(), k.float(), v.float(), grid, 3, dilation, border)
    assert out32.dtype == torch.float32
    assert rel_err(out32, expected) < 1e-5


@pytest.mark.parametrize("border", ["zeros", "mask"])
@pytest.mark.parametrize("kernel_size,dilation", [(1, 1), (5, 1), (5, 2), (7, 1)])
def test_kernel_sizes_and_value_width(kernel_size, dilation, border, torch_path):
    gen = torch.Generator().manual_seed(kernel_size * 10 + dilation)
    h, w = 4, 7
    q, k = randn(gen, 1, 2, h * w, 4), randn(gen, 1, 2, h * w, 4)
    v = randn(gen, 1, 2, h * w, 6)  # d_v != d
    out = AF.dilated_attention(q, k, v, (h, w), kernel_size, dilation, border, scale=0.7)
    assert out.shape == (1, 2, h * w, 6)
    assert rel_err(out, ref_grid(q, k, v, h, w, kernel_size, dilation, border, scale=0.7)) < 1e-12


def test_kernel_window_larger_than_grid(torch_path):
    """2x3 grid, dilation 3: every key but the centre lies outside."""
    gen = torch.Generator().manual_seed(11)
    q, k, v = (randn(gen, 2, 2, 6, 4) for _ in range(3))
    assert torch.allclose(AF.dilated_attention(q, k, v, (2, 3), 3, 3, "mask"), v, atol=1e-15)
    # zeros: the centre against eight zero keys (logit 0, value 0)
    logit = (q * k).sum(-1, keepdim=True) * 4 ** -0.5
    weight = torch.exp(logit) / (torch.exp(logit) + 8)
    assert torch.allclose(AF.dilated_attention(q, k, v, (2, 3), 3, 3, "zeros"), weight * v, atol=1e-14)


def test_kernel_non_contiguous_inputs(torch_path):
    """q, k, v as the module hands them over: strided views of one qkv tensor."""
    gen = torch.Generator().manual_seed(12)
    h, w, H, d = 3, 5, 2, 4
    qkv = randn(gen, 2, h * w, 3 * H * d)
    q, k, v = qkv.view(2, h * w, 3, H, d).permute(2, 0, 3, 1, 4)  # each (B, H, N, d), not contiguous
    assert not q.is_contiguous()
    out = AF.dilated_attention(q, k, v, (h, w), 3, 2)
    assert rel_err(out, ref_grid(q, k, v, h, w, 3, 2, "zeros")) < 1e-12


@pytest.mark.parametrize("border", ["zeros", "mask"])
@pytest.mark.parametrize("dilation", [1, 2])
def test_kernel_gradcheck(dilation, border, torch_path):
    gen = torch.Generator().manual_seed(13)
    q, k = (randn(gen, 1, 2, 12, 3).requires_grad_() for _ in range(2))
    v = randn(gen, 1, 2, 12, 2).requires_grad_()  # d_v != d
    assert torch.autograd.gradcheck(lambda q, k, v: AF.dilated_attention(q, k, v, (3, 4), 3, dilation, border),
                                    (q, k, v))


def test_kernel_gradients_match_autograd_of_brute_force(torch_path):
    """The custom backward against autograd through the independent loop reference, mask border."""
    gen = torch.Generator().manual_seed(14)
    q, k, v = (randn(gen, 2, 2, 15, 4).requires_grad_() for _ in range(3))
    g = randn(gen, 2, 2, 15, 4)
    ours = torch.autograd.grad(AF.dilated_attention(q, k, v, (3, 5), 3, 2, "mask"), (q, k, v), g)
    ref = torch.autograd.grad(ref_grid(q, k, v, 3, 5, 3, 2, "mask"), (q, k, v), g)
    for a, b in zip(ours, ref):
        assert rel_err(a, b) < 1e-12


def test_kernel_create_graph_gives_gradients_and_second_derivatives():
    """create_graph=True (a gradient penalty's first pass) gives the same gradients, now with a graph: the plain
    ops recomputed, whose second derivatives match finite differences in float64, for both borders, one rate and
    a rate per head group (one larger than the grid), and q = k one tensor (counted once)."""
    gen = torch.Generator().manual_seed(25)
    q, k, v = (randn(gen, 1, 2, 12, 3).requires_grad_() for _ in range(3))
    g = randn(gen, 1, 2, 12, 3)
    plain = torch.autograd.grad(AF.dilated_attention(q, k, v, (3, 4), 3, 1), (q, k, v), g)
    graph = torch.autograd.grad(AF.dilated_attention(q, k, v, (3, 4), 3, 1), (q, k, v), g, create_graph=True)
    for a, b in zip(graph, plain):
        assert rel_err(a, b) < 1e-12 and a.requires_grad
    for border in ("zeros", "mask"):
        for dilation in (1, [1, 5]):
            attend = lambda *t: AF.dilated_attention(*t, (3, 4), 3, dilation, border)  # noqa: E731
            plain = torch.autograd.grad(attend(q, k, v), (q, k, v), g)  # the kernel's backward
            graph = torch.autograd.grad(attend(q, k, v), (q, k, v), g, create_graph=True)  # the plain form's
            assert all(rel_err(a, b) < 1e-12 for a, b in zip(graph, plain)), (border, dilation)
            assert torch.autograd.gradgradcheck(attend, (q, k, v)), (border, dilation)
    qk = q.detach().clone().requires_grad_()
    attend = lambda t, u: AF.dilated_attention(t, t, u, (3, 4), 3, 2, "mask")  # noqa: E731
    plain = torch.autograd.grad((attend(qk, v) * g).sum(), (qk, v))
    graph = torch.autograd.grad((attend(qk, v) * g).sum(), (qk, v), create_graph=True)
    assert all(rel_err(a, b) < 1e-12 for a, b in zip(graph, plain))
    assert torch.autograd.gradgradcheck(attend, (qk, v))


def test_kernel_op_registration():
    """The torch.library op's schema, fake (meta) kernel and autograd registration are consistent."""
    gen = torch.Generator().manual_seed(15)
    q, k, v = (randn(gen, 1, 2, 6, 3) for _ in range(3))
    torch.library.opcheck(torch.ops.attention_suite.dilated_attention.default, (q, k, v, 2, 3, 3, [1], True, 0.5),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


def test_backward_op_fake_kernel_matches_on_strided_inputs():
    """The backward op's fake kernel gives the real kernel's (contiguous) strides when q, k and v are views of a
    fused qkv projection, as the mixer makes them: a compiled backward on CUDA checks them (inductor's
    assert_size_stride failed there, 2026-11-26, before the fake kernel stopped copying q's strides)."""
    gen = torch.Generator().manual_seed(16)
    qkv = randn(gen, 1, 30, 3, 2, 4)  # (B, N, q/k/v, heads, d): one projection
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (B, heads, N, d), not contiguous
    assert not q.is_contiguous()
    out, attn = torch.ops.attention_suite.dilated_attention(q, k, v, 5, 6, 3, [1], True, 0.5)
    torch.library.opcheck(torch.ops.attention_suite.dilated_attention_backward.default,
                          (randn(gen, *out.shape), q, k, v, attn, 5, 6, 3, [1], 0.5),
                          test_utils=("test_schema", "test_faketensor"))


def test_kernel_under_torch_compile():
    """The op is one node of a compiled graph (fake kernels, autograd registration): torch.compile (aot_eager,
    fullgraph) gives eager's output and gradients."""
    gen = torch.Generator().manual_seed(23)
    q, k, v = (randn(gen, 2, 3, 20, 4).requires_grad_() for _ in range(3))
    g = randn(gen, 2, 3, 20, 4)

    def f(q, k, v):
        return AF.dilated_attention(q, k, v, (4, 5), 3, 2, "mask")

    eager = f(q, k, v)
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v)
    assert rel_err(compiled, eager) < 1e-12
    for a, b in zip(torch.autograd.grad(compiled, (q, k, v), g), torch.autograd.grad(eager, (q, k, v), g)):
        assert rel_err(a, b) < 1e-12


@pytest.mark.parametrize("border", ["zeros", "mask"])
def test_kernel_allocates_its_outputs_and_one_chunk(border, monkeypatch):
    """Issue 20: the kernel holds no temporary as large as q.

    The peak of the CPU allocator's events over one forward + backward (torch.profiler; exact byte counts of
    every allocation and free, the same on any machine) is at most what must exist -- the output, the attention
    map saved for the backward, dq, dk, dv -- plus one chunk's buffers. Chunks of one (sample, head) here, so a
    full-size temporary (a product q * k over all samples, the whole attention map's gradient, a copy of a
    strided q, k, v or upstream gradient) exceeds the bound: the kernel before issue 20 went 3.4x over it.
    """
    from benchmarks.measure import profiler_peak_bytes

    monkeypatch.setattr(AF, "DILATED_CHUNK_BYTES", 1)  # one (sample, head) pair per chunk
    monkeypatch.setattr(AF, "DILATED_GATHER_ELEMENTS", 0)  # the loops over the offsets (small inputs gather)
    gen = torch.Generator().manual_seed(24)
    B, H, h, w, d, d_v, ks = 2, 3, 12, 10, 8, 6, 3
    n = h * w
    qk = randn(gen, B, n, 2, H, d, dtype=torch.float32)
    q, k = (t.requires_grad_() for t in qk.permute(2, 0, 3, 1, 4))  # (B, H, N, d) each, strided as the module's
    v = randn(gen, B, n, H, d_v, dtype=torch.float32).transpose(1, 2).requires_grad_()  # (B, H, N, d_v), strided
    g = randn(gen, B, H, 1, d_v, dtype=torch.float32).expand(B, H, n, d_v)  # a stride-0 upstream gradient
    assert q.is_leaf and not (q.is_contiguous() or v.is_contiguous() or g.is_contiguous())

    def step():
        torch.autograd.grad(AF.dilated_attention(q, k, v, (h, w), ks, 2, border), (q, k, v), g)

    step()  # the measured step allocates exactly what any later one does
    peak = profiler_peak_bytes(step)
    floor = 4 * B * H * n * (d_v + ks * ks + d + d + d_v)  # float32: out, attention map, dq, dk, dv
    chunk = 4 * n * (max(d, d_v) + ks * ks + 1)  # one (sample, head): products, attention map gradient, row sums
    assert floor <= peak <= floor + chunk, (peak - floor, chunk)


FIRST_CALL = """
import sys
import torch
from attention import functional as AF
q, k, v = (torch.randn(1, 2, 20, 4, requires_grad=True) for _ in range(3))
before = set(sys.modules)
AF.dilated_attention(q, k, v, (4, 5), 3, 2).sum().backward()
print(sorted(set(sys.modules) - before))
"""


def test_kernel_first_call_imports_nothing():
    """A process's first dilated attention imports no module. Issue 20: as a torch.library.custom_op, whose kernel
    runs under torch._dynamo.disable, its first call imported torch._dynamo and sympy (~70 MiB of resident memory,
    most of what the issue measured for one forward + backward in a fresh process)."""
    done = subprocess.run([sys.executable, "-c", FIRST_CALL], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize("grid,dilation", [((6, 6), 1), ((5, 8), 2), ((7, 4), 3), ((2, 3), 3)])
def test_kernel_matches_dilateformer_unfold(grid, dilation, torch_path):
    """DilateFormer's nn.Unfold implementation IS the zero-padding semantics: outputs and gradients agree."""
    gen = torch.Generator().manual_seed(16)
    h, w = grid
    q, k, v = (randn(gen, 2, 3, h * w, 4).requires_grad_() for _ in range(3))
    g = randn(gen, 2, 3, h * w, 4)
    ours = AF.dilated_attention(q, k, v, grid, 3, dilation, "zeros")
    theirs = unfold_dilated_attention(q, k, v, grid, 3, dilation)
    assert rel_err(ours, theirs) < 1e-12
    for a, b in zip(torch.autograd.grad(ours, (q, k, v), g), torch.autograd.grad(theirs, (q, k, v), g)):
        assert rel_err(a, b) < 1e-12


def test_kernel_bad_arguments():
    q = torch.randn(1, 1, 12, 4)
    with pytest.raises(ValueError, match="grid"):
        AF.dilated_attention(q, q, q, (3, 5))
    with pytest.raises(ValueError, match="border"):
        AF.dilated_attention(q, q, q, (3, 4), border="reflect")
    with pytest.raises(ValueError, match="kernel_size"):
        AF.dilated_attention(q, q, q, (3, 4), kernel_size=4)
    with pytest.raises(ValueError, match="dilation"):
        AF.dilated_attention(q, q, q, (3, 4), dilation=0)


def test_point_kernel_matches_brute_force():
    """The point path's kernel, index_attention over the batch's flattened rows (sample b's points at b N + j,
    heads side by side in the channels), against a loop over each point's own neighbours."""
    gen = torch.Generator().manual_seed(17)
    B, H, N, K, d = 2, 3, 10, 4, 5
    q, k, v = (randn(gen, B, H, N, d) for _ in range(3))
    idx = torch.randint(0, N, (B, N, K), generator=gen)
    rows = [t.transpose(1, 2).reshape(B * N, H * d) for t in (q, k, v)]  # (B N, H d)
    table = (idx + N * torch.arange(B).view(B, 1, 1)).view(B * N, K)  # (B N, K) rows of the batch
    out = AF.index_attention(*rows, table, H).view(B, N, H, d).transpose(1, 2)  # (B, H, N, d)
    assert rel_err(out, ref_points(q, k, v, idx)) < 1e-12


# --------------------------------------------------------------------------------------------
# The module
# --------------------------------------------------------------------------------------------

def build(dim=24, **opts):
    torch.manual_seed(0)
    return attention.build("dilated", dim=dim, **opts).double().eval()


def split_qkv(mixer, x):
    C, H = mixer.dim, mixer.heads
    qkv = x @ mixer.qkv.weight.T + mixer.qkv.bias  # (B, N, 3C), channels (q|k|v, head, d)
    return [qkv[..., i * C:(i + 1) * C].unflatten(-1, (H, C // H)).transpose(1, 2) for i in range(3)]  # (B, H, N, d)


@pytest.mark.parametrize("border", ["zeros", "mask"])
def test_module_groups_heads_by_rate_on_grids(border, torch_path):
    dil = (1, 3, 2)
    mixer = build(dim=24, heads=6, dilations=list(dil), border=border)
    gen = torch.Generator().manual_seed(18)
    h, w = 4, 5
    x = randn(gen, 2, h * w, 24)
    q, k, v = split_qkv(mixer, x)
    with torch.no_grad():
        groups = [ref_grid(q[:, 2 * g:2 * g + 2], k[:, 2 * g:2 * g + 2], v[:, 2 * g:2 * g + 2], h, w, 3, r, border)
                  for g, r in enumerate(dil)]  # heads 0-1 rate 1, 2-3 rate 3, 4-5 rate 2
        expected = mixer.proj(torch.cat(groups, dim=1).transpose(1, 2).flatten(2))
        y = mixer(x, Grid(h, w))
        swapped = build(dim=24, heads=6, dilations=[1, 2, 3], border=border)(x, Grid(h, w))
    assert rel_err(y, expected) < 1e-12
    assert rel_err(swapped, expected) > 1e-3  # the rate order matters: the test can tell groups apart


def test_module_is_dilateformer_msda():
    """The module equals DilateFormer's MultiDilatelocalAttention (its forward written out) with our weights."""
    C, dil = 36, [1, 2, 3]
    mixer = build(dim=C, heads=3, dilations=dil)
    gen = torch.Generator().manual_seed(19)
    B, h, w = 2, 5, 6
    x = randn(gen, B, h, w, C)  # DilateFormer's block input (B, H, W, C)
    nd = len(dil)
    with torch.no_grad():
        # MultiDilatelocalAttention.forward with qkv = 1x1 conv (our Linear's weights) and proj = our Linear
        xc = x.permute(0, 3, 1, 2)  # B, C, H, W
        qkv = torch.einsum("oc,bchw->bohw", mixer.qkv.weight, xc) + mixer.qkv.bias[None, :, None, None]
        qkv = qkv.reshape(B, 3, nd, C // nd, h, w).permute(2, 1, 0, 3, 4, 5)  # num_dilation,3,B,C//nd,H,W
        out = xc.reshape(B, nd, C // nd, h, w).permute(1, 0, 3, 4, 2).clone()  # num_dilation,B,H,W,C//nd
        for i in range(nd):
            out[i] = DilateAttention(C // mixer.heads, None, 0, 3, dil[i])(qkv[i][0], qkv[i][1], qkv[i][2])
        expected = mixer.proj(out.permute(1, 2, 3, 0, 4).reshape(B, h, w, C))
        y = mixer(x.reshape(B, h * w, C), Grid(h, w))
    assert rel_err(y, expected.reshape(B, h * w, C)) < 1e-12
    shapes = sorted(tuple(p.shape) for p in mixer.parameters())
    assert shapes == sorted([(3 * C, C), (3 * C,), (C, C), (C,)])


@pytest.mark.parametrize("n,neighbours", [(40, None), (40, 3), (10, None)])  # n=10: 9 * r > N, clamped
def test_module_point_neighbourhoods(n, neighbours):
    dil = (1, 2, 4)
    mixer = build(dim=24, heads=6, dilations=list(dil), neighbours=neighbours)
    K = 9 if neighbours is None else neighbours
    gen = torch.Generator().manual_seed(20)
    x = randn(gen, 2, n, 24)
    xyz = randn(gen, 2, n, 3)
    q, k, v = split_qkv(mixer, x)
    groups = []
    for g, r in enumerate(dil):
        idx = ref_neighbours(xyz, K, r)
        assert idx.shape[-1] == min(K, math.ceil(n / r))  # every r-th of min(K*r, N) nearest
        assert (idx[..., 0] == torch.arange(n)).all()  # the nearest is the point itself
        hs = slice(2 * g, 2 * g + 2)
        groups.append(ref_points(q[:, hs], k[:, hs], v[:, hs], idx))
    with torch.no_grad():
        expected = mixer.proj(torch.cat(groups, dim=1).transpose(1, 2).flatten(2))
        y = mixer(x, Points(xyz))
    assert rel_err(y, expected) < 1e-12


@pytest.mark.parametrize("n", [30, 7])
def test_module_points_permutation_equivariant(n):
    mixer = build(dim=16, heads=4, dilations=[1, 2])
    gen = torch.Generator().manual_seed(21)
    x, xyz = randn(gen, 2, n, 16), randn(gen, 2, n, 3)
    perm = torch.randperm(n, generator=gen)
    with torch.no_grad():
        y, y_perm = mixer(x, Points(xyz)), mixer(x[:, perm], Points(xyz[:, perm]))
    assert rel_err(y_perm, y[:, perm]) < 1e-12


def test_module_layouts():
    mixer = build(dim=16, heads=4, dilations=[1, 2])
    x = torch.randn(2, 12, 16, dtype=torch.float64)
    with pytest.raises(ValueError, match="dilated"):
        mixer(x, None)
    with pytest.raises(ValueError):
        mixer(x, Grid(3, 5))
    with pytest.raises(ValueError):
        mixer(x, Points(torch.rand(2, 13, 3)))
    with pytest.raises(ValueError):
        Points(torch.rand(2, 12, 2))


@pytest.mark.parametrize("opts,option,allowed", [
    ({"kernel_size": 4}, "attn.kernel_size=4", "odd"),
    ({"kernel_size": 0}, "attn.kernel_size=0", ">= 1"),
    ({"kernel_size": -3}, "attn.kernel_size=-3", ">= 1"),
    ({"dilations": []}, r"attn.dilations=\[\]", ">= 1"),
    ({"dilations": [1, 0]}, r"attn.dilations=\[1, 0\]", ">= 1"),
    ({"dilations": [1, 2.5]}, r"attn.dilations=\[1, 2.5\]", "integers"),
    ({"dilations": "12"}, "attn.dilations='12'", "list"),
    ({"heads": 8, "dilations": [1, 2, 3]}, "attn.heads=8", "multiple of 3"),
    ({"heads": 2, "dilations": [1, 2, 3, 4]}, "attn.heads=2", "multiple of 4"),
    ({"border": "reflect"}, "attn.border='reflect'", "'zeros', 'mask'"),
    ({"neighbours": 0}, "attn.neighbours=0", ">= 1"),
    ({"heads": 3, "dilations": [1, 2, 3]}, "attn.heads=3", "divisor"),  # 3 does not divide 32
])
def test_bad_options(opts, option, allowed):
    with pytest.raises(UserError, match=option) as info:
        attention.build("dilated", dim=32, **opts)
    assert allowed in str(info.value)


def test_options_and_config():
    cfg = OmegaConf.load(Path(__file__).resolve().parents[2] / "configs" / "attn" / "dilated.yaml")
    opts = {key: value for key, value in cfg.items() if key != "name"}
    assert cfg.name == "dilated" and set(opts) == set(attention.options("dilated"))
    for dim in (32, 64, 128, 256):  # the widths the suite's networks build mixers at
        mixer = attention.build("dilated", dim=dim, **opts)
        assert mixer.dilations == (1, 2, 3, 4) and mixer.heads == 8
    # the paper's rates, where the width allows them
    assert attention.build("dilated", dim=72, heads=3, dilations=[1, 2, 3]).dilations == (1, 2, 3)
    assert attention.build("dilated", dim=64, heads=4, dilations=2).dilations == (2,)  # a bare rate


def test_cost_counts_the_kernel():
    """FLOPs = projections + 2 * (q.k and attn*v) over all k*k window positions, via the op's FLOP formula."""
    B, C, n, K = 2, 32, 64, 9  # 9 * 4 <= 64: no point set is clamped
    mixer = attention.build("dilated", dim=C)
    expected = 2 * B * n * (3 * C * C + C * C) + 2 * B * n * K * 2 * C
    assert mixer.cost(n, batch=B, layout="grid")["flops"] == expected
    # on points the same attention work (as batched matmuls); kNN's distances are elementwise coordinate
    # differences (attention.pointops.square_distance), which the FLOP counter skips
    assert mixer.cost(n, batch=B, layout="points")["flops"] == expected


def test_eager_calls_run_the_ops_autograd_without_their_dispatch():
    """In eager code dilated_attention and index_attention run their op's kernel and autograd as a plain
    autograd.Function (attention.eager.skips_dispatch: the op's dispatch cost 3x the Function's per forward +
    backward), with the op's outputs and gradients bit for bit; under a dispatch mode (here the FLOP counter, which
    must count the op) the op itself runs."""
    from torch.utils.flop_counter import FlopCounterMode

    gen = torch.Generator().manual_seed(17)
    q, k, v = (randn(gen, 2, 3, 20, 4).requires_grad_() for _ in range(3))
    g = randn(gen, 2, 3, 20, 4)
    rows = randn(gen, 7, 6).requires_grad_(), randn(gen, 9, 6).requires_grad_(), randn(gen, 9, 4).requires_grad_()
    index = torch.randint(0, 9, (7, 5), generator=gen)
    calls = {
        "dilated": (lambda: AF.dilated_attention(q, k, v, (4, 5), 3, 2), (q, k, v),
                    lambda: AF._dilated_op(q, k, v, 4, 5, 3, [2], False, 4 ** -0.5)[0]),
        "index": (lambda: AF.index_attention(*rows, index, 2), rows,
                  lambda: AF._index_op(*rows, index, 2, 3 ** -0.5)[0]),
    }
    for name, (call, inputs, through_op) in calls.items():
        out = call()
        assert type(out.grad_fn).__name__ == f"_{name.capitalize()}FunctionBackward", out.grad_fn
        expected = through_op()
        assert "Function" not in type(expected.grad_fn).__name__, expected.grad_fn
        upstream = g if name == "dilated" else torch.ones_like(out)
        grads = torch.autograd.grad(out, inputs, upstream)
        assert torch.equal(out, expected), name
        for a, b in zip(grads, torch.autograd.grad(expected, inputs, upstream)):
            assert torch.equal(a, b), name
        with FlopCounterMode(display=False) as flops:
            counted = call()
        assert "Function" not in type(counted.grad_fn).__name__ and flops.get_total_flops() > 0, name


def test_autocast_off_switches_autocast_off_only_where_it_is_on():
    """attention.eager.autocast_off, the written-out functions' guard: inside autocast it switches it off for the
    block (a product then runs in its inputs' dtype) and on again after; outside autocast, and for a device type
    without autocast ("meta", the FLOP counter's), it enters no autocast context at all."""
    import contextlib

    from attention.eager import autocast_off

    a = torch.randn(4, 4)
    assert isinstance(autocast_off("cpu"), contextlib.nullcontext)
    assert isinstance(autocast_off("meta"), contextlib.nullcontext)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert (a @ a).dtype == torch.bfloat16
        guard = autocast_off("cpu")
        assert isinstance(guard, torch.autocast)
        with guard:
            assert not torch.is_autocast_enabled("cpu") and (a @ a).dtype == torch.float32
        assert torch.is_autocast_enabled("cpu") and (a @ a).dtype == torch.bfloat16
        assert isinstance(autocast_off("meta"), contextlib.nullcontext)
