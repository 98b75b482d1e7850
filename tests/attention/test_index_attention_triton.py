"""Attention over indexed keys in Triton (attention/index_attention_triton.py) against float64 brute force and the
op's torch kernel.

The kernels run on CPU tensors under Triton's interpreter, which ``TRITON_INTERPRET=1`` turns on when they are
defined (at import), so in ONE subprocess for every case (the interpreter is slow: small cases): the forward's
output and log-sum-exp and the backward's dq, dk, dv against an explicit gather + softmax in float64 (autograd) and
against the op's torch kernel in float32, to 1e-5 relative (float32 rounding is ~1e-7 here).
The same subprocess runs ``FocalAttention`` and ``DilatedAttention`` on point sets forward and backward with
``functional.INDEX_BACKEND = "triton"`` and ``"torch"``. Without a GPU, :func:`test_kernels_compile_for_sm90`
compiles the kernels for an H100 as the wrappers launch them and reads the PTX and the registers; the tests marked
``cuda`` run them on a GPU. Triton is in the lock: if it does not import, these tests fail.
"""

import contextlib
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import attention
from attention import functional as AF
from attention.layout import Points
from triton_sm90 import compiled_rows

ROOT = Path(__file__).resolve().parents[2]


def rel_err(a, b):
    """|a - b| / |b| (Frobenius norms)."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def reference(q, k, v, index, heads, scale, g):
    """Float64 brute force: k[index], v[index] gathered whole, a softmax per (row, head), autograd for the
    gradients. Returns out (R, C_v), lse (R, heads), dq, dk, dv. G tables (G, R, M): head h gathers through table
    h // (heads / G)."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    tables = index.view(-1, *index.shape[-2:])  # (G, R, M)
    _, rows, m = tables.shape
    per = heads // tables.shape[0]
    head_tables = tables.repeat_interleave(per, dim=0)  # (heads, R, M)
    heads_of = torch.arange(heads).view(1, 1, heads)
    kg = k.view(-1, heads, k.shape[1] // heads)[head_tables.permute(1, 2, 0), heads_of]  # (R, M, heads, d)
    vg = v.view(-1, heads, v.shape[1] // heads)[head_tables.permute(1, 2, 0), heads_of]  # (R, M, heads, d_v)
    logits = torch.einsum("rhd,rmhd->rhm", q.view(rows, heads, -1), kg) * scale  # (R, heads, M)
    out = torch.einsum("rhm,rmhd->rhd", logits.softmax(-1), vg).reshape(rows, -1)  # (R, C_v)
    grads = torch.autograd.grad(out, (q, k, v), g.double())
    return (out.detach(), logits.logsumexp(-1).detach(), *grads)


def cases() -> dict:
    """name -> dict(q, k, v, index, g, heads, scale): float32 q (R, C), k (T, C), v (T, C_v), index (R, M)."""
    gen = torch.Generator().manual_seed(28)
    out = {}

    def add(name, rows, keys, m, heads, d, d_v, index=None, layout="contiguous", scale=None, unused=0, tables=0):
        if layout == "module":  # a head group's row views of a qkv projection, rows 3C apart (dilated's layout)
            assert d == d_v
            qkv = torch.randn(keys, 3 * 2 * heads * d, generator=gen)  # (T, 3C) with twice the group's heads
            c = heads * d
            q, k, v = qkv[:rows, c:2 * c], qkv[:, 3 * c:4 * c], qkv[:, 5 * c:]
        else:
            q, k = torch.randn(rows, heads * d, generator=gen), torch.randn(keys, heads * d, generator=gen)
            v = torch.randn(keys, heads * d_v, generator=gen)
        if index is None:  # the last ``unused`` keys are never named: zero gradients; ``tables``: (G, R, M)
            index = torch.randint(0, keys - unused, (tables, rows, m) if tables else (rows, m), generator=gen)
        if layout in ("module", "expanded"):  # autograd's gradient of a sum: stride 0 along the rows
            g = torch.randn(1, heads * d_v, generator=gen).expand(rows, -1)
        else:
            g = torch.randn(rows, heads * d_v, generator=gen)
        out[name] = dict(q=q, k=k, v=v, index=index, g=g, heads=heads,
                         scale=d ** -0.5 if scale is None else scale)

    repeats = torch.randint(0, 8, (13, 5), generator=gen)
    repeats[0] = torch.tensor([2, 2, 2, 0, 2])  # one key four times over, one once
    repeats[5] = 6  # a row naming one key in every slot
    add("3 heads, d=5 d_v=3, repeats, 3 keys never named", 13, 11, 5, 3, 5, 3, index=repeats, scale=0.7)
    hub = torch.randint(0, 6, (40, 4), generator=gen)
    hub[:, 1] = 0  # key 0 in every row, twice in some: in-degree >= 40, many steps of the key kernel
    hub[::3, 3] = 0
    add("high in-degree, 2 heads d=4, int32 index", 40, 9, 4, 2, 4, 4, index=hub.int())
    add("M=1, 1 head d=8", 7, 7, 1, 1, 8, 8, index=torch.randperm(7, generator=gen)[:, None])
    add("R != T (queries N, keys N + pooled), M=19 > BM, d=6 d_v=4", 12, 17, 19, 2, 6, 4, unused=2)
    add("strided module layout, expanded gradient, d=8", 9, 14, 6, 2, 8, 8, layout="module", unused=3)
    add("2 tables for 4 heads (dilated's head groups), d=4 d_v=3, M=19 > BM", 11, 13, 19, 4, 4, 3, unused=2,
        tables=2)
    add("4 tables for 4 heads, module layout, expanded gradient, d=4", 10, 10, 5, 4, 4, 4, layout="module",
        tables=4)
    return out


CASES = cases()
# mixers on point sets: name -> (variant, options, B, N)
MODULES = {"focal": ("focal", dict(heads=2, window_size=4, expand_size=1, focal_level=3, neighbours=8,
                                   coarse_neighbours=5), 2, 60),
           "dilated": ("dilated", dict(heads=4, dilations=[1, 3], kernel_size=3), 2, 40),
           # 10 points, fewer than K r_max = 27: the groups see 9 and 4 neighbours, one call each
           "dilated, small set": ("dilated", dict(heads=4, dilations=[1, 3], kernel_size=3), 2, 10)}
# Triton calls a mixer makes forward (and as many backward): one for all its head groups, one a group where their
# tables differ in length
CALLS = {"focal": 1, "dilated": 1, "dilated, small set": 2}
DIM = 24

# Runs in the subprocess under the interpreter: every case through the kernels' wrappers, then each mixer with
# INDEX_BACKEND "triton" and "torch", counting the Triton calls.
INTERPRET = """
import sys
import torch
import triton
from triton.runtime import interpreter
import attention
from attention import functional as AF, index_attention_triton as IT
from attention.layout import Points

for kernel in (IT._forward_kernel, IT._backward_query_kernel, IT._backward_key_kernel):
    assert triton.knobs.runtime.interpret and isinstance(kernel, interpreter.InterpretedFunction)
torch.set_num_threads(1)
cases, modules, dim = torch.load(sys.argv[1])
out = {"cases": {}, "modules": {}, "calls": []}
for name, c in cases.items():
    args = (c["index"], c["heads"], c["scale"])
    o, lse = IT.forward(c["q"], c["k"], c["v"], *args)
    grads = IT.backward(c["g"], c["q"], c["k"], c["v"], c["index"], o, lse, c["heads"], c["scale"])
    out["cases"][name] = (o, lse, *grads)

calls = out["calls"]
for name in ("forward", "backward"):  # count the Triton calls, to show the mixers really ran them
    def counted(*args, _kernel=getattr(IT, name), _name=name):
        calls.append(_name)
        return _kernel(*args)
    setattr(IT, name, counted)
for name, (variant, opts, b, n) in modules.items():
    torch.manual_seed(0)
    mixer = attention.build(variant, dim=dim, **opts)
    gen = torch.Generator().manual_seed(1)
    xyz, x = torch.rand(b, n, 3, generator=gen), torch.randn(b, n, dim, generator=gen)
    runs = []
    for backend in ("triton", "torch"):
        AF.INDEX_BACKEND = backend
        xr = x.clone().requires_grad_()
        mixer.zero_grad()
        y = mixer(xr, Points(xyz))
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        runs.append([y.detach(), xr.grad, *(p.grad for p in mixer.parameters() if p.grad is not None)])
        calls.append(f"{name} {backend} done")
    out["modules"][name] = runs
torch.save(out, sys.argv[2])
"""


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict:
    """The Triton kernels' results for every case and mixer, run by the interpreter in one subprocess."""
    folder = tmp_path_factory.mktemp("index_triton")
    torch.save((CASES, MODULES, DIM), folder / "cases.pt")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", INTERPRET, str(folder / "cases.pt"), str(folder / "out.pt")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    if done.returncode:
        pytest.fail(f"the interpreted kernels failed (Triton is in the lock, so it must import):\n{done.stderr}")
    return torch.load(folder / "out.pt")


def test_cases_cover_what_they_claim():
    c = CASES["strided module layout, expanded gradient, d=8"]
    assert not any(c[t].is_contiguous() for t in "qkv") and c["q"].stride() == (3 * 2 * 16, 1)
    assert c["g"].stride(0) == 0
    c = CASES["3 heads, d=5 d_v=3, repeats, 3 keys never named"]
    assert (c["index"][0] == 2).sum() == 4 and set(range(8, 11)).isdisjoint(c["index"].flatten().tolist())
    c = CASES["high in-degree, 2 heads d=4, int32 index"]
    assert (c["index"] == 0).sum() > 40 and set(range(6, 9)).isdisjoint(c["index"].flatten().tolist())
    c = CASES["R != T (queries N, keys N + pooled), M=19 > BM, d=6 d_v=4"]
    from attention import index_attention_triton as IT  # imports Triton, launches nothing

    assert c["index"].shape[1] > IT.forward_config(19, 6, 4)["BM"] and c["q"].shape[0] != c["k"].shape[0]


@pytest.mark.parametrize("name", list(CASES))
def test_kernels_equal_brute_force_and_the_torch_path(interpreted, name):
    c = CASES[name]
    got = interpreted["cases"][name]  # out, lse, dq, dk, dv
    want64 = reference(c["q"], c["k"], c["v"], c["index"], c["heads"], c["scale"], c["g"])
    # the op's torch kernel (the CPU's path) in float32
    out32, lse32 = AF._index_forward_torch(c["q"], c["k"], c["v"], c["index"], c["heads"], c["scale"])
    want32 = [out32, lse32, *AF._index_backward_torch(c["g"], c["q"], c["k"], c["v"], c["index"], out32, lse32,
                                                      c["heads"], c["scale"])]
    for what, a, b64, b32 in zip(("out", "lse", "dq", "dk", "dv"), got, want64, want32):
        assert a.dtype == torch.float32 and a.shape == b64.shape and a.is_contiguous(), what
        assert rel_err(a, b64) < 1e-5, (what, rel_err(a, b64))
        assert rel_err(a, b32) < 1e-5, (what, rel_err(a, b32))
    # keys no row names get exactly zero gradients
    unused = torch.ones(c["k"].shape[0], dtype=torch.bool)
    unused[c["index"].flatten()] = False
    assert torch.equal(got[3][unused], torch.zeros_like(got[3][unused]))
    assert torch.equal(got[4][unused], torch.zeros_like(got[4][unused]))
    assert (got[4][~unused] != 0).any(dim=1).all()  # (dk of M = 1 is 0: one slot's weight is 1 whatever its logit)


def test_mixers_with_the_triton_kernels_equal_their_torch_paths(interpreted):
    # the Triton runs called the kernels once forward and once backward (dilated: once for all its head groups, a
    # table each; on a set smaller than K r_max once a group), the torch runs never
    expected = []
    for name in MODULES:
        expected += ["forward"] * CALLS[name] + ["backward"] * CALLS[name]
        expected += [f"{name} triton done", f"{name} torch done"]
    assert interpreted["calls"] == expected
    for name in MODULES:
        triton_run, torch_run = interpreted["modules"][name]
        assert len(triton_run) == len(torch_run) == 6  # y, dx, qkv weight and bias, proj weight and bias
        for a, b in zip(triton_run, torch_run):
            assert a.shape == b.shape and rel_err(a, b) < 1e-5, (name, rel_err(a, b))


def test_inverse_index_is_a_stable_csr():
    """Edges grouped by key, each key's in (row, slot) order; offsets where each key's edges start."""
    from attention import index_attention_triton as IT

    gen = torch.Generator().manual_seed(5)
    index = torch.randint(0, 40, (300, 7), generator=gen)  # ~52 edges a key, repeats within rows
    index[:, 3] = 11  # one key in every row
    index[index == 30] = 31  # key 30 named by no row
    edge_row, offsets = IT.inverse_index(index.to(torch.int32), 45)  # keys 40 .. 44 named by no row either
    assert edge_row.dtype == torch.int32 and offsets.shape == (46,) and offsets[-1] == index.numel()
    for key in range(45):
        rows, slots = (index == key).nonzero(as_tuple=True)  # row-major: (row, slot) order
        assert edge_row[offsets[key]:offsets[key + 1]].tolist() == rows.tolist(), key
    # the edges of a key in (row, slot) order: a row naming a key twice lists it twice, adjacent
    edge = torch.arange(index.numel()).view(300, 7)
    order = torch.cat([edge[index == key] for key in range(45)])  # flattened (row, slot) positions by key
    assert torch.equal(edge_row.long(), order // 7)
    # G tables: one CSR over the (table, key) slots, table by table, each as its own
    tables = torch.stack([index, torch.randint(0, 45, (300, 7), generator=gen), index.flip(0)])  # (3, R, M)
    edge_row, offsets = IT.inverse_index(tables.to(torch.int32), 45)
    assert edge_row.shape == (3 * 300 * 7,) and offsets.shape == (3 * 45 + 1,) and offsets[-1] == tables.numel()
    for g in range(3):
        rows_g, offsets_g = IT.inverse_index(tables[g].to(torch.int32), 45)
        assert torch.equal(offsets[g * 45:(g + 1) * 45 + 1] - offsets[g * 45], offsets_g), g
        assert torch.equal(edge_row[offsets[g * 45]:offsets[(g + 1) * 45]], rows_g), g


def test_kernels_take_float32_only():
    from attention import index_attention_triton as IT

    q = torch.zeros(3, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="float32 tensors only"):
        IT.forward(q, q, q, torch.zeros(3, 2, dtype=torch.long), 2, 0.5)


def test_tables_must_divide_the_heads():
    """G index tables serve G equal groups of heads: 3 tables for 4 heads is refused, by the op and the kernels."""
    from attention import index_attention_triton as IT

    q, index = torch.zeros(3, 8), torch.zeros(3, 3, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="G dividing heads = 4"):
        AF.index_attention(q, q, q, index, 4)
    with pytest.raises(ValueError, match="G dividing heads"):
        IT.forward(q, q, q, index, 4, 0.5)
    with pytest.raises(ValueError, match=r"index must be \(R, M\)"):
        AF.index_attention(q, q, q, torch.zeros(3, dtype=torch.long), 4)


def test_auto_runs_the_torch_kernel_on_the_cpu(monkeypatch):
    def no_kernel(*args, **kwargs):
        raise AssertionError("backend 'auto' called the Triton kernels for CPU tensors")

    monkeypatch.setattr(AF.INDEX_KERNELS, "call", no_kernel)
    monkeypatch.setattr(AF.INDEX_KERNELS, "usable", True)
    assert AF.INDEX_BACKEND == "auto"
    for name, (variant, opts, b, n) in MODULES.items():
        mixer = attention.build(variant, dim=DIM, **opts)
        x = torch.randn(b, n, DIM, requires_grad=True)
        mixer(x, Points(torch.rand(b, n, 3))).sum().backward()
        assert x.grad is not None and torch.isfinite(x.grad).all()
    with pytest.raises(ValueError, match="backend='cuda'"):
        AF.index_backend((), "cuda")


def test_an_index_out_of_range_is_refused_before_the_kernel_reads_it(monkeypatch):
    def no_kernel(*args, **kwargs):
        raise AssertionError("the kernel was launched with an index outside the keys")

    monkeypatch.setattr(AF.INDEX_KERNELS, "call", no_kernel)
    q, k = torch.randn(3, 4), torch.randn(5, 4)
    for bad in (5, -1):
        index = torch.tensor([[0, 1], [2, bad], [4, 4]])
        with pytest.raises(RuntimeError, match="outside the 5 key rows"):
            AF._index_forward(q, k, k, index, 2, 0.5, backend="triton")


def test_op_differentiates_twice_and_counts_flops():
    """A gradient penalty differentiates the op's gradients (create_graph): the plain ops, recomputed, give first
    and second derivatives that match finite differences in float64, with G tables, and with one tensor passed as
    both q and k the same gradient as without create_graph (not counted twice)."""
    c = CASES["3 heads, d=5 d_v=3, repeats, 3 keys never named"]
    q, k, v = (c[t].clone().requires_grad_() for t in "qkv")
    out, lse = AF._index_op(q, k, v, c["index"], c["heads"], c["scale"])  # the op's torch kernel on the CPU
    assert rel_err(lse, reference(q, k, v, c["index"], c["heads"], c["scale"], c["g"])[1]) < 1e-6
    gen = torch.Generator().manual_seed(6)
    index = torch.randint(0, 6, (2, 5, 4), generator=gen)  # G = 2 tables for 4 heads
    q64 = torch.randn(5, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    qk, v64 = (torch.randn(6, 8, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(2))
    for args in ((q64, qk, v64, index[0], 2), (q64, qk, v64, index, 4)):
        assert torch.autograd.gradcheck(lambda *t: AF.index_attention(*t, *args[3:]), args[:3])
        assert torch.autograd.gradgradcheck(lambda *t: AF.index_attention(*t, *args[3:]), args[:3])
    # q and k one tensor (PCT's shared projection does this for offset attention): counted once, not twice
    square = torch.randint(0, 6, (6, 4), generator=gen)
    weight = torch.randn(6, 8, generator=gen, dtype=torch.float64)
    plain = torch.autograd.grad((AF.index_attention(qk, qk, v64, square, 2) * weight).sum(), (qk, v64))
    graph = torch.autograd.grad((AF.index_attention(qk, qk, v64, square, 2) * weight).sum(), (qk, v64),
                                create_graph=True)
    assert all(rel_err(a, b) < 1e-12 for a, b in zip(graph, plain)) and graph[0].requires_grad
    assert torch.autograd.gradgradcheck(lambda t, u: AF.index_attention(t, t, u, square, 2), (qk, v64))
    # FLOPs: the gathered form's (as its bmm's count them), forward and backward
    rows, m = c["index"].shape
    C, C_v = q.shape[1], v.shape[1]
    meta = [t.detach().to("meta").requires_grad_() for t in (q, k, v)]
    with FlopCounterMode(display=False) as counter:
        out = AF._index_op(*meta, c["index"].to("meta"), c["heads"], c["scale"])[0]
    assert counter.get_total_flops() == 2 * rows * m * (C + C_v)
    with FlopCounterMode(display=False) as counter:
        out.backward(torch.empty_like(out))
    assert counter.get_total_flops() == 2 * rows * m * (3 * C + 2 * C_v)


def test_op_registration_passes_opcheck():
    """Schema, autograd registration, fake tensors (torch.compile's leaf) of the op, on its torch kernel."""
    c = CASES["R != T (queries N, keys N + pooled), M=19 > BM, d=6 d_v=4"]
    q, k, v = (c[t].clone().requires_grad_() for t in "qkv")
    result = torch.library.opcheck(AF._index_op, (q, k, v, c["index"], c["heads"], c["scale"]))
    assert set(result.values()) == {"SUCCESS"}, result


def test_kernel_failure_warns_once_and_the_torch_path_takes_over(monkeypatch):
    from attention import index_attention_triton as IT

    c = CASES["high in-degree, 2 heads d=4, int32 index"]
    args = (c["index"], c["heads"], c["scale"])
    q, k, v = (c[t].clone().requires_grad_() for t in "qkv")
    want = torch.autograd.grad(AF.index_attention(q, k, v, *args), (q, k, v), c["g"])  # torch path

    def broken(*args):
        raise RuntimeError("no driver")

    monkeypatch.setattr(IT, "forward", broken)
    monkeypatch.setattr(IT, "backward", broken)
    monkeypatch.setattr(AF.INDEX_KERNELS, "usable", True)
    # backend "auto" as on a GPU: the Triton kernels while they are usable
    monkeypatch.setattr(AF, "index_backend", lambda tensors, backend=None: backend if backend in ("torch", "triton")
                        else "triton" if AF.INDEX_KERNELS.usable else "torch")
    with pytest.warns(UserWarning, match="torch path takes over") as caught:
        got = torch.autograd.grad(AF.index_attention(q, k, v, *args), (q, k, v), c["g"])
    assert len(caught) == 1 and AF.INDEX_KERNELS.usable is False
    assert all(rel_err(a, w) < 1e-6 for a, w in zip(got, want))  # the op's torch kernel finished that call
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # turned off: no second warning, and the op's torch kernel
        again = torch.autograd.grad(AF.index_attention(q, k, v, *args), (q, k, v), c["g"])
    assert all(torch.equal(a, w) for a, w in zip(again, want))
    # the backward alone failing (after a forward on Triton) hands over too
    monkeypatch.setattr(AF.INDEX_KERNELS, "usable", True)
    qd, kd, vd = (t.detach() for t in (q, k, v))
    out, lse = AF._index_forward(qd, kd, vd, *args, backend="torch")
    with pytest.warns(UserWarning, match="torch path takes over"):
        grads = AF._index_backward(c["g"], qd, kd, vd, c["index"], out, lse, c["heads"], c["scale"])
    assert all(rel_err(a, w) < 1e-6 for a, w in zip(grads, want))
    # backend "triton" raises instead, and out of memory always raises (and leaves the kernels on)
    monkeypatch.setattr(AF.INDEX_KERNELS, "usable", True)
    monkeypatch.setattr(AF, "INDEX_BACKEND", "triton")
    with pytest.raises(RuntimeError, match="no driver"):
        AF.index_attention(q, k, v, *args)
    monkeypatch.setattr(AF, "INDEX_BACKEND", "auto")

    def out_of_memory(*args):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(IT, "forward", out_of_memory)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        AF.index_attention(q, k, v, *args)
    assert AF.INDEX_KERNELS.usable is True


# Runs in a subprocess with a scratch Triton cache and no interpreter: records each launch the wrappers make
# (CPU tensors: nothing runs), specialises its arguments as Triton's launcher does, compiles it for an H100 (sm_90,
# no GPU needed), and prints, per launch, its kernel, constexprs, atomic instructions, global loads and registers.
COMPILE = """
import json
import sys
import torch
from attention import index_attention_triton as IT

sys.path.insert(0, "tests")
from triton_sm90 import compile_sm90, record_launches

launches = record_launches(IT._forward_kernel, IT._backward_query_kernel, IT._backward_key_kernel)

n = 4096
qkv = torch.empty(n, 3 * 256)  # dilated: 8 heads in 4 groups, d = 32, row views of the qkv projection, a table each
table = torch.empty(n + 84, 256)  # focal: 4 heads, d = 64, N points + pooled tokens
layouts = {
    "dilated C=256": ((qkv[:, :256], qkv[:, 256:512], qkv[:, 512:]), torch.randint(0, n, (4, n, 9)), 8),
    "focal C=256": ((torch.empty(n, 256), table, table.clone()), torch.randint(0, n + 84, (n, 98)), 4),
}
for name, ((q, k, v), index, heads) in layouts.items():
    del launches[:]
    out, lse = IT.forward(q, k, v, index, heads, 0.2)
    forward_launches = len(launches)
    IT.backward(out, q, k, v, index, out, lse, heads, 0.2)
    assert (forward_launches, len(launches)) == (1, 3), (forward_launches, len(launches))
    passed = [*launches[0][1][:3], *launches[1][1][:3], *launches[2][1][:3]]
    assert all(a is b for a, b in zip(passed, (q, k, v) * 3)), "a copy of q, k or v went to a kernel"
    for kernel, args, options in launches:
        print(json.dumps(dict(layout=name, **compile_sm90(kernel, args, options))))
"""


def test_kernels_compile_for_sm90(tmp_path):
    # One launch forward, two backward, each compiled for an H100 as the wrappers launch it: no atomic instruction
    # (the gradients are sums in a fixed order: bit-reproducible), no spills, 16-byte loads (ALIGN = 4).
    rows = compiled_rows(COMPILE, tmp_path)
    kernels = ["_forward_kernel", "_backward_query_kernel", "_backward_key_kernel"]
    assert [(r["layout"], r["kernel"]) for r in rows] == [
        (layout, kernel) for layout in ("dilated C=256", "focal C=256") for kernel in kernels]
    for r in rows:
        assert r["atomics"] == [], r
        assert r["STACK"] == 0 and r["LOCAL"] == 0 and r["REG"] <= 128, r
        assert r["constexprs"]["ALIGN"] == 4 and "ld.global.v4.b32" in r["loads"], r
        assert r["constexprs"]["DP"] == (32 if r["layout"].startswith("dilated") else 64), r


# --------------------------------------------------------------------------------------------
# On a GPU
# --------------------------------------------------------------------------------------------

def lattice_points(b: int, n: int, seed: int) -> torch.Tensor:
    """(b, n, 3) distinct points of the integer lattice {0..63}^3: every squared distance is an exact integer in
    float32, so the GPU's float32 kNN and the CPU's float64 one name the same neighbours (ties to the lower index)."""
    gen = torch.Generator().manual_seed(seed)
    sites = torch.stack([torch.randperm(64 ** 3, generator=gen)[:n] for _ in range(b)])  # (b, n)
    return torch.stack([sites // 4096, sites // 64 % 64, sites % 64], dim=-1).float()  # (b, n, 3)


def run_mixer(mixer, x, xyz, upstream):
    """y and the gradients of x and of every parameter that gets one, for y's gradient ``upstream``."""
    x = x.clone().requires_grad_()
    mixer.zero_grad()
    y = mixer(x, Points(xyz))
    y.backward(upstream)
    return [y.detach(), x.grad, *(p.grad.clone() for p in mixer.parameters() if p.grad is not None)]


GPU_MIXERS = {"focal": ("focal", dict(heads=4)), "dilated": ("dilated", dict(heads=8))}
# What makes a Triton kernel's failure hand over to torch: the one warning these tests turn into an error (torch warns
# of other things on a GPU, e.g. cuBLAS's first call in autograd's device thread finding no current context).
KERNEL_FAILED = ".*the Triton kernel failed"


@contextlib.contextmanager
def deterministic_algorithms():
    """torch's deterministic algorithms, as ``trainer.deterministic=true`` turns them on. The index-attention kernels
    never add with atomics, but focal pools the points' features through ``torch.gather``, whose backward does on
    CUDA unless these are on: on an H200 two runs at N = 65,536 differed in the last bits."""
    before = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)
        if before is None:
            del os.environ["CUBLAS_WORKSPACE_CONFIG"]
        else:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = before


@pytest.mark.cuda
@pytest.mark.parametrize("name", list(GPU_MIXERS))
def test_mixers_on_the_gpu_against_float64(name):
    variant, opts = GPU_MIXERS[name]
    b, n, c = 2, 3000, 64
    torch.manual_seed(0)
    mixer = attention.build(variant, dim=c, **opts)
    gen = torch.Generator().manual_seed(2)
    xyz, x, g = lattice_points(b, n, 3), torch.randn(b, n, c, generator=gen), torch.randn(b, n, c, generator=gen)
    want = run_mixer(mixer.double(), x.double(), xyz.double(), g.double())  # the CPU torch path in float64
    mixer = mixer.float().cuda()
    assert AF.index_backend((x.cuda(),)) == "triton"
    with warnings.catch_warnings(), deterministic_algorithms():
        warnings.filterwarnings("error", message=KERNEL_FAILED)  # a failing kernel would warn and hand over
        first, second = (run_mixer(mixer, x.cuda(), xyz.cuda(), g.cuda()) for _ in range(2))
    assert all(torch.equal(a, b) for a, b in zip(first, second))  # no atomics in deterministic mode: bit-identical
    for a, w in zip(first, want):
        assert rel_err(a.cpu(), w) < 1e-4, rel_err(a.cpu(), w)  # float32 through the projections and sums
    assert AF.INDEX_KERNELS.usable


@pytest.mark.cuda
def test_kernels_on_the_gpu_against_float64():
    for name, c in CASES.items():
        args = (c["index"].cuda(), c["heads"], c["scale"])
        leaves = [c[t].cuda().requires_grad_() for t in "qkv"]
        assert AF.index_backend(leaves) == "triton"
        out = AF.index_attention(*leaves, *args)
        got = (out, *torch.autograd.grad(out, leaves, c["g"].cuda()))
        want = reference(c["q"], c["k"], c["v"], c["index"], c["heads"], c["scale"], c["g"])
        for a, w in zip(got, want[:1] + want[2:]):
            assert rel_err(a.cpu(), w) < 1e-5, (name, rel_err(a.cpu(), w))


@pytest.mark.cuda
@pytest.mark.parametrize("name", list(GPU_MIXERS))
def test_mixers_at_65536_points_finish_and_repeat_bit_for_bit(name):
    """Issue 28 §4's size: N = 65,536, C = 256, forward + backward, twice, bit-identical (deterministic
    algorithms on, as trainer.deterministic=true has them)."""
    import time

    variant, opts = GPU_MIXERS[name]
    n, c = 65536, 256
    torch.manual_seed(0)
    mixer = attention.build(variant, dim=c, **opts).cuda()
    gen = torch.Generator().manual_seed(4)
    xyz = lattice_points(1, n, 5).cuda()
    x, g = torch.randn(1, n, c, generator=gen).cuda(), torch.randn(1, n, c, generator=gen).cuda()
    runs = []
    with deterministic_algorithms():
        for _ in range(2):
            torch.cuda.synchronize()
            start = time.perf_counter()
            runs.append(run_mixer(mixer, x, xyz, g))
            torch.cuda.synchronize()
            print(f"{name} N={n} C={c} forward + backward: {time.perf_counter() - start:.3f} s")
    assert all(t.isfinite().all() for t in runs[0])
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    assert AF.INDEX_KERNELS.usable
