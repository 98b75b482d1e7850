"""The mixer contract: every registered variant, its options, its structure and its cost."""

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

import attention
from attention import Grid, Points, UserError

DIM = 32
GRID = Grid(4, 6)  # not square, so rows and columns cannot be confused
N = len(GRID)


def build(name, dim=DIM, **opts):
    torch.manual_seed(0)
    return attention.build(name, dim=dim, **opts).eval()


def layouts(batch, n=N, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {"grid": GRID, "points": Points(torch.rand(batch, n, 3, generator=gen)), "none": None}


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def point_variants():
    return [n for n in attention.names() if "points" in attention.get(n).layouts]


# --------------------------------------------------------------------------------------------
# Every registered variant
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["grid", "points", "none"])
@pytest.mark.parametrize("name", attention.names())
def test_forward_shape_and_finite(name, kind):
    mixer = build(name)
    x = torch.randn(2, N, DIM, generator=torch.Generator().manual_seed(1))
    layout = layouts(2)[kind]
    if kind not in mixer.layouts:
        with pytest.raises(ValueError, match=name):
            mixer(x, layout)
        return
    y = mixer(x, layout)
    assert y.shape == (2, N, DIM)
    assert y.dtype == x.dtype
    assert torch.isfinite(y).all()


@pytest.mark.parametrize("name", attention.names())
def test_registered_class_is_a_mixer(name):
    cls = attention.get(name)
    assert issubclass(cls, attention.Mixer)
    assert cls.name == name
    assert cls.layouts <= {"grid", "points", "none"} and cls.layouts
    assert "heads" in attention.options(name)


@pytest.mark.parametrize("name", attention.names())
def test_gradients_reach_every_parameter(name):
    mixer = build(name).train()
    kind = sorted(mixer.layouts)[0]
    x = torch.randn(2, N, DIM, generator=torch.Generator().manual_seed(2), requires_grad=True)
    mixer(x, layouts(2)[kind]).square().sum().backward()
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    for pname, p in mixer.named_parameters():
        assert p.grad is not None, pname
        assert torch.isfinite(p.grad).all(), pname


# The options each variant needs to be differentiated twice: SDPA's fused kernels have no double backward
TWICE = {"self": {"fused": False}}
# heads at dim 8: dilated splits its heads into one group per rate (four by default)
HEADS = {"dilated": 4}


@pytest.mark.parametrize("kind", ["grid", "points"])
@pytest.mark.parametrize("name", attention.names())
def test_every_variant_takes_a_gradient_penalty(name, kind):
    """A discriminator's gradient penalty (R1, WGAN-GP) differentiates the gradient w.r.t. the input again
    (create_graph): second derivatives match finite differences in float64 (the kernels with a written-out backward
    recompute their plain ops there), and the penalty reaches the parameters."""
    mixer = build(name, dim=8, heads=HEADS.get(name, 2), **TWICE.get(name, {})).double().train()
    if kind not in mixer.layouts:
        pytest.skip(f"{name} does not serve {kind}")
    gen = torch.Generator().manual_seed(3)
    layout = Grid(3, 4) if kind == "grid" else Points(torch.rand(2, 12, 3, generator=gen, dtype=torch.float64))
    x = torch.randn(2, 12, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradgradcheck(lambda t: mixer(t, layout), (x,))
    grad, = torch.autograd.grad(mixer(x, layout).square().sum(), x, create_graph=True)
    grad.square().sum().backward()
    grads = [p.grad for p in mixer.parameters() if p.grad is not None]  # focal's grid tables get none on points
    assert grads and all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("name", point_variants())
def test_permutation_equivariance_on_points(name):
    mixer = build(name)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, N, DIM, generator=gen)
    xyz = torch.rand(2, N, 3, generator=gen)
    perm = torch.randperm(N, generator=gen)
    with torch.no_grad():
        y = mixer(x, Points(xyz))
        y_perm = mixer(x[:, perm], Points(xyz[:, perm]))
    assert rel_err(y_perm, y[:, perm]) < 1e-5


