"""The fused Triton kernels of dilated attention (attention/dilated_triton.py) against the torch kernel.

The kernels run on CPU tensors under Triton's interpreter, which ``TRITON_INTERPRET=1`` turns on when they are
defined (at import), so in one subprocess for every case (the interpreter is slow: small grids, up to 8 x 9): the
forward's output and attention map and the backward's dq, dk, dv must equal the torch kernel's
(``functional._dilated_forward`` / ``_dilated_backward`` with ``backend="torch"``) in float32, and both the float64
torch kernel, to 1e-6 relative (1e-5 on a GPU, whose exp and division are approximate). The same subprocess runs
``DilatedAttention`` forward and backward with ``functional.DILATED_BACKEND = "triton"`` and with ``"torch"``.
Without a GPU, :func:`test_kernels_compile_for_sm90_as_launched` compiles the kernels for an H100 as the wrappers
launch them and reads the PTX and the registers; the test marked ``cuda`` runs them on a GPU. Triton is in the
lock: if it does not import, these tests fail.
"""

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from attention import functional as AF
from triton_sm90 import compiled_rows

ROOT = Path(__file__).resolve().parents[2]


def rel_err(a, b):
    """|a - b| / |b| (Frobenius norms); |a - b| where b is 0 (a mask border's lone centre: dq = dk = 0)."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / (b.norm() if b.norm() > 0 else 1)).item()


def module_layout(gen, B, H, n, d, d_v, heads, device="cpu"):
    """q, k (B, H, N, d), v (B, H, N, d_v) as DilatedAttention hands them to the kernel: the last H of ``heads``
    heads of rearrange(qkv(x), "b n (three h d) -> three b h n d") (strided, not contiguous), here with d_v = d."""
    assert d == d_v
    qkv = torch.randn(B, n, 3 * heads * d, generator=gen).to(device)  # (B, N, 3 heads d)
    q, k, v = qkv.view(B, n, 3, heads, d).permute(2, 0, 3, 1, 4)  # each (B, heads, N, d)
    return q[:, heads - H:], k[:, heads - H:], v[:, heads - H:]  # the last H heads: a group's slice


def cases() -> dict:
    """name -> dict(q, k, v, g, h, w, ks, r, mask, scale): float32 tensors (B, H, N, .)."""
    gen = torch.Generator().manual_seed(28)
    out = {}

    def add(name, B, H, h, w, d, d_v, ks, r, border, layout="contiguous", scale=None):
        n = h * w
        if layout == "module":
            q, k, v = module_layout(gen, B, H, n, d, d_v, heads=H + 1)
        else:
            q, k = (torch.randn(B, H, n, d, generator=gen) for _ in range(2))
            v = torch.randn(B, H, n, d_v, generator=gen)
        if layout == "expanded":  # autograd's gradient of a sum: stride 0 but for the last dim
            g = torch.randn(1, 1, 1, d_v, generator=gen).expand(B, H, n, d_v)
        else:
            g = torch.randn(B, H, n, d_v, generator=gen)
        out[name] = dict(q=q, k=k, v=v, g=g, h=h, w=w, ks=ks, r=r, mask=border == "mask",
                         scale=d ** -0.5 if scale is None else scale)

    add("k3 r1 zeros 5x7, module layout, B=2 H=2", 2, 2, 5, 7, 8, 8, 3, 1, "zeros", "module")
    add("k3 r2 mask 5x7, module layout", 1, 2, 5, 7, 8, 8, 3, 2, "mask", "module")
    add("k3 r3 zeros 8x9, d=5 d_v=3, expanded gradient", 2, 1, 8, 9, 5, 3, 3, 3, "zeros", "expanded")
    add("k3 r3 mask 2x3 (rows p=+-1 wholly outside)", 2, 1, 2, 3, 4, 6, 3, 3, "mask")
    add("k3 r3 zeros 2x3 (rows p=+-1 wholly outside)", 2, 1, 2, 3, 4, 6, 3, 3, "zeros")
    add("k1 1x6", 1, 2, 1, 6, 3, 5, 1, 1, "zeros")
    add("k1 r2 mask 3x4", 1, 1, 3, 4, 4, 4, 1, 2, "mask")
    add("k5 r1 mask 8x9, d=7 d_v=4", 1, 1, 8, 9, 7, 4, 5, 1, "mask", scale=0.3)
    add("k5 r2 zeros 1x6, d=6 d_v=2", 2, 1, 1, 6, 6, 2, 5, 2, "zeros")
    add("k5 r3 zeros 5x7, module layout (offsets +-2 wholly outside)", 1, 1, 5, 7, 4, 4, 5, 3, "zeros", "module")
    add("k5 r3 mask 6x5, module layout", 1, 1, 6, 5, 4, 4, 5, 3, "mask", "module")
    add("k3 r1000 mask 4x5 (dilation beyond the grid)", 1, 1, 4, 5, 4, 4, 3, 1000, "mask")
    add("k3 r1000 zeros 4x5 (dilation beyond the grid)", 1, 1, 4, 5, 4, 4, 3, 1000, "zeros")
    # head groups at their own rates in one launch, as DilatedAttention calls it: every head of the qkv projection
    add("k3 rates 1 3 2 zeros 5x7, module layout, B=2 H=6", 2, 6, 5, 7, 4, 4, 3, [1, 3, 2], "zeros", "module")
    add("k3 rates 2 1000 mask 4x6, 2 heads a group", 1, 4, 4, 6, 4, 4, 3, [2, 1000], "mask")
    return out


CASES = cases()
# DilatedAttention end to end: (dim, heads, dilations, border, B, h, w)
MODULES = {"zeros 5x7": (24, 6, [1, 3, 2], "zeros", 2, 5, 7), "mask 4x6": (16, 4, [2, 1], "mask", 1, 4, 6)}

# Runs in the subprocess under the interpreter: every case's forward and backward with backend="triton", then the
# module with DILATED_BACKEND "triton" and "torch", counting the Triton launches.
INTERPRET = """
import sys
import torch
import triton
from triton.runtime import interpreter
import attention
from attention import dilated_triton, functional as AF
from attention.layout import Grid

