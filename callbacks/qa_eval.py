"""``QAEval``: per-dataset predictions files and a TensorBoard panel of full trajectories after each eval.

The numbers (``val/<dataset>/em``, ``f1``, ``sub_em``, ``searches``, ``turns``, ``valid_action_rate``, ``accuracy``
on multiple-choice sets, and their averages ``val/<name>``) are logged by ``BridgeModule`` itself; this callback
adds what a researcher reads next: ``<run dir>/predictions/<stage>_<dataset>_step<step>.jsonl`` (a ``/`` in the
dataset name, as in ``mirage/medqa``, becomes ``_``; one line per question:
``id, question, type, options, golden_answers, prediction, em, f1, reward, response, searches``, where ``type`` is
the example's ``metadata["type"]`` (the world's ``single`` / ``bridge`` / ``comparison``, a MIRAGE subset; null
when the data has none), ``options`` the multiple-choice options (null for free text; ``prediction`` is then the
letter the reward read, or the answer as written when it names no option, and ``em`` / ``f1`` score that letter,
as the reward and ``accuracy`` do) and each search is ``{query, titles, ids}`` of the passages shown),
``add_text`` panels ``<stage>/<dataset>/trajectories`` on every TensorBoard logger, and, when the examples have a
type, EM and searches per type, logged through the module (rank 0's numbers, on every rank):
``<stage>/<dataset>/by_type/<type>/em``, ``.../searches`` (a policy that never searches twice scores 0 on 2-hop
questions; the dataset average hides it).

With a ``judge`` (opt-in: one judge call per trajectory), every record also gets ``reasoning_quality`` (1-5, or
null when the reply held no score or the request failed) and ``judge_reply``, and the module logs
``<stage>/<dataset>/reasoning_quality`` (mean over parsed replies), ``.../judge_unparsed`` and ``.../judge_failed``
(counts, also warned about), and the means over sets and over MIRAGE subsets (``<stage>/mirage/reasoning_quality``).
Replies are cached in ``judge_cache`` (default ``<default_root_dir>/judge_cache.jsonl``), so a repeated or
interrupted evaluation asks only for what is missing. See ``bridge_pl.judge`` and docs/medical.md.

With several processes each rank judges every world-th record of the gathered set (rank r: records r, r + world,
...), the ranks wait for each other on the process group's store (no timeout: judging may outlast the process
group's), and rank 0 collects the replies and computes the numbers from the whole set, as one process would.
Judging that lasts over 30 s prints a progress line (rank 0's share) about every 30 s, terminal or not.

The run dir is ``trainer.log_dir`` (the logger's version folder, or ``default_root_dir`` without a logger).
The step is the model's training step (``BridgeModule.policy_version``, saved in checkpoints), so
``bridge-pl validate --ckpt_path`` names its files like the fit's validation did at that step
(``trainer.global_step`` is 0 outside ``fit``).

With several processes every rank's predictions are gathered to rank 0, put back in dataset order
(Lightning's ``DistributedSampler`` deals example i to rank i mod world), de-duplicated by example id
(the sampler repeats examples to even out ranks), and written once.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch.distributed as dist
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_warn

from bridge_pl.distributed import interleave, join_at_rank_zero, process_rank, share_from_rank_zero, wait_for_ranks
from bridge_pl.judge import Judge, JudgeCache, apply_verdicts, judge_verdicts, summarize
from bridge_pl.metrics import set_means, trajectory_scores
from bridge_pl.miss_analysis import trajectory_searches
from bridge_pl.records import Passage
from bridge_pl.rollout.batch import RolloutBatch
from bridge_pl.terminal import plain_line

JUDGE_PROGRESS_EVERY_S = 30.0  # seconds between the judge's progress lines


def eval_dataset_names(trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> list[str]:
    """The named ``stage`` ('val' | 'test') sets, in config order; the same list on every rank."""
    sources = getattr(trainer.datamodule, f"{stage}_sources", None)
    if sources is not None:
        return list(sources)
    prefix = f"{stage}/"
    return sorted(key[len(prefix):] for key in pl_module.last_eval_batches if key.startswith(prefix))


def prediction_records(batch: RolloutBatch, passage: Callable[[int], Passage]) -> list[dict[str, Any]]:
    """One predictions-file record per trajectory of ``batch``; ``passage(row)`` looks up shown passages."""
    records = []
    for b, searches in enumerate(trajectory_searches(batch, passage)):
        answer, golds, options = batch.answers[b], batch.golds[b], batch.metadata[b].get("options")
        scores = trajectory_scores(answer, golds, options, batch.choices[b])
        records.append({
            "id": batch.example_ids[b],
            "question": batch.questions[b],
            "type": batch.metadata[b].get("type"),
            "options": options,
            "golden_answers": list(golds),
            "prediction": answer,
            "em": scores["em"],
            "f1": scores["f1"],
            "reward": float(batch.rewards[b]),
            "response": batch.responses[b],
            "searches": [
                {"query": s.query, "titles": [p.title for p in s.passages], "ids": [p.id for p in s.passages]}
                for s in searches
            ],
        })
    return records


def metrics_by_type(records: list[dict[str, Any]], prefix: str) -> dict[str, float]:
    """Mean EM and searches per question type: ``{prefix}/by_type/<type>/em`` and ``.../searches``.

    Records whose ``type`` is None are left out; no typed record, no metric.
    """
    by_type: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        if record["type"] is not None:
            by_type.setdefault(str(record["type"]), []).append(record)
    metrics = {}
    for kind, group in sorted(by_type.items()):
        metrics[f"{prefix}/by_type/{kind}/em"] = sum(r["em"] for r in group) / len(group)
        metrics[f"{prefix}/by_type/{kind}/searches"] = sum(len(r["searches"]) for r in group) / len(group)
    return metrics


def gather_to_rank_zero(local: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """All ranks' records on rank 0, in dataset order and de-duplicated by id; ``None`` on other ranks.

    Rank r's i-th record is taken to be example ``i * world + r`` (Lightning's ``DistributedSampler``).
    A collective: every rank must call it.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return local
    world = dist.get_world_size()
    gathered: list[list[dict[str, Any]]] | None = [[] for _ in range(world)] if dist.get_rank() == 0 else None
    dist.gather_object(local, gathered, dst=0)
    return merge_rank_records(gathered) if gathered is not None else None


