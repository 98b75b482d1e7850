"""The kernels of ``attention.functional`` against brute-force float64 references.

Every reference below is written from the formula in the project issue, with an
explicit N x M matrix per (sample, head) and explicit sums, independently of the
kernel it checks (no call into ``attention``).
"""

import math

import pytest
import torch

from attention import functional as AF

# (B, heads, N, M, d, d_v): d_v != d and N != M included.
SHAPES = [
    (1, 1, 5, 5, 4, 4),
    (2, 3, 7, 4, 8, 5),
    (3, 2, 4, 9, 6, 10),
    (2, 4, 16, 16, 16, 16),
]
SHAPE_IDS = ["B{}h{}N{}M{}d{}dv{}".format(*s) for s in SHAPES]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def randn(gen, *shape):
    return torch.randn(*shape, generator=gen, dtype=torch.float64)


def per_head(fn, *tensors):
    """Apply ``fn`` to the 2-D slices [b, h] of each tensor and stack (B, h, ...)."""
    B, H = tensors[0].shape[:2]
    return torch.stack([torch.stack([fn(*(t[b, h] for t in tensors)) for h in range(H)]) for b in range(B)])


# --------------------------------------------------------------------------------------------
# Brute-force references (float64, explicit N x M matrices)
# --------------------------------------------------------------------------------------------

def ref_softmax(q, k, v, scale=None):
    d = q.shape[-1]
    scale = d ** -0.5 if scale is None else scale

    def one(q, k, v):  # q (N, d), k (M, d), v (M, d_v)
        N, M = q.shape[0], k.shape[0]
        logits = torch.empty(N, M, dtype=torch.float64)
        for i in range(N):
            for j in range(M):
                logits[i, j] = (q[i] * k[j]).sum() * scale
        e = torch.exp(logits - logits.max(dim=1, keepdim=True).values)
        a = e / e.sum(dim=1, keepdim=True)
        return a @ v

    return per_head(one, q, k, v)


def ref_offset(q, k, v, eps=1e-9):
    def one(q, k, v):  # q (N, d), k (M, d), v (N, d_v) -> (M, d_v)
        N, M = q.shape[0], k.shape[0]
        logits = q @ k.T  # no scaling
        e = torch.exp(logits - logits.max(dim=1, keepdim=True).values)
        a = e / e.sum(dim=1, keepdim=True)  # softmax over keys
        col = torch.zeros(M, dtype=torch.float64)
        for j in range(M):
            for i in range(N):
                col[j] += a[i, j]
        a = a / (eps + col)[None, :]
        out = torch.zeros(M, v.shape[1], dtype=torch.float64)
        for j in range(M):
            for i in range(N):
                out[j] += a[i, j] * v[i]
        return out

    return per_head(one, q, k, v)


def ref_external(q, mem_k, mem_v, eps=1e-9):
    def one(q):  # q (N, d)
        N, S = q.shape[0], mem_k.shape[0]
        logits = q @ mem_k.T  # (N, S)
        e = torch.exp(logits - logits.max(dim=0, keepdim=True).values)
        a = e / e.sum(dim=0, keepdim=True)  # softmax over the N tokens
        rows = torch.zeros(N, dtype=torch.float64)
        for i in range(N):
            for s in range(S):
                rows[i] += a[i, s]
        a = a / (eps + rows)[:, None]
        return a @ mem_v

    return per_head(one, q)


def ref_taylor(q, k, v, eps=1e-6):
    def one(q, k, v):
        qn = q / q.norm(dim=-1, keepdim=True)
        kn = k / k.norm(dim=-1, keepdim=True)
        sim = 1 + qn @ kn.T  # (N, M), S_ij = 1 + q_i . k_j
        # The denominator N + q.(sum_j k_j + eps) is S.sum(-1) + eps * sum(q_i).
        den = sim.sum(dim=-1) + eps * qn.sum(dim=-1)
        return (sim @ v) / den[:, None]

    return per_head(one, q, k, v)


def ref_elu(q, k, v, eps=1e-6):
    def phi(x):
        return torch.where(x > 0, x + 1, torch.exp(x))  # elu(x) + 1

    def one(q, k, v):
        sim = phi(q) @ phi(k).T  # (N, M)
        return (sim @ v) / (sim.sum(dim=-1) + eps)[:, None]

    return per_head(one, q, k, v)


# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------

def qkv_inputs(kernel, shape, seed):
    """Random float64 inputs of a kernel for ``shape`` = (B, h, N, M, d, d_v)."""
    B, H, N, M, d, dv = shape
    gen = torch.Generator().manual_seed(seed)
    q = randn(gen, B, H, N, d)
    if kernel == "external":
        return q, randn(gen, M, d), randn(gen, M, d)  # M plays the memory size S
    if kernel == "offset":
        return q, randn(gen, B, H, M, d), randn(gen, B, H, N, dv)  # v has the queries' length
    return q, randn(gen, B, H, M, d), randn(gen, B, H, M, dv)


KERNELS = {
    "softmax": (AF.softmax_attention, ref_softmax),
    "offset": (AF.offset_attention, ref_offset),
    "external": (AF.external_attention, ref_external),
    "taylor": (AF.taylor_linear_attention, ref_taylor),
    "elu": (AF.elu_linear_attention, ref_elu),
}


def seed_of(kernel, shape):
    """A fixed seed per (kernel, shape) (``hash`` of a str changes between runs)."""
    return 100 * sorted(KERNELS).index(kernel) + SHAPES.index(shape)


def expected_shape(kernel, shape):
    B, H, N, M, d, dv = shape
    if kernel == "external":
        return (B, H, N, d)
    if kernel == "offset":
        return (B, H, M, dv)  # indexed by key position
    return (B, H, N, dv)


# --------------------------------------------------------------------------------------------
# Against the references
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_kernel_matches_bruteforce_float32(kernel, shape):
    fn, ref = KERNELS[kernel]
    inputs = qkv_inputs(kernel, shape, seed=seed_of(kernel, shape))
    expected = ref(*inputs)
    out = fn(*(t.float() for t in inputs))
    assert out.dtype == torch.float32
    assert out.shape == expected_shape(kernel, shape)
    assert torch.isfinite(out).all()
    assert rel_err(out, expected) < 1e-5


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_kernel_matches_bruteforce_float64(kernel, shape):
    fn, ref = KERNELS[kernel]
    inputs = qkv_inputs(kernel, shape, seed=1000 + seed_of(kernel, shape))
    out = fn(*inputs)
    assert out.dtype == torch.float64
    assert out.shape == expected_shape(kernel, shape)
    assert rel_err(out, ref(*inputs)) < 1e-12


def test_softmax_explicit_scale():
    gen = torch.Generator().manual_seed(3)
    q, k, v = randn(gen, 2, 2, 5, 4), randn(gen, 2, 2, 6, 4), randn(gen, 2, 2, 6, 3)
    for scale in (1.0, 0.1):
        assert rel_err(AF.softmax_attention(q, k, v, scale=scale), ref_softmax(q, k, v, scale=scale)) < 1e-12


def test_external_memory_of_other_width():
    """mem_v may have its own width: the output takes it."""
    gen = torch.Generator().manual_seed(4)
    q, mk, mv = randn(gen, 2, 3, 6, 4), randn(gen, 5, 4), randn(gen, 5, 7)
    out = AF.external_attention(q, mk, mv)
    assert out.shape == (2, 3, 6, 7)
    assert rel_err(out, ref_external(q, mk, mv)) < 1e-12


# Closed forms: uniform attention, checked without any reference implementation.

def test_closed_forms_with_zero_queries():
    gen = torch.Generator().manual_seed(5)
    B, H, N, M, d, dv = 2, 2, 5, 7, 4, 3
    k, v = randn(gen, B, H, M, d), randn(gen, B, H, M, dv)
    q0 = torch.zeros(B, H, N, d, dtype=torch.float64)
    mean_v = v.mean(dim=-2, keepdim=True).expand(B, H, N, dv)
    # softmax of equal logits -> mean of the values
    assert rel_err(AF.softmax_attention(q0, k, v), mean_v) < 1e-12
    # LAM: a zero query normalises to zero, sim = 1 -> mean of the values
    assert rel_err(AF.taylor_linear_attention(q0, k, v), mean_v) < 1e-12
    # offset: q = k = 0 -> A = 1/M, column sums N/M -> A = 1/N: every output is the mean of v over queries
    vq = randn(gen, B, H, N, dv)
    out = AF.offset_attention(q0, torch.zeros(B, H, M, d, dtype=torch.float64), vq)
    assert out.shape == (B, H, M, dv)
    assert rel_err(out, vq.mean(dim=-2, keepdim=True).expand(B, H, M, dv)) < 1e-8
    # external: softmax over tokens = 1/N, row sums S/N -> 1/S: mean of the value memory
    S = 6
    mk, mv = randn(gen, S, d), randn(gen, S, d)
    out = AF.external_attention(q0, mk, mv)
    assert rel_err(out, mv.mean(dim=0).expand(B, H, N, d)) < 1e-8


def test_elu_with_one_key_returns_its_value():
    gen = torch.Generator().manual_seed(6)
    q, k, v = randn(gen, 2, 3, 5, 4), randn(gen, 2, 3, 1, 4), randn(gen, 2, 3, 1, 6)
    out = AF.elu_linear_attention(q, k, v)
    # phi > 0, so with a single key the weights are 1 up to eps = 1e-6
    assert rel_err(out, v.expand(2, 3, 5, 6)) < 1e-5


def test_offset_columns_sum_to_one():
    """After the column normalisation every key's weights over queries sum to ~1: v = 1 gives 1."""
    gen = torch.Generator().manual_seed(7)
    q, k = randn(gen, 2, 2, 6, 4), randn(gen, 2, 2, 9, 4)
    out = AF.offset_attention(q, k, torch.ones(2, 2, 6, 1, dtype=torch.float64))
    assert torch.allclose(out, torch.ones_like(out), atol=1e-6)


def test_external_rows_sum_to_one():
    gen = torch.Generator().manual_seed(8)
    q, mk = randn(gen, 2, 2, 6, 4), randn(gen, 5, 4)
    out = AF.external_attention(q, mk, torch.ones(5, 1, dtype=torch.float64))
    assert torch.allclose(out, torch.ones_like(out), atol=1e-6)


@pytest.mark.parametrize("kernel", ["softmax", "taylor", "elu"])
def test_key_permutation_invariance(kernel):
    """Permuting keys and values together leaves the output unchanged."""
    fn, _ = KERNELS[kernel]
    q, k, v = qkv_inputs(kernel, (2, 2, 5, 8, 4, 3), seed=9)
    perm = torch.randperm(8, generator=torch.Generator().manual_seed(10))
    assert rel_err(fn(q, k[:, :, perm], v[:, :, perm]), fn(q, k, v)) < 1e-12


# --------------------------------------------------------------------------------------------
# Gradients
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_gradcheck(kernel):
    fn, _ = KERNELS[kernel]
    inputs = tuple(t.requires_grad_() for t in qkv_inputs(kernel, (1, 2, 4, 3, 3, 2), seed=11))
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_float32_gradients_finite(kernel):
    fn, _ = KERNELS[kernel]
    inputs = tuple(t.float().requires_grad_() for t in qkv_inputs(kernel, (2, 2, 16, 12, 8, 8), seed=12))
    fn(*inputs).square().sum().backward()
    for t in inputs:
        assert t.grad is not None and torch.isfinite(t.grad).all()
        assert t.grad.abs().sum() > 0


def test_reference_sanity():
    """The references themselves: softmax reference vs a closed-form 1-key case and row-stochasticity."""
    gen = torch.Generator().manual_seed(13)
    q, k = randn(gen, 1, 1, 3, 2), randn(gen, 1, 1, 4, 2)
    ones = torch.ones(1, 1, 4, 1, dtype=torch.float64)
    assert torch.allclose(ref_softmax(q, k, ones), torch.ones(1, 1, 3, 1, dtype=torch.float64))
    # two keys: weight of key 0 is a logistic in the logit difference
    k2, v2 = randn(gen, 1, 1, 2, 2), torch.tensor([[[[1.0], [0.0]]]], dtype=torch.float64)
    diff = (q[0, 0] @ (k2[0, 0, 0] - k2[0, 0, 1])) / math.sqrt(2)
    assert torch.allclose(ref_softmax(q, k2, v2)[0, 0, :, 0], torch.sigmoid(diff))