for kernel in (dilated_triton._forward_kernel, dilated_triton._backward_query_kernel,
               dilated_triton._backward_key_kernel):
    assert triton.knobs.runtime.interpret and isinstance(kernel, interpreter.InterpretedFunction)
torch.set_num_threads(1)
# blocks of queries as large as the tiles allow (launch_config), not the GPU's smaller ones: fewer programs for the
# interpreter to run one by one; the 8 x 9 grids still take 2 or 3 blocks, the last one partial
dilated_triton.TARGET_PROGRAMS = 1
cases, modules = torch.load(sys.argv[1])
out = {"cases": {}, "modules": {}, "calls": []}
for name, c in cases.items():
    assert all(c[t].dtype == torch.float32 for t in "qkvg")
    args = (c["h"], c["w"], c["ks"], c["r"])
    o, attn = AF._dilated_forward(c["q"], c["k"], c["v"], *args, c["mask"], c["scale"], backend="triton")
    grads = AF._dilated_backward(c["g"], c["q"], c["k"], c["v"], attn, *args, c["scale"], backend="triton")
    out["cases"][name] = (o, attn, *grads)

calls = out["calls"]
for name in ("forward", "backward"):  # count the Triton calls, to show the module really ran them
    def counted(*args, _kernel=getattr(dilated_triton, name), _name=name):
        calls.append(_name)
        return _kernel(*args)
    setattr(dilated_triton, name, counted)
for name, (dim, heads, dilations, border, B, h, w) in modules.items():
    torch.manual_seed(0)
    mixer = attention.build("dilated", dim=dim, heads=heads, dilations=dilations, border=border)
    x = torch.randn(B, h * w, dim, generator=torch.Generator().manual_seed(1))
    runs = []
    for backend in ("triton", "torch"):
        AF.DILATED_BACKEND = backend
        xr = x.clone().requires_grad_()
        mixer.zero_grad()
        y = mixer(xr, Grid(h, w))
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        runs.append([y.detach(), xr.grad, *(p.grad for p in mixer.parameters())])
        calls.append(f"{name} {backend} done")
    out["modules"][name] = runs
torch.save(out, sys.argv[2])
"""


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict:
    """The Triton kernels' results for every case and module, run by the interpreter in one subprocess."""
    folder = tmp_path_factory.mktemp("dilated_triton")
    torch.save((CASES, MODULES), folder / "cases.pt")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", INTERPRET, str(folder / "cases.pt"), str(folder / "out.pt")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    if done.returncode:
        pytest.fail(f"the interpreted kernels failed (Triton is in the lock, so it must import):\n{done.stderr}")
    return torch.load(folder / "out.pt")


def test_cases_cover_the_layouts():
    # the strided inputs reach the subprocess strided (torch.save keeps views), the gradient with stride 0
    module = CASES["k3 r1 zeros 5x7, module layout, B=2 H=2"]
    assert not any(module[t].is_contiguous() for t in "qkv") and module["q"].stride(-2) == 3 * 3 * 8
    g = CASES["k3 r3 zeros 8x9, d=5 d_v=3, expanded gradient"]["g"]
    assert g.shape[0] == 2 and (g.stride(0), g.stride(2), g.stride(3)) == (0, 0, 1)


@pytest.mark.parametrize("name", list(CASES))
def test_kernels_equal_the_torch_kernel(interpreted, name):
    c = CASES[name]
    args = (c["h"], c["w"], c["ks"], c["r"])
    got = interpreted["cases"][name]  # out, attn, dq, dk, dv
    want32, want64 = [], []
    for dtype, want in ((torch.float32, want32), (torch.float64, want64)):
        q, k, v, g = (c[t].to(dtype) for t in "qkvg")
        out, attn = AF._dilated_forward(q, k, v, *args, c["mask"], c["scale"], backend="torch")
        want += [out, attn, *AF._dilated_backward(g, q, k, v, attn, *args, c["scale"], backend="torch")]
    for what, a, b32, b64 in zip(("out", "attn", "dq", "dk", "dv"), got, want32, want64):
        assert a.dtype == torch.float32 and a.shape == b64.shape and a.is_contiguous(), what
        # float32 rounding: about 2e-7 here, as the torch float32 kernel's own error
        assert rel_err(a, b64) < 1e-6, (what, rel_err(a, b64))
        assert rel_err(a, b32) < 1e-6, (what, rel_err(a, b32))
        assert rel_err(b32, b64) < 1e-6, what  # the torch float32 kernel is as close: the bound is fair
    attn, attn64 = got[1], want64[1]
    if c["mask"]:  # keys outside the grid are out of the softmax: exactly 0, as in the torch kernel
        assert torch.equal(attn == 0, attn64 == 0)
        assert (attn64 == 0).any() or c["ks"] == 1
    assert torch.allclose(attn.sum(2), torch.ones(()), atol=1e-6)  # weights of a query sum to 1


def test_module_with_the_triton_kernels_equals_the_torch_path(interpreted):
    # the Triton runs called the kernels once forward and once backward for all head groups, the torch runs never
    expected_calls = []
    for name in MODULES:
        expected_calls += ["forward", "backward", f"{name} triton done", f"{name} torch done"]
    assert interpreted["calls"] == expected_calls
    for name in MODULES:
        triton_run, torch_run = interpreted["modules"][name]
        assert len(triton_run) == len(torch_run) == 6  # y, dx, qkv weight and bias, proj weight and bias
        for a, b in zip(triton_run, torch_run):
            assert a.shape == b.shape and rel_err(a, b) < 1e-5, (name, rel_err(a, b))


# Runs in a subprocess with a scratch Triton cache and no interpreter: records each launch the wrappers make
# (CPU tensors: nothing runs), specialises its arguments as Triton's launcher does (ints of 1 are constexprs,
# pointers and ints divisible by 16 carry the hint), compiles it for an H100 (sm_90, no GPU needed), and prints,
# per launch, its kernel, constexprs, atomic instructions, global load widths and registers / stack (cuobjdump).
COMPILE = """
import json
import sys
import torch
from attention import dilated_triton as DT

sys.path.insert(0, "tests")
from triton_sm90 import compile_sm90, record_launches

launches = record_launches(DT._forward_kernel, DT._backward_query_kernel, DT._backward_key_kernel)


def strided(B, H, heads, n, d):  # a head group's slice of the module's qkv, as DilatedAttention makes them
    q, k, v = torch.empty(B, n, 3 * heads * d).view(B, n, 3, heads, d).permute(2, 0, 3, 1, 4)
    return q[:, :H], k[:, :H], v[:, :H]


layouts = {  # DilateFormer's 56 x 56 stage (C = 72, 3 heads at rates 1, 2, 3); 65,536 tokens, C = 256, 8 heads
    "56x56 C=72": (strided(1, 3, 3, 56 * 56, 24), 56, 56, 3, [1, 2, 3], False),
    "256x256 C=256": (strided(1, 8, 8, 256 * 256, 32), 256, 256, 3, [1, 2, 3, 4], True),
    "5x7 d=5 k=5": ((torch.empty(2, 3, 35, 5), torch.empty(2, 3, 35, 5), torch.empty(2, 3, 35, 3)), 5, 7, 5, 2, True),
}
for name, ((q, k, v), h, w, ks, r, mask) in layouts.items():
    del launches[:]
    out, attn = DT.forward(q, k, v, h, w, ks, r, mask, 0.2)
    forward_launches = len(launches)
    DT.backward(out, q, k, v, attn, h, w, ks, r, 0.2)
    assert (forward_launches, len(launches)) == (1, 3), (forward_launches, len(launches))
    # the strided inputs and gradient go to the kernels as they are: no copy
    passed = [*launches[0][1][:3], *launches[1][1][:3:2], *launches[2][1][:2]]
    assert all(a is b for a, b in zip(passed, (q, k, v, out, v, q, out))), "a copy went to the kernel"
    for kernel, args, options in launches:
        print(json.dumps(dict(layout=name, **compile_sm90(kernel, args, options))))
"""


def test_kernels_compile_for_sm90_as_launched(tmp_path):
    # One launch forward, two backward, each compiled for an H100 as the wrappers launch it: no atomic instruction
    # (the gradients are sums in a fixed order: bit-reproducible), no spills, and at the module's layouts 16-byte
    # loads (ALIGN = 4: rows of 3C floats); a head width of 5 (ALIGN = 1) compiles too.
    rows = compiled_rows(COMPILE, tmp_path)
    kernels = ["_forward_kernel", "_backward_query_kernel", "_backward_key_kernel"]
    assert [(r["layout"], r["kernel"]) for r in rows] == [
        (layout, kernel) for layout in ("56x56 C=72", "256x256 C=256", "5x7 d=5 k=5") for kernel in kernels]
    for r in rows:
        assert r["atomics"] == [], r
        assert r["STACK"] == 0 and r["LOCAL"] == 0 and r["REG"] <= 128, r  # no spills, 4 blocks of 4 warps an SM
        module = r["layout"] != "5x7 d=5 k=5"
        assert r["constexprs"]["ALIGN"] == (4 if module else 1), r
        assert ("ld.global.v4.b32" in r["loads"]) == module, r
        assert r["constexprs"]["KS"] == (3 if module else 5) and r["constexprs"]["DP"] == (32 if module else 8), r


def test_auto_keeps_the_torch_kernel_on_the_cpu(monkeypatch):
    def no_kernel(*args, **kwargs):
        raise AssertionError("backend 'auto' called the Triton kernels for CPU tensors")

    monkeypatch.setattr(AF.DILATED_KERNELS, "call", no_kernel)
    monkeypatch.setattr(AF.DILATED_KERNELS, "usable", True)
    c = CASES["k3 r2 mask 5x7, module layout"]
    q, k, v = (c[t].clone().requires_grad_() for t in "qkv")
    AF.dilated_attention(q, k, v, (5, 7), 3, 2, "mask").sum().backward()
    with pytest.raises(ValueError, match="backend='cuda'"):
        AF._dilated_forward(q, k, v, 5, 7, 3, 2, True, 0.5, backend="cuda")