@pytest.mark.parametrize("kind", ["grid", "points", "none"])
@pytest.mark.parametrize("name", attention.names())
def test_batch_independence(name, kind):
    mixer = build(name)
    if kind not in mixer.layouts:
        pytest.skip(f"{name} does not serve {kind}")
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(3, N, DIM, generator=gen)
    lay = layouts(3, seed=5)
    with torch.no_grad():
        y = mixer(x, lay[kind])
        # sample 1 alone
        single = {"grid": GRID, "points": Points(lay["points"].xyz[1:2]), "none": None}[kind]
        y1 = mixer(x[1:2], single)
        # the other samples changed: sample 1's output must not move
        x2 = x.clone()
        x2[0] = torch.randn(N, DIM, generator=gen) * 3
        x2[2] = torch.randn(N, DIM, generator=gen) * 3
        y2 = mixer(x2, lay[kind])
    assert rel_err(y1[0], y[1]) < 1e-5
    assert rel_err(y2[1], y[1]) < 1e-5
    assert rel_err(y2[0], y[0]) > 1e-3  # the change did reach the mixer


@pytest.mark.parametrize("name", attention.names())
def test_empty_inputs_give_empty_outputs(name):
    """No samples (B = 0) or no tokens (N = 0): the empty (B, N, C) output, on every layout the variant serves (a
    grid has >= 1 token), and a backward that reaches x and every parameter (with zeros)."""
    mixer = build(name)
    cases = [(0, N, layouts(0)[kind]) for kind in ("grid", "points", "none") if kind in mixer.layouts]
    cases += [(2, 0, layout) for kind, layout in layouts(2, n=0).items() if kind != "grid" and kind in mixer.layouts]
    for b, n, layout in cases:
        x = torch.randn(b, n, DIM, requires_grad=True)
        y = mixer(x, layout)
        assert y.shape == (b, n, DIM) and y.dtype == x.dtype, (b, n, layout)
        y.sum().backward()
        assert x.grad.shape == x.shape
        assert all(p.grad is not None and not p.grad.any() for p in mixer.parameters())
        mixer.zero_grad(set_to_none=True)


@pytest.mark.parametrize("name", attention.names())
def test_layout_mismatch_raises(name):
    mixer = build(name)
    x = torch.randn(2, N, DIM)
    if "grid" in mixer.layouts:
        with pytest.raises(ValueError):
            mixer(x, Grid(5, 5))
    if "points" in mixer.layouts:
        with pytest.raises(ValueError):
            mixer(x, Points(torch.rand(2, N + 1, 3)))
        with pytest.raises(ValueError):
            mixer(x, Points(torch.rand(3, N, 3)))  # batch mismatch
    with pytest.raises(ValueError):
        mixer(torch.randn(2, N, DIM + 1), None if "none" in mixer.layouts else GRID)


def test_layout_constructors_validate():
    with pytest.raises(ValueError):
        Grid(0, 3)
    for h, w in ((2.0, 3), (True, 3), (3, "4"), (3, None)):  # a float side failed later in len(); True passed as 1
        with pytest.raises(ValueError, match="integers"):
            Grid(h, w)
    with pytest.raises(ValueError):
        Points(torch.rand(2, 5, 2))
    assert len(Grid(3, 5)) == 15
    assert len(Points(torch.rand(2, 7, 3))) == 7


@pytest.mark.parametrize("name", ["dilated", "focal"])
def test_layers_sharing_a_points_layout_search_the_points_once(name):
    """What a local variant derives from the points alone (dilated's nearest neighbours, focal's regions, order and
    key rows) is kept on the layout: the second layer of a network searches nothing, and computes what a layer
    with its own fresh layout computes, bit for bit, forward and backward. An in-place change to the points makes
    the layout search again."""
    from op_log import OpLog

    first, second = build(name, neighbours=6), build(name, neighbours=6)
    gen = torch.Generator().manual_seed(3)
    xyz = torch.rand(2, 40, 3, generator=gen)
    x = torch.randn(2, 40, DIM, generator=gen, requires_grad=True)
    shared = Points(xyz.clone())

    def searches(call):
        with OpLog() as log:
            out = call()
        return out, sum(op in ("knn", "farthest_point_sample") for op in log.count.elements())

    h, searched = searches(lambda: first(x, shared))
    assert searched > 0
    out, searched = searches(lambda: second(h, shared))
    assert searched == 0
    expected = second(first(x, Points(xyz.clone())), Points(xyz.clone()))
    assert torch.equal(out, expected)
    (grad,) = torch.autograd.grad(out.square().sum(), x)
    assert torch.equal(grad, torch.autograd.grad(expected.square().sum(), x)[0])

    shared.xyz.mul_(-1)  # the points move: the kept search is stale
    out, searched = searches(lambda: second(h, shared))
    assert searched > 0
    assert torch.equal(out, second(h, Points(-xyz)))


