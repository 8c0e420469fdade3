"""IndexRefresh: no-op for fixed passage sides, scheduled rebuilds for a tied tower, DDP agreement.

Run as a script (``python tests/test_index_refresh.py OUT_DIR``) it is the 2-process DDP job that
``test_ddp_ranks_build_the_same_index`` launches.
"""

import json
import logging
import os
import subprocess
import sys
import types
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from bridge_pl.records import Passage
from bridge_pl.retrieval.bm25 import BM25Retriever
from bridge_pl.retrieval.dense import DenseRetriever
from callbacks.index_refresh import IndexRefresh

PASSAGES = [
    Passage("a", "Cats", "the cat sat on the mat"),
    Passage("b", "Paris", "paris is the capital of france"),
    Passage("c", "Dogs", "dogs bark loudly at night"),
    Passage("d", "Python", "python is a programming language"),
    Passage("e", "Sun", "the sun is a star"),
]
QUERIES = ["capital of france", "a cat on a mat", "what is a star", "barking dogs"]


class TinyModule(pl.LightningModule):
    """Trains the retriever's query tower to raise the top-3 scores of a few queries."""

    def __init__(self, retriever: DenseRetriever) -> None:
        super().__init__()
        self.retriever = retriever

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        queries = [QUERIES[i] for i in batch.tolist()]
        _, rows = self.retriever.search(queries, 3)
        return -self.retriever.score(queries, rows).logsumexp(-1).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.retriever.query_encoder.parameters(), lr=0.5)

    def train_dataloader(self):
        return DataLoader(torch.arange(len(QUERIES)), batch_size=1)


def dense(cache_dir: Path, passage_tower: str) -> DenseRetriever:
    return DenseRetriever(PASSAGES, encoder="tiny-bert", passage_tower=passage_tower,
                          cache_dir=str(cache_dir), progress=False)


def trainer(root: Path, callback: IndexRefresh, max_steps: int, **kwargs) -> pl.Trainer:
    return pl.Trainer(
        default_root_dir=root, max_steps=max_steps, callbacks=[callback], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **kwargs,
    )


@pytest.fixture
def rank_zero_messages():
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


@pytest.mark.parametrize("kind", ["frozen", "bm25"])
def test_noop_is_said_once(tmp_path, rank_zero_messages, kind):
    retriever = BM25Retriever(PASSAGES) if kind == "bm25" else dense(tmp_path, "frozen")
    callback = IndexRefresh(every_n_steps=1)
    module = types.SimpleNamespace(retriever=retriever)
    for _ in range(2):
        callback.on_train_start(None, module)
    said = [m for m in rank_zero_messages if "IndexRefresh does nothing" in m]
    assert len(said) == 1 and ("frozen" in said[0] if kind == "frozen" else "BM25Retriever" in said[0])
    assert callback.retriever is None


def test_tied_tower_is_rebuilt_on_schedule(tmp_path):
    retriever = dense(tmp_path, "tied")
    retriever.prepare()
    initial = retriever.index.fingerprint
    callback = IndexRefresh(every_n_steps=2)
    fit = trainer(tmp_path, callback, max_steps=4)
    fit.fit(TinyModule(retriever))
    assert callback.refreshes == 2 and callback.last_refresh_step == 4
    assert retriever.index.fingerprint == retriever.fingerprint() != initial
    assert retriever.allow_stale  # the callback accepts staleness between refreshes
    assert fit.callback_metrics["index_refresh/seconds"] > 0
    assert 0 <= fit.callback_metrics["index_refresh/topk_overlap"] <= 1


def test_rerank_strategy_enables_stale_reranking(tmp_path):
    retriever = dense(tmp_path, "tied")
    callback = IndexRefresh(strategy="rerank", over_retrieve=3)
    trainer(tmp_path, callback, max_steps=2).fit(TinyModule(retriever))
    assert retriever.rerank_stale and retriever.rerank_factor == 3 and callback.refreshes == 0
    assert retriever.index.fingerprint != retriever.fingerprint()  # stale, yet search worked


def test_piecewise_schedule():
    callback = IndexRefresh(schedule=[[10, 5], [100, 50]])
    assert [callback.interval(s) for s in (0, 10, 99, 100, 1000)] == [None, 5, 5, 50, 50]
    callback.last_refresh_step = 10
    assert not callback.due(14) and callback.due(15)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({}, "every_n_steps"), ({"every_n_steps": 2, "schedule": [[0, 1]]}, "not both"),
     ({"schedule": [[0, 0]]}, "every_n"), ({"schedule": [[5, 1], [5, 2]]}, "increasing"),
     ({"every_n_steps": 1, "strategy": "lazy"}, "strategy")],
)
def test_bad_options_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        IndexRefresh(**kwargs)


def test_ddp_ranks_build_the_same_index(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get(
        "PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, __file__, str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert results[0]["fingerprint"] == results[1]["fingerprint"] != results[0]["initial"]
    assert [r["refreshes"] for r in results] == [2, 2]


def test_index_older_than_the_weights_is_rebuilt_at_train_start(tmp_path):
    retriever = dense(tmp_path, "tied")
    retriever.prepare()
    with torch.no_grad():  # as if a checkpoint had been loaded after prepare()
        retriever.query_encoder.encoder.embeddings.word_embeddings.weight.mul_(1.1)
    callback = IndexRefresh(every_n_steps=100)
    callback.on_train_start(types.SimpleNamespace(global_step=7), types.SimpleNamespace(retriever=retriever))
    assert retriever.index.fingerprint == retriever.fingerprint() and callback.last_refresh_step == 7


def ddp_main(out: Path) -> None:
    """2-process CPU DDP fit; each rank records the index fingerprint it ends with."""
    torch.set_num_threads(1)
    retriever = dense(out / "emb", "tied")
    retriever.prepare()
    initial = retriever.index.fingerprint
    callback = IndexRefresh(every_n_steps=1)
    fit = trainer(out, callback, max_steps=2, accelerator="cpu", devices=2, strategy="ddp")
    fit.fit(TinyModule(retriever))
    result = {"fingerprint": retriever.index.fingerprint, "initial": initial, "refreshes": callback.refreshes}
    (out / f"rank{fit.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    ddp_main(Path(sys.argv[1]))
