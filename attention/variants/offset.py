"""``offset``: PCT's attention (Guo et al., 2021, "PCT: Point cloud transformer").

Q and K share one projection C -> C/qk_ratio without bias; V is C -> C with
bias; no output projection (PCT's offset block ``x + ReLU(BN(conv(x - mixer(x))))``
owns the conv after it). With the defaults this is exactly PCT's SA_Layer
minus ``trans_conv`` and ``after_norm``.
"""

from einops import rearrange
from torch import nn

from .. import functional
from ..base import Mixer, check_divides
from ..registry import register


@register("offset")
class OffsetAttention(Mixer):
    complexity = "quadratic"  # the N x N map

    def __init__(self, dim: int, heads: int = 1, qk_ratio: int = 4):
        super().__init__(dim, heads)
        check_divides("qk_ratio", qk_ratio, dim, self.name)
        check_divides("heads", heads, dim // qk_ratio, self.name, what="the query/key width dim/qk_ratio =")
        self.qk_ratio = qk_ratio
        self.qk = nn.Linear(dim, dim // qk_ratio, bias=False)  # shared by queries and keys
        self.v = nn.Linear(dim, dim)

    def mix(self, x, layout):
        qk = rearrange(self.qk(x), "b n (h d) -> b h n d", h=self.heads)
        v = rearrange(self.v(x), "b n (h d) -> b h n d", h=self.heads)
        out = functional.offset_attention(qk, qk, v)  # (B, h, N, d)
        return rearrange(out, "b h n d -> b n (h d)")
