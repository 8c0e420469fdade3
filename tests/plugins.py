"""Plug-ins defined outside the package, named in YAML by ``class_path`` (no code change in bridge_pl).

HashedBagRetriever: a retriever. DistinctWordsReward: a reward. StepLog, KillAt, SearchSteer: callbacks for the
fault-injection test (a per-iteration loss log that survives SIGKILL; a SIGKILL at a chosen point of the run;
the tiny policy steered to search); RolloutLog for the pinned fit. SlowJudge: a reasoning-quality judge as slow
as a local LLM over a large set.
ShortTimeoutDDP: DDP whose collectives time out after a few seconds, to try what outlasts the timeout quickly.

Hashed bag-of-words towers: the query tower is a trainable ``EmbeddingBag``; passage vectors come from
a frozen copy of its initial weights. Brute-force inner-product search (no FAISS), to show the seam
needs nothing but the :class:`~bridge_pl.retrieval.base.Retriever` interface.
"""

import json
import os
import re
import signal
import time
import zlib
from datetime import timedelta

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

from bridge_pl.bilevel import ParamUpdate
from bridge_pl.data.sources import load_corpus
from bridge_pl.distributed import process_rank
from bridge_pl.judge import Judge, Reply
from bridge_pl.retrieval.base import Retriever
from bridge_pl.retrieval.dense import DenseRetriever
from bridge_pl.rewards import RewardFunction
from bridge_pl.rollout.engine import HFRolloutEngine


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


class StepLog(L.Callback):
    """Appends ``{"step": n, <loss/... and grad_norm/...>: value}`` per finished iteration and ``{"val_step": n,
    <val/...>: value}`` per finished validation to a jsonl file (flushed and synced, so it survives SIGKILL); rank 0
    writes it."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._append(trainer, "step", ("loss/", "grad_norm/"))

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self._append(trainer, "val_step", ("val/",))

    def _append(self, trainer, key: str, prefixes: tuple[str, ...]) -> None:
        if trainer.global_rank != 0:  # one line per step with several processes
            return
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(prefixes)}
        with open(self.path, "a") as f:
            f.write(json.dumps({key: trainer.global_step, **metrics}) + "\n")
            f.flush()
            os.fsync(f.fileno())


class KillAt(L.Callback):
    """SIGKILLs this process (or sends it ``signal_name``) at the ``count``-th (1-based) pass through ``point``, as a
    crash (or a scheduler) would:

    ``rollout`` (an env step between two generated turns), ``update`` (an optimizer step, before it applies),
    ``checkpoint`` (a checkpoint file written to its temp name, not yet renamed into place), ``save`` (a checkpoint
    save starting, sharded ones included), ``validation`` (a validation batch), ``refresh`` (an index rebuild, before
    the new index is in place). With ``rank``, only that rank's process (``LOCAL_RANK``, on one machine) is hit.
    """

    def __init__(self, point: str, count: int = 1, signal_name: str = "SIGKILL", rank: int | None = None) -> None:
        self.point, self.count, self.seen = point, count, 0
        self.signum = signal.Signals[signal_name]
        targets = {
            "rollout": (HFRolloutEngine, "_env_step"),
            "update": (ParamUpdate, "apply_grads"),
            "refresh": (DenseRetriever, "refresh_index"),
            "checkpoint": (os, "replace"),
            "save": (L.Trainer, "save_checkpoint"),
        }
        self.armed = rank is None or int(os.environ.get("LOCAL_RANK", 0)) == rank
        if self.armed and point in targets:
            owner, name = targets[point]
            original = getattr(owner, name)

            def wrapped(*args, **kwargs):
                if point != "checkpoint" or str(args[1]).endswith(".ckpt"):
                    self._tick()
                return original(*args, **kwargs)

            setattr(owner, name, wrapped)

    def _tick(self) -> None:
        self.seen += 1
        if self.armed and self.seen == self.count:
            os.kill(os.getpid(), self.signum)

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        if self.point == "validation":
            self._tick()


class PromptLog(L.Callback):
    """Appends, per training rollout call, ``{"step": n, "ids": [example ids]}`` to ``<path>.rank<r>``: an
    iteration's first call is its batch, later ones are dynamic sampling's refills."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_fit_start(self, trainer, pl_module):
        collector = trainer.datamodule.collector
        generate = collector.generate

        def logged(agent, examples, training):
            if training:
                with open(f"{self.path}.rank{trainer.global_rank}", "a") as f:
                    f.write(json.dumps({"step": trainer.global_step, "ids": [ex.id for ex in examples]}) + "\n")
            return generate(agent, examples, training)

        collector.generate = logged


