"""``self``: multi-head softmax self-attention (Vaswani et al., 2017) through SDPA."""

from einops import rearrange
from torch import nn

from .. import functional
from ..base import Mixer
from ..registry import register


@register("self")
class SelfAttention(Mixer):
    def __init__(self, dim: int, heads: int = 4, qkv_bias: bool = True):
        super().__init__(dim, heads)
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)

    def mix(self, x, layout):
        q, k, v = rearrange(self.qkv(x), "b n (three h d) -> three b h n d", three=3, h=self.heads)
        out = functional.softmax_attention(q, k, v)  # (B, h, N, d)
        return self.proj(rearrange(out, "b h n d -> b n (h d)"))
