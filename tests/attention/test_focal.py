"""``focal``: focal self-attention against explicit float64 loops, its borders, point sets and options.

The grid reference below builds, for every query pixel, the explicit list of
keys it attends to and their biases with plain loops; the neighbourhoods come
from the official mechanisms (``torch.roll`` + ``valid_ind_rolled`` for the
expand slots, ``nn.Unfold`` + ``valid_ind_unfold`` for the pooled tokens, as in
microsoft/Focal-Transformer), not from the module's index code.
"""

import math

import pytest
import torch
from torch import nn

import attention
from attention import Grid, Points, UserError
from attention import functional as AF
from attention.pointops import gather
from attention.variants import focal as focal_module

DIM = 16


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def build(dim=DIM, seed=0, randomise=True, **opts):
    """A focal mixer; with ``randomise`` every bias table and pool gets random values, so each one matters."""
    torch.manual_seed(seed)
    mixer = attention.build("focal", dim=dim, **opts).eval()
    if randomise:
        with torch.no_grad():
            for name, p in mixer.named_parameters():
                if "relative_position" in name:
                    p.normal_(0, 1.0)
                if "pool_layers" in name:
                    p.normal_(0, 0.3)
    return mixer


# --------------------------------------------------------------------------------------------
# The official neighbourhoods, recomputed the official way on index maps
# --------------------------------------------------------------------------------------------