def test_points_repr_and_messages_name_the_shape_not_the_coordinates():
    layout = Points(torch.rand(2, 1000, 3))
    assert repr(layout) == "Points(xyz of shape (2, 1000, 3), torch.float32, cpu)"
    with pytest.raises(ValueError, match=r"Points\(xyz of shape \(2, 1000, 3\)") as raised:
        build("external")(torch.randn(2, 999, DIM), layout)
    assert len(str(raised.value)) < 200 and "tensor(" not in str(raised.value)


def test_points_memo_is_kept_per_key_and_not_under_a_fake_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    layout, made = Points(torch.rand(1, 5, 3)), []
    assert layout.memo("a", lambda: made.append("a") or 1) == 1
    assert layout.memo("a", lambda: made.append("a") or 2) == 1
    assert layout.memo("b", lambda: made.append("b") or 3) == 3
    assert made == ["a", "b"]
    with FakeTensorMode():
        fake = Points(torch.rand(1, 5, 3))
        fake.memo("a", lambda: made.append("fake"))
        fake.memo("a", lambda: made.append("fake"))
    assert made == ["a", "b", "fake", "fake"]
    assert "xyz" in repr(layout) and "memo" not in repr(layout)


# --------------------------------------------------------------------------------------------
# Options, registry
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", attention.names())
def test_heads_not_dividing_dim(name):
    with pytest.raises(UserError, match="heads"):
        attention.build(name, dim=DIM, heads=3)


@pytest.mark.parametrize("name", attention.names())
def test_heads_zero(name):
    with pytest.raises(UserError, match="heads"):
        attention.build(name, dim=DIM, heads=0)


@pytest.mark.parametrize("name", attention.names())
def test_unknown_option(name):
    with pytest.raises(UserError, match="bogus_option"):
        attention.build(name, dim=DIM, bogus_option=1)


def bool_options():
    return [(n, o) for n in attention.names() for o, v in attention.options(n).items() if isinstance(v, bool)]


@pytest.mark.parametrize("name,option", bool_options())
def test_boolean_options_refuse_other_values(name, option):
    """A string like "false" is truthy: taken as is it switched a layer on. Every boolean option (its default a
    bool) refuses strings and numbers at build time, naming the option; true and false build."""
    for value in ("false", "no", "true", 0, 1, None):
        with pytest.raises(UserError, match=f"attn.{option}="):
            attention.build(name, dim=DIM, **{option: value})
    for value in (True, False):
        attention.build(name, dim=DIM, **{option: value})


def test_boolean_options_cover_the_reported_ones():
    assert {("external", "in_proj"), ("external", "out_proj"), ("self", "qkv_bias"), ("self", "separate_qkv"),
            ("linear_elu", "out_proj"), ("dilated", "qkv_bias"), ("focal", "qkv_bias")} <= set(bool_options())


@pytest.mark.parametrize("memory", [0, -3, 2.5])
def test_external_memory_invalid(memory):
    with pytest.raises(UserError, match="memory"):
        attention.build("external", dim=DIM, memory=memory)


def test_offset_qk_ratio_not_dividing():
    with pytest.raises(UserError, match="qk_ratio"):
        attention.build("offset", dim=DIM, qk_ratio=3)
    with pytest.raises(UserError, match="qk_ratio"):
        attention.build("offset", dim=DIM, qk_ratio=0)
    # heads must divide the query/key width dim / qk_ratio = 8
    with pytest.raises(UserError, match="heads"):
        attention.build("offset", dim=DIM, qk_ratio=4, heads=16)
    attention.build("offset", dim=DIM, qk_ratio=4, heads=8)


ATTN_CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "attn"


@pytest.mark.parametrize("name", attention.names())
def test_yaml_defaults_are_the_class_defaults(name):
    """A variant's defaults are written twice, on purpose: ``configs/attn/<name>.yaml`` is what Hydra composes
    (a key must be there for ``attn.<key>=`` to override it, and the run's resolved config records every option)
    and the constructor's defaults are what ``attention.build(name, dim)`` gives a library user. Neither can be
    read from the other without composing configs through Python code, so this test holds them equal: the same
    keys, the same values."""
    path = ATTN_CONFIGS / f"{name}.yaml"
    assert path.is_file(), f"variant {name!r} has no {path}: add one with its name and every option's default"
    cfg = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    assert cfg.pop("name") == name
    defaults = {k: list(v) if isinstance(v, tuple) else v for k, v in attention.options(name).items()}
    assert cfg == defaults


def test_every_attn_yaml_is_a_registered_variant():
    assert sorted(p.stem for p in ATTN_CONFIGS.glob("*.yaml")) == attention.names()


def test_unknown_variant_lists_available():
    with pytest.raises(UserError) as info:
        attention.build("no_such_variant", dim=DIM)
    msg = str(info.value)
    assert "no_such_variant" in msg
    for name in attention.names():
        assert name in msg


def test_user_error_is_value_error():
    assert issubclass(UserError, ValueError)


def test_register_rejects_duplicate_name():
    existing = attention.get("self")
    before = attention.names()

    class Impostor(attention.Mixer):
        pass

    with pytest.raises(KeyError, match="self"):
        attention.register("self")(Impostor)
    assert attention.get("self") is existing
    assert attention.names() == before
    assert Impostor.name != "self"
    # re-registering the same class under its own name is harmless
    assert attention.register("self")(existing) is existing
    assert attention.get("self") is existing


# --------------------------------------------------------------------------------------------
# Published structure
# --------------------------------------------------------------------------------------------

