"""``linear_taylor``: LAM, linear attention by first-order Taylor expansion (Li et al., 2021).

softmax's exp(q.k) is replaced by 1 + q.k with L2-normalised q and k (so the
similarity is non-negative), which makes attention O(N) in time and memory.
"""

from einops import rearrange
from torch import nn

from .. import functional
from ..base import Mixer
from ..registry import register


@register("linear_taylor")
class TaylorLinearAttention(Mixer):
    complexity = "linear"  # K^T V summed once over the tokens

    def __init__(self, dim: int, heads: int = 1, qkv_bias: bool = True):
        super().__init__(dim, heads)
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)

    def mix(self, x, layout):
        q, k, v = rearrange(self.qkv(x), "b n (three h d) -> three b h n d", three=3, h=self.heads)
        out = functional.taylor_linear_attention(q, k, v)  # (B, h, N, d)
        return self.proj(rearrange(out, "b h n d -> b n (h d)"))
