"""``sdpa_decode``: PyTorch SDPA attention, except single-token decode steps, which use two small matmuls.

On CPU, ``scaled_dot_product_attention`` with a one-token query (transformers folds the grouped-query heads
into a query of length ``n_heads / n_kv_heads``) runs a flash kernel built for long queries: when no row is
padded (transformers then passes no mask) it took 61 % of a decode step in a profile of the demo's policy
(``benchmarks/decode_attention_bench.py`` times both). A decode step is ``[B, H, 1, D] x [B, H_kv, L, D]``; a batched
matmul over the grouped heads, a float32 softmax and a second matmul do it without copying the cache.
Every other call (prefill, an observation fed to the cache, training forwards) goes to transformers' SDPA.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "sdpa_decode"


def decode_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention output ``[B, Q, H, D]`` for ``query [B, H, Q, D]`` and ``key``/``value [B, H_kv, L, D]``.

    ``attention_mask`` is SDPA's: boolean ``[B, 1, Q, L]`` (True = attend) or additive, or None.
    """
    batch, heads, q_len, dim = query.shape
    if q_len != 1 or dropout or kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    kv_heads, length = key.shape[1], key.shape[2]
    scale = scaling if scaling is not None else dim**-0.5
    grouped = query.reshape(batch, kv_heads, heads // kv_heads, dim)  # head h reads kv head h // (H / H_kv)
    scores = torch.matmul(grouped, key.transpose(-1, -2)).float() * scale  # [B, H_kv, H / H_kv, L]
    if attention_mask is not None:
        mask = attention_mask[:, :, -1:, -length:]  # [B, 1, 1, L]
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.float()
    probs = scores.softmax(dim=-1).to(value.dtype)
    return torch.matmul(probs, value).reshape(batch, 1, heads, dim), None


AttentionInterface.register(NAME, decode_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)


def use_decode_attention(model) -> None:
    """Switch a transformers model that runs SDPA attention to ``sdpa_decode`` (others are left alone)."""
    if getattr(model.config, "_attn_implementation", None) == "sdpa":
        model.set_attn_implementation(NAME)