# --------------------------------------------------------------------------------------------
# offset attention in bounded memory (issue 28): the chunked two-pass form
# --------------------------------------------------------------------------------------------

def offset_full(q, k, v, eps=1e-9):
    """The whole-map form of offset_attention, as it was (softmax over keys, columns over queries)."""
    attn = torch.softmax(q @ k.transpose(-2, -1), dim=-1)
    attn = attn / (eps + attn.sum(dim=-2, keepdim=True))
    return attn.transpose(-2, -1) @ v


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_offset_written_out_backward_equals_autograds_of_the_plain_ops(shape):
    """OffsetFull's backward (issue 28: fewer kernels) gives the plain ops' gradients in float64, for separate q
    and k, for one shared q = k (PCT's projection: the two gradients add up) and for v alone."""
    q, k, v = (t.requires_grad_() for t in qkv_inputs("offset", shape, seed=25))
    grad = torch.randn(*k.shape[:-1], v.shape[-1], generator=torch.Generator().manual_seed(26),
                       dtype=torch.float64)
    out = AF.OffsetFull.apply(q, k, v, 1e-9)
    assert rel_err(out.detach(), offset_full(q, k, v).detach()) < 1e-13
    for got, want in zip(torch.autograd.grad(out, (q, k, v), grad),
                         torch.autograd.grad(offset_full(q, k, v), (q, k, v), grad)):
        assert rel_err(got, want) < 1e-12
    if shape[2] == shape[3]:
        qk = q.detach().clone().requires_grad_()
        got = torch.autograd.grad(AF.OffsetFull.apply(qk, qk, v.detach(), 1e-9), qk, grad)[0]
        assert rel_err(got, torch.autograd.grad(offset_full(qk, qk, v.detach()), qk, grad)[0]) < 1e-12
    v_only = v.detach().clone().requires_grad_()
    got = torch.autograd.grad(AF.OffsetFull.apply(q.detach(), k.detach(), v_only, 1e-9), v_only, grad)[0]
    assert rel_err(got, torch.autograd.grad(offset_full(q.detach(), k.detach(), v_only), v_only, grad)[0]) < 1e-12


@pytest.mark.parametrize("kernel", ["offset", "offset chunked", "taylor", "elu", "external"])
def test_written_out_backward_called_under_autocast_computes_in_float32(kernel, monkeypatch):
    """A caller that runs backward() inside its autocast block (torch allows it) gets the gradients of a backward
    outside it, bit for bit: the written-out backwards switch autocast off, as float32_kernel does for the forward
    (under autocast their products ran in bfloat16, and the full offset form's softmax backward failed on mixed
    dtypes). Offset with one tensor as q and k, as PCT."""
    if kernel == "offset chunked":
        monkeypatch.setattr(AF, "OFFSET_FULL_MAX_ELEMENTS", 1)
        monkeypatch.setattr(AF, "OFFSET_CHUNK_ELEMENTS", 2 * 8)  # chunks of 2 queries
    gen = torch.Generator().manual_seed(29)
    if kernel.startswith("offset"):
        tensors, call = (randn(gen, 1, 2, 8, 4), randn(gen, 1, 2, 8, 6)), lambda a, b: AF.offset_attention(a, a, b)
    else:
        k_shape = (6, 4) if kernel == "external" else (1, 2, 8, 4)
        tensors, call = (randn(gen, 1, 2, 8, 4), randn(gen, *k_shape), randn(gen, *k_shape)), KERNELS[kernel][0]
    grads = []
    for inside in (False, True):
        leaves = [t.float().requires_grad_() for t in tensors]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = call(*(t.bfloat16() for t in leaves))
            if inside:
                out.float().square().sum().backward()
        if not inside:
            out.float().square().sum().backward()
        grads.append([t.grad for t in leaves])
    for outside, inside in zip(*grads):
        assert inside.dtype == torch.float32 and torch.equal(inside, outside)


def test_offset_double_backward():
    """A gradient penalty differentiates offset attention twice: gradgradcheck through OffsetFull, and PCT's one
    tensor as q and k gets the plain ops' gradient and second gradient (each input's share counted once)."""
    inputs = tuple(t.requires_grad_() for t in qkv_inputs("offset", (1, 2, 4, 3, 3, 2), seed=27))
    assert torch.autograd.gradgradcheck(lambda q, k, v: AF.offset_attention(q, k, v), inputs,
                                        eps=1e-6, atol=1e-6, rtol=1e-5)
    qk, v = inputs[0].detach().requires_grad_(), inputs[2][..., :4, :].detach().requires_grad_()
    results = []
    for fn in (AF.offset_attention, lambda *t: AF._offset_full(*t, 1e-9)):
        grad, = torch.autograd.grad(fn(qk, qk, v).square().sum(), qk, create_graph=True)
        results.append((grad, *torch.autograd.grad(grad.square().sum(), (qk, v))))
    for got, want in zip(*results):
        assert rel_err(got.detach(), want.detach()) < 1e-12
    assert torch.autograd.gradgradcheck(lambda q, v: AF.offset_attention(q, q, v), (qk, v),
                                        eps=1e-6, atol=1e-6, rtol=1e-5)


