"""Loader batches: :class:`ExampleBatch`, and :class:`PromptStream`, the seeded and resumable training batches."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator, Sequence

from torch.utils.data import IterableDataset

from bridge_pl.records import QAExample
from bridge_pl.seeding import derive_seed


class ExampleBatch:
    """One loader batch: the QA examples of a rollout, held whole.

    Under a half precision (``bf16-true``, ``16-true``) Lightning's precision plugin walks every loader batch with
    ``apply_to_collection`` before any DataModule hook sees it, and that walk refuses frozen dataclasses such as
    :class:`QAExample`. This holder is not a collection, so the walk leaves it alone; it iterates and indexes
    like the list it holds.
    """

    __slots__ = ("examples",)

    def __init__(self, examples: Sequence[QAExample]) -> None:
        self.examples = list(examples)

    def __iter__(self) -> Iterator[QAExample]:
        return iter(self.examples)

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index):
        return self.examples[index]

    def __repr__(self) -> str:
        return f"ExampleBatch({[ex.id for ex in self.examples]})"


class PromptStream(IterableDataset):
    """An endless, seeded stream of training batches (:class:`ExampleBatch`), resumable by position.

    Epoch e is a permutation seeded by ``derive_seed(seed, "epoch", e)``; rank r of w processes takes every w-th
    batch. With ``mixture`` ({question type: weight}, types from ``metadata["type"]``), each batch slot instead
    draws a type by weight, then an example of that type, from an RNG seeded by ``seed`` and the batch position.
    """

    def __init__(self, examples: list[QAExample], batch_size: int, seed: int, start: int, rank: int, world: int,
                 mixture: dict[str, float] | None = None):
        self.examples, self.batch_size, self.seed = examples, batch_size, seed
        self.start, self.rank, self.world = start, rank, world
        self.by_type: dict[str, list[QAExample]] = {}
        if mixture:
            for ex in examples:
                self.by_type.setdefault(ex.metadata.get("type"), []).append(ex)
            missing = sorted(t for t, w in mixture.items() if w > 0 and t not in self.by_type)
            if missing:
                raise ValueError(f"data.type_mixture names question types the training set lacks: {missing} "
                                 f"(it has {sorted(map(str, self.by_type))})")
        self.mixture = {t: w for t, w in (mixture or {}).items() if w > 0}

    def draw(self, rng: random.Random, size: int | None = None) -> list[QAExample]:
        """``size`` (default ``batch_size``) examples drawn at random (by type with ``mixture``, else uniformly
        without repeats)."""
        size = self.batch_size if size is None else size
        if self.mixture:
            types = rng.choices(list(self.mixture), list(self.mixture.values()), k=size)
            return [rng.choice(self.by_type[t]) for t in types]
        return rng.sample(self.examples, min(size, len(self.examples)))

    def draw_share(self, rng: random.Random) -> list[QAExample]:
        """This rank's batch of one draw for all ranks: ``rng`` (seeded alike on every rank) draws ``world``
        batches at once and rank r takes every w-th example, so the ranks' batches never share an example (without
        ``mixture``, which draws with repeats)."""
        return self.draw(rng, self.batch_size * self.world)[self.rank :: self.world]

    def _batches(self) -> Iterator[list[QAExample]]:
        if self.mixture:
            for position in itertools.count():
                yield self.draw(random.Random(derive_seed(self.seed, "mixture", position)))
        per_epoch = max(1, len(self.examples) // self.batch_size)
        epoch = 0
        while True:
            order = list(range(len(self.examples)))
            random.Random(derive_seed(self.seed, "epoch", epoch)).shuffle(order)
            for b in range(per_epoch):
                yield [self.examples[i] for i in order[b * self.batch_size : (b + 1) * self.batch_size]]
            epoch += 1

    def __iter__(self) -> Iterator[ExampleBatch]:
        for position, batch in enumerate(self._batches()):
            if position >= self.start * self.world and position % self.world == self.rank:
                yield ExampleBatch(batch)
