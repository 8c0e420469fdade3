"""``RolloutDataModule``: QA sets in, on-policy ``RolloutBatch``es out.

The dataloaders yield :class:`~bridge_pl.data.stream.ExampleBatch`es of QA examples (cheap to prefetch). The rollout
runs in :meth:`RolloutDataModule.on_after_batch_transfer`, which Lightning calls right before the step that consumes
the batch, so every batch is generated with the parameters of that step even though the loader is one batch ahead
(the versions recorded in the batch prove it). The rollout itself is the
:class:`~bridge_pl.rollout.collector.RolloutCollector`'s.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

import lightning as L
from lightning.fabric.utilities.apply_func import move_data_to_device
from torch.utils.data import DataLoader

from bridge_pl.config import raise_problems, require_choice
from bridge_pl.data.medical import expand_sets
from bridge_pl.data.settings import DEFAULT_TEST, DEFAULT_VAL, data_problems, read_stage_sources, source_key
from bridge_pl.data.sources import load_qa
from bridge_pl.data.stream import ExampleBatch, PromptStream
from bridge_pl.distributed import gather_per_rank, this_ranks
from bridge_pl.metrics import QAMetrics
from bridge_pl.records import QAExample, QASpec
from bridge_pl.rewards import ExactMatchReward, RewardFunction
from bridge_pl.rollout.agent import RolloutAgent
from bridge_pl.rollout.backends import EngineName
from bridge_pl.rollout.batch import RolloutBatch
from bridge_pl.rollout.collector import GroupSampling, Limits, RolloutCollector
from bridge_pl.rollout.env import EnvConfig
from bridge_pl.rollout.prompts import CHOICE_INSTRUCTION, INSTRUCTION, PromptBuilder
from bridge_pl.rollout.vllm_engine import VLLMConfig
from bridge_pl.seeding import derive_seed


class RolloutDataModule(L.LightningDataModule):
    """Reads QA sets, streams training prompts, and has its collector roll out the module's policy + retriever.

    Args:
        train: QA source for training (see :func:`bridge_pl.data.sources.load_qa`: ``world/train``,
            ``fanoutqa/sub``, a FlashRAG/Search-R1 jsonl path, ..., or an inline list of records).
        val, test: named QA sources, each evaluated and reported separately (``val/<name>/em``).
        max_eval_examples: evaluate on the first N examples of each val/test set (None: all).
        batch_size: prompts per training iteration; ``n_samples`` trajectories each (a GRPO group).
        eval_batch_size: prompts per evaluation batch (greedy, one trajectory each).
        max_turns, max_new_tokens_per_turn, max_response_tokens, temperature, top_p: rollout settings.
        engine: the generation backend: ``hf`` (bridge-pl's own KV-cached decode loop), ``vllm`` (an in-process
            vLLM engine, weights synced before each rollout; under ``ddp``/``fsdp2`` one engine per rank, each
            gathering the whole policy), or ``auto`` (default): vLLM where it imports, the run has one process and
            the engine builds for the policy, else ``hf`` (logged).
        vllm: settings of the vLLM backend (:class:`~bridge_pl.rollout.vllm_engine.VLLMConfig`).
        filter_groups: DAPO dynamic sampling: train only on groups whose rewards differ (the others have
            GRPO advantage 0), refilling from fresh prompts; ``max_sampling_rounds`` bounds the rollouts per
            iteration (1: filter without refilling). See :meth:`RolloutCollector.sample_groups`.
        type_mixture: training prompts drawn by question type (``metadata["type"]``, e.g. the world's
            ``single`` / ``bridge`` / ``comparison``) with these weights, instead of epochs over the set.
        env: tag names, templates and token budgets (default: Search-R1's).
        reward: the reward function of free-text questions (default exact match). A multiple-choice question
            (``metadata["options"]``, gold = the option letter) is rewarded 1 for the gold option and 0
            otherwise, whatever this is (see :func:`bridge_pl.rewards.choice_letter` for the answers read).
        instruction: prompt template with ``{question}``; ``{think}``, ``{search}``, ``{information}`` and
            ``{answer}`` become the env's tag names.
        choice_instruction: the template of multiple-choice questions: also ``{options}`` (``A. text`` lines).
        use_chat_template: wrap the prompt in the tokenizer's chat template when it has one.
        seed: seeds the prompt order and the sampling (retrieval and generation); None (default): the run's
            ``seed_everything`` (so one ``--seed_everything=N`` reseeds the whole run), 0 if it has none.
    """

    def __init__(
        self,
        train: QASpec = "world/train",
        val: dict[str, QASpec] | None = None,
        test: dict[str, QASpec] | None = None,
        max_eval_examples: int | None = None,
        batch_size: int = 4,
        n_samples: int = 4,
        eval_batch_size: int = 16,
        max_turns: int = 3,
        max_new_tokens_per_turn: int = 64,
        max_response_tokens: int = 512,
        temperature: float = 1.0,
        top_p: float = 1.0,
        engine: EngineName = "auto",
        vllm: VLLMConfig = VLLMConfig(),
        filter_groups: bool = False,
        max_sampling_rounds: int = 1,
        type_mixture: dict[str, float] | None = None,
        env: EnvConfig | None = None,
        reward: RewardFunction | None = None,
        instruction: str = INSTRUCTION,
        choice_instruction: str = CHOICE_INSTRUCTION,
        use_chat_template: bool = True,
        seed: int | None = None,
    ) -> None:
        super().__init__()
        raise_problems(data_problems(locals()))  # the arguments by name
        self.train_source = train
        # mirage:PATH names the five MIRAGE subsets: sets <name>/medqa, ... (see bridge_pl.data.medical)
        self.val_sources = expand_sets(val) if val is not None else dict(DEFAULT_VAL)
        self.test_sources = expand_sets(test) if test is not None else dict(DEFAULT_TEST)
        self.max_eval_examples, self.eval_batch_size = max_eval_examples, eval_batch_size
        self.batch_size, self.type_mixture = batch_size, type_mixture
        self.collector = RolloutCollector(
            PromptBuilder(instruction, choice_instruction, env or EnvConfig(), use_chat_template),
            Limits(max_turns, max_new_tokens_per_turn, max_response_tokens, temperature, top_p),
            GroupSampling(n_samples, batch_size, filter_groups, max_sampling_rounds),
            require_choice("data.engine", engine, EngineName), vllm, reward or ExactMatchReward(), seed)
        self.consumed = 0  # training batches generated so far (the resumable data position)
        self._sets: dict[str, list[QAExample]] = {}

    @property
    def seed(self) -> int:
        """``data.seed``, or the seed Lightning's ``seed_everything`` set for this run (0 without one)."""
        return self.collector.seed

    @property
    def n_samples(self) -> int:
        """Trajectories per training prompt (a GRPO group's size)."""
        return self.collector.groups.n_samples

    # ---- data -----------------------------------------------------------------------------------
    def load(self, source: QASpec, limit: int | None = None) -> list[QAExample]:
        """The QA set ``source`` (read once, then cached), its first ``limit`` examples when given."""
        key = source_key(source)
        if key not in self._sets:
            self._sets[key] = load_qa(source)
        return self._sets[key][:limit] if limit is not None else self._sets[key]

    def load_sources(self, stage: str, preloaded: Mapping[str, list[QAExample]] | None = None) -> None:
        """Load (and so check) every QA set ``stage`` (``fit``, ``validate``, ``test``, ``predict``) reads;
        ``preloaded``: sets :func:`~bridge_pl.data.settings.read_stage_sources` read already."""
        self._sets.update(preloaded or {})
        settings = {"train": self.train_source, "val": self.val_sources, "test": self.test_sources,
                    "batch_size": self.batch_size, "type_mixture": self.type_mixture}
        self._sets.update(read_stage_sources(stage, settings, self._sets))

    def stream(self) -> PromptStream:
        """The training prompts from the current data position, this rank's share."""
        trainer = self.trainer
        rank, world = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
        return PromptStream(self.load(self.train_source), self.batch_size, self.seed, self.consumed, rank, world,
                            self.type_mixture)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.stream(), batch_size=None)

    def _eval_loaders(self, sources: dict[str, QASpec]) -> list[DataLoader]:
        return [DataLoader(self.load(source, self.max_eval_examples), batch_size=self.eval_batch_size,
                           collate_fn=ExampleBatch) for source in sources.values()]

    def val_dataloader(self) -> list[DataLoader]:
        return self._eval_loaders(self.val_sources)

    def test_dataloader(self) -> list[DataLoader]:
        return self._eval_loaders(self.test_sources)

    def predict_dataloader(self) -> list[DataLoader]:
        return self._eval_loaders(self.test_sources)

    def evaluate(self, module: RolloutAgent) -> dict[str, dict[str, float]]:
        """Greedy metrics (:class:`~bridge_pl.metrics.QAMetrics`) of every validation set with ``module``'s current
        policy and retriever, over the batches the validation loaders yield, by set name; beside the metrics,
        ``questions`` and ``multiple_choice`` count this process's questions. The caller opens the steps'
        precision context."""
        results = {}
        for name, loader in zip(self.val_sources, self.val_dataloader()):
            metric = QAMetrics().to(module.device)
            for batch in loader:
                metric.update_from_rollouts(self.rollout(module, batch, training=False, dataset=name))
            counts = {"questions": float(metric.questions), "multiple_choice": float(metric.choice_questions)}
            results[name] = {**{key: float(value) for key, value in metric.compute().items()}, **counts}
        return results

    def teardown(self, stage: str) -> None:
        self.collector.close()

    def state_dict(self) -> dict:
        """The data position and the sampling generator's state (saved in checkpoints)."""
        state: dict = {"consumed": self.consumed}
        generators = gather_per_rank(self.collector.generator_state())  # every rank samples with its own generator
        if any(g is not None for g in generators):
            state["generator"] = generators
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        self.consumed = int(state_dict["consumed"])
        self.collector.load_generator_state(this_ranks(state_dict.get("generator")))

    # ---- rollouts -------------------------------------------------------------------------------
    def transfer_batch_to_device(self, batch: ExampleBatch, device, dataloader_idx: int) -> ExampleBatch:
        return batch  # plain examples stay on the host; the rollout below lands on the device

    def on_after_batch_transfer(self, batch: ExampleBatch, dataloader_idx: int) -> RolloutBatch:
        trainer = self.trainer
        training = trainer.training
        sources = self.val_sources if (trainer.validating or trainer.sanity_checking) else self.test_sources
        dataset = "train" if training else list(sources)[dataloader_idx]
        module = trainer.lightning_module
        # the steps' precision context (bf16-mixed: autocast), which Lightning opens only around the steps
        with trainer.precision_plugin.forward_context():
            rollout = self.rollout(module, batch, training=training, dataset=dataset)
        if training:
            self.consumed += 1
        return move_data_to_device(rollout, module.device)

    def rollout(self, module: RolloutAgent, examples: Sequence[QAExample], training: bool, dataset: str
                ) -> RolloutBatch:
        """The collector's batch of ``examples`` at the current data position; dynamic sampling's refills are drawn
        from the training stream by an RNG seeded by the position and the round, so a resumed run draws the same."""

        def refill(round_: int) -> list[QAExample]:
            return self.stream().draw_share(random.Random(derive_seed(self.seed, "refill", self.consumed, round_)))

        return self.collector.collect(module, examples, training, dataset, position=self.consumed, refill=refill)