def test_offset_backward_launches_fewer_kernels_and_no_broadcast_add_over_the_map():
    """The written-out backward runs 9 kernels where autograd's chain of the plain ops (``AF._offset_full``, the
    form before it) ran 13, and its only (N, M) outputs are the map's gradient (the column sums' share added by the
    product itself) and the softmax's backward: the plain chain adds the column sums' gradient as a pass of its
    own."""
    from op_log import OpLog

    b, h, n, d, dv = 2, 1, 16, 4, 8
    gen = torch.Generator().manual_seed(28)
    qk, v = randn(gen, b, h, n, d).requires_grad_(), randn(gen, b, h, n, dv).requires_grad_()
    grad = randn(gen, b, h, n, dv)
    counts = {}
    for name, fn in (("written", AF.offset_attention), ("plain", lambda q, k, v: AF._offset_full(q, k, v, 1e-9))):
        out = fn(qk, qk, v)
        with OpLog() as log:
            torch.autograd.grad(out, (qk, v), grad)
        counts[name] = [(op, numel) for op, view, numel in log.ops if not view and op != "_unsafe_view.default"]
    written = [op for op, _ in counts["written"]]
    assert sorted(written) == sorted(["div.Tensor", "mul.Tensor", "sum.dim_IntList", "baddbmm.default",
                                      "_softmax_backward_data.default", "bmm.default", "bmm.default", "bmm.default",
                                      "add.Tensor"]), written  # add: q's and k's gradients, one (N, d) tensor
    map_passes = [op for op, numel in counts["written"] if numel == b * h * n * n]
    assert map_passes == ["baddbmm.default", "_softmax_backward_data.default"], map_passes
    plain = counts["plain"]
    assert len(plain) == 13 and [op for op, numel in plain if numel == b * h * n * n] == [
        "bmm.default", "add.Tensor", "_softmax_backward_data.default"], plain


LINEAR = {"taylor": True, "elu": False}


def linear_plain(taylor):
    return lambda q, k, v: AF._linear_plain(q, k, v, 1e-6, taylor)


def linear_written(taylor):
    return lambda q, k, v: AF.LinearAttention.apply(q, k, v, 1e-6, taylor)


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("kernel", sorted(LINEAR))
def test_linear_written_out_backward_equals_autograds_of_the_plain_ops(kernel, shape):
    """LinearAttention (both linear kernels, one (d, d_v + 1) product for numerator and denominator, a backward
    written out) gives the plain ops' values and gradients in float64: separate q and k, one tensor as both, v
    alone; and a query of zeros for Taylor, whose norm F.normalize clamps (its gradient is then dy / 1e-12)."""
    taylor = LINEAR[kernel]
    q, k, v = (t.requires_grad_() for t in qkv_inputs(kernel, shape, seed=31))
    if taylor:
        q.data[..., 0, :] = 0
    grad = randn(torch.Generator().manual_seed(32), *q.shape[:-1], v.shape[-1])
    written, plain = linear_written(taylor), linear_plain(taylor)
    out = written(q, k, v)
    assert rel_err(out.detach(), plain(q, k, v).detach()) < 1e-13
    assert rel_err(out.detach(), KERNELS[kernel][1](q.detach(), k.detach(), v.detach())) < 1e-12 or taylor
    want_grads = torch.autograd.grad(plain(q, k, v), (q, k, v), grad)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), grad), want_grads):
        assert rel_err(got, want) < 1e-12
    if shape[2] == shape[3]:
        qk = k.detach().clone().requires_grad_()
        got = torch.autograd.grad(written(qk, qk, v.detach()), qk, grad)[0]
        assert rel_err(got, torch.autograd.grad(plain(qk, qk, v.detach()), qk, grad)[0]) < 1e-12
    v_only = v.detach().clone().requires_grad_()
    got = torch.autograd.grad(written(q.detach(), k.detach(), v_only), v_only, grad)[0]
    assert rel_err(got, torch.autograd.grad(plain(q.detach(), k.detach(), v_only), v_only, grad)[0]) < 1e-12


@pytest.mark.parametrize("kernel", sorted(LINEAR))
def test_linear_gradients_reach_a_projection_without_copies(kernel):
    """The mixers hand over q, k and v as head views of one projection (B, N, 3C): the written-out backward writes
    dq and dk in that layout, so that the views' backward takes them back without a copy (one ``clone``, for dv,
    where the plain chain and a contiguous dq, dk took more), and every op of the plain chain's backward counted,
    it runs fewer; the projection's gradient is the plain chain's."""
    from einops import rearrange
    from op_log import OpLog

    taylor = LINEAR[kernel]
    x = randn(torch.Generator().manual_seed(33), 2, 16, 3 * 8).requires_grad_()
    grads, ops = {}, {}
    for name, fn in (("written", linear_written(taylor)), ("plain", linear_plain(taylor))):
        q, k, v = (rearrange(t, "b n (h d) -> b h n d", h=2) for t in x.split(8, dim=-1))
        out = fn(q, k, v)
        with OpLog() as log:
            grads[name], = torch.autograd.grad(out, x, torch.ones_like(out))
        ops[name] = [op for op, view, _ in log.ops
                     if not view and op not in ("empty.memory_format", "ones_like.default")]
    assert rel_err(grads["written"], grads["plain"]) < 1e-12
    assert sum(op.startswith("clone") for op in ops["written"]) == 1, ops["written"]
    assert len(ops["written"]) < len(ops["plain"]), (ops["written"], ops["plain"])


