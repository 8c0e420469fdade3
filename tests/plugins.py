"""Plug-ins defined outside the package, named in YAML by ``class_path`` (no code change in bridge_pl).

HashedBagRetriever: a retriever. DistinctWordsReward: a reward.

Hashed bag-of-words towers: the query tower is a trainable ``EmbeddingBag``; passage vectors come from
a frozen copy of its initial weights. Brute-force inner-product search (no FAISS), to show the seam
needs nothing but the :class:`~bridge_pl.retrieval.base.Retriever` interface.
"""

import re
import zlib

import torch
from torch import nn

from bridge_pl.data.sources import load_corpus
from bridge_pl.retrieval.base import Retriever
from bridge_pl.rewards import RewardFunction


class HashedBagEncoder(nn.Module):
    """Texts -> ``[N, dim]`` mean of hashed word embeddings."""

    def __init__(self, buckets: int, dim: int) -> None:
        super().__init__()
        self.buckets = buckets
        self.bag = nn.EmbeddingBag(buckets, dim, mode="mean")

    def forward(self, texts: list[str]) -> torch.Tensor:
        ids, offsets = [], []
        for text in texts:
            offsets.append(len(ids))
            words = re.findall(r"\w+", text.lower()) or [""]
            ids.extend(zlib.crc32(w.encode()) % self.buckets for w in words)
        device = self.bag.weight.device
        return self.bag(torch.tensor(ids, device=device), torch.tensor(offsets, device=device))


class HashedBagRetriever(Retriever):
    def __init__(self, corpus: str, buckets: int = 4096, dim: int = 32, seed: int = 0) -> None:
        super().__init__()
        self._passages = load_corpus(corpus)
        torch.manual_seed(seed)
        self.tower = HashedBagEncoder(buckets, dim)
        with torch.no_grad():
            vectors = self.tower([p.contents for p in self._passages])
        self.register_buffer("passage_vectors", vectors, persistent=False)

    @property
    def passages(self):
        return self._passages

    @property
    def query_encoder(self) -> nn.Module:
        return self.tower

    @torch.no_grad()
    def search(self, queries, k):
        scores = self.tower(queries) @ self.passage_vectors.T
        top = scores.topk(k, dim=-1)
        return top.values.float().cpu(), top.indices.cpu()

    def score(self, queries, rows, query_encoder=None):
        q = (query_encoder or self.tower)(queries)
        return (q.unsqueeze(1) * self.passage_vectors[rows.to(q.device)]).sum(-1)


class DistinctWordsReward(RewardFunction):
    """Reward = distinct words the policy wrote / 20 (capped at 1): varies between samples of a random
    model, so GRPO advantages and every loss term are non-trivial in the tiny end-to-end tests."""

    name = "distinct_words"

    def __call__(self, response: str, golds: list[str]) -> float:
        return min(1.0, len(set(re.findall(r"\w+", response))) / 20)
