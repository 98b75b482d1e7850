"""``focal``: focal self-attention (Yang et al., 2021, "Focal Self-attention for
Local-Global Interactions in Vision Transformers").

On grids this follows the official code (microsoft/Focal-Transformer,
``classification/focal_transformer.py``: ``WindowAttention`` and the pooling of
``FocalTransformerBlock`` with ``pool_method="fc"``), with ws = ``window_size``,
e = ``expand_size``, fw = ``focal_window``, L = ``focal_level``:

- The map is cut into ws x ws windows, padded at the bottom and right to a
  multiple of ws. The ws*ws queries of a window attend, through one softmax
  over all keys of all levels, to:
- level 0, fine: the window's own ws*ws tokens, then the tokens of four copies
  of the window shifted diagonally by (+e, +e), (+e, -e), (-e, +e), (-e, -e)
  (the official rolls tl, tr, bl, br) minus those inside the window (the
  official ``valid_ind_rolled``): 4*ws^2 - 4*(ws - e)^2 key slots that cover
  the ring of width e around the window (hence e <= ws // 2). Where two copies
  overlap (bands ws - 2e wide in the middle of each side) a token fills two
  slots, each with its own bias, exactly as in the official code.
- levels l = 1 .. L-1, coarse (k = l - 1 below, as in the official loops): the
  padded map is pooled over sub-windows of g = floor(ws / 2^k) pixels a side
  by 'fc' pooling, a learned Linear(g*g, 1) over a sub-window's positions
  shared by the channels. The mixer initialises it to the mean, the value
  the official block writes; the official ``FocalTransformer`` then draws
  it again with its other Linears (truncated normal, std 0.02), which
  ``model=focal_t|focal_s`` does too. The mean stays the default elsewhere:
  those networks have no official pool init, and it is the pool that point
  sets use. The pooled map has 2^k tokens per window a side and covers the centre
  of the padded map (the official trim when 2^k * g < ws, e.g. ws = 7, k = 1).
  A window attends to the K x K pooled tokens around it, K = fw + 2^k - 1:
  its own 2^k x 2^k sub-windows and (fw - 1) / 2 more on each side (the
  official ``nn.Unfold`` plus ``valid_ind_unfold``; fw odd, as there).
- Keys and values of pooled tokens come from the same qkv projection as those
  of pixels (only its k and v rows are applied to them); scale d^-0.5; output
  projection Linear(C, C).
- Relative position biases, one kind per key kind, with the official names
  and shapes: ``relative_position_bias_table`` (the Swin table, zeros at
  start) inside the window; ``relative_position_bias_table_to_neighbors``, a
  free bias per (query slot, expand slot); per coarse level a table in
  ``relative_position_bias_table_to_windows`` indexed by the query's position
  in its window minus the pooled token's position in its K x K neighbourhood.

Borders (``border``, grids only):

- ``roll``, the official function: the zero-padded map is projected (a
  padding pixel's key and value are the qkv bias) and its padding pixels are
  keys of the windows that hold them; the expand copies are cyclic rolls of
  the padded map (``torch.roll``), so a window at one edge takes expand tokens
  from the opposite edge (offsets taken modulo the padded sides); every pooled
  token of the pooled map is a key, and the slots of the K x K neighbourhood
  beyond the pooled map (``nn.Unfold``'s zero padding) have key and value 0
  and the official additive mask -100 on their logits.
- ``mask`` (the default for generic use; a deviation): out-of-map expand
  tokens and padding pixels are excluded from the softmax. A pooled token is
  a key iff its sub-window holds at least one pixel of the map (padding
  pixels enter the 'fc' sum as zeros, as the official F.pad); pooled slots
  beyond the pooled map are excluded exactly.

Either way a map smaller than a window is one padded window with the module's
own ws and e; the official block instead shrinks the window to the map's
shorter side and drops the expansion, so its parameters depend on the map
(``tasks/nets/backbones/focal.py`` does that at build time, as the official
block; with ``border=roll`` and the shrunk options the function is then the
official one).

On point sets (no official counterpart), in place of windows:

- fine: each point attends to its ``neighbours`` nearest points, itself
  included (default ws^2, at most N);
- coarse: level l pools regions of s = floor(ws / 2^(l-1))^2 points (the area
  of that level's sub-window) around m = ceil(N / s) centres picked by
  farthest point sampling; a region is its centre's s nearest points, pooled
  by their mean (the 'fc' pool's initial value: a learned pool would need an
  order of the region's points). Sampling starts at the point farthest from
  the centroid, so the result does not depend on the order of the points.
- each point attends, at coarse level l, to the pooled tokens of the t regions
  whose centres are nearest to it (nearest first, ties to the earlier centre),
  t = ``coarse_neighbours``, by default (fw + 2^(l-1) - 1)^2, the K x K pooled
  tokens a grid window sees; where m <= t it attends to all m in sampling
  order, so every point of a small set (N <= t * s, e.g. 2401 points with the
  defaults) sees the same coarse tokens. Attention costs O(N (K + t)) time and
  O(N C + N (K + t)) memory: :func:`attention.functional.index_attention` never holds
  the (N, K + t) keys and values, only their indices (see there). The searches are those of
  :mod:`attention.pointops`: farthest point sampling, O(N^2 / s), and k-nearest
  searches, about O(N (K + t)) on evenly spread points.
- no position bias (the tables above are grid offsets), so ``expand_size`` and
  ``border`` act on grids only, ``neighbours`` and ``coarse_neighbours`` on
  point sets only; ``focal_window`` on grids, and on point sets through the
  default of ``coarse_neighbours``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from .. import functional
from ..base import Mixer, check_bool, check_positive
from ..errors import UserError
from ..pointops import MORTON_BITS, farthest_from_centroid, farthest_point_sample, gather, knn, morton_codes
from ..registry import register
from ..tensor_cache import tensor_cache


# --------------------------------------------------------------------------------------------
# Grid geometry: which token each key slot of each window reads (pure functions of the sizes)
# --------------------------------------------------------------------------------------------

def window_offsets(ws: int) -> torch.Tensor:
    """(ws*ws, 2) row/column offsets of a window's pixels from its top-left one, row-major."""
    return torch.cartesian_prod(torch.arange(ws), torch.arange(ws))


def expand_offsets(ws: int, e: int) -> torch.Tensor:
    """(4*ws^2 - 4*(ws - e)^2, 2) offsets of the expand slots, in the official order.

    The window shifted by (+e, +e), (+e, -e), (-e, +e), (-e, -e) (the official
    rolls tl, tr, bl, br), each row-major, without the offsets inside the window.
    """
    # Python integers, not a boolean mask: the result is a function of (ws, e) alone, and a mask's data-dependent
    # shape broke torch.compile's graph at every block of a focal backbone (a graph and recompiles per block)
    shifted = [(a + dr, b + dc) for dr, dc in ((e, e), (e, -e), (-e, e), (-e, -e))
               for a in range(ws) for b in range(ws)]  # each copy row-major, as window_offsets
    outside = [o for o in shifted if not (0 <= o[0] < ws and 0 <= o[1] < ws)]
    return torch.tensor(outside, dtype=torch.long).reshape(-1, 2)


def relative_position_index(ws: int, k: int) -> torch.Tensor:
    """(ws*ws, k*k) index into a ((ws + k - 1)^2)-entry table, as the official ``get_relative_position_index``.

    Entry (i, j): query at (a, b) in a ws x ws window, key at (u, v) in a k x k
    grid; index (a - u + k - 1) * (ws + k - 1) + (b - v + k - 1). For k = ws
    this is the Swin index.
    """
    q, kv = window_offsets(ws), window_offsets(k)
    rel = q[:, None, :] - kv[None, :, :] + (k - 1)  # (ws*ws, k*k, 2), both >= 0
    return rel[..., 0] * (ws + k - 1) + rel[..., 1]


def pooled_geometry(h: int, w: int, ws: int, k: int) -> tuple[int, int, int, int, int]:
    """Sub-window side g, pooled map size (ph, pw) and its top-left pixel (top, left) at coarse level k.

    As the official block: g = floor(ws / 2^k), 2^k sub-windows per window a
    side, centred on the padded map (trimmed when 2^k * g < ws).
    """
    nh, nw = math.ceil(h / ws), math.ceil(w / ws)
    g = ws // 2 ** k
    ph, pw = nh * 2 ** k, nw * 2 ** k
    return g, ph, pw, (nh * ws - ph * g) // 2, (nw * ws - pw * g) // 2


BORDERS = ("mask", "roll")
ROLL_MASK = -100.0  # the official additive mask of pooled slots beyond the pooled map (border=roll)


@tensor_cache(maxsize=64)
def grid_plan(h: int, w: int, ws: int, e: int, focal_level: int, focal_window: int, device: torch.device,
              border: str = "mask"):
    """The keys of every window of an h x w map, as indices into its key sources.

    Sources: the pixels (``mask``: the h*w of the map; ``roll``: the H'*W' of
    the map padded to multiples of ws), then the pooled tokens of each coarse
    level (row-major), then one null token read by masked slots. Returns
    ``keys`` (nW, M) and ``valid`` (nW, M), windows row-major, slots in the
    order: window, expand (see :func:`expand_offsets`), then each level's
    K x K neighbourhood row-major. With ``roll`` every pixel slot is valid
    (expand offsets wrap around the padded map) and so is every pooled token
    of the pooled map; the invalid slots are those beyond it.
    """
    nh, nw = math.ceil(h / ws), math.ceil(w / ws)
    win_r = torch.arange(nh).repeat_interleave(nw)  # (nW,) window row, column
    win_c = torch.arange(nw).repeat(nh)

    # level 0: pixels at fixed offsets from the window's top-left pixel
    offsets = torch.cat([window_offsets(ws), expand_offsets(ws, e)])  # (F, 2)
    r = win_r[:, None] * ws + offsets[:, 0]  # (nW, F)
    c = win_c[:, None] * ws + offsets[:, 1]
    if border == "roll":  # the official torch.roll of the padded map
        keys, valid = [(r % (nh * ws)) * (nw * ws) + c % (nw * ws)], [torch.ones_like(r, dtype=torch.bool)]
        first = nh * ws * nw * ws
    else:
        keys, valid = [r * w + c], [(r >= 0) & (r < h) & (c >= 0) & (c < w)]
        first = h * w

    # coarse levels: the K x K pooled tokens around the window's own 2^k x 2^k
    for k in range(focal_level - 1):
        g, ph, pw, top, left = pooled_geometry(h, w, ws, k)
        span = torch.arange(focal_window + 2 ** k - 1) - (focal_window - 1) // 2  # (K,)
        pr = (win_r * 2 ** k)[:, None, None] + span[None, :, None]  # (nW, K, 1)
        pc = (win_c * 2 ** k)[:, None, None] + span[None, None, :]  # (nW, 1, K)
        exists = (pr >= 0) & (pr < ph) & (pc >= 0) & (pc < pw)  # (nW, K, K)
        if border != "roll":
            exists = exists & (top + pr * g < h) & (left + pc * g < w)  # sub-window holds a pixel of the map
        keys.append((first + pr * pw + pc).flatten(1))  # (nW, K*K)
        valid.append(exists.flatten(1))
        first += ph * pw

    valid = torch.cat(valid, dim=1)  # (nW, M)
    keys = torch.cat(keys, dim=1).masked_fill(~valid, first)  # (nW, M), masked slots read the null token
    return keys.to(device), valid.to(device)


# --------------------------------------------------------------------------------------------
# Point sets: the points in a cache-friendly order
# --------------------------------------------------------------------------------------------

