"""``linear_taylor``: LAM, linear attention by first-order Taylor expansion (Li et al., 2021).

softmax's exp(q.k) is replaced by 1 + q.k with L2-normalised q and k (so the
similarity is non-negative), which makes attention O(N) in time and memory.

LAM's module (lironui/Linear-Attention-Mechanism, ``PositionLinearAttention``)
is ``qk_ratio=8 out_proj=false`` inside the block ``x + gamma * mixer(x)``
(``tasks/nets/blocks.py``' ``ScaledResidual``, gamma starting at 0): queries and
keys C -> C/8 and values C -> C, each with a bias, no output projection, its
eps = 1e-6 added to the sum of the keys. (LAM's module reshapes its output to
(W, H) where the input is (H, W), so it is defined on square maps only; on
those they are equal.) The defaults keep the transformer's form: C -> C
queries and keys, an output projection.
"""

from collections.abc import Callable
from typing import ClassVar

from einops import rearrange

from .. import functional
from ..base import Mixer, check_bool, check_divides
from ..registry import register


@register("linear_taylor")
class TaylorLinearAttention(Mixer):
    """The linear-attention variants: stacked q|k|v projections, a kernel on per-head tensors, a projection."""
    complexity = "linear"  # K^T V summed once over the tokens
    kernel: ClassVar[Callable] = staticmethod(functional.taylor_linear_attention)

    def __init__(self, dim: int, heads: int = 1, qkv_bias: bool = True, qk_ratio: int = 1, out_proj: bool = True):
        super().__init__(dim, heads)
        check_divides("qk_ratio", qk_ratio, dim, self.name)
        self.qk_dim = dim // qk_ratio
        check_divides("heads", heads, self.qk_dim, self.name, what="the query/key channels dim/qk_ratio")
        check_bool("qkv_bias", qkv_bias, self.name)  # out_proj: checked by projection()
        self.qkv = self.projection(dim, 2 * self.qk_dim + dim, True, "in_proj", bias=qkv_bias)
        self.proj = self.projection(dim, dim, out_proj, "out_proj")

    def mix(self, x, layout):
        q, k, v = self.qkv(x).split([self.qk_dim, self.qk_dim, self.dim], dim=-1)  # (B, N, C'), each
        q, k, v = (rearrange(t, "b n (h d) -> b h n d", h=self.heads) for t in (q, k, v))
        out = self.kernel(q, k, v)  # (B, h, N, d)
        return self.proj(rearrange(out, "b h n d -> b n (h d)"))
