"""A KV cache whose layers append into spare room instead of concatenating at every step.

transformers' ``DynamicLayer`` grows by ``torch.cat``, which copies a layer's whole cache for every new token: a
decode step of the demo's policy copied all 30 layers' keys and values (48 rows x ~300 positions: hundreds of MB per
step), 13 % of an evaluation batch's CPU time in a profile. ``GrowingLayer`` keeps each layer's keys and values in
a buffer with ``room`` positions to spare and hands attention a view of the filled part, so a step writes only its
own entries and a copy happens once per ``room`` tokens. Attention sees the same values in the same order, so the
results do not change (``tests/test_engine.py`` compares whole rollouts with transformers' cache).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

ROOM = 64  # positions allocated beyond what a layer holds when its buffer is (re)made


class GrowingLayer(DynamicLayer):
    """``DynamicLayer`` with amortised appends; ``keys``/``values`` are views ``[B, H, L, D]`` of buffers
    ``[B, H, L + spare, D]``.

    Whatever replaces ``keys``/``values`` (``batch_select_indices``, ``batch_repeat_interleave``, ``crop``, the
    engine's compaction) leaves them as plain tensors; the next ``update`` then copies them into a new buffer.
    """

    def __init__(self, room: int = ROOM, **kwargs) -> None:
        super().__init__(**kwargs)
        self.room = room
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None
        self._views: tuple[torch.Tensor, torch.Tensor] | None = None  # the views last handed out

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length, new = self.get_seq_length(), key_states.shape[-2]
        owned = self._views is not None and self.keys is self._views[0] and self.values is self._views[1]
        if not owned or length + new > self._buffers[0].shape[-2]:
            self._buffers = (self._regrow(self.keys, key_states, length),
                             self._regrow(self.values, value_states, length))
        keys, values = self._buffers
        keys[:, :, length : length + new] = key_states
        values[:, :, length : length + new] = value_states
        self._views = (keys[:, :, : length + new], values[:, :, : length + new])
        self.keys, self.values = self._views
        return self.keys, self.values

    def _regrow(self, held: torch.Tensor, incoming: torch.Tensor, length: int) -> torch.Tensor:
        """A buffer with room for ``length`` held + the incoming positions + ``room``, holding ``held``."""
        batch, heads, new, dim = incoming.shape
        buffer = incoming.new_empty(batch, heads, length + new + self.room, dim)
        if length:
            buffer[:, :, :length] = held
        return buffer

    def reset(self) -> None:
        self._buffers = self._views = None
        super().reset()


def growing_cache(config) -> DynamicCache:
    """transformers' dynamic cache for a model ``config``, its plain full-attention layers as :class:`GrowingLayer`
    (sliding-window and other layer kinds are kept as transformers makes them)."""
    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache
