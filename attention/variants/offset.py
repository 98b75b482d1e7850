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
        # the projections on the (B N, C) rows: nn.Linear on (B, N, C) goes through matmul's reshapes (host ops,
        # in PCT's batch-16 GPU step that its host bounds); views where x is contiguous
        b, n, c = x.shape
        rows = x.view(b * n, c) if x.is_contiguous() else x.reshape(b * n, c)
        qk = self.qk(rows).view(b, n, self.heads, -1).transpose(1, 2)  # (B, h, N, d)
        v = self.v(rows).view(b, n, self.heads, -1).transpose(1, 2)  # (B, h, N, d_v)
        out = functional.offset_attention(qk, qk, v)  # (B, h, N, d_v)
        return out.transpose(1, 2).reshape(b, n, -1)  # (B, N, h d_v): a view where h = 1
