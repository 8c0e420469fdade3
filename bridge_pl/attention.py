"""The policy's attention: PyTorch SDPA with a shared training prefix, and opt-in matmul decode steps.

``sdpa_prefix`` (what :class:`~bridge_pl.policy.Policy` sets on SDPA models) is transformers' SDPA attention plus
the place where a training forward's shared prefix is recorded and read (:class:`SharedPrefixKV`): the keys and
values of the leading tokens every row has, run once, are put ahead of each row's own.

``sdpa_decode`` (``Policy(decode_matmul=True)``) also runs single-token decode steps as two small matmuls. On CPU,
``scaled_dot_product_attention`` with a one-token query (transformers folds the grouped-query heads into a query
of length ``n_heads / n_kv_heads``) runs a flash kernel built for long queries, which is slow when no row is padded
(transformers then passes no mask). A decode step is ``[B, H, 1, D] x [B, H_kv, L, D]``; a batched matmul over the
grouped heads, a float32 softmax and a second matmul do it without copying the cache. It is faster per unpadded
decode step on CPU (2.3-2.9x unpadded, 1.1-1.2x padded, at the demo's 32 rows x 250 cached tokens), but whole
rollouts at the demo's shape sampled 0.83-0.98x the tokens/s of plain SDPA with it (``benchmarks/rollout_bench.py``),
and on CUDA it would replace the fused kernels; so it is off by default (``benchmarks/decode_attention_bench.py``
times both side by side).
"""

from __future__ import annotations

import functools

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "sdpa_prefix"  # SDPA + SharedPrefixKV: the policy's default on SDPA models
DECODE_NAME = "sdpa_decode"  # the same, with one-token decode steps as two matmuls (opt-in)
MIN_SHARED_PREFIX = 16  # shorter prefixes shared by every row are not worth a separate forward


class SharedPrefixKV:
    """Keys and values ``[1, H_kv, P, D]`` per layer of a prefix that every row of a batch starts with.

    :meth:`Policy.forward <bridge_pl.policy.Policy.forward>` runs the prefix once (one row), with ``record_prefix``
    set to this object, then the rows' remainders with ``after_prefix``: each layer's attention then reads the
    prefix's keys and values (broadcast over the rows) ahead of its own, so every row computes what it would with
    the prefix in it, and the prefix's gradient is the sum over the rows. Objects, not a changing flag, tell the two
    passes apart, because activation checkpointing replays a layer's forward, with the same arguments, in the
    backward.
    """

    def __init__(self) -> None:
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}

    def record(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Keep layer ``layer``'s prefix keys and values (the first time only: a checkpoint replay keeps them)."""
        self.keys.setdefault(layer, key)
        self.values.setdefault(layer, value)

    def prepend(
        self, layer: int, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None, q_len: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The remainder's ``key``/``value [B, H_kv, T, D]`` with the prefix's ahead (``[B, H_kv, P + T, D]``), and
        SDPA's boolean mask ``[B, 1, T, P + T]``: every remainder query sees the whole prefix, then ``attention_mask``
        (the remainder's own, causal when None)."""
        batch = key.shape[0]
        prefix_key, prefix_value = self.keys[layer], self.values[layer]
        length = prefix_key.shape[2]
        key = torch.cat([prefix_key.expand(batch, -1, -1, -1), key], dim=2)
        value = torch.cat([prefix_value.expand(batch, -1, -1, -1), value], dim=2)
        own = key.shape[2] - length
        if attention_mask is None:
            attention_mask = torch.ones(q_len, own, dtype=torch.bool, device=key.device).tril(own - q_len)[None, None]
        elif attention_mask.dtype != torch.bool:  # an additive mask: 0 where attending
            attention_mask = attention_mask == 0
        attention_mask = attention_mask[..., -own:].expand(batch, 1, q_len, own)
        seen = torch.ones(batch, 1, q_len, length, dtype=torch.bool, device=key.device)
        return key, value, torch.cat([seen, attention_mask], dim=-1)


def bridge_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    record_prefix: SharedPrefixKV | None = None,
    after_prefix: SharedPrefixKV | None = None,
    decode_matmul: bool = False,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention output ``[B, Q, H, D]`` for ``query [B, H, Q, D]`` and ``key``/``value [B, H_kv, L, D]``.

    ``attention_mask`` is SDPA's: boolean ``[B, 1, Q, L]`` (True = attend) or additive, or None.
    ``record_prefix``: keep this layer's keys and values as a shared prefix's; ``after_prefix``: attend to that
    prefix ahead of ``key``/``value`` (:class:`SharedPrefixKV`). ``decode_matmul``: a one-token query without
    dropout, softcap or position bias is computed by two matmuls over the grouped heads; everything else by
    transformers' SDPA.
    """
    if record_prefix is not None:
        record_prefix.record(module.layer_idx, key, value)
    if after_prefix is not None:
        key, value, attention_mask = after_prefix.prepend(module.layer_idx, key, value, attention_mask,
                                                          query.shape[2])
    batch, heads, q_len, dim = query.shape
    if (not decode_matmul or q_len != 1 or dropout or kwargs.get("softcap") is not None
            or kwargs.get("position_bias") is not None):
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


prefix_attention = functools.partial(bridge_attention, decode_matmul=False)  # ``sdpa_prefix``
decode_attention = functools.partial(bridge_attention, decode_matmul=True)  # ``sdpa_decode``

for _name, _forward in ((NAME, prefix_attention), (DECODE_NAME, decode_attention)):
    AttentionInterface.register(_name, _forward)
    AttentionMaskInterface.register(_name, sdpa_mask)
ATTENTIONS = (NAME, DECODE_NAME)  # the implementations that record and read a SharedPrefixKV


def use_bridge_attention(model, decode_matmul: bool = False) -> None:
    """Switch a transformers model that runs SDPA attention to ``sdpa_prefix``, or with ``decode_matmul`` to
    ``sdpa_decode`` (models with another attention are left alone)."""
    if getattr(model.config, "_attn_implementation", None) == "sdpa":
        model.set_attn_implementation(DECODE_NAME if decode_matmul else NAME)