def test_kernel_failure_warns_once_and_the_torch_kernel_takes_over(monkeypatch):
    from attention import dilated_triton

    c = CASES["k5 r1 mask 8x9, d=7 d_v=4"]
    args = ((8, 9), 5, 1, "mask", c["scale"])
    q, k, v = (c[t].clone().requires_grad_() for t in "qkv")
    want = torch.autograd.grad(AF.dilated_attention(q, k, v, *args), (q, k, v), c["g"])  # the torch kernel

    def broken(*args):
        raise RuntimeError("no driver")

    monkeypatch.setattr(dilated_triton, "forward", broken)
    monkeypatch.setattr(dilated_triton, "backward", broken)
    monkeypatch.setattr(AF.DILATED_KERNELS, "usable", True)
    # backend "auto" as on a GPU: the Triton kernels while they are usable
    monkeypatch.setattr(AF, "_dilated_backend", lambda tensors, backend: backend if backend in ("torch", "triton")
                        else "triton" if AF.DILATED_KERNELS.usable else "torch")
    with pytest.warns(UserWarning, match="torch kernel takes over") as caught:
        got = torch.autograd.grad(AF.dilated_attention(q, k, v, *args), (q, k, v), c["g"])
    assert len(caught) == 1 and AF.DILATED_KERNELS.usable is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # turned off: no second warning
        again = torch.autograd.grad(AF.dilated_attention(q, k, v, *args), (q, k, v), c["g"])
    for a, b, w in zip(got, again, want):
        assert torch.equal(a, w) and torch.equal(b, w)
    # the backward alone failing (after a forward on Triton) hands over too
    monkeypatch.setattr(AF.DILATED_KERNELS, "usable", True)
    qd, kd, vd = (t.detach() for t in (q, k, v))
    _, attn = AF._dilated_forward(qd, kd, vd, 8, 9, 5, 1, True, c["scale"], backend="torch")
    with pytest.warns(UserWarning, match="torch kernel takes over"):
        grads = AF._dilated_backward(c["g"], qd, kd, vd, attn, 8, 9, 5, 1, c["scale"])
    assert all(torch.equal(a, w) for a, w in zip(grads, want))
    # backend "triton" raises instead, and out of memory always raises (and leaves the kernels on)
    monkeypatch.setattr(AF.DILATED_KERNELS, "usable", True)
    with pytest.raises(RuntimeError, match="no driver"):
        AF._dilated_forward(qd, kd, vd, 8, 9, 5, 1, True, c["scale"], backend="triton")

    def out_of_memory(*args):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(dilated_triton, "forward", out_of_memory)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        AF.dilated_attention(q, k, v, *args)
    assert AF.DILATED_KERNELS.usable is True


def test_kernels_take_float32_only():
    from attention import dilated_triton  # imports Triton, launches nothing

    q = torch.zeros(1, 1, 6, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="float32 tensors only"):
        dilated_triton.forward(q, q, q, 2, 3, 3, 1, False, 0.5)


# (B, H of heads, h, w, d, kernel_size, dilation, border): DilateFormer's 56 x 56 stage (C = 72, 3 heads at rates
# 1, 2, 3 in one call, as DilatedAttention makes it), a batch with k = 5, and 65,536 tokens (C = 256, 8 heads, 4 rates)
GPU_SIZES = [(1, 3, 3, 56, 56, 24, 3, [1, 2, 3], "zeros"), (4, 3, 6, 14, 14, 32, 5, 3, "mask"),
             (1, 8, 8, 256, 256, 32, 3, [1, 2, 3, 4], "zeros")]