def morton_order(xyz: torch.Tensor) -> torch.Tensor:
    """(B, N) permutation of each sample's points along a Morton (Z-order) curve through their bounding box.

    A memory layout only: the point-set path runs its attention with queries and keys in this order, so that
    a chunk of queries lies in a small region of space and gathers its keys from a few nearby rows, which stay
    in cache (at N = 16384 on a CPU the attention took 0.46 s, forward and backward, against 0.84 s with the
    points in a random order); the result does not depend on the order. Coordinates are quantised to
    2^MORTON_BITS cells along each side of the box (:func:`attention.pointops.morton_codes`); equal codes keep the
    points' order.
    """
    xyz = xyz.float() if xyz.dtype in functional.HALF else xyz
    lo, hi = xyz.amin(dim=1, keepdim=True), xyz.amax(dim=1, keepdim=True)  # (B, 1, 3)
    scale = (1 << MORTON_BITS) / (hi - lo).clamp_min(torch.finfo(xyz.dtype).tiny)  # (B, 1, 3) cells per unit
    return morton_codes(xyz, lo, scale).argsort(dim=1, stable=True)


# --------------------------------------------------------------------------------------------
# The mixer
# --------------------------------------------------------------------------------------------

@register("focal")
class FocalAttention(Mixer):
    complexity = "linear"  # fixed windows and pooled regions
    layouts = frozenset({"grid", "points"})
    layout_options = {"expand_size": frozenset({"grid"}), "border": frozenset({"grid"}),
                      "neighbours": frozenset({"points"}), "coarse_neighbours": frozenset({"points"})}

    def __init__(self, dim: int, heads: int = 4, window_size: int = 7, expand_size: int = 3,
                 focal_level: int = 2, focal_window: int = 7, border: str = "mask", neighbours: int | None = None,
                 coarse_neighbours: int | None = None, qkv_bias: bool = True):
        super().__init__(dim, heads)
        self._check_options(window_size, expand_size, focal_level, focal_window, neighbours)
        if coarse_neighbours is not None:
            check_positive("coarse_neighbours", coarse_neighbours, self.name)
        check_bool("qkv_bias", qkv_bias, self.name)
        if border not in BORDERS:
            raise UserError(f"attn.border={border!r} is invalid for attention variant {self.name!r}: expected one of "
                            f"{list(BORDERS)} (roll = the official cyclic roll of the zero-padded map, mask = "
                            f"out-of-map keys left out).")
        ws, e = window_size, expand_size
        self.window_size, self.expand_size, self.border = ws, e, border
        self.focal_level, self.focal_window = focal_level, focal_window
        self.neighbours = ws * ws if neighbours is None else neighbours
        self.coarse_neighbours = coarse_neighbours
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)

        # level 0: bias inside the window (Swin table, zeros as in the official code) and to the expand slots
        self.relative_position_bias_table = nn.Parameter(torch.zeros((2 * ws - 1) ** 2, heads))  # (entries, heads)
        self.register_buffer("relative_position_index", relative_position_index(ws, ws), persistent=False)
        self.relative_position_bias_table_to_neighbors = None
        if e > 0:
            slots = len(expand_offsets(ws, e))  # 4*ws^2 - 4*(ws - e)^2
            self.relative_position_bias_table_to_neighbors = nn.Parameter(
                nn.init.trunc_normal_(torch.empty(1, heads, ws * ws, slots), std=0.02))

        # coarse levels: an 'fc' pool over each sub-window and a bias table to the pooled tokens
        self.pool_layers = nn.ModuleList()
        self.relative_position_bias_table_to_windows = nn.ParameterList()
        for k in range(focal_level - 1):
            g = ws // 2 ** k
            pool = nn.Linear(g * g, 1)
            nn.init.constant_(pool.weight, 1 / (g * g))  # the mean (the Focal backbone re-draws it, as official)
            nn.init.zeros_(pool.bias)
            self.pool_layers.append(pool)
            side = focal_window + 2 ** k - 1  # K
            table = torch.empty(heads, (ws + side - 1) ** 2)
            self.relative_position_bias_table_to_windows.append(nn.Parameter(nn.init.trunc_normal_(table, std=0.02)))
            self.register_buffer(f"relative_position_index_{k}", relative_position_index(ws, side), persistent=False)

    def _check_options(self, ws, e, focal_level, focal_window, neighbours):
        check_positive("window_size", ws, self.name)
        check_positive("expand_size", e, self.name, minimum=0)
        if e > ws // 2:
            raise UserError(f"attn.expand_size={e} is too large for attn.window_size={ws} in attention variant "
                            f"{self.name!r}: expected 0 <= expand_size <= window_size // 2 = {ws // 2}, so that the "
                            f"four shifted copies of the window cover the ring around it.")
        check_positive("focal_level", focal_level, self.name)
        if focal_level > 1 and 2 ** (focal_level - 2) > ws:
            raise UserError(f"attn.focal_level={focal_level} is too large for attn.window_size={ws} in attention "
                            f"variant {self.name!r}: its coarsest level pools sub-windows of floor(window_size / "
                            f"2**(focal_level - 2)) = 0 pixels; expected 1 <= focal_level <= "
                            f"2 + floor(log2(window_size)) = {1 + ws.bit_length()}.")
        check_positive("focal_window", focal_window, self.name)
        if focal_window % 2 == 0:
            raise UserError(f"attn.focal_window={focal_window} is invalid for attention variant {self.name!r}: "
                            f"expected an odd integer >= 1 (the pooled tokens around a window are centred on it).")
        if neighbours is not None:
            check_positive("neighbours", neighbours, self.name)

    def mix(self, x, layout):
        if layout.kind == "grid":
            return self._mix_grid(x, layout.h, layout.w)
        return self._mix_points(x, layout)

    def _kv(self, t):
        """Keys and values (..., 2C) of tokens t (..., C): the k and v rows of the qkv projection."""
        bias = None if self.qkv.bias is None else self.qkv.bias[self.dim:]
        return F.linear(t, self.qkv.weight[self.dim:], bias)

    # ---- grids ------------------------------------------------------------------------------

    def _mix_grid(self, x, h, w):
        b, n, c = x.shape
        ws = self.window_size
        nh, nw = math.ceil(h / ws), math.ceil(w / ws)
        keys, valid = grid_plan(h, w, ws, self.expand_size, self.focal_level, self.focal_window, x.device,
                                self.border)
        pad = (0, 0, 0, nw * ws - w, 0, nh * ws - h)

        # q and k|v split from the projection, not sliced: a split's backward is one concatenation, where each slice
        # wrote a zero-filled gradient of the whole (B, pixels, 3C) projection and the two were then summed
        if self.border == "roll":  # the padded map is projected: padding pixels are keys (the qkv bias)
            q, kv = self.qkv(F.pad(x.view(b, h, w, c), pad)).flatten(1, 2).split([c, 2 * c], dim=-1)  # (B, H'*W', .)
            q = q.view(b, nh * ws, nw * ws, c)  # (B, H', W', C)
        else:
            q, kv = self.qkv(x).split([c, 2 * c], dim=-1)  # (B, N, C), (B, N, 2C)
            q = F.pad(q.view(b, h, w, c), pad)  # (B, H', W', C)
        q = rearrange(q, "b (nh r) (nw s) (heads d) -> b heads (nh nw) (r s) d", r=ws, s=ws, heads=self.heads)

        sources = [kv] + [self._kv(self._pool(x, h, w, k)) for k in range(self.focal_level - 1)]
        sources = torch.cat(sources + [x.new_zeros(b, 1, 2 * c)], dim=1)  # (B, pixels + pooled + 1, 2C)
        # Per head [k | v] rows before the gather (a copy of the sources), so that each head's gathered keys and
        # values are (M, d) blocks 2d apart that the attention's matmuls read in place: gathered as (B, nW, M, 2C)
        # and split by head after, both matmuls first copied them out (two copies of the gathered size, about 5
        # times the sources' at Focal-T's levels on 56 x 56 to 64 x 64 maps).
        sources = rearrange(sources, "b p (two heads d) -> b heads p (two d)", two=2, heads=self.heads)
        # index_select, not sources[:, :, keys]: the same rows, but its backward is one index_add_ where advanced
        # indexing's is index_put_ with accumulation, which sorts the indices first (several kernels on a GPU, and
        # 4.8x the time on the CPU with the slots' many repeats); deterministic where torch's deterministic mode is
        k, v = sources.index_select(2, keys.view(-1)).unflatten(2, keys.shape).chunk(2, dim=-1)  # (B, heads, nW, M, d)

        bias = self._grid_bias()[:, None]  # (heads, 1, ws*ws, M)
        if self.border == "roll":  # slots beyond the pooled map: key and value 0, logit + ROLL_MASK (official)
            bias = bias + torch.where(valid, 0.0, ROLL_MASK).to(bias.dtype)[:, None, :]  # (heads, nW, ws*ws, M)
            out = functional.focal_attention(q, k, v, bias=bias)
        else:
            out = functional.focal_attention(q, k, v, mask=valid[:, None, :], bias=bias)
        out = rearrange(out, "b heads (nh nw) (r s) d -> b (nh r) (nw s) (heads d)", nh=nh, r=ws)  # (B, H', W', C)
        if (nh * ws, nw * ws) != (h, w):  # the padding's rows and columns out (a slice's backward fills zeros)
            out = out[:, :h, :w]  # (B, h, w, C)
        return self.proj(out.reshape(b, n, c))

    def _pool(self, x, h, w, k):
        """Pooled tokens (B, ph*pw, C) of coarse level k, row-major, of the map x (B, h*w, C) padded with zeros."""
        ws = self.window_size
        g, ph, pw, top, left = pooled_geometry(h, w, ws, k)
        pad = (0, 0, 0, math.ceil(w / ws) * ws - w, 0, math.ceil(h / ws) * ws - h)
        m = F.pad(x.view(x.shape[0], h, w, -1), pad)  # (B, H', W', C)
        m = m[:, top:top + ph * g, left:left + pw * g]  # (B, ph*g, pw*g, C)
        m = rearrange(m, "b (ph r) (pw s) c -> b (ph pw) c (r s)", r=g, s=g)  # (B, P, C, g*g)
        return self.pool_layers[k](m).squeeze(-1)  # (B, P, C)

    def _grid_bias(self):
        """Relative position bias (heads, ws*ws, M) of a window's queries to its key slots."""
        a = self.window_size ** 2
        # index_select for the backward's index_add_ (as the keys' gather in _mix_grid)
        inside = self.relative_position_bias_table.index_select(
            0, self.relative_position_index.view(-1))  # (a*a, heads)
        parts = [inside.view(a, a, self.heads).permute(2, 0, 1)]  # (heads, a, a)
        if self.relative_position_bias_table_to_neighbors is not None:
            parts.append(self.relative_position_bias_table_to_neighbors[0])  # (heads, a, expand slots)
        for k, table in enumerate(self.relative_position_bias_table_to_windows):
            index = getattr(self, f"relative_position_index_{k}")  # (a, K*K)
            parts.append(table.index_select(1, index.view(-1)).view(self.heads, a, -1))  # (heads, a, K*K)
        return torch.cat(parts, dim=-1)

    # ---- point sets -------------------------------------------------------------------------

    def coarse_tokens(self, k: int) -> int:
        """How many pooled tokens of coarse level k (level l = k + 1) a point attends to: t in the docstring."""
        return (self.focal_window + 2 ** k - 1) ** 2 if self.coarse_neighbours is None else self.coarse_neighbours

    @torch.no_grad()
    def point_regions(self, xyz):
        """Fine neighbours (B, N, K) of every point, and per coarse level the regions (B, m, s) to pool and
        the regions (B, N, min(t, m)) each point attends to (all m in sampling order where m <= t)."""
        b, n, _ = xyz.shape
        fine = knn(xyz, xyz, min(self.neighbours, n))  # (B, N, K), nearest first
        areas = [(self.window_size // 2 ** k) ** 2 for k in range(self.focal_level - 1)]
        if not areas:
            return fine, [], []
        start = farthest_from_centroid(xyz)  # (B,): the regions do not depend on the order of the points
        centres = gather(xyz, farthest_point_sample(xyz, math.ceil(n / min(areas)), start))  # (B, m_max, 3)
        # FPS picks prefixes: the first m centres of a longer run are those of a run of m
        regions, seen = [], []
        for k, area in enumerate(areas):
            m, t = math.ceil(n / area), self.coarse_tokens(k)
            regions.append(knn(centres[:, :m], xyz, min(area, n)))  # (B, m, s)
            everyone = torch.arange(m, device=xyz.device).expand(b, n, m)  # (B, N, m)
            seen.append(everyone if m <= t else knn(xyz, centres[:, :m], t))  # (B, N, min(t, m))
        return fine, regions, seen

    @torch.no_grad()
    def point_plan(self, xyz) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor]:
        """What :meth:`_mix_points` derives from the points alone: the coarse levels' regions to pool (B, m, s)
        (:meth:`point_regions`), the order the attention runs the points in (B, N) and each point's place in it
        (B, N) (:func:`morton_order`), and every query's key rows (B N, M) in that order, in one table of sources
        a sample (its points in order, then each level's pooled tokens), samples one after another."""
        b, n, _ = xyz.shape
        fine, regions, seen = self.point_regions(xyz)
        order = morton_order(xyz)  # (B, N): the points in the order the attention runs them
        arange = torch.arange(n, device=xyz.device).expand(b, n)  # (B, N)
        rank = torch.empty_like(order).scatter_(1, order, arange)  # (B, N): each point's place in the order
        # first source row of each level in a sample's table: points, then each level's m pooled tokens
        firsts = [n + sum(r.shape[1] for r in regions[:k]) for k in range(len(regions))]
        index = torch.cat([fine] + [near + first for near, first in zip(seen, firsts)], dim=2)  # (B, N, M)
        s = n + sum(r.shape[1] for r in regions)  # sources a sample
        # the row of each source in the flattened table (B*S) whose points are in order
        row = torch.cat([rank, torch.arange(n, s, device=xyz.device).expand(b, -1)], dim=1)  # (B, S)
        row = row + s * torch.arange(b, device=xyz.device)[:, None]
        index = row.gather(1, index.view(b, -1)).view(b, n, -1)  # (B, N, M) rows of the table
        index = index.gather(1, order[..., None].expand(-1, -1, index.shape[-1]))  # queries in order
        return regions, order, rank, index.view(b * n, -1)

    def _mix_points(self, x, layout):
        """Each point against its fine neighbours, then each level's nearest pooled tokens, in one softmax.

        The keys are named by an index into one table of sources (the points, then each level's pooled
        tokens) and :func:`functional.index_attention` attends over them (one Triton kernel on a GPU, chunk by
        chunk in torch elsewhere), never holding the (B, N, K + t, 2C) keys and values at once. Queries and point
        sources run in :func:`morton_order`, for the cache; the output comes back in the points' order, and each
        point's keys keep their order (fine, then level by level).
        The plan (:meth:`point_plan`) is kept on the layout: the layers of a network that share it search the
        points once.
        """
        b, n, c = x.shape
        options = (self.neighbours, self.window_size, self.focal_level, self.focal_window, self.coarse_neighbours)
        regions, order, rank, index = layout.memo(("focal plan", options), lambda: self.point_plan(layout.xyz))
        qkv = self.qkv(x)  # (B, N, 3C)
        pooled = [self._kv(gather(x, region).mean(dim=2)) for region in regions]  # per level (B, m, 2C)
        s = n + sum(p.shape[1] for p in pooled)  # sources a sample
        q = gather(qkv[..., :c], order)  # (B, N, C) in order
        k = torch.cat([gather(qkv[..., c:2 * c], order)] + [p[..., :c] for p in pooled], dim=1)  # (B, S, C)
        v = torch.cat([gather(qkv[..., 2 * c:], order)] + [p[..., c:] for p in pooled], dim=1)
        out = functional.index_attention(q.reshape(b * n, c), k.reshape(b * s, c), v.reshape(b * s, c), index,
                                         self.heads)  # (B*N, C) in order
        return self.proj(gather(out.view(b, n, c), rank))  # (B, N, C) in the points' order

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, window_size={self.window_size}, expand_size={self.expand_size}, "
                f"focal_level={self.focal_level}, focal_window={self.focal_window}, border={self.border!r}, "
                f"neighbours={self.neighbours}, coarse_neighbours={self.coarse_neighbours}")
