"""``offset``: PCT's attention (Guo et al., 2021, "PCT: Point cloud transformer").

Q and K share one projection C -> C/qk_ratio without bias; V is C -> C with
bias; no output projection (PCT's offset block ``x + ReLU(BN(conv(x - mixer(x))))``
owns the conv after it). With the defaults this is exactly PCT's SA_Layer
minus ``trans_conv`` and ``after_norm``.
"""

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
        # x (B, N, C) -> (B, N, C): both projections and the kernel as one function where it can
        # (functional.offset_projected: fewer host ops, on a GPU a small batch's step is bound by them)
        return functional.offset_projected(x, self.qk.weight, self.v.weight, self.v.bias, self.heads)