def official_expand_slots(ws, e):
    """Offsets (from the window's top-left pixel) read by the official rolled keys, in slot order.

    An index map with a margin, rolled as ``WindowAttention.forward`` rolls k,
    partitioned into windows, the window at (1, 1) read, ``valid_ind_rolled`` applied.
    """
    side = 3 * ws
    coords = torch.stack(torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij"), -1)  # (side, side, 2)
    rolled = []
    for shifts in ((-e, -e), (-e, e), (e, -e), (e, e)):  # k_tl, k_tr, k_bl, k_br
        r = torch.roll(coords, shifts=shifts, dims=(0, 1))
        rolled.append(r[ws:2 * ws, ws:2 * ws].reshape(-1, 2))  # the window at (1, 1), row-major
    masks = []
    for rows, cols in ((slice(None, -e), slice(None, -e)), (slice(None, -e), slice(e, None)),
                       (slice(e, None), slice(None, -e)), (slice(e, None), slice(e, None))):
        m = torch.ones(ws, ws)
        m[rows, cols] = 0
        masks.append(m)
    valid_ind_rolled = torch.stack(masks).flatten().nonzero().view(-1)
    return (torch.cat(rolled)[valid_ind_rolled] - ws).tolist()


def official_pooled_neighbourhoods(ph, pw, fw, k):
    """For each window (row-major), the pooled (row, col) of its slots, None where the unfold pads.

    ``nn.Unfold`` with the official kernel, stride and padding over an index
    map of the pooled tokens, then ``valid_ind_unfold`` for k > 0.
    """
    kernel = 2 * (fw // 2) + 2 ** k + (2 ** k - 1)
    unfold = nn.Unfold(kernel_size=(kernel, kernel), stride=2 ** k, padding=kernel // 2)
    index = torch.arange(1, ph * pw + 1, dtype=torch.float64).view(1, 1, ph, pw)  # 0 = padding
    cols = unfold(index)[0].T.reshape(-1, kernel, kernel)  # (windows, kernel, kernel)
    cols = cols[:, 2 ** k - 1:, 2 ** k - 1:].flatten(1)  # valid_ind_unfold
    return [[None if t == 0 else divmod(int(t) - 1, pw) for t in row] for row in cols.tolist()]


def test_official_rolls_give_the_expand_ring():
    for ws, e in [(7, 3), (5, 2), (4, 1), (6, 3), (3, 1)]:
        slots = official_expand_slots(ws, e)
        assert len(slots) == 4 * ws ** 2 - 4 * (ws - e) ** 2
        ring = {(a, b) for a in range(-e, ws + e) for b in range(-e, ws + e)} - {
            (a, b) for a in range(ws) for b in range(ws)}
        assert {tuple(s) for s in slots} == ring  # e <= ws // 2: the copies cover the ring, no more


# --------------------------------------------------------------------------------------------
# Brute-force float64 reference on grids
# --------------------------------------------------------------------------------------------

def pooled_maps(mixer, x, h, w):
    """Per coarse level: {(p, q): pooled feature} (float64) for tokens whose sub-window touches the map, ph, pw."""
    ws = mixer.window_size
    nh, nw = math.ceil(h / ws), math.ceil(w / ws)
    levels = []
    for k in range(mixer.focal_level - 1):
        g = ws // 2 ** k
        ph, pw = nh * 2 ** k, nw * 2 ** k
        top, left = (nh * ws - ph * g) // 2, (nw * ws - pw * g) // 2  # the official trim of the padded map
        weight = mixer.pool_layers[k].weight.double()[0]
        bias = mixer.pool_layers[k].bias.double()[0]
        tokens = {}
        for p in range(ph):
            for q in range(pw):
                acc, touches = torch.zeros(x.shape[-1], dtype=torch.float64), False
                for u in range(g):
                    for v in range(g):
                        r, c = top + p * g + u, left + q * g + v
                        if r < h and c < w:  # padding pixels are zeros
                            acc = acc + weight[u * g + v] * x[r * w + c]
                            touches = True
                if touches:
                    tokens[p, q] = acc + bias
        levels.append((tokens, ph, pw))
    return levels


def keys_of(mixer, x, h, w, r, c, levels):
    """The explicit keys of pixel (r, c): a list of (feature, bias per head, pixels it covers)."""
    ws, e, fw = mixer.window_size, mixer.expand_size, mixer.focal_window
    nw = math.ceil(w / ws)
    i, j, a, b = r // ws, c // ws, r % ws, c % ws
    table = mixer.relative_position_bias_table.double()
    keys = []
    for a2 in range(ws):  # the window
        for b2 in range(ws):
            rr, cc = i * ws + a2, j * ws + b2
            if rr < h and cc < w:
                bias = table[(a - a2 + ws - 1) * (2 * ws - 1) + (b - b2 + ws - 1)]
                keys.append((x[rr * w + cc], bias, {(rr, cc)}))
    if e > 0:  # the expand slots, each with its own bias
        neighbours = mixer.relative_position_bias_table_to_neighbors.double()[0]
        for slot, (da, db) in enumerate(official_expand_slots(ws, e)):
            rr, cc = i * ws + da, j * ws + db
            if 0 <= rr < h and 0 <= cc < w:
                keys.append((x[rr * w + cc], neighbours[:, a * ws + b, slot], {(rr, cc)}))
    for k, (tokens, ph, pw) in enumerate(levels):  # pooled tokens around the window
        side = fw + 2 ** k - 1
        table_k = mixer.relative_position_bias_table_to_windows[k].double()
        g = ws // 2 ** k
        top, left = (math.ceil(h / ws) * ws - ph * g) // 2, (nw * ws - pw * g) // 2
        for slot, pq in enumerate(official_pooled_neighbourhoods(ph, pw, fw, k)[i * nw + j]):
            if pq is None or pq not in tokens:
                continue
            u, v = divmod(slot, side)
            bias = table_k[:, (a - u + side - 1) * (ws + side - 1) + (b - v + side - 1)]
            pixels = {(top + pq[0] * g + s, left + pq[1] * g + t) for s in range(g) for t in range(g)}
            keys.append((tokens[pq], bias, {(pr, pc) for pr, pc in pixels if pr < h and pc < w}))
    return keys


def reference_grid(mixer, x, h, w):
    """Focal attention of one sample x (N, C), float64, query by query."""
    C, H = mixer.dim, mixer.heads
    d = C // H
    W, bqkv = mixer.qkv.weight.double(), mixer.qkv.bias.double()
    x = x.double()
    levels = pooled_maps(mixer, x, h, w)
    out = torch.empty(h * w, C, dtype=torch.float64)
    for r in range(h):
        for c in range(w):
            keys = keys_of(mixer, x, h, w, r, c, levels)
            feats = torch.stack([f for f, _, _ in keys])  # (M, C)
            biases = torch.stack([bias for _, bias, _ in keys])  # (M, heads)
            q = x[r * w + c] @ W[:C].T + bqkv[:C]
            k = feats @ W[C:2 * C].T + bqkv[C:2 * C]
            v = feats @ W[2 * C:].T + bqkv[2 * C:]
            for head in range(H):
                sl = slice(head * d, (head + 1) * d)
                logits = (k[:, sl] @ q[sl]) * d ** -0.5 + biases[:, head]
                p = torch.exp(logits - logits.max())
                out[r * w + c, sl] = (p / p.sum()) @ v[:, sl]
    return out @ mixer.proj.weight.double().T + mixer.proj.bias.double()


GRID_CASES = [
    # (h, w, options): Focal-T defaults on non-multiples; a map smaller than the window; the official trim (ws 5, L 3)
    (13, 10, dict(heads=2)),
    (5, 9, dict(heads=2)),
    (3, 2, dict(heads=2)),
    (11, 13, dict(heads=2, window_size=5, expand_size=2, focal_level=3, focal_window=3)),
    (9, 8, dict(heads=4, window_size=4, expand_size=1, focal_level=3, focal_window=1)),
]


@pytest.mark.parametrize("h,w,opts", GRID_CASES, ids=[f"{h}x{w}-{i}" for i, (h, w, _) in enumerate(GRID_CASES)])
def test_grid_matches_bruteforce(h, w, opts):
    mixer = build(**opts)
    gen = torch.Generator().manual_seed(h * w)
    x = torch.randn(2, h * w, DIM, generator=gen)
    with torch.no_grad():
        y32 = mixer(x, Grid(h, w))
        expected = torch.stack([reference_grid(mixer, x[b], h, w) for b in range(2)])
        assert y32.dtype == torch.float32
        assert rel_err(y32, expected) < 1e-5
        y64 = mixer.double()(x.double(), Grid(h, w))
    assert rel_err(y64, expected) < 1e-12


def test_grid_key_counts():
    """Interior windows see the window, 4*ws^2 - 4*(ws - e)^2 expand slots and fw^2 pooled tokens (Focal-T: 230)."""
    mixer = build()
    h = w = 49  # 7 x 7 windows: the centre one sees all of them
    zero = torch.zeros(h * w, DIM, dtype=torch.float64)
    keys = keys_of(mixer, zero, h, w, 24, 24, pooled_maps(mixer, zero, h, w))
    assert len(keys) == 49 + 132 + 49


def test_window_covering_the_map_is_plain_attention():
    """One window over the whole map, no expansion, no coarse level, zero biases: softmax attention over the map."""
    for h, w in [(5, 6), (7, 7), (1, 4)]:
        mixer = build(dim=32, heads=4, window_size=7, expand_size=0, focal_level=1, randomise=False)
        with torch.no_grad():
            mixer.relative_position_bias_table.zero_()
        x = torch.randn(3, h * w, 32, generator=torch.Generator().manual_seed(h + w))
        with torch.no_grad():
            y = mixer(x, Grid(h, w))
            q, k, v = (x.double() @ mixer.qkv.weight.double().T + mixer.qkv.bias.double()).chunk(3, dim=-1)
            heads = []
            for s in range(0, 32, 8):
                a = torch.softmax(q[..., s:s + 8] @ k[..., s:s + 8].transpose(1, 2) / 8 ** 0.5, dim=-1)
                heads.append(a @ v[..., s:s + 8])
            expected = mixer.proj(torch.cat(heads, dim=-1).float())
        assert rel_err(y, expected) < 1e-5
        # and the bias table does matter
        with torch.no_grad():
            mixer.relative_position_bias_table.normal_()
            assert rel_err(mixer(x, Grid(h, w)), expected) > 1e-3


# --------------------------------------------------------------------------------------------
# Borders: masked, not wrapped
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("h,w,opts,query", [
    (13, 10, dict(focal_window=1), (0, 0)),  # with fw = 7 every pooled token of this map is in reach
    (13, 10, dict(focal_window=1), (12, 9)),
    (11, 13, dict(window_size=5, expand_size=2, focal_level=3, focal_window=3), (5, 0)),
    (14, 21, dict(focal_window=3), (3, 0)),
])
def test_tokens_out_of_reach_change_nothing(h, w, opts, query):
    mixer = build(heads=2, **opts)
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(1, h * w, DIM, generator=gen)
    r, c = query
    zero = torch.zeros(h * w, DIM, dtype=torch.float64)
    reach = set().union(*(pixels for _, _, pixels in keys_of(mixer, zero, h, w, r, c, pooled_maps(mixer, zero, h, w))))
    outside = torch.tensor([(rr, cc) not in reach for rr in range(h) for cc in range(w)])
    assert outside.any() and not outside.all()
    x2 = x.clone()
    x2[0, outside] = torch.randn(int(outside.sum()), DIM, generator=gen) * 5
    x3 = x.clone()
    x3[0, ~outside] += 1.0
    with torch.no_grad():
        y, y2, y3 = (mixer(t, Grid(h, w))[0, r * w + c] for t in (x, x2, x3))
    assert torch.equal(y, y2) or rel_err(y2, y) < 1e-6
    assert rel_err(y3, y) > 1e-3  # tokens in reach do matter


def test_left_window_does_not_see_the_right_edge():
    """The official roll would hand the left-most window the right-most columns as expand tokens; masking does not."""
    h, w = 7, 21  # three windows side by side
    mixer = build(heads=2, focal_window=3)  # pooled: the window's own and its direct neighbours
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(1, h * w, DIM, generator=gen)
    cols = torch.arange(h * w) % w
    right_edge, expand = cols >= w - 3, cols == 8  # columns 18-20 wrap to -3..-1 under the roll; 8 is in reach
    left_window = cols < 7
    with torch.no_grad():
        y = mixer(x, Grid(h, w))
        x2 = x.clone()
        x2[0, right_edge] += 5 * torch.randn(int(right_edge.sum()), DIM, generator=gen)
        y2 = mixer(x2, Grid(h, w))
        x3 = x.clone()
        x3[0, expand] += 5.0
        y3 = mixer(x3, Grid(h, w))
    assert torch.equal(y[0, left_window], y2[0, left_window]) or rel_err(y2[0, left_window], y[0, left_window]) < 1e-6
    assert rel_err(y2[0, ~left_window], y[0, ~left_window]) > 1e-3
    assert rel_err(y3[0, left_window], y[0, left_window]) > 1e-3


@pytest.mark.parametrize("opts", [dict(window_size=4, expand_size=2, focal_level=3, focal_window=3),
                                  dict(window_size=4, expand_size=1, focal_level=2, focal_window=3)])
def test_roll_and_mask_agree_inside_and_differ_at_borders(opts):
    """A 12 x 12 map, no padding: the centre window's keys (its ring, the pooled tokens around it) lie in the
    map, so the official roll (border=roll) and the mask give it the same output; the windows at the border
    take wrapped expand tokens and all pooled tokens under roll, so they differ. (The official function itself
    is held by tests/tasks/test_focal_official.py.)"""
    h = w = 12
    rolled = build(heads=2, border="roll", **opts).double()
    masked = build(heads=2, border="mask", **opts).double()
    masked.load_state_dict(rolled.state_dict())
    x = torch.randn(2, h * w, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        y_roll, y_mask = (m(x, Grid(h, w)).view(2, h, w, DIM) for m in (rolled, masked))
    torch.testing.assert_close(y_roll[:, 4:8, 4:8], y_mask[:, 4:8, 4:8], rtol=1e-12, atol=1e-12)
    for rows, cols in ((slice(0, 4), slice(0, 4)), (slice(8, 12), slice(4, 8)), (slice(4, 8), slice(8, 12))):
        assert (y_roll[:, rows, cols] - y_mask[:, rows, cols]).abs().amax() > 1e-3


def test_border_option_is_checked():
    with pytest.raises(UserError, match="attn.border='wrap'"):
        attention.build("focal", dim=DIM, border="wrap")
    assert attention.get("focal").layout_options["border"] == frozenset({"grid"})


# --------------------------------------------------------------------------------------------
# Shapes, sizes, gradients
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("opts", [dict(), dict(window_size=5, expand_size=2, focal_level=3, focal_window=3),
                                  dict(window_size=1, expand_size=0, focal_level=2, focal_window=1),
                                  dict(border="roll"), dict(window_size=5, expand_size=2, focal_level=3,
                                                            focal_window=3, border="roll")])
@pytest.mark.parametrize("h,w", [(5, 9), (13, 10), (3, 2), (1, 1), (1, 20), (14, 14)])
def test_sizes_shapes_and_gradients(h, w, opts):
    mixer = build(dim=DIM, heads=4, **opts).train()
    x = torch.randn(2, h * w, DIM, generator=torch.Generator().manual_seed(h * 31 + w), requires_grad=True)
    y = mixer(x, Grid(h, w))
    assert y.shape == (2, h * w, DIM) and y.dtype == x.dtype
    assert torch.isfinite(y).all()
    y.square().sum().backward()
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    for name, p in mixer.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


def test_wrong_grid_or_points_raise():
    mixer = build()
    x = torch.randn(2, 12, DIM)
    with pytest.raises(ValueError):
        mixer(x, Grid(3, 5))
    with pytest.raises(ValueError):
        mixer(x, Points(torch.rand(2, 13, 3)))
    with pytest.raises(ValueError):
        Points(torch.rand(2, 12, 2))
    with pytest.raises(ValueError, match="focal"):
        mixer(x, None)


# --------------------------------------------------------------------------------------------
# Point sets
# --------------------------------------------------------------------------------------------

def fps_reference(xyz, m, start):
    chosen = [start]
    for _ in range(m - 1):
        d = torch.stack([((xyz - xyz[c]) ** 2).sum(-1) for c in chosen]).amin(0)
        chosen.append(int(d.argmax()))
    return chosen


def nearest(dist_row, k):
    """The first k indices sorted by (distance, index)."""
    return sorted(range(len(dist_row)), key=lambda j: (float(dist_row[j]), j))[:k]


def reference_points(mixer, x, xyz):
    """One sample: each point against its nearest points and the pooled regions of its nearest centres, float64."""
    n, C, H = x.shape[0], mixer.dim, mixer.heads
    d = C // H
    x, xyz = x.double(), xyz.double()
    dist = ((xyz[:, None] - xyz[None]) ** 2).sum(-1)  # (N, N)
    start = int(((xyz - xyz.mean(0)) ** 2).sum(-1).argmax())
    levels = []  # per coarse level: the centres and their pooled tokens, in sampling order
    for k in range(mixer.focal_level - 1):
        area = (mixer.window_size // 2 ** k) ** 2
        centres = fps_reference(xyz, math.ceil(n / area), start)
        levels.append((k, centres, [x[nearest(dist[c], min(area, n))].mean(0) for c in centres]))
    W, bqkv = mixer.qkv.weight.double(), mixer.qkv.bias.double()
    out = torch.empty(n, C, dtype=torch.float64)
    for i in range(n):
        feats = [x[j] for j in nearest(dist[i], min(mixer.neighbours, n))]
        for k, centres, pooled in levels:
            t = (mixer.focal_window + 2 ** k - 1) ** 2 if mixer.coarse_neighbours is None else mixer.coarse_neighbours
            seen = range(len(centres)) if len(centres) <= t else nearest(dist[i, centres], t)
            feats += [pooled[r] for r in seen]
        feats = torch.stack(feats)
        q = x[i] @ W[:C].T + bqkv[:C]
        k = feats @ W[C:2 * C].T + bqkv[C:2 * C]
        v = feats @ W[2 * C:].T + bqkv[2 * C:]
        for head in range(H):
            sl = slice(head * d, (head + 1) * d)
            out[i, sl] = torch.softmax((k[:, sl] @ q[sl]) * d ** -0.5, dim=0) @ v[:, sl]
    return out @ mixer.proj.weight.double().T + mixer.proj.bias.double()


@pytest.mark.parametrize("n,opts", [
    (40, dict(window_size=4, expand_size=1, focal_level=3, neighbours=6)),  # all regions: m = 3, 10 <= t = 49, 64
    (30, dict()),  # neighbours 49 clamped to 30, one region of all points
    (25, dict(window_size=3, expand_size=1, focal_level=1, neighbours=5)),
    (60, dict(window_size=4, expand_size=1, focal_level=3, focal_window=1, neighbours=6)),  # t = 1 of 4, 4 of 15
    (60, dict(window_size=4, expand_size=1, focal_level=3, neighbours=5, coarse_neighbours=3)),  # 3 of 4, 3 of 15
])
def test_points_match_bruteforce(n, opts):
    mixer = build(heads=2, **opts)
    gen = torch.Generator().manual_seed(n)
    x, xyz = torch.randn(2, n, DIM, generator=gen), torch.rand(2, n, 3, generator=gen)
    with torch.no_grad():
        y = mixer(x, Points(xyz))
        expected = torch.stack([reference_points(mixer, x[b], xyz[b]) for b in range(2)])
        assert rel_err(y, expected) < 1e-5
        assert rel_err(mixer.double()(x.double(), Points(xyz.double())), expected) < 1e-12


def every_point_sees_every_region(mixer, x, xyz):
    """The point-set path as it was before coarse_neighbours: every region's pooled token, shared by all points."""
    b, n, c = x.shape
    fine, regions, _ = mixer.point_regions(xyz)
    qkv = mixer.qkv(x)
    keys = [gather(qkv[..., c:], fine)]
    for region in regions:
        pooled = mixer._kv(gather(x, region).mean(dim=2))
        keys.append(pooled[:, None].expand(b, n, -1, -1))
    k, v = torch.cat(keys, dim=2).view(b, n, -1, 2, mixer.heads, c // mixer.heads).permute(3, 0, 4, 1, 2, 5)
    q = qkv[..., :c].view(b, n, mixer.heads, 1, c // mixer.heads).transpose(1, 2)
    out = AF.focal_attention(q, k, v)  # (B, heads, N, 1, d)
    return mixer.proj(out.transpose(1, 2).reshape(b, n, c))


@pytest.mark.parametrize("n,opts", [(40, dict(window_size=4, expand_size=1, focal_level=3)),  # m = 3, 10
                                    (2401, dict()),  # m = 49 = t: the largest set that keeps every region
                                    (200, dict(focal_level=3, coarse_neighbours=50))])  # m = 5, 23
def test_small_sets_see_every_region_exactly_as_before(n, opts):
    mixer = build(**opts)
    gen = torch.Generator().manual_seed(n)
    x, xyz = torch.randn(1, n, DIM, generator=gen), torch.rand(1, n, 3, generator=gen)
    _, regions, seen = mixer.point_regions(xyz)
    assert all(near.shape[-1] == region.shape[1] for region, near in zip(regions, seen))
    with torch.no_grad():
        assert torch.equal(mixer(x, Points(xyz)), every_point_sees_every_region(mixer, x, xyz))
    if n == 2401:  # one point more: 50 regions, each point sees its 49 nearest
        _, regions, seen = mixer.point_regions(torch.rand(1, n + 1, 3, generator=gen))
        assert regions[0].shape[1] == 50 and seen[0].shape[-1] == 49


def test_point_regions():
    mixer = build(window_size=4, expand_size=1, focal_level=3, neighbours=7, coarse_neighbours=5)
    gen = torch.Generator().manual_seed(5)
    xyz = torch.rand(2, 50, 3, generator=gen, dtype=torch.float64)
    fine, regions, seen = mixer.point_regions(xyz)
    assert fine.shape == (2, 50, 7)
    assert [tuple(r.shape) for r in regions] == [(2, 4, 16), (2, 13, 4)]  # ceil(50/16) regions of 16, ceil(50/4) of 4
    assert [tuple(s.shape) for s in seen] == [(2, 50, 4), (2, 50, 5)]  # all 4; the 5 nearest of 13
    for b in range(2):
        dist = ((xyz[b, :, None] - xyz[b, None]) ** 2).sum(-1)
        for i in range(50):
            assert fine[b, i].tolist() == nearest(dist[i], 7)
        start = int(((xyz[b] - xyz[b].mean(0)) ** 2).sum(-1).argmax())
        centres = fps_reference(xyz[b], 13, start)
        for region, size in zip(regions, (16, 4)):
            for r, centre in enumerate(centres[:region.shape[1]]):
                assert sorted(region[b, r].tolist()) == sorted(nearest(dist[centre], size))
        for i in range(50):
            assert seen[0][b, i].tolist() == [0, 1, 2, 3]
            assert seen[1][b, i].tolist() == nearest(dist[i, centres], 5)


def test_points_permutation_equivariance():
    mixer = build(window_size=4, expand_size=1, focal_level=3, neighbours=6)
    gen = torch.Generator().manual_seed(9)
    x, xyz = torch.randn(2, 60, DIM, generator=gen), torch.rand(2, 60, 3, generator=gen)
    perm = torch.randperm(60, generator=gen)
    with torch.no_grad():
        y = mixer(x, Points(xyz))
        y_perm = mixer(x[:, perm], Points(xyz[:, perm]))
    assert rel_err(y_perm, y[:, perm]) < 1e-5


def concatenated_keys(mixer, x, xyz):
    """The point-set path as it was before attention over indexed keys: every point's (M, 2C) keys and values gathered
    and concatenated into one (B, N, M, 2C) tensor, then functional.focal_attention, autograd through it all."""
    b, n, c = x.shape
    fine, regions, seen = mixer.point_regions(xyz)
    qkv = mixer.qkv(x)  # (B, N, 3C)
    keys = [gather(qkv[..., c:], fine)]  # (B, N, K, 2C)
    for region, near in zip(regions, seen):
        keys.append(gather(mixer._kv(gather(x, region).mean(dim=2)), near))  # (B, N, min(t, m), 2C)
    k, v = torch.cat(keys, dim=2).view(b, n, -1, 2, mixer.heads, c // mixer.heads).permute(3, 0, 4, 1, 2, 5)
    q = qkv[..., :c].view(b, n, mixer.heads, 1, c // mixer.heads).transpose(1, 2)  # (B, heads, N, 1, d)
    out = AF.focal_attention(q, k, v)  # (B, heads, N, 1, d)
    return mixer.proj(out.transpose(1, 2).reshape(b, n, c))


@pytest.mark.parametrize("rows", [1, 7, None])  # queries per chunk of index_attention's torch kernel; None: the default
def test_points_match_the_concatenated_formulation_with_gradients(rows, monkeypatch):
    """Chunked attention over indexed keys, run in Morton order: the same outputs and gradients (x and every
    parameter) as the concatenated keys, in float64, whatever the chunks (7 divides neither 300 nor 600 rows)."""
    if rows is not None:
        monkeypatch.setitem(AF.INDEX_CHUNK_ELEMENTS, "cpu", rows * (8 + 5 + 5) * DIM)  # M = 18 keys
    # levels of 19 and 75 regions: each point sees its 5 nearest of both
    mixer = build(heads=2, window_size=4, expand_size=1, focal_level=3, neighbours=8, coarse_neighbours=5).double()
    gen = torch.Generator().manual_seed(3)
    xyz = torch.rand(2, 300, 3, generator=gen, dtype=torch.float64)
    x = torch.randn(2, 300, DIM, generator=gen, dtype=torch.float64)
    upstream = torch.randn(2, 300, DIM, generator=gen, dtype=torch.float64)
    results = []
    for f in (lambda t: mixer(t, Points(xyz)), lambda t: concatenated_keys(mixer, t, xyz)):
        mixer.zero_grad()
        xg = x.clone().requires_grad_()
        y = f(xg)
        y.backward(upstream)
        results.append([y, xg.grad] + [p.grad.clone() for p in mixer.parameters() if p.grad is not None])
    assert len(results[0]) == len(results[1]) == 2 + 4  # qkv and proj weights and biases; the grid tables get none
    for got, expected in zip(*results):
        assert rel_err(got, expected) < 1e-12


def test_index_attention_against_loops_and_its_gradients(monkeypatch):
    """out[i] = softmax_j(q_i . k_j * scale) v_j over the rows index[i] names, per head, repeated rows included;
    first and second derivatives by finite differences, in chunks of 2 rows."""
    monkeypatch.setitem(AF.INDEX_CHUNK_ELEMENTS, "cpu", 2 * 5 * 6)
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(7, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(4, 6, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(2))
    index = torch.randint(0, 4, (7, 5), generator=gen)
    index[0] = torch.tensor([2, 2, 2, 0, 2])  # one key five times over and one once
    out = AF.index_attention(q, k, v, index, 3, scale=0.7)
    expected = torch.empty(7, 6, dtype=torch.float64)
    for i in range(7):
        for head in range(3):
            sl = slice(2 * head, 2 * head + 2)
            logits = torch.stack([(q[i, sl] * k[j, sl]).sum() * 0.7 for j in index[i].tolist()])
            expected[i, sl] = sum(a * v[j, sl] for a, j in zip(torch.softmax(logits, 0), index[i].tolist()))
    assert rel_err(out, expected) < 1e-13
    assert torch.autograd.gradcheck(lambda *t: AF.index_attention(*t, index, 3), (q, k, v))
    assert torch.autograd.gradgradcheck(lambda *t: AF.index_attention(*t, index, 3), (q, k, v))


def test_morton_order_is_a_permutation_that_keeps_neighbours_close():
    gen = torch.Generator().manual_seed(6)
    xyz = torch.rand(2, 4096, 3, generator=gen)
    order = focal_module.morton_order(xyz)
    assert torch.equal(order.sort(dim=1).values, torch.arange(4096).expand(2, -1))
    # consecutive points in the order are about 8 times closer than consecutive points of the set
    step = xyz.gather(1, order[..., None].expand(-1, -1, 3)).diff(dim=1).norm(dim=-1).mean()
    assert step < xyz.diff(dim=1).norm(dim=-1).mean() / 5
    same = torch.zeros(1, 5, 3)  # one point five times: the order of the set
    assert focal_module.morton_order(same).tolist() == [[0, 1, 2, 3, 4]]
    from op_log import OpLog

    with OpLog() as log:  # a launch each on a GPU: the bits are spread in a few steps, not looped over one by one
        focal_module.morton_order(xyz)
    assert sum(not view for _, view, _ in log.ops) <= 30  # 28; a loop over the 30 bits made 120 more


def test_points_under_bfloat16_autocast():
    """Half projections, attention in float32 (as functional.focal_attention): close to the float32 result."""
    mixer = build(heads=2, window_size=4, expand_size=1, focal_level=3, neighbours=8, coarse_neighbours=5)
    gen = torch.Generator().manual_seed(8)
    xyz, x = torch.rand(1, 300, 3, generator=gen), torch.randn(1, 300, DIM, generator=gen)
    with torch.no_grad():
        expected = mixer(x, Points(xyz))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = mixer(x, Points(xyz))
    assert y.dtype == torch.bfloat16 and rel_err(y, expected) < 3e-2


# --------------------------------------------------------------------------------------------
# Kernel, options, cost
# --------------------------------------------------------------------------------------------

def test_kernel_matches_bruteforce():
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 3, 4, 5, 6, generator=gen, dtype=torch.float64)
    k = torch.randn(2, 3, 4, 7, 6, generator=gen, dtype=torch.float64)
    v = torch.randn(2, 3, 4, 7, 2, generator=gen, dtype=torch.float64)
    bias = torch.randn(3, 1, 5, 7, generator=gen, dtype=torch.float64)
    mask = torch.rand(4, 1, 7, generator=gen) > 0.4
    mask[:, :, 0] = True
    out = AF.focal_attention(q, k, v, mask=mask, bias=bias)
    expected = torch.empty(2, 3, 4, 5, 2, dtype=torch.float64)
    for i in range(2):
        for h in range(3):
            for w in range(4):
                for s in range(5):
                    keep = [m for m in range(7) if mask[w, 0, m]]
                    logits = torch.stack([(q[i, h, w, s] * k[i, h, w, m]).sum() / 6 ** 0.5 + bias[h, 0, s, m]
                                          for m in keep])
                    a = torch.exp(logits - logits.max())
                    expected[i, h, w, s] = sum(a[j] / a.sum() * v[i, h, w, m] for j, m in enumerate(keep))
    assert rel_err(out, expected) < 1e-12
    assert rel_err(AF.focal_attention(q, k, v), AF.softmax_attention(q.flatten(0, 1), k.flatten(0, 1),
                                                                      v.flatten(0, 1)).view_as(out)) < 1e-12


@pytest.mark.parametrize("opts,option", [
    (dict(window_size=0), "window_size"),
    (dict(window_size=2.5), "window_size"),
    (dict(expand_size=-1), "expand_size"),
    (dict(expand_size=4), "expand_size"),  # > window_size // 2 = 3
    (dict(window_size=4, expand_size=3), "expand_size"),
    (dict(focal_level=0), "focal_level"),
    (dict(focal_level=5), "focal_level"),  # 2**3 > 7: empty sub-windows
    (dict(focal_window=0), "focal_window"),
    (dict(focal_window=4), "focal_window"),
    (dict(neighbours=0), "neighbours"),
    (dict(coarse_neighbours=0), "coarse_neighbours"),
])
def test_bad_options_name_the_option(opts, option):
    with pytest.raises(UserError, match=f"attn.{option}="):
        attention.build("focal", dim=DIM, **opts)


def test_boundary_options_build():
    attention.build("focal", dim=DIM, window_size=7, expand_size=3, focal_level=4)  # sub-windows of 7, 3, 1
    attention.build("focal", dim=DIM, window_size=1, expand_size=0, focal_level=2, focal_window=1)


def test_params_and_flops():
    C, heads, ws, e, fw = 32, 4, 7, 3, 7
    mixer = attention.build("focal", dim=C, heads=heads)
    expected_params = (C * 3 * C + 3 * C + C * C + C  # qkv, proj
                       + (2 * ws - 1) ** 2 * heads  # inside the window
                       + heads * ws * ws * (4 * ws ** 2 - 4 * (ws - e) ** 2)  # to the expand slots
                       + ws * ws + 1 + heads * (ws + fw - 1) ** 2)  # fc pool and its table
    assert mixer.cost(16)["params"] == expected_params
    # 14 x 14 map: 4 windows, 2 x 2 pooled tokens of 7 x 7 pixels, 49 + 132 + 49 keys per window
    n, windows, pooled, keys = 196, 4, 4, 230
    macs = (n * C * 3 * C  # qkv
            + pooled * C * ws * ws + pooled * C * 2 * C  # fc pool, k and v of pooled tokens
            + 2 * windows * ws * ws * keys * C  # q k^T and a v
            + n * C * C)  # output projection
    assert mixer.cost(n, layout="grid")["flops"] == 2 * macs
    assert mixer.cost(4 * n, layout="grid")["flops"] == 4 * 2 * macs  # linear in the map's size


def test_grid_attention_reads_the_gathered_keys_and_values_in_place():
    """On a grid the keys and values are gathered per head as [k | v] rows, so the attention's two matmuls read each
    head's (M, d) blocks where they lie: no copy of the gathered size (gathered as (B, nW, M, 2C) and split by head
    after, each matmul first copied its operand out: 22% of the step's peak memory at N = 65,536, C = 256)."""
    from op_log import OpLog

    mixer = attention.build("focal", dim=32, heads=4)
    x, layout = torch.randn(2, 14 * 14, 32), Grid(14, 14)
    keys, _ = focal_module.grid_plan(14, 14, mixer.window_size, mixer.expand_size, mixer.focal_level,
                                     mixer.focal_window, x.device, mixer.border)
    gathered = x.shape[0] * keys.numel() * 32  # one of k, v gathered: (B, heads, nW, M, d) elements

    with OpLog() as log:
        out = mixer(x, layout)
    copies = [numel for name, _, numel in log.ops if name in ("clone.default", "_to_copy.default", "copy_.default")]
    assert out.shape == (2, 14 * 14, 32)
    assert copies and max(copies) < gathered, (copies, gathered)
