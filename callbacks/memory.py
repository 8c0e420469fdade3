"""``MemoryAccount``: peak and resident memory per phase of a run, logged and written as a table.

Phases (``bridge_pl.memory.PhaseLedger``: each moment of the run belongs to the innermost open phase; a phase that a
nested one interrupts resumes after it, in the same record):

- ``setup``: from the start of the process to the start of fit: imports, the models loaded, the retriever's corpus
  encoded (or its cache read) and its index built, the optimizers built. Its peak counts from the start of the process
  (whatever ran in it before the run, e.g. a test session, included);
- ``warm_start``: ``callbacks.WarmStart``'s ``on_fit_start`` (its supervised steps; the evaluation it runs after them
  is ``evaluation``, nested);
- ``engine_build``: the generation backend built at the first rollout (``RolloutCollector.start_engine``; for vLLM
  its weights and KV cache allocated and the first weight push), nested in whatever rollout asked for it;
- ``rollout``: a training rollout (``RolloutDataModule.rollout`` with ``training=True``: generation, searches,
  rewards, the LM-credit sequences); Lightning runs it in ``on_after_batch_transfer``, before ``on_train_batch_start``;
- ``update``: from ``on_train_batch_start`` to ``on_train_batch_end``: ``training_step`` (the solver's policy and
  retriever steps);
- ``evaluation``: a validation or test loop (``on_validation_start`` to ``on_validation_end``) and every greedy
  rollout outside one (``WarmStart``'s evaluation);
- ``landscape``: ``callbacks.LossLandscape``'s probes (in its ``on_train_batch_start`` and ``on_train_end``; a call
  that probes nothing is left to the phase around it);
- ``checkpoint``: ``trainer.save_checkpoint`` (``ValidatedCheckpoint`` saves after the validation);
- ``other``: the rest (Lightning's loop glue, data fetching, other callbacks, teardown).

Per run of a phase (``bridge_pl.memory``): ``peak`` (the kernel's RSS high-water mark, reset at each boundary),
RSS at its start and end, and glibc's heap at its end: ``in_use`` (live ``malloc`` blocks) and ``free`` (freed blocks
its arenas keep: what the allocator holds back from the OS). The allocator-kept memory is read from ``mallinfo2``
rather than by trimming, because ``malloc_trim`` would change what every later phase sees; ``release=True`` trims
(``gc.collect()`` + ``malloc_trim(0)``) at the end of every phase anyway and records the RSS after it, for a run that
asks what trimming between phases would give (its later peaks are then not those of a plain run).

Resetting the high-water mark also resets what ``getrusage`` (and so ``/usr/bin/time``'s "Maximum resident set size")
reports at exit: with this callback that number is the peak since the last phase boundary, not the process's; the
process's peak is the highest phase peak (every moment belongs to a phase).

Outputs: ``memory/<phase>/{peak_gib,rise_gib,end_gib,in_use_gib,kept_gib}`` to the logger at the end of every run of a
phase (``rise``: peak minus the RSS at the phase's start); at teardown ``path`` (default
``<default_root_dir>/memory_account.jsonl``; ranks above 0 add ``.rank<N>``): one JSON line per run of a phase
(bytes, seconds; in ``info`` the shape of its largest rollout batch: rows, padded width, real and sampled tokens),
then one ``{"sizes": ...}`` line with the shapes a memory floor is computed from (parameters by part and dtype, the
policy's config, the corpus embeddings, the vLLM settings); and beside it ``<stem>.md``, the table of each phase's
highest-peak run. ``self.records`` holds the records.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from collections.abc import Callable
from pathlib import Path

import lightning as L
import torch

from bridge_pl.files import atomic_write
from bridge_pl.memory import GIB, PhaseLedger, PhaseRecord
from callbacks.landscape import LossLandscape
from callbacks.warm_start import WarmStart

PHASES = ("setup", "warm_start", "engine_build", "rollout", "update", "evaluation", "landscape", "checkpoint",
          "other")


def _gib(value: int | None) -> float | None:
    return None if value is None else value / GIB


def summary(records: list[PhaseRecord | dict]) -> dict[str, dict]:
    """Per phase (in :data:`PHASES` order, then any other): its highest-peak run (``peak``, ``rise``, ``rss_start``,
    ``rss_end``, ``in_use``, ``free``, ``rss_released``, ``step``, ``index``), with ``runs`` and total ``seconds``."""
    rows: dict[str, dict] = {}
    for record in records:
        r = record.as_dict() if isinstance(record, PhaseRecord) else record
        row = rows.setdefault(r["phase"], {"runs": 0, "seconds": 0.0, "peak": None})
        row["runs"] += 1
        row["seconds"] += r["seconds"]
        if r["peak"] is not None and (row["peak"] is None or r["peak"] > row["peak"]):
            rise = r["peak"] - r["rss_start"] if r["rss_start"] is not None else None
            row.update({k: r[k] for k in ("peak", "rss_start", "rss_end", "in_use", "free", "rss_released", "step",
                                          "index")}, rise=rise)
    order = [p for p in PHASES if p in rows] + [p for p in rows if p not in PHASES]
    return {p: rows[p] for p in order}


def markdown_table(records: list[PhaseRecord | dict]) -> str:
    """The table of :func:`summary` in GiB."""
    def cell(value: int | None) -> str:
        return "-" if value is None else f"{value / GIB:.2f}"

    lines = ["| phase | runs | seconds | peak RSS | peak - RSS at start | RSS at end | heap in use | heap kept free "
             "| RSS after trim |", "|---|---|---|---|---|---|---|---|---|"]
    for phase, row in summary(records).items():
        lines.append(f"| {phase} | {row['runs']} | {row['seconds']:.1f} | {cell(row.get('peak'))} | "
                     f"{cell(row.get('rise'))} | {cell(row.get('rss_end'))} | {cell(row.get('in_use'))} | "
                     f"{cell(row.get('free'))} | {cell(row.get('rss_released'))} |")
    return "\n".join(lines) + "\n\n(GiB; the row of each phase is its run with the highest peak)\n"


def _parameter_bytes(module: torch.nn.Module | None) -> dict:
    """``{"params", "bytes", "trainable_params", "trainable_bytes", "by_dtype": {dtype: bytes}}`` (shared tensors
    once)."""
    out = {"params": 0, "bytes": 0, "trainable_params": 0, "trainable_bytes": 0, "by_dtype": {}}
    if module is None:
        return out
    for p in module.parameters():
        n, size = p.numel(), p.numel() * p.element_size()
        out["params"] += n
        out["bytes"] += size
        dtype = str(p.dtype).removeprefix("torch.")
        out["by_dtype"][dtype] = out["by_dtype"].get(dtype, 0) + size
        if p.requires_grad:
            out["trainable_params"] += n
            out["trainable_bytes"] += size
    return out


def sizes(trainer: L.Trainer, pl_module: L.LightningModule) -> dict:
    """The shapes a memory floor is computed from, read from the live module and data module (each part where the
    module has it)."""
    out: dict = {"parts": {}}
    for name, child in pl_module.named_children():
        out["parts"][name] = _parameter_bytes(child)
    policy = getattr(pl_module, "policy", None)
    hf = getattr(policy, "hf_model", None)
    if hf is not None:
        config = hf.config
        keys = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings", "model_type")
        out["policy_config"] = {k: getattr(config, k, None) for k in keys}
        out["policy_dtype"] = str(getattr(policy, "weight_dtype", "")).removeprefix("torch.")
        out["logprob_chunk"] = getattr(policy, "logprob_chunk", None)
        out["gradient_checkpointing"] = bool(getattr(hf, "is_gradient_checkpointing", False)) or any(
            getattr(m, "gradient_checkpointing", False) is True for m in hf.modules())  # the layers' own flag
        peft = getattr(getattr(policy, "model", None), "peft_config", None)
        if peft:
            (lora,) = list(peft.values())[:1]
            out["lora"] = {"r": lora.r, "target_modules": sorted(lora.target_modules)
                           if isinstance(lora.target_modules, (set, list)) else lora.target_modules}
    solver = getattr(pl_module, "solver", None)
    if solver is not None:
        out["solver"] = getattr(solver, "name", None)
        out["keeps_credit_graph"] = bool(getattr(pl_module, "keeps_credit_graph", False))
    rl = getattr(pl_module, "rl_config", None)
    if rl is not None:
        out["micro_batch_tokens"] = rl.micro_batch_tokens
        out["minibatches"] = rl.minibatches
    retriever = getattr(pl_module, "retriever", None)
    if retriever is not None:
        emb = getattr(retriever, "_emb", None)  # the corpus embeddings, where the retriever keeps them in memory
        out["corpus"] = {
            "passages": len(retriever.passages) if hasattr(retriever, "passages") else None,
            "dim": getattr(getattr(retriever, "query_encoder", None), "dim", None),
            "embeddings_bytes": int(getattr(emb, "nbytes", 0)) if emb is not None else None,
            "embeddings_mapped": type(emb).__name__ == "memmap",
        }
    data = trainer.datamodule
    collector = getattr(data, "collector", None)
    if collector is not None:
        vllm = getattr(collector, "vllm", None)
        out["data"] = {
            "engine": getattr(collector, "engine_name", None),
            "engine_built": getattr(getattr(collector, "engine", None), "name", None),
            "kv_cache_gb": getattr(vllm, "kv_cache_gb", None),
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE"),
            "batch_size": getattr(data, "batch_size", None),
            "n_samples": getattr(data, "n_samples", None),
            "eval_batch_size": getattr(data, "eval_batch_size", None),
        }
    return out


def _batch_info(batch) -> dict:
    """Rows, padded width and real tokens of a rollout batch (what its KV cache and forwards are sized by)."""
    mask = getattr(batch, "attention_mask", None)
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        return {}
    lengths = mask.sum(-1)
    info = {"rows": int(mask.shape[0]), "width": int(mask.shape[1]), "tokens": int(lengths.sum()),
            "max_tokens": int(lengths.max()) if lengths.numel() else 0}
    action = getattr(batch, "action_mask", None)
    if isinstance(action, torch.Tensor):
        info["sampled_tokens"] = int(action.sum())
    credit = getattr(batch, "credit_sequences", None) or []
    if credit:  # the packed LM-credit rows the update scores (with grad, in modes that keep their graph)
        info["credit_rows"], info["credit_tokens"] = len(credit), sum(seq.length for seq in credit)
    return info


class MemoryAccount(L.Callback):
    """Peak RSS, RSS and glibc's heap per phase of the run (module doc).

    Args:
        path: the jsonl file (the markdown table goes beside it, ``.md``); None: ``<default_root_dir>/
            memory_account.jsonl``.
        release: ``gc.collect()`` + ``malloc_trim(0)`` at the end of every phase, RSS after it recorded (changes
            what later phases see; off by default).
        log: log ``memory/<phase>/...`` to the trainer's logger.
    """

    def __init__(self, path: str | None = None, release: bool = False, log: bool = True) -> None:
        self.path, self.release, self.log = path, release, log
        self.ledger = PhaseLedger("setup", release=release)  # setup's peak counts from the start of the process
        self.sizes: dict = {}
        self._trainer: L.Trainer | None = None
        self._wrapped = False

    @property
    def records(self) -> list[PhaseRecord]:
        """Every closed run of a phase, in the order they closed."""
        return self.ledger.records

    # ---- the ledger ---------------------------------------------------------------------------
    def _step(self) -> int | None:
        return None if self._trainer is None else self._trainer.global_step

    def _switch(self, phase: str) -> None:
        """Make ``phase`` the bottom phase, unless a nested one is open (a hook called from inside a wrapped call)."""
        if self.ledger.depth == 1:
            self._logged(self.ledger.switch(phase, self._step()))

    def _leave_setup(self) -> None:
        if self.ledger.depth == 1 and self.ledger.current == "setup":
            self._switch("other")

    def _logged(self, record: PhaseRecord | None) -> None:
        logger = self._trainer.logger if self._trainer is not None else None
        if record is None or not self.log or logger is None or record.peak is None:
            return
        rise = record.peak - record.rss_start if record.rss_start is not None else None
        values = {"peak_gib": _gib(record.peak), "rise_gib": _gib(rise), "end_gib": _gib(record.rss_end),
                  "in_use_gib": _gib(record.in_use), "kept_gib": _gib(record.free)}
        logger.log_metrics({f"memory/{record.phase}/{k}": v for k, v in values.items() if v is not None},
                           step=record.step or 0)

    @contextlib.contextmanager
    def measuring(self, name: str, changed: Callable[[], object] | None = None):
        """A nested phase ``name`` around the block (none inside a phase of that name already, or once finished); it
        yields a dict whose items go to the record's ``info``. ``changed``: read before and after the block; equal
        readings leave the block to the phase around it (a call that did nothing worth a phase)."""
        if self.ledger.finished or self.ledger.current == name:
            yield {} if self.ledger.finished else self.ledger.innermost.info  # e.g. a validation's rollouts
            return
        self._leave_setup()
        before = changed() if changed is not None else None
        info: dict = {}
        self.ledger.enter(name, self._step())
        try:
            yield info
        finally:
            keep = changed is None or changed() != before
            self._logged(self.ledger.leave(info, keep=keep))

    def phase(self, name: str, fn: Callable, changed: Callable[[], object] | None = None) -> Callable:
        """``fn`` called inside :meth:`measuring` ``(name, changed)``; a rollout batch it returns is described in the
        record (rows, padded width, tokens)."""

        @functools.wraps(fn)
        def measured(*args, **kwargs):
            with self.measuring(name, changed) as info:
                result = fn(*args, **kwargs)
                batch = _batch_info(result)
                if batch.get("tokens", 0) > info.get("tokens", -1):  # several batches in one phase: the largest
                    info.update(batch)
                return result

        return measured

    def _wrap(self, trainer: L.Trainer) -> None:
        data = trainer.datamodule
        if data is not None and callable(getattr(data, "rollout", None)):
            training_rollout, eval_rollout = self.phase("rollout", data.rollout), self.phase("evaluation", data.rollout)

            def rollout(module, examples, training: bool, dataset: str):
                return (training_rollout if training else eval_rollout)(module, examples, training, dataset)

            data.rollout = rollout
            collector = getattr(data, "collector", None)
            if callable(getattr(collector, "start_engine", None)):
                collector.start_engine = self.phase("engine_build", collector.start_engine)
        for callback in trainer.callbacks:
            if isinstance(callback, WarmStart):
                callback.on_fit_start = self.phase("warm_start", callback.on_fit_start)
            elif isinstance(callback, LossLandscape):  # a call that probes nothing stays in the phase around it
                probes = functools.partial(lambda c: len(c.probed_steps), callback)
                for hook in ("on_train_batch_start", "on_train_end"):
                    setattr(callback, hook, self.phase("landscape", getattr(callback, hook), changed=probes))
        trainer.save_checkpoint = self.phase("checkpoint", trainer.save_checkpoint)

    # ---- hooks --------------------------------------------------------------------------------
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._trainer = trainer
        if not self._wrapped:
            self._wrap(trainer)
            self._wrapped = True

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._leave_setup()
        self.sizes = sizes(trainer, pl_module)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._switch("other")

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        self._switch("update")

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch,
                           batch_idx: int) -> None:
        self._switch("other")

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._leave_setup()
        self._switch("evaluation")

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._switch("other")

    def on_test_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._leave_setup()
        self._switch("evaluation")

    def on_test_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._switch("other")

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._write(trainer)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._write(trainer)

    # ---- output -------------------------------------------------------------------------------
    def output_path(self, trainer: L.Trainer) -> Path:
        path = Path(self.path) if self.path else Path(trainer.default_root_dir) / "memory_account.jsonl"
        if trainer.global_rank:
            path = path.with_name(f"{path.name}.rank{trainer.global_rank}")
        return path

    def _write(self, trainer: L.Trainer) -> None:
        if self.ledger.finished:
            return
        closed = len(self.records)
        self.ledger.finish()
        engine = getattr(getattr(trainer.datamodule, "collector", None), "engine", None)
        if "data" in self.sizes:  # which backend the run built (known after the first rollout)
            self.sizes["data"]["engine_built"] = getattr(engine, "name", None)
        for record in self.records[closed:]:
            self._logged(record)
        path = self.output_path(trainer)
        lines = [json.dumps(r.as_dict()) for r in self.records] + [json.dumps({"sizes": self.sizes})]
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda f: f.write(("\n".join(lines) + "\n").encode()))
        atomic_write(path.with_suffix(".md"), lambda f: f.write(markdown_table(self.records).encode()))