def test_offset_structure_is_pct():
    C = 64
    mixer = build("offset", dim=C)
    params = dict(mixer.named_parameters())
    shapes = sorted(tuple(p.shape) for p in params.values())
    # one (C/4, C) weight (shared Q/K, no bias), one (C, C) weight and its (C,) bias
    assert shapes == sorted([(C // 4, C), (C, C), (C,)])
    w_qk = next(p for p in params.values() if p.shape == (C // 4, C))
    w_v = next(p for p in params.values() if p.shape == (C, C))
    b_v = next(p for p in params.values() if p.shape == (C,))
    linears = [m for m in mixer.modules() if isinstance(m, nn.Linear)]
    assert len(linears) == 2
    assert any(m.weight is w_qk and m.bias is None for m in linears)
    assert any(m.weight is w_v and m.bias is b_v for m in linears)

    # The module computes PCT's SA from these parameters, with Q = K = x W_qk^T.
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(2, 10, C, generator=gen, dtype=torch.float64)
    mixer = mixer.double()
    with torch.no_grad():
        y = mixer(x)
        qk = x @ w_qk.double().T  # (B, N, C/4)
        v = x @ w_v.double().T + b_v.double()  # (B, N, C)
        energy = qk @ qk.transpose(1, 2)  # (B, N, N): queries x keys
        a = torch.softmax(energy, dim=-1)
        a = a / (1e-9 + a.sum(dim=1, keepdim=True))
        expected = torch.einsum("bij,bic->bjc", a, v)  # output_j = sum_i A_ij v_i
    assert rel_err(y, expected) < 1e-12


def test_offset_params_at_256():
    C = 256
    hand = C * (C // 4) + C * C + C  # shared bias-free Q/K projection + V with bias
    assert hand == 82176  # the issue's count
    assert build("offset", dim=C).cost(2)["params"] == hand


@pytest.mark.parametrize("heads", [1, 4])
def test_external_structure(heads):
    C = 128
    mixer = build("external", dim=C, heads=heads)
    mems = [p for p in mixer.parameters() if p.shape == (64, C // heads)]
    assert len(mems) == 2
    assert mems[0] is not mems[1]

    # Memories shared by the heads: per-head loop with the same M_k, M_v.
    gen = torch.Generator().manual_seed(7)
    mixer = mixer.double()
    x = torch.randn(2, 9, C, generator=gen, dtype=torch.float64)
    d = C // heads
    with torch.no_grad():
        q = mixer.q(x)
        outs = []
        for h in range(heads):
            a = q[..., h * d:(h + 1) * d] @ mixer.mem_k.T  # (B, N, S)
            a = torch.softmax(a, dim=1)  # over tokens
            a = a / (1e-9 + a.sum(dim=2, keepdim=True))  # over slots
            outs.append(a @ mixer.mem_v)
        expected = mixer.proj(torch.cat(outs, dim=-1))
        y = mixer(x)
    assert rel_err(y, expected) < 1e-12


@pytest.mark.parametrize("heads", [1, 2, 4])
def test_self_matches_plain_multihead_attention(heads):
    C, n = DIM, 11
    mixer = build("self", dim=C, heads=heads)
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(3, n, C, generator=gen)
    W, b = mixer.qkv.weight.double(), mixer.qkv.bias.double()
    d = C // heads
    xd = x.double()
    with torch.no_grad():
        qkv = xd @ W.T + b
        q, k, v = qkv[..., :C], qkv[..., C:2 * C], qkv[..., 2 * C:]
        heads_out = []
        for h in range(heads):
            sl = slice(h * d, (h + 1) * d)
            logits = q[..., sl] @ k[..., sl].transpose(1, 2) / d ** 0.5
            e = torch.exp(logits - logits.amax(dim=-1, keepdim=True))
            heads_out.append((e / e.sum(dim=-1, keepdim=True)) @ v[..., sl])
        expected = torch.cat(heads_out, dim=-1) @ mixer.proj.weight.double().T + mixer.proj.bias.double()
        y = mixer(x)
    assert rel_err(y, expected) < 1e-5


def test_self_unfused_is_the_same_function():
    """fused=False (plain ops: a gradient penalty can differentiate them twice) computes what SDPA computes, with
    SAGAN's options too (unscaled logits, pooled keys), outputs and gradients; a fused that is not a bool is
    refused."""
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(2, N, DIM, generator=gen, dtype=torch.float64)
    for opts in ({}, dict(heads=1, qk_ratio=8, v_ratio=2, kv_pool=2, scale=1.0, separate_qkv=True)):
        results = []
        for fused in (True, False):
            mixer = build("self", **opts, fused=fused).double()
            xg = x.clone().requires_grad_()
            y = mixer(xg, GRID)
            y.square().sum().backward()
            results.append([y, xg.grad, *(p.grad for p in mixer.parameters())])
        assert all(rel_err(a, b) < 1e-12 for a, b in zip(*results)), opts
    assert "fused=False" in repr(build("self", fused=False))
    with pytest.raises(UserError, match="attn.fused"):
        build("self", fused="no")


@pytest.mark.parametrize("scale", [float("inf"), float("nan"), 0, -1.0, "abc", "0.5", True])
def test_self_scale_must_be_a_finite_positive_number(scale):
    """scale=inf built and gave NaN everywhere; "abc" raised float()'s own ValueError: both name the option now."""
    with pytest.raises(UserError, match="attn.scale"):
        build("self", scale=scale)


def test_self_kv_pool_on_points_is_permutation_equivariant():
    """kv_pool on Points samples its centres from the point farthest from the centroid (not from point 0), so the
    output, in float64, is permuted with the points to 1e-12, and equals the pooled attention written out: brute-force
    farthest point sampling from that start, each centre's p*p nearest points max-pooled, softmax attention."""
    gen = torch.Generator().manual_seed(12)
    n, p = 40, 2
    mixer = build("self", heads=2, kv_pool=p).double()
    x = torch.randn(2, n, DIM, generator=gen, dtype=torch.float64)
    xyz = torch.rand(2, n, 3, generator=gen, dtype=torch.float64)
    perm = torch.randperm(n, generator=gen)
    with torch.no_grad():
        y = mixer(x, Points(xyz))
        assert rel_err(mixer(x[:, perm], Points(xyz[:, perm])), y[:, perm]) < 1e-12

        q, k, v = mixer.qkv(x).split(DIM, dim=-1)  # (B, N, C) each
        want = []
        for b in range(2):
            pts = xyz[b]
            dist = ((pts[:, None] - pts[None]) ** 2).sum(-1)  # (N, N)
            picked = [int(((pts - pts.mean(0)) ** 2).sum(-1).argmax())]
            while len(picked) < n // (p * p):
                picked.append(int(dist[picked].min(0).values.argmax()))
            groups = dist[picked].argsort(dim=1, stable=True)[:, :p * p]  # (M, p*p) nearest, ties to lower index
            kb, vb = k[b][groups].amax(1), v[b][groups].amax(1)  # (M, C)
            heads = []
            for h in range(2):
                sl = slice(h * DIM // 2, (h + 1) * DIM // 2)
                logits = q[b, :, sl] @ kb[:, sl].T / (DIM // 2) ** 0.5
                heads.append(torch.softmax(logits, dim=-1) @ vb[:, sl])
            want.append(mixer.proj(torch.cat(heads, dim=-1)))
    assert rel_err(y, torch.stack(want)) < 1e-12


# --------------------------------------------------------------------------------------------
# Cost
# --------------------------------------------------------------------------------------------

def linear_params(i, o, bias=True):
    return i * o + (o if bias else 0)


@pytest.mark.parametrize("C,heads", [(32, 1), (64, 4)])
def test_cost_params(C, heads):
    qkv_mixer = linear_params(C, 3 * C) + linear_params(C, C)
    expected = {
        "self": qkv_mixer,
        "linear_elu": qkv_mixer,
        "linear_taylor": qkv_mixer,
        "external": 2 * linear_params(C, C) + 2 * 64 * (C // heads),
        "offset": linear_params(C, C // 4, bias=False) + linear_params(C, C),
    }
    for name, count in expected.items():
        assert build(name, dim=C, heads=heads).cost(4)["params"] == count, name


@pytest.mark.parametrize("B,n,C,heads", [(1, 9, 16, 1), (2, 12, 32, 4)])
def test_cost_flops_self(B, n, C, heads):
    macs = B * (n * C * 3 * C  # qkv
                + n * n * C  # Q K^T over all heads
                + n * n * C  # A V
                + n * C * C)  # output projection
    assert build("self", dim=C, heads=heads).cost(n, batch=B)["flops"] == 2 * macs


@pytest.mark.parametrize("B,n,C,heads,S", [(1, 9, 16, 1, 64), (2, 12, 32, 4, 8)])
def test_cost_flops_external(B, n, C, heads, S):
    macs = B * (n * C * C  # query projection
                + n * C * S  # Q M_k^T over all heads
                + n * S * C  # A M_v
                + n * C * C)  # output projection
    assert build("external", dim=C, heads=heads, memory=S).cost(n, batch=B)["flops"] == 2 * macs


def test_cost_flops_offset():
    B, n, C = 2, 10, 32
    macs = B * (n * C * C // 4 + n * C * C + n * n * C // 4 + n * n * C)
    assert build("offset", dim=C).cost(n, batch=B)["flops"] == 2 * macs


def declared(complexity):
    return [n for n in attention.names() if attention.get(n).complexity == complexity]


def test_every_variant_declares_its_complexity():
    assert declared("linear") and declared("quadratic")
    assert set(declared("linear")) | set(declared("quadratic")) == set(attention.names())

    class Vague(attention.Mixer):
        complexity = "fast"

    with pytest.raises(ValueError, match="complexity"):
        attention.register("vague")(Vague)
    assert "vague" not in attention.names()


@pytest.mark.parametrize("name", declared("linear"))
def test_linear_variants_flops_linear_in_n(name):
    """FLOPs x 4 when N x 4, on grids whose sides are multiples of focal's 7-token window (28, 56, 112), so that
    no window is cut at a border; on a grid for the local variants, whose neighbour search on point sets is
    quadratic."""
    mixer = build(name)
    kind = "grid" if "grid" in mixer.layouts else None
    f1, f2, f4 = (mixer.cost(side * side, layout=kind)["flops"] for side in (28, 56, 112))
    assert abs(f2 / f1 - 4) < 0.2
    assert abs(f4 / f2 - 4) < 0.2


@pytest.mark.parametrize("name", declared("quadratic"))
def test_quadratic_variants_flops_superlinear(name):
    mixer = build(name)
    f1, f2 = mixer.cost(64)["flops"], mixer.cost(128)["flops"]
    assert f2 / f1 > 2.5


@pytest.mark.parametrize("name", attention.names())
def test_cost_reports_ints_and_scales_with_batch(name):
    mixer = build(name)
    c1, c2 = mixer.cost(16), mixer.cost(16, batch=2)
    assert isinstance(c1["params"], int) and isinstance(c1["flops"], int)
    assert c1["params"] == sum(p.numel() for p in mixer.parameters()) > 0
    assert c1["flops"] > 0 and c2["flops"] == 2 * c1["flops"]


@pytest.mark.parametrize("name", attention.names())
def test_cost_of_a_float64_mixer(name):
    """cost() makes its inputs in the module's dtype: a float64 mixer's projections refused float32 inputs. The same
    FLOPs as in float32."""
    assert build(name).double().cost(16) == build(name).cost(16)


def test_cost_uses_one_layout_kind_and_leaves_global_rng_alone():
    mixer = attention.build("external", dim=16)
    assert isinstance(mixer.example_layout(64), attention.Points)
    assert isinstance(mixer.example_layout(63), attention.Points)  # same kind at square and non-square N
    assert isinstance(mixer.example_layout(64, kind="grid"), attention.Grid)
    with pytest.raises(ValueError, match="square"):
        mixer.example_layout(63, kind="grid")
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    mixer.cost(64)
    assert torch.equal(torch.rand(3), expected)
    assert mixer.cost(64, layout="grid") == mixer.cost(64, layout="points")  # external ignores positions


def test_external_expand_is_eamlps_widened_multi_head_form():
    """attn.expand = e: Linear(C, eC) queries in e*heads heads of C/heads channels, shared memories, output
    Linear(eC, C); checked against loops over heads, tokens and slots in float64."""
    torch.manual_seed(0)
    b, n, c, heads, e, s = 2, 5, 8, 2, 3, 4
    mixer = attention.build("external", dim=c, heads=heads, memory=s, expand=e).double()
    x = torch.randn(b, n, c, dtype=torch.float64)
    q = x @ mixer.q.weight.T + mixer.q.bias  # (B, N, eC)
    d = c // heads
    out = torch.zeros(b, n, e * c, dtype=torch.float64)
    for bi in range(b):
        for h in range(e * heads):
            qh = q[bi, :, h * d:(h + 1) * d]  # (N, d)
            logits = torch.tensor([[float(qh[i] @ mixer.mem_k[j]) for j in range(s)] for i in range(n)],
                                  dtype=torch.float64)  # (N, S)
            a = logits.exp() / logits.exp().sum(dim=0, keepdim=True)  # softmax over tokens
            a = a / (1e-9 + a.sum(dim=1, keepdim=True))  # then l1 over slots
            out[bi, :, h * d:(h + 1) * d] = a @ mixer.mem_v
    expected = out @ mixer.proj.weight.T + mixer.proj.bias
    torch.testing.assert_close(mixer(x), expected, rtol=1e-9, atol=1e-10)
    assert sum(p.numel() for p in mixer.parameters()) == (c * e * c + e * c) + 2 * s * d + (e * c * c + c)
    with pytest.raises(attention.UserError, match="expand"):
        attention.build("external", dim=c, expand=0)