@pytest.mark.parametrize("kernel", sorted(LINEAR))
def test_linear_double_backward(kernel):
    """A gradient penalty differentiates the linear kernels twice (the plain ops recomputed under create_graph)."""
    inputs = tuple(t.requires_grad_() for t in qkv_inputs(kernel, (1, 2, 4, 3, 3, 2), seed=35))
    assert torch.autograd.gradgradcheck(KERNELS[kernel][0], inputs, eps=1e-6, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_external_written_out_backward_equals_autograds_of_the_plain_ops(shape):
    """External attention is offset attention with the memory's slots as queries: through OffsetFull (the slot
    normalisation after the product, a backward written out) it gives the plain ops' values and gradients in
    float64, the memories' gradients summed over every (sample, head), where that is the cheaper form: no dropout
    in training and d_v <= S (it divides the (N, d_v) output where the plain ops divide the (S, N) map), otherwise
    the plain ops run."""
    b, h, n, s, d, _ = shape
    gen = torch.Generator().manual_seed(36)
    q, mk, mv = randn(gen, b, h, n, d).requires_grad_(), randn(gen, s, d).requires_grad_(), randn(gen, s, d)
    mv = mv[:, :min(d, s)].clone().requires_grad_()  # d_v <= S
    grad = randn(gen, b, h, n, mv.shape[-1])
    out = AF.external_attention(q, mk, mv)
    assert type(out.grad_fn).__name__ == "OffsetFullBackward"
    plain = AF._external_plain(q, mk, mv, 1e-9)
    assert rel_err(out.detach(), plain.detach()) < 1e-13
    assert rel_err(out.detach(), ref_external(q.detach(), mk.detach(), mv.detach())) < 1e-12
    for got, want in zip(torch.autograd.grad(out, (q, mk, mv), grad), torch.autograd.grad(plain, (q, mk, mv), grad)):
        assert rel_err(got, want) < 1e-12
    assert torch.autograd.gradgradcheck(AF.external_attention, (q[:1, :1, :3].detach().requires_grad_(), mk, mv),
                                        eps=1e-6, atol=1e-6)
    wide = randn(gen, s, s + 1).requires_grad_()  # d_v > S, and dropout in training: the plain ops
    assert type(AF.external_attention(q, mk, wide).grad_fn).__name__ != "OffsetFullBackward"
    dropped = AF.external_attention(q, mk, mv, dropout=0.5, training=True)
    assert type(dropped.grad_fn).__name__ != "OffsetFullBackward"


def test_batched_matmul_is_matmul_with_fewer_host_ops():
    """The linear, focal kernels' products: equal to ``@`` for equal leading dims (4-D, 5-D, 3-D), broadcast ones and
    matrices, gradients too; on equal leading dims of 4-D tensors fewer aten ops than ``matmul``'s, forward and
    backward (host time, in a step its launches bound)."""
    from torch.profiler import ProfilerActivity, profile

    gen = torch.Generator().manual_seed(30)
    for a_shape, b_shape in [((2, 3, 5, 4), (2, 3, 4, 6)), ((2, 3, 2, 5, 4), (2, 3, 2, 4, 6)), ((3, 5, 4), (3, 4, 6)),
                             ((2, 3, 5, 4), (4, 6)), ((2, 1, 5, 4), (1, 3, 4, 6)), ((5, 4), (4, 6))]:
        a, b = randn(gen, *a_shape).requires_grad_(), randn(gen, *b_shape).requires_grad_()
        got, want = AF.batched_matmul(a, b), a @ b
        assert got.shape == want.shape and torch.allclose(got, want, rtol=0, atol=1e-14)
        grad = randn(gen, *want.shape)
        for g, w in zip(torch.autograd.grad(got, (a, b), grad), torch.autograd.grad(want, (a, b), grad)):
            assert torch.allclose(g, w, rtol=0, atol=1e-13)

    a, b = randn(gen, 2, 3, 5, 4).requires_grad_(), randn(gen, 2, 3, 4, 6).requires_grad_()

    def host_ops(fn) -> int:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn(a, b).sum().backward()
        return sum(e.name.startswith("aten::") for e in prof.events())

    assert host_ops(AF.batched_matmul) < host_ops(torch.matmul)


def test_offset_dispatches_fewer_host_ops_than_the_plain_chain():
    """Every op the host dispatches, views and matmul's wrappers included (what torch.profiler lists as aten ops):
    on a GPU, PCT's batch-16 step is bound by its host. The written-out function multiplies its (B h) matrices with
    ``bmm``, where ``@`` on (B, h, ., .) wraps each product in about ten more ops: forward and backward took 108
    host ops, more than the plain chain's 99, before; 71 now."""
    from torch.profiler import ProfilerActivity, profile

    gen = torch.Generator().manual_seed(29)
    qk, v = randn(gen, 2, 1, 16, 4).requires_grad_(), randn(gen, 2, 1, 16, 8).requires_grad_()
    grad = randn(gen, 2, 1, 16, 8)

    def host_ops(fn) -> int:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            torch.autograd.grad(fn(qk, qk, v), (qk, v), grad)
        return sum(e.name.startswith("aten::") for e in prof.events())

    written = host_ops(AF.offset_attention)
    plain = host_ops(lambda q, k, v: AF._offset_full(q, k, v, 1e-9))
    assert written <= 0.8 * plain, (written, plain)


# --------------------------------------------------------------------------------------------
# PCT's offset mixer with its projections as one function (OffsetProjected)
# --------------------------------------------------------------------------------------------

def projected_inputs(seed, b=2, n=7, c=16, d_qk=4, bias=True, layout="contiguous"):
    gen = torch.Generator().manual_seed(seed)
    x = randn(gen, b, n, c) if layout == "contiguous" else randn(gen, b, c, n).transpose(1, 2)  # (B, N, C)
    weights = [randn(gen, d_qk, c), randn(gen, c, c), randn(gen, c) if bias else None]
    return [x.requires_grad_()] + [w if w is None else w.requires_grad_() for w in weights]


def projected(*args):
    """OffsetProjected outside autocast: apply(x, w_qk, w_v, b_v, heads, eps)."""
    return AF.OffsetProjected.apply(*args, None)


def ref_offset_projected(x, w_qk, w_v, b_v, heads):
    """The mixer written from its definition: explicit projections, heads split, ref_offset's explicit sums."""
    b, n, _ = x.shape
    qk = torch.einsum("bnc,oc->bno", x, w_qk)
    v = torch.einsum("bnc,oc->bno", x, w_v) + (0 if b_v is None else b_v)
    split = lambda t: t.reshape(b, n, heads, -1).permute(0, 2, 1, 3)  # noqa: E731  (B, h, N, d)
    return ref_offset(split(qk), split(qk), split(v)).permute(0, 2, 1, 3).reshape(b, n, -1)  # (B, N, h d_v)


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("heads,bias", [(1, True), (2, True), (4, False)])
def test_offset_projected_equals_the_projections_then_offset_attention(heads, bias, layout):
    """Values against the explicit reference; gradients of x and of all three weights against autograd through
    the two nn.Linear products and offset_attention (the mixer before), float64; with frozen weights, and with
    x that needs no gradient."""
    x, w_qk, w_v, b_v = projected_inputs(40 + heads, bias=bias, layout=layout)
    out = projected(x, w_qk, w_v, b_v, heads, 1e-9)
    assert out.shape == (2, 7, 16)
    assert rel_err(out.detach(), ref_offset_projected(x, w_qk, w_v, b_v, heads).detach()) < 1e-12
    grad = randn(torch.Generator().manual_seed(45), *out.shape)
    inputs = [t for t in (x, w_qk, w_v, b_v) if t is not None]
    got = torch.autograd.grad(out, inputs, grad)
    want = torch.autograd.grad(AF._offset_projected_plain(x, w_qk, w_v, b_v, heads, 1e-9), inputs, grad)
    for g, w in zip(got, want):
        assert g.shape == w.shape and rel_err(g, w) < 1e-12
    frozen = [w if w is None else w.detach() for w in (w_qk, w_v, b_v)]
    dx, = torch.autograd.grad(projected(x, *frozen, heads, 1e-9), x, grad)
    assert rel_err(dx, want[0]) < 1e-12
    weights_only = torch.autograd.grad(projected(x.detach(), w_qk, w_v, b_v, heads, 1e-9),
                                       inputs[1:], grad)
    for g, w in zip(weights_only, want[1:]):
        assert rel_err(g, w) < 1e-12


def test_offset_projected_double_backward():
    """A gradient penalty through the mixer: the plain ops recomputed, so second derivatives exist (gradgradcheck)."""
    inputs = projected_inputs(46, b=1, n=4, c=8, d_qk=2)
    assert torch.autograd.gradcheck(lambda *t: projected(*t, 1, 1e-9), inputs)
    assert torch.autograd.gradgradcheck(lambda *t: projected(*t, 1, 1e-9), inputs)
    assert torch.autograd.gradgradcheck(lambda *t: projected(*t, 2, 1e-9), inputs)


@pytest.mark.parametrize("heads", [1, 2])
def test_offset_projected_double_backward_without_bias(heads):
    """Without b_v (None, not an input of the recomputed plain ops) a gradient penalty still differentiates twice:
    second derivatives against finite differences, and the create_graph gradients equal the plain ops'."""
    x, w_qk, w_v, _ = projected_inputs(47, b=1, n=4, c=8, d_qk=2, bias=False)
    assert torch.autograd.gradgradcheck(lambda *t: projected(*t, None, heads, 1e-9), (x, w_qk, w_v))
    assert torch.autograd.gradgradcheck(lambda *t: AF.offset_projected(*t, None, heads), (x, w_qk, w_v))
    got = torch.autograd.grad(projected(x, w_qk, w_v, None, heads, 1e-9).square().sum(), (x, w_qk, w_v),
                              create_graph=True)
    want = torch.autograd.grad(ref_offset_projected(x, w_qk, w_v, None, heads).square().sum(), (x, w_qk, w_v))
    assert all(rel_err(g, w) < 1e-12 for g, w in zip(got, want))


def test_offset_projected_takes_fewer_nodes_and_kernels():
    """One autograd node where the two nn.Linear and the kernel made eleven (views, transposes, the products, the
    sums of q's and k's and of x's two uses' gradients): 6 nodes a forward + backward with the weights' 3
    AccumulateGrad and the sum, against 17; and 3 products fewer (one for both projections forward, one each for
    the input's and the weights' gradients backward), counted below autograd, views left out; and the same FLOPs
    as the FLOP counter counts them (it counts no in-place ``baddbmm_``, so the function takes none)."""
    from op_log import OpLog
    from torch.utils.flop_counter import FlopCounterMode

    inputs = projected_inputs(47, n=16, c=32, d_qk=8)

    def count(fn):
        with OpLog() as log:
            loss = fn(*inputs, 1, 1e-9).sum()
            nodes, stack = set(), [loss.grad_fn]
            while stack:
                node = stack.pop()
                if node is not None and node not in nodes:
                    nodes.add(node)
                    stack.extend(n for n, _ in node.next_functions)
            torch.autograd.grad(loss, inputs)
        products = [op for op, view, _ in log.ops if op.split(".")[0] in ("mm", "addmm", "bmm", "baddbmm", "baddbmm_")]
        return len(nodes), len(products), len([op for op, view, _ in log.ops if not view]), log.count["copy_"]

    fused, plain = count(projected), count(AF._offset_projected_plain)
    assert fused[3] == 0, fused  # v's bias added in place on its columns, not copied back into them
    assert fused[0] == 6 and plain[0] == 17, (fused, plain)
    assert fused[1] == plain[1] - 3, (fused, plain)
    assert fused[2] < plain[2], (fused, plain)

    def flops(fn, heads):  # the same work, as the FLOP counter (mode=bench, mode=summary) sees it
        with FlopCounterMode(display=False) as counter:
            torch.autograd.grad(fn(*inputs, heads, 1e-9).sum(), inputs)
        return counter.get_total_flops()

    for heads in (1, 2):
        assert flops(projected, heads) == flops(AF._offset_projected_plain, heads) > 0


def test_offset_mixer_runs_as_one_function_where_it_can(monkeypatch):
    """The offset variant trains through OffsetProjected in float32, float64 and under autocast; a map too large
    to hold whole keeps the plain form (the chunked kernel), and so does every call with ``OFFSET_PROJECTED`` off
    (the benchmark's other form), with the same values."""
    import attention

    mixer = attention.build("offset", dim=16)
    x = torch.randn(2, 8, 16, requires_grad=True)
    assert mixer(x).grad_fn.name() == "OffsetProjectedBackward"
    assert mixer.double()(x.double()).grad_fn.name() == "OffsetProjectedBackward"
    mixer.float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = mixer(x)
    assert out.dtype == torch.bfloat16 and out.grad_fn.name() == "OffsetProjectedBackward"
    fused = mixer(x)
    with monkeypatch.context() as patch:
        patch.setattr(AF, "OFFSET_PROJECTED", False)
        plain = mixer(x)
        assert plain.grad_fn.name() != "OffsetProjectedBackward"
    assert torch.allclose(plain, fused, rtol=1e-5, atol=1e-6)
    monkeypatch.setattr(AF, "OFFSET_FULL_MAX_ELEMENTS", 2 * 8 * 8 - 1)
    assert mixer(x).grad_fn.name() != "OffsetProjectedBackward"
    reference = AF._offset_projected_plain(x, mixer.qk.weight, mixer.v.weight, mixer.v.bias, 1, 1e-9)
    assert torch.allclose(mixer(x), reference, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])  # x from a layer outside or inside autocast