def merge_rank_records(parts: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Interleave per-rank records (rank r's i-th is example ``i * world + r``); keep each id's first record."""
    seen: set[str] = set()
    records = []
    for record in interleave(parts):
        if record["id"] not in seen:
            seen.add(record["id"])
            records.append(record)
    return records


def trajectory_markdown(record: dict[str, Any]) -> str:
    """A TensorBoard (markdown) rendering of one predictions record, with the full response text."""
    lines = [
        f"**Question** ({record['id']}): {record['question']}  ",
        f"**Gold:** {' | '.join(record['golden_answers'])}  ",
        f"**Prediction:** {record['prediction']}  (EM {record['em']:.0f}, F1 {record['f1']:.2f}, "
        f"reward {record['reward']:.2f})",
        "",
    ]
    for i, search in enumerate(record["searches"], 1):
        shown = "; ".join(f"{t} [{pid}]" for t, pid in zip(search["titles"], search["ids"]))
        lines.append(f"{i}. search `{search['query']}` → {shown}")
    lines += ["", "Response:", ""]
    lines += ["    " + line for line in record["response"].splitlines()]  # indented: a verbatim block
    return "\n".join(lines)


def _write_jsonl(path: Path, records: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


class QAEval(L.Callback):
    """Writes per-dataset predictions and shows a few full trajectories in TensorBoard after each eval.

    Args:
        num_trajectories: trajectories per dataset in the TensorBoard text panel (the first ones of the
            dataset; 0 turns the panel off).
        write_predictions: write the predictions jsonl files.
        judge: scores each trajectory's reasoning (``bridge_pl.judge.HFJudge`` or ``OpenAIJudge``); None: off.
        judge_cache: the judge's reply cache (jsonl); None: ``<default_root_dir>/judge_cache.jsonl``.
    """

    def __init__(self, num_trajectories: int = 3, write_predictions: bool = True, judge: Judge | None = None,
                 judge_cache: str | None = None) -> None:
        if num_trajectories < 0:
            raise ValueError(f"QAEval: num_trajectories must be >= 0, got {num_trajectories}")
        self.num_trajectories = num_trajectories
        self.write_predictions = write_predictions
        self.judge, self.judge_cache = judge, judge_cache
        self.written: list[Path] = []  # predictions files written by this process (rank 0)

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.report(trainer, pl_module, "val")

    def on_test_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.report(trainer, pl_module, "test")

    def report(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Gather, write and display the ``stage`` predictions of every named dataset (a collective)."""
        run_dir = Path(trainer.log_dir or trainer.default_root_dir)  # log_dir broadcasts: call on all ranks
        step = int(getattr(pl_module, "policy_version", trainer.global_step))
        judged: dict[str, dict[str, float]] = {}
        for name in eval_dataset_names(trainer, pl_module, stage):
            local = [
                record
                for batch in pl_module.last_eval_batches.get(f"{stage}/{name}", [])
                for record in prediction_records(batch, pl_module.retriever.passage)
            ]
            records = gather_to_rank_zero(local)
            # rank 0's numbers on every rank, so every rank's callback_metrics agree (a collective, like the gather)
            metrics = metrics_by_type(records or [], f"{stage}/{name}")
            if self.judge is not None:  # a collective too: every rank judges a share
                metrics.update(self.judge_set(records, f"{stage}/{name}", trainer))
            typed = trainer.strategy.broadcast(metrics, src=0)
            if typed:  # through the module, so they share the TensorBoard step of val/<dataset>/em
                pl_module.log_dict(typed, add_dataloader_idx=False)
            if f"{stage}/{name}/reasoning_quality" in typed:
                judged[f"{stage}/{name}"] = {"reasoning_quality": typed[f"{stage}/{name}/reasoning_quality"]}
            if not records:
                continue
            if self.write_predictions:
                path = run_dir / "predictions" / f"{stage}_{name.replace('/', '_')}_step{step}.jsonl"
                _write_jsonl(path, records)
                self.written.append(path)
            if self.num_trajectories:
                text = "\n\n---\n\n".join(map(trajectory_markdown, records[: self.num_trajectories]))
                for logger in trainer.loggers:
                    if isinstance(logger, TensorBoardLogger):
                        logger.experiment.add_text(f"{stage}/{name}/trajectories", text, step)
        if judged:  # <stage>/reasoning_quality and, over MIRAGE subsets, <stage>/mirage/reasoning_quality
            pl_module.log_dict(set_means(judged, stage), add_dataloader_idx=False)

    def judge_set(self, records: list[dict[str, Any]] | None, key: str, trainer: L.Trainer) -> dict[str, float]:
        """Judge one set (a collective: every rank calls it with the gathered ``records`` on rank 0, None elsewhere).

        Each rank judges its share (``records[rank::world]``) and waits on the store until every rank has; rank 0
        then writes the replies into ``records`` and returns ``<key>/reasoning_quality`` and the two counts
        (other ranks, or an empty set: ``{}``).
        """
        share = share_from_rank_zero(records)
        verdicts = judge_verdicts(self.judge, share, self.cache(trainer), _progress_lines(key)) if share else []
        wait_for_ranks(f"judge {key}", report=_waiting_lines(key), report_every_s=JUDGE_PROGRESS_EVERY_S)
        verdicts = join_at_rank_zero(verdicts)
        if not records:
            return {}
        apply_verdicts(records, verdicts)
        summary = summarize(verdicts)
        if summary.unparsed or summary.failed:
            rank_zero_warn(
                f"QAEval judge: on {key}, {summary.unparsed} of {len(records)} replies held no 'Score: N' and "
                f"{summary.failed} requests failed (first: {summary.example}); they are left out of "
                f"{key}/reasoning_quality"
            )
        metrics = {f"{key}/judge_unparsed": float(summary.unparsed), f"{key}/judge_failed": float(summary.failed)}
        if summary.reasoning_quality is not None:
            metrics[f"{key}/reasoning_quality"] = summary.reasoning_quality
        return metrics

    def cache(self, trainer: L.Trainer) -> JudgeCache:
        """This process's view of the judge cache (``judge_cache``, or ``<default_root_dir>/judge_cache.jsonl``)."""
        return JudgeCache(self.judge_cache or Path(trainer.default_root_dir) / "judge_cache.jsonl", process_rank())


def _progress_lines(key: str) -> Callable[[int, int], None]:
    """A :func:`~bridge_pl.judge.judge_verdicts` progress callback that prints (rank 0) at most every
    ``JUDGE_PROGRESS_EVERY_S`` seconds: ``QAEval judge: <key>: asked 640 of 1916 (95 s)``."""
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    share = f" (rank 0's share; {world} ranks)" if world > 1 else ""
    start = last = time.monotonic()

    def report(asked: int, to_ask: int) -> None:
        nonlocal last
        now = time.monotonic()
        if now - last >= JUDGE_PROGRESS_EVERY_S:
            last = now
            plain_line(f"QAEval judge: {key}: asked {asked} of {to_ask}{share} ({now - start:.0f} s)")

    return report


def _waiting_lines(key: str) -> Callable[[int, int], None]:
    """A :func:`~bridge_pl.distributed.wait_for_ranks` report that prints (rank 0) how many ranks are done."""
    return lambda done, world: plain_line(f"QAEval judge: {key}: {done} of {world} ranks done judging, waiting")