class SearchSteer(L.Callback):
    """Steers the random tiny policy to issue searches for the whole fit (``helpers.searching``), so a
    subprocess run trains the retriever on real searches as the in-process tests do; with ``answers`` it then
    answers with one of them (single-token words with a leading space), so rewards vary within a group."""

    def __init__(self, answers: list[str] = ()) -> None:
        self.answers = tuple(answers)

    def on_fit_start(self, trainer, pl_module):
        from helpers import searching

        self._steer = searching(pl_module.policy, answers=self.answers)
        self._steer.__enter__()


class SlowJudge(Judge):
    """Sleeps ``seconds`` before each reply on rank ``slow_rank`` (a judge that outlasts the process group's
    timeout), then replies ``Score: N`` with N (1-5) a hash of the prompt: the same record always gets the same
    score, whichever rank asks."""

    def __init__(self, seconds: float = 0.0, slow_rank: int = 0) -> None:
        super().__init__()
        self.seconds, self.slow_rank = seconds, slow_rank

    @property
    def identity(self) -> str:
        return "test:prompt-hash"

    def reply(self, prompts):
        if process_rank() == self.slow_rank:
            time.sleep(self.seconds)
        return [Reply(f"Score: {1 + zlib.crc32(p.encode()) % 5}") for p in prompts]


class ShortTimeoutDDP(DDPStrategy):
    """DDP whose process group times out after ``seconds`` once every rank is set up; the rendezvous keeps
    Lightning's default timeout, since ranks start seconds apart on a busy machine."""

    def __init__(self, seconds: float, **kwargs) -> None:
        super().__init__(**kwargs)
        self.seconds = seconds

    def setup(self, trainer) -> None:
        super().setup(trainer)
        self.barrier()  # from here on the ranks keep pace, until a collective waits on a slow one
        torch.distributed.distributed_c10d._set_pg_timeout(timedelta(seconds=self.seconds))


class RolloutLog(L.Callback):
    """Appends one line per rollout batch a step consumes (training and validation) to a jsonl file: its example
    ids, a digest of its tokens and masks, rewards, answers, choices, search queries, candidates and shown order,
    the sampler's log-probs, the LM-credit searches and sequences, and the sampling stats (wall time left out)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._append("train", trainer.global_step, batch)

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        self._append("val", trainer.global_step, batch)

    def _append(self, stage: str, step: int, batch) -> None:
        def digest(*tensors) -> str:
            return f"{zlib.crc32(b''.join(t.detach().cpu().contiguous().numpy().tobytes() for t in tensors)):08x}"

        credit = [[s.prefix, s.branches, s.target] for s in batch.credit_sequences]
        row = {
            "stage": stage, "step": step, "dataset": batch.dataset, "ids": batch.example_ids,
            "tokens": digest(batch.input_ids, batch.attention_mask, batch.action_mask),
            "rewards": batch.rewards.tolist(), "answers": batch.answers, "choices": batch.choices,
            "groups": batch.group_ids.tolist(), "queries": batch.search_queries,
            "search": digest(batch.search_traj, batch.search_candidates, batch.search_order),
            "search_logprob": batch.search_logprob.tolist(),
            "sampler_logprob_sum": None if batch.sampler_logprobs is None else float(batch.sampler_logprobs.sum()),
            "credit_searches": batch.credit_searches.tolist(),
            "credit": f"{zlib.crc32(json.dumps(credit).encode()):08x}",
            "sampling": {k: v for k, v in batch.sampling.items() if k != "seconds"},
            "versions": [batch.policy_version, batch.retriever_version], "temperature": batch.temperature,
        }
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
