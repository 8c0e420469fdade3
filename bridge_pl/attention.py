"""The policy's attention: PyTorch SDPA with a shared training prefix.

``sdpa_prefix`` (what :class:`~bridge_pl.policy.Policy` sets on SDPA models) is transformers' SDPA attention plus
the place where a training forward's shared prefix is recorded and read (:class:`SharedPrefixKV`): the keys and
values of the leading tokens every row has, run once, are put ahead of each row's own.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "sdpa_prefix"  # SDPA + SharedPrefixKV: the policy's default on SDPA models
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
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention output ``[B, Q, H, D]`` for ``query [B, H, Q, D]`` and ``key``/``value [B, H_kv, L, D]``.

    ``attention_mask`` is SDPA's: boolean ``[B, 1, Q, L]`` (True = attend) or additive, or None.
    ``record_prefix``: keep this layer's keys and values as a shared prefix's; ``after_prefix``: attend to that
    prefix ahead of ``key``/``value`` (:class:`SharedPrefixKV`). The attention itself is transformers' SDPA.
    """
    if record_prefix is not None:
        record_prefix.record(module.layer_idx, key, value)
    if after_prefix is not None:
        key, value, attention_mask = after_prefix.prepend(module.layer_idx, key, value, attention_mask,
                                                          query.shape[2])
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


AttentionInterface.register(NAME, bridge_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)


def use_bridge_attention(model) -> None:
    """Switch a transformers model that runs SDPA attention to ``sdpa_prefix`` (models with another attention are
    left alone)."""
    if getattr(model.config, "_attn_implementation", None) == "sdpa":
        model.set_attn_implementation(NAME)