@pytest.mark.parametrize("heads", [1, 2])
def test_offset_projected_under_autocast_is_the_plain_form_under_autocast(heads, x_dtype):
    """Under bf16 autocast the function runs its projections' products (and their gradients') in bf16, as
    autocast runs nn.Linear, and the attention between in float32 (float32_kernel), returning bf16 as the plain
    form does: its values and the float32 gradients of x and the weights against the plain form under autocast
    (bf16's rounding apart), and both against float64."""
    from torch.utils._python_dispatch import TorchDispatchMode

    x, w_qk, w_v, b_v = projected_inputs(50, n=16, c=32, d_qk=8)
    inputs = [x] + [(w * 0.1).detach().requires_grad_() for w in (w_qk, w_v, b_v)]  # logits of order 1: a sharp
    want = ref_offset_projected(*inputs, heads)  # softmax turns bf16's rounding of q and k into large changes
    grad = randn(torch.Generator().manual_seed(51), *want.shape)
    want = (want, *torch.autograd.grad(want, inputs, grad))
    floats = [t.detach().to(x_dtype if i == 0 else torch.float32).requires_grad_() for i, t in enumerate(inputs)]
    results = {}
    for name, fn in (("fused", AF.offset_projected), ("plain", AF._offset_projected_plain)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fn(*floats, heads, 1e-9)
        assert out.dtype == torch.bfloat16
        assert (out.grad_fn.name() == "OffsetProjectedBackward") == (name == "fused")
        results[name] = (out, *torch.autograd.grad(out, floats, grad.to(out.dtype)))
        assert [g.dtype for g in results[name][1:]] == [t.dtype for t in floats]
    for fused, plain, exact in zip(results["fused"], results["plain"], want):
        assert rel_err(fused.detach(), plain.detach()) < 1e-2
        assert rel_err(fused.detach(), exact) < 1e-2 and rel_err(plain.detach(), exact) < 1e-2

    class Dtypes(TorchDispatchMode):  # each product's (op, dtype of its first input)
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.split(".")[0] in ("mm", "bmm", "baddbmm", "_softmax"):
                self.seen.append((func.__name__.split(".")[0], args[0].dtype))
            return func(*args, **(kwargs or {}))

    with Dtypes() as mode:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = AF.offset_projected(*floats, heads, 1e-9)
        torch.autograd.grad(out, floats, grad.to(out.dtype))
    assert {dtype for op, dtype in mode.seen if op == "mm"} == {torch.bfloat16}  # forward and both gradients
    assert {dtype for op, dtype in mode.seen if op != "mm"} == {torch.float32}  # the attention, both ways


@pytest.mark.parametrize("rows", [1, 3, 7, 50])  # one query a chunk; chunks that do not divide N; one chunk
@pytest.mark.parametrize("shape", SHAPES[1:3], ids=SHAPE_IDS[1:3])
def test_offset_chunked_equals_the_full_map_values_and_gradients(shape, rows):
    q, k, v = (t.requires_grad_() for t in qkv_inputs("offset", shape, seed=21))
    out = AF.OffsetChunked.apply(q, k, v, 1e-9, rows)
    want = ref_offset(q.detach(), k.detach(), v.detach())
    assert out.shape == want.shape and rel_err(out.detach(), want) < 1e-13
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(22), dtype=torch.float64)
    got = torch.autograd.grad(out, (q, k, v), grad)
    expected = torch.autograd.grad(offset_full(q, k, v), (q, k, v), grad)
    for g, e in zip(got, expected):
        assert rel_err(g, e) < 1e-12
    # q and k as one tensor (PCT's shared projection): the two gradients add up
    qk = q.detach()[..., :k.shape[-2], :].clone().requires_grad_() if shape[2] >= shape[3] else None
    if qk is not None:
        vq = v.detach()[..., :k.shape[-2], :]
        g1 = torch.autograd.grad(AF.OffsetChunked.apply(qk, qk, vq, 1e-9, rows).sum(), qk)[0]
        g2 = torch.autograd.grad(offset_full(qk, qk, vq).sum(), qk)[0]
        assert rel_err(g1, g2) < 1e-12


