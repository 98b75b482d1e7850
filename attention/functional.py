"""Pure attention kernels on per-head tensors.

Every kernel takes ``q`` of shape (B, heads, N, d) and keys/values of shape
(B, heads, M, d) / (B, heads, M, d_v) unless its docstring says otherwise, and
implements its paper's formula and nothing else: projections, heads and
layouts belong to the modules in ``attention.variants``. Each kernel is tested
against a brute-force O(N^2) float64 reference in ``tests/attention``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def softmax_attention(q, k, v, scale: float | None = None):
    """softmax(q k^T * scale) v, scale = d^-0.5 by default, via the fused SDPA kernel."""
    return F.scaled_dot_product_attention(q, k, v, scale=scale)  # (B, heads, N, d_v)


def offset_attention(q, k, v, eps: float = 1e-9):
    """PCT's attention (Guo et al., 2021), as in its reference code.

    A = softmax(q k^T) over the keys, no scaling; then each column of A is
    divided by (eps + its sum over the queries); output_j = sum_i A_ij v_i.

    The output is indexed by the *key* position j and sums over query positions
    i, so ``v`` has the queries' length N and the output the keys' length M:
    q (B, h, N, d), k (B, h, M, d), v (B, h, N, d_v) -> (B, h, M, d_v).
    In PCT q and k come from one shared projection of the same tokens (N = M).
    """
    attn = torch.softmax(q @ k.transpose(-2, -1), dim=-1)  # (B, h, N, M)
    attn = attn / (eps + attn.sum(dim=-2, keepdim=True))  # column-normalised over queries
    return attn.transpose(-2, -1) @ v  # (B, h, M, d_v)


def external_attention(q, mem_k, mem_v, eps: float = 1e-9):
    """External attention (Guo et al., 2021) with double normalisation.

    A = q M_k^T over S memory slots, softmax over the N tokens, then each
    token's row divided by (eps + its sum over the S slots); output = A M_v.
    q (B, h, N, d), mem_k and mem_v (S, d), shared by all heads -> (B, h, N, d).
    """
    attn = torch.softmax(q @ mem_k.transpose(0, 1), dim=-2)  # (B, h, N, S), normalised over tokens
    attn = attn / (eps + attn.sum(dim=-1, keepdim=True))  # then over slots
    return attn @ mem_v  # (B, h, N, d)


def taylor_linear_attention(q, k, v, eps: float = 1e-6):
    """LAM (Li et al., 2021): softmax approximated by its first-order Taylor expansion.

    sim(q, k) = 1 + q^T k with q and k L2-normalised, so
    out_i = (sum_j v_j + q_i (K^T V)) / (M + q_i . (sum_j k_j + eps)), in O(N + M).
    """
    q = F.normalize(q, dim=-1)
    k = F.normalize(k, dim=-1)
    kv = k.transpose(-2, -1) @ v  # (B, h, d, d_v)
    num = v.sum(dim=-2, keepdim=True) + q @ kv  # (B, h, N, d_v)
    den = k.shape[-2] + q @ (k.sum(dim=-2) + eps).unsqueeze(-1)  # (B, h, N, 1)
    return num / den


def elu_linear_attention(q, k, v, eps: float = 1e-6):
    """Linear attention (Katharopoulos et al., 2020) with phi(x) = elu(x) + 1.

    out_i = phi(q_i)^T (sum_j phi(k_j) v_j^T) / (phi(q_i)^T sum_j phi(k_j) + eps), in O(N + M).
    """
    q = F.elu(q) + 1
    k = F.elu(k) + 1
    kv = k.transpose(-2, -1) @ v  # (B, h, d, d_v)
    den = q @ k.sum(dim=-2).unsqueeze(-1) + eps  # (B, h, N, 1)
    return (q @ kv) / den  # (B, h, N, d_v)
