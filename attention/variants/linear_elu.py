"""``linear_elu``: linear attention with the elu(x) + 1 feature map (Katharopoulos et al., 2020)."""

from einops import rearrange
from torch import nn

from .. import functional
from ..base import Mixer
from ..registry import register


@register("linear_elu")
class EluLinearAttention(Mixer):
    complexity = "linear"  # phi(K)^T V summed once over the tokens

    def __init__(self, dim: int, heads: int = 4, qkv_bias: bool = True):
        super().__init__(dim, heads)
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)

    def mix(self, x, layout):
        q, k, v = rearrange(self.qkv(x), "b n (three h d) -> three b h n d", three=3, h=self.heads)
        out = functional.elu_linear_attention(q, k, v)  # (B, h, N, d)
        return self.proj(rearrange(out, "b h n d -> b n (h d)"))