def test_offset_chunked_gradcheck():
    inputs = tuple(t.requires_grad_() for t in qkv_inputs("offset", (1, 2, 5, 4, 3, 2), seed=23))
    assert torch.autograd.gradcheck(lambda q, k, v: AF.OffsetChunked.apply(q, k, v, 1e-9, 2), inputs,
                                    eps=1e-6, atol=1e-6, rtol=1e-5)


def test_offset_chunked_double_backward(monkeypatch):
    """A gradient penalty through the chunked form (above OFFSET_FULL_MAX_ELEMENTS): the plain chunked ops
    recomputed under create_graph, so second derivatives exist (gradgradcheck), for separate q, k and for PCT's
    one q = k; the penalty's gradients equal those of the whole-map reference in float64."""
    inputs = tuple(t.requires_grad_() for t in qkv_inputs("offset", (1, 2, 5, 4, 3, 2), seed=25))
    assert torch.autograd.gradgradcheck(lambda q, k, v: AF.OffsetChunked.apply(q, k, v, 1e-9, 2), inputs)
    monkeypatch.setattr(AF, "OFFSET_FULL_MAX_ELEMENTS", 1)  # every size chunked: offset_attention as a user calls it
    qk, v = inputs[0], inputs[2]  # q = k (N = 5 rows), v of the queries' length
    assert torch.autograd.gradgradcheck(lambda t, u: AF.offset_attention(t, t, u), (qk, v))
    penalties = []
    for fn in (AF.offset_attention, offset_full):
        grad, = torch.autograd.grad(fn(qk, qk, v).square().sum(), qk, create_graph=True)
        penalties.append(torch.autograd.grad(grad.square().sum(), (qk, v)))
    assert all(rel_err(g, w) < 1e-12 for g, w in zip(*penalties))


def test_offset_goes_chunked_above_its_budget_and_never_holds_the_map(monkeypatch):
    """Above OFFSET_FULL_MAX_ELEMENTS entries offset_attention runs chunked: the same values and gradients as the
    full map, and (a dispatch mode sees every op's outputs, forward and backward) no tensor as large as N x M."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in torch.utils._pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.numel = max(self.numel, t.numel())
            return out

    b, h, n, d = 1, 2, 1024, 8
    monkeypatch.setattr(AF, "OFFSET_FULL_MAX_ELEMENTS", b * h * n * n - 1)  # just below this size's map
    monkeypatch.setattr(AF, "OFFSET_CHUNK_ELEMENTS", b * h * 64 * n)  # chunks of 64 queries
    gen = torch.Generator().manual_seed(24)
    qk, v = randn(gen, b, h, n, d).float().requires_grad_(), randn(gen, b, h, n, d).float().requires_grad_()
    with Largest() as seen:
        out = AF.offset_attention(qk, qk, v)
        out.square().sum().backward()
    assert seen.numel <= b * h * 64 * n < b * h * n * n // 8, seen.numel
    q64, v64 = qk.detach().double().requires_grad_(), v.detach().double().requires_grad_()
    want = offset_full(q64, q64, v64)
    want.square().sum().backward()
    assert rel_err(out.detach(), want.detach()) < 1e-5
    assert rel_err(qk.grad, q64.grad) < 1e-4 and rel_err(v.grad, v64.grad) < 1e-5
    # a size under the budget keeps the full map (fast)
    monkeypatch.setattr(AF, "OFFSET_FULL_MAX_ELEMENTS", b * h * n * n)
    with Largest() as seen:
        AF.offset_attention(qk.detach(), qk.detach(), v.detach())
    assert seen.numel == b * h * n * n


@pytest.mark.cuda
@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_kernels_on_cuda_against_float64(kernel):
    """Each kernel on a CUDA GPU (the written-out autograd functions of offset, external and both linear kernels
    included), in float32 and under bf16 autocast (computed in float32 inside, float32_kernel; not SDPA, which
    autocast runs in bf16): its values and gradients against the CPU's float64, q a strided view of a
    projection, as the mixers hand it over."""
    fn, _ = KERNELS[kernel]
    shape = (2, 3, 64, 64, 16, 16)
    inputs = qkv_inputs(kernel, shape, seed=38)
    grad = randn(torch.Generator().manual_seed(39), *expected_shape(kernel, shape))
    leaves = [t.detach().requires_grad_() for t in inputs]
    out = fn(*leaves)
    want = (out, *torch.autograd.grad(out, leaves, grad))
    for autocast in (False,) if kernel == "softmax" else (False, True):
        cuda = [t.detach().float().cuda().requires_grad_() for t in inputs]
        q = cuda[0]
        if kernel != "external":  # q a strided view (B, h, N, d) of a (B, N, h d) projection
            q = cuda[0].detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            out = fn(q, *cuda[1:])
        assert out.dtype == torch.float32
        got = (out, *torch.autograd.grad(out, [q, *cuda[1:]], grad.float().cuda()))
        for a, w in zip(got, want):
            assert rel_err(a.cpu(), w) < 1e-5, (kernel, autocast, rel_err(a.cpu(), w))


@pytest.mark.cuda
@pytest.mark.parametrize("heads", [1, 2])
def test_offset_projected_on_cuda_against_float64(heads):
    """PCT's offset mixer as one function on a CUDA GPU, float32: its values and the gradients of x and of the
    three weights against the CPU's float64 (on CUDA its backward's products write into the column blocks of one
    gradient through their strided ``out=``, which the CPU's bmm takes by a loop over the batch)."""
    inputs = projected_inputs(48, b=2, n=64, c=32, d_qk=8)
    want = projected(*inputs, heads, 1e-9)
    grad = randn(torch.Generator().manual_seed(49), *want.shape)
    want = (want, *torch.autograd.grad(want, inputs, grad))
    cuda = [t.detach().float().cuda().requires_grad_() for t in inputs]
    out = AF.offset_projected(*cuda, heads)
    assert out.grad_fn.name() == "OffsetProjectedBackward"
    got = (out, *torch.autograd.grad(out, cuda, grad.float().cuda()))
    for a, w in zip(got, want):
        assert rel_err(a.cpu(), w) < 1e-5, (heads, rel_err(a.cpu(), w))


@pytest.mark.cuda
def test_offset_projected_under_autocast_on_cuda():
    """The function under CUDA's bf16 autocast (x in float32 and in bf16): bf16 out, gradients in the inputs'
    dtypes, against the CPU's float64 within bf16's rounding."""
    x, w_qk, w_v, b_v = projected_inputs(52, n=64, c=32, d_qk=8)
    inputs = [x] + [(w * 0.1).detach().requires_grad_() for w in (w_qk, w_v, b_v)]  # logits of order 1
    want = ref_offset_projected(*inputs, 1)
    grad = randn(torch.Generator().manual_seed(53), *want.shape)
    want = (want, *torch.autograd.grad(want, inputs, grad))
    for x_dtype in (torch.float32, torch.bfloat16):
        cuda = [t.detach().to("cuda", x_dtype if i == 0 else torch.float32).requires_grad_()
                for i, t in enumerate(inputs)]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = AF.offset_projected(*cuda, 1)
        assert out.dtype == torch.bfloat16 and out.grad_fn.name() == "OffsetProjectedBackward"
        got = (out, *torch.autograd.grad(out, cuda, grad.to("cuda", torch.bfloat16)))
        assert [g.dtype for g in got[1:]] == [t.dtype for t in cuda]
        for a, w in zip(got, want):
            assert rel_err(a.detach().cpu(), w) < 2e-2, (x_dtype, rel_err(a.detach().cpu(), w))
