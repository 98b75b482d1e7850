"""``linear_elu``: linear attention with the elu(x) + 1 feature map (Katharopoulos et al., 2020).

The same module as ``linear_taylor`` (projections, heads, options) with the
elu feature map's kernel.
"""

from .. import functional
from ..registry import register
from .linear_taylor import TaylorLinearAttention


@register("linear_elu")
class EluLinearAttention(TaylorLinearAttention):
    complexity = "linear"  # phi(K)^T V summed once over the tokens
    kernel = staticmethod(functional.elu_linear_attention)

    def __init__(self, dim: int, heads: int = 4, qkv_bias: bool = True, qk_ratio: int = 1, out_proj: bool = True):
        super().__init__(dim, heads, qkv_bias, qk_ratio, out_proj)