@pytest.mark.cuda
@pytest.mark.parametrize("B,H,heads,h,w,d,ks,r,border", GPU_SIZES)
def test_kernels_on_the_gpu(B, H, heads, h, w, d, ks, r, border):
    gen = torch.Generator().manual_seed(h + ks)
    q, k, v = module_layout(gen, B, H, h * w, d, d, heads=heads)  # float32 on the CPU, strided
    g = torch.randn(B, H, h * w, d, generator=gen)
    args, scale = (h, w, ks, r), d ** -0.5
    q64, k64, v64, g64 = (t.double() for t in (q, k, v, g))
    out64, attn64 = AF._dilated_forward(q64, k64, v64, *args, border == "mask", scale)
    want = (out64, attn64, *AF._dilated_backward(g64, q64, k64, v64, attn64, *args, scale))
    gen.manual_seed(h + ks)
    qc, kc, vc = module_layout(gen, B, H, h * w, d, d, heads=heads, device="cuda")  # the same, strided, on the GPU
    assert not qc.is_contiguous() and AF._dilated_backend((qc, kc, vc), None) == "triton"
    assert AF._dilated_backend((qc.double(),), None) == "torch"  # float64 keeps the torch kernel
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*the Triton kernel failed")  # a failing kernel would hand over
        out, attn = AF._dilated_forward(qc, kc, vc, *args, border == "mask", scale)
        got = (out, attn, *AF._dilated_backward(g.cuda(), qc, kc, vc, attn, *args, scale))
        for what, a, b in zip(("out", "attn", "dq", "dk", "dv"), got, want):
            assert rel_err(a.cpu(), b) < 1e-5, (what, rel_err(a.cpu(), b))
        # through autograd, twice: bit-identical gradients (no atomics)
        leaves = [t.detach().requires_grad_() for t in (qc, kc, vc)]
        first, second = (torch.autograd.grad(AF.dilated_attention(*leaves, (h, w), ks, r, border), leaves,
                                             g.cuda()) for _ in range(2))
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert all(rel_err(a.cpu(), b) < 1e-5 for a, b in zip(first, want[2:]))
    assert AF.DILATED_KERNELS.usable


def _alignment_spec(tensors, dims) -> int:
    """ALIGN as dilated_triton.alignment's docstring states it, written plainly (the form it had before its host
    cost was cut): the largest of 4, 2, 1 dividing d, d_v, every stride but the last of dims longer than 1 and every
    data pointer in elements, each last stride 1; 1 where any stride reaches 2^31."""
    if any(abs(st) >= 2 ** 31 for t in tensors for st in t.stride()):
        return 1
    for align in (4, 2):
        if all(m % align == 0 for m in dims) and all(
                t.data_ptr() % (align * t.element_size()) == 0 and t.stride(-1) == 1
                and all(st % align == 0 for st, size in zip(t.stride()[:-1], t.shape[:-1]) if size > 1)
                for t in tensors):
            return align
    return 1


def test_alignment_and_launch_helpers_equal_their_plain_forms():
    """The wrappers' host helpers, made cheaper (kept per layout; no ``ConstexprFunction`` calls), decide exactly
    what the plain forms decide: ALIGN over views at every element offset, odd and even strides, size-one and
    stride-zero dimensions and head widths of 1 to 8; ``pow2`` / ``cdiv`` as Triton's; launch configurations kept
    read-only (a caller changing one would change every later launch's)."""
    import triton

    from attention import dilated_triton as DT
    from attention import index_attention_triton as IT
    from attention.triton_kernels import cdiv, pow2

    base = torch.randn(4, 3, 40, 24)
    cases = [base, base[..., 1:], base[..., 2:18], base[:, :, :, 4:20], base[:, 1:2, :, :12], base[:1, :, 3:4],
             base.transpose(1, 2), base[..., ::2], base[0:1].expand(5, -1, -1, -1),
             torch.randn(3, 5, 7, 6)[..., 1:5], torch.randn(2, 1, 9, 2)[:, :, 1:],
             torch.zeros(1, 1, 1, 4).expand(2, 3, 5, 4), base.view(-1)[2:].view(1, 1, -1, 2)[..., :1]]
    seen = set()
    for i, t in enumerate(cases):
        for other in (base, cases[(i + 3) % len(cases)], cases[(i + 5) % len(cases)]):
            for dims in ((8, 8), (6, 4), (5, 4), (4, 2), (8, 1)):
                got = DT.alignment((t, other), dims)
                assert got == _alignment_spec((t, other), dims), (i, dims)
                seen.add(got)
    assert seen == {1, 2, 4}
    for n in range(1, 5000):
        assert pow2(n) == triton.next_power_of_2(n), n
    for a in range(0, 200):
        for b in range(1, 33):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)
    for config in (DT.launch_config(12, 3136, 24, 24, 3), IT.forward_config(19, 6, 4), IT.key_config(76, 8, 6, 4)):
        with pytest.raises(TypeError):
            config["num_warps"] = 1
    assert DT.launch_config(12, 3136, 24, 24, 3) is DT.launch_config(12, 3136, 24, 24, 3)
