"""``RolloutDataModule``: QA prompts in, on-policy ``RolloutBatch``es out.

The dataloaders yield :class:`ExampleBatch`es of :class:`~bridge_pl.data.qa.QAExample` (cheap to prefetch). Generation
runs in :meth:`RolloutDataModule.on_after_batch_transfer`, which Lightning calls right before the
step that consumes the batch, so every batch is generated with the parameters of that step even
though the loader is one batch ahead (the versions recorded in the batch prove it).
"""

from __future__ import annotations

import itertools
import math
import os
import random
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any, Literal, NamedTuple

import lightning as L
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader, IterableDataset

from bridge_pl.config import require_choice
from bridge_pl.data.medical import expand_sets
from bridge_pl.data.sources import load_qa
from bridge_pl.distributed import gather_per_rank, this_ranks
from bridge_pl.policy import BranchedSequence
from bridge_pl.records import QAExample, QASpec
from bridge_pl.rewards import ExactMatchReward, RewardFunction, choice_letter, choice_scores, extract_answer
from bridge_pl.rollout.agent import RolloutAgent
from bridge_pl.rollout.batch import RolloutBatch
from bridge_pl.rollout.engine import MultiTurnEngine, RolloutEngine, Trajectory
from bridge_pl.rollout.env import EnvConfig, SearchEnv
from bridge_pl.rollout.vllm_engine import VLLMConfig, VLLMRolloutEngine, vllm_available
from bridge_pl.seeding import derive_seed

# {think}, {search}, {information}, {answer}: the env's tag names (data.env); {question}: the question.
INSTRUCTION = (
    "Answer the question. Think step by step inside <{think}> and </{think}>. Whenever you are missing a fact, "
    "search for it by writing <{search}> query </{search}>; the search results will be shown between "
    "<{information}> and </{information}>. You may search several times. When you know the answer, write it "
    "inside <{answer}> and </{answer}> with no explanation, for example <{answer}> Paris </{answer}>.\n"
    "Question: {question}\n"
)
# The same for a multiple-choice question; {options}: one "A. text" line per option.
CHOICE_INSTRUCTION = (
    "Answer the multiple-choice question. Think step by step inside <{think}> and </{think}>. Whenever you are "
    "missing a fact, search for it by writing <{search}> query </{search}>; the search results will be shown "
    "between <{information}> and </{information}>. You may search several times. When you know the answer, "
    "write the correct option inside <{answer}> and </{answer}> with no explanation: its letter, for example "
    "<{answer}>C</{answer}>, or its text.\n"
    "Question: {question}\n"
    "Options:\n{options}\n"
)


def options_text(options: dict[str, str]) -> str:
    """The options as the prompt shows them: ``"A. text"`` lines."""
    return "\n".join(f"{letter}. {text}" for letter, text in options.items())


MIN_TEMPERATURE = 0.01  # data.temperature floor: below it sampling is greedy in float32 and a GRPO group's
# samples are all alike (no advantage signal); evaluation is greedy anyway
_TEMPLATE_FIELDS = ("question", "think", "search", "information", "answer")
_PLACEHOLDERS = ", ".join("{" + name + "}" for name in _TEMPLATE_FIELDS)
_AT_LEAST_ONE = ("batch_size", "n_samples", "eval_batch_size", "max_turns", "max_new_tokens_per_turn",
                 "max_response_tokens", "max_sampling_rounds")


def _template_problem(instruction: str) -> str | None:
    """Why ``instruction`` is not a usable prompt template, or None."""
    if "{question}" not in instruction:
        return "a template containing '{question}'"
    try:
        instruction.format(**{name: name for name in _TEMPLATE_FIELDS})
    except (KeyError, IndexError, ValueError) as error:
        detail = f"unknown placeholder {{{error.args[0]}}}" if isinstance(error, (KeyError, IndexError)) else error
        return (f"a template whose only placeholders are {_PLACEHOLDERS} "
                f"(write a literal brace as {{{{ or }}}}); {detail}")
    return None


# option (without ``data.``) -> (test, what it must be); shared by the CLI (on the parsed config, before any model
# loads) and RolloutDataModule.__init__ (a datamodule built in Python)
DATA_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    **{key: (lambda v: v >= 1, "an integer >= 1") for key in _AT_LEAST_ONE},
    "temperature": (lambda v: math.isfinite(v) and v >= MIN_TEMPERATURE,
                    f"a finite number >= {MIN_TEMPERATURE} (below it every sample of a group is the same)"),
    "max_eval_examples": (lambda v: v >= 1, "null (all) or an integer >= 1"),
    "top_p": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "type_mixture": (lambda v: all(math.isfinite(w) and w >= 0 for w in v.values()) and sum(v.values()) > 0,
                     "finite weights >= 0 with a positive sum"),
}


def data_problems(values: Mapping[str, Any]) -> list[str]:
    """What is wrong with the datamodule's settings ``values`` (option name -> value, unset optional ones None),
    as messages that name the option (``data.<name>``); empty when they are fine."""
    problems = [f"data.{key} must be {requirement}, got {values[key]!r}"
                for key, (ok, requirement) in DATA_RULES.items() if values.get(key) is not None and not ok(values[key])]
    instruction = values.get("instruction")
    if instruction is not None and (requirement := _template_problem(instruction)):
        problems.append(f"data.instruction must be {requirement}")
    return problems


DEFAULT_VAL = {"world_dev": "world/dev"}
DEFAULT_TEST = {"world_test": "world/test"}


def _source_key(source: QASpec) -> str:
    return source if isinstance(source, str) else f"<inline list {id(source)}>"


def read_stage_sources(stage: str, data: Mapping[str, Any], known: Mapping[str, list[QAExample]] | None = None,
                       ) -> dict[str, list[QAExample]]:
    """Read (and so check) every QA set ``stage`` reads, by source key, from the datamodule's settings ``data``
    (``train``, ``val``, ``test``, ``batch_size``, ``type_mixture``; unset val/test: the defaults); sets in
    ``known`` are not read again. For ``fit``, a ``data.batch_size`` larger than the training set is an error.

    Raises:
        DataFormatError: a malformed set (the message names file:line and field); ValueError: the batch size.
    """
    val = data.get("val") if data.get("val") is not None else DEFAULT_VAL
    test = data.get("test") if data.get("test") is not None else DEFAULT_TEST
    sources = {"fit": [data["train"], *val.values()], "validate": list(val.values())}.get(stage, list(test.values()))
    sets = dict(known or {})
    for source in sources:
        if _source_key(source) not in sets:
            sets[_source_key(source)] = load_qa(source)
    if stage == "fit" and data.get("type_mixture") is None:  # a mixture draws with replacement
        train_size, batch_size = len(sets[_source_key(data["train"])]), data["batch_size"]
        if batch_size > train_size:
            name = data["train"] if isinstance(data["train"], str) else "(inline list)"
            raise ValueError(f"data.batch_size ({batch_size}) is larger than the training set {name} "
                             f"({train_size} examples)")
    return sets


Engine = Literal["auto", "hf", "vllm"]


def policy_text(trajectory: Trajectory, tokenizer) -> str:
    """The text of the tokens the policy generated (observations and env messages left out)."""
    ids = [i for i, m in zip(trajectory.response_ids, trajectory.action_mask) if m]
    return tokenizer.decode(ids, skip_special_tokens=True)


class Score(NamedTuple):
    """What one trajectory scored: its ``answer`` (a multiple-choice one as the option letter it names, as written
    when it names none; None: no answer), its ``reward``, and ``choice``, the letter its multiple-choice answer was
    read as (None: no option named, or a free-text question)."""

    answer: str | None
    reward: float
    choice: str | None


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


class _PromptStream(IterableDataset):
    """An endless, seeded stream of training batches (:class:`ExampleBatch`), resumable by position.

    Epoch e is a permutation seeded by ``derive_seed(seed, "epoch", e)``; rank r of w processes takes every w-th
    batch. With
    ``mixture`` ({question type: weight}, types from ``metadata["type"]``), each batch slot instead draws a
    type by weight, then an example of that type, from an RNG seeded by ``seed`` and the batch position.
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


class RolloutDataModule(L.LightningDataModule):
    """Reads QA sets, builds prompts, and rolls out the module's current policy + retriever.

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
            iteration (1: filter without refilling). See :meth:`_sample_groups`.
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
        engine: Engine = "auto",
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
        if problems := data_problems(locals()):  # the arguments by name
            raise ValueError("; ".join(problems))
        if "{question}" not in choice_instruction or "{options}" not in choice_instruction:
            raise ValueError("data.choice_instruction must contain '{question}' and '{options}'")
        self.train_source = train
        # mirage:PATH names the five MIRAGE subsets: sets <name>/medqa, ... (see bridge_pl.data.medical)
        self.val_sources = expand_sets(val) if val is not None else dict(DEFAULT_VAL)
        self.test_sources = expand_sets(test) if test is not None else dict(DEFAULT_TEST)
        self.max_eval_examples = max_eval_examples
        self.batch_size, self.n_samples, self.eval_batch_size = batch_size, n_samples, eval_batch_size
        self.filter_groups, self.max_sampling_rounds = filter_groups, max_sampling_rounds
        self.type_mixture = type_mixture
        self.engine_args = dict(
            max_turns=max_turns, max_new_tokens_per_turn=max_new_tokens_per_turn,
            max_response_tokens=max_response_tokens, temperature=temperature, top_p=top_p,
        )
        self.engine_name, self.vllm_config = require_choice("data.engine", engine, Engine), vllm
        self.env_config = env or EnvConfig()
        self.reward = reward or ExactMatchReward()
        self.instruction, self.use_chat_template, self._seed = instruction, use_chat_template, seed
        self.choice_instruction = choice_instruction
        self.consumed = 0  # training batches generated so far (the resumable data position)
        self._sets: dict[str, list[QAExample]] = {}
        self._engine: MultiTurnEngine | None = None
        self._generator: torch.Generator | None = None
        self._generator_state: torch.Tensor | None = None  # restored from a checkpoint, applied lazily

    @property
    def seed(self) -> int:
        """``data.seed``, or the seed Lightning's ``seed_everything`` set for this run (0 without one)."""
        return self._seed if self._seed is not None else int(os.environ.get("PL_GLOBAL_SEED", 0))

    # ---- data -----------------------------------------------------------------------------------
    def load(self, source: QASpec, limit: int | None = None) -> list[QAExample]:
        key = _source_key(source)
        if key not in self._sets:
            self._sets[key] = load_qa(source)
        return self._sets[key][:limit] if limit is not None else self._sets[key]

    def load_sources(self, stage: str, preloaded: Mapping[str, list[QAExample]] | None = None) -> None:
        """Load (and so check) every QA set ``stage`` (``fit``, ``validate``, ``test``, ``predict``) reads;
        ``preloaded``: sets :func:`read_stage_sources` read already."""
        self._sets.update(preloaded or {})
        settings = {"train": self.train_source, "val": self.val_sources, "test": self.test_sources,
                    "batch_size": self.batch_size, "type_mixture": self.type_mixture}
        self._sets.update(read_stage_sources(stage, settings, self._sets))

    def _stream(self) -> _PromptStream:
        trainer = self.trainer
        rank, world = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
        return _PromptStream(self.load(self.train_source), self.batch_size, self.seed, self.consumed, rank, world,
                             self.type_mixture)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self._stream(), batch_size=None)

    def _eval_loaders(self, sources: dict[str, str]) -> list[DataLoader]:
        return [
            DataLoader(self.load(src, self.max_eval_examples), batch_size=self.eval_batch_size,
                       collate_fn=ExampleBatch)
            for src in sources.values()
        ]

    def val_dataloader(self) -> list[DataLoader]:
        return self._eval_loaders(self.val_sources)

    def test_dataloader(self) -> list[DataLoader]:
        return self._eval_loaders(self.test_sources)

    def predict_dataloader(self) -> list[DataLoader]:
        return self._eval_loaders(self.test_sources)

    def teardown(self, stage: str) -> None:
        if self._engine is not None:
            self._engine.close()

    def state_dict(self) -> dict:
        """The data position and the sampling generator's state (saved in checkpoints)."""
        state: dict = {"consumed": self.consumed}
        generator = self._generator.get_state() if self._generator is not None else None
        generators = gather_per_rank(generator)  # every rank samples with its own generator
        if any(g is not None for g in generators):
            state["generator"] = generators
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        self.consumed = int(state_dict["consumed"])
        self._generator_state = this_ranks(state_dict.get("generator"))

    # ---- prompts --------------------------------------------------------------------------------
    def prompt_ids(self, tokenizer, question: str, options: dict[str, str] | None = None) -> list[int]:
        """Token ids of the prompt for ``question`` (chat-templated when the tokenizer has a template); with
        ``options`` (``{letter: text}``) the multiple-choice template, which lists them."""
        tags = self.env_config.tag_names()
        if options:
            text = self.choice_instruction.format(question=question, options=options_text(options), **tags)
        else:
            text = self.instruction.format(question=question, **tags)
        if self.use_chat_template and getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
            )
            return tokenizer(text, add_special_tokens=False)["input_ids"]
        return tokenizer(text)["input_ids"]

    # ---- rollouts -------------------------------------------------------------------------------
    def _stage_name(self, dataloader_idx: int) -> tuple[str, bool]:
        """(dataset name, training?) for the batch being transferred."""
        trainer = self.trainer
        if trainer.training:
            return "train", True
        sources = self.val_sources if (trainer.validating or trainer.sanity_checking) else self.test_sources
        return list(sources)[dataloader_idx], False

    def transfer_batch_to_device(self, batch: ExampleBatch, device, dataloader_idx: int) -> ExampleBatch:
        return batch  # plain examples stay on the host; the rollout below lands on the device

    def on_after_batch_transfer(self, batch: ExampleBatch, dataloader_idx: int) -> RolloutBatch:
        dataset, training = self._stage_name(dataloader_idx)
        module = self.trainer.lightning_module
        # the steps' precision context (bf16-mixed: autocast), which Lightning opens only around the steps
        with self.trainer.precision_plugin.forward_context():
            rollout = self.rollout(module, batch, training=training, dataset=dataset)
        if training:
            self.consumed += 1
        return move_data_to_device(rollout, module.device)

    def rollout(self, module: RolloutAgent, examples: Sequence[QAExample], training: bool, dataset: str
                ) -> RolloutBatch:
        """Generate trajectories for ``examples`` with ``module``'s current policy and retriever.

        Training: ``n_samples`` sampled trajectories per prompt with Plackett-Luce retrieval (and, with
        ``filter_groups``, dynamic sampling: see :meth:`_sample_groups`); else greedy generation with
        deterministic top-k retrieval. A training batch's ``sampling`` stats include ``seconds``, the wall time
        of the whole rollout (generation, rewards, LM-credit sequences).
        """
        start = time.perf_counter()
        examples = list(examples)
        if training:
            trajectories, per_traj, scores, sampling = self._sample_groups(module, examples)
        else:
            trajectories = self._generate(module, examples, training=False)
            per_traj = [examples[t.prompt_index] for t in trajectories]
            scores, sampling = self._score(module, trajectories, per_traj), {}
        tokenizer = module.policy.tokenizer
        policy_version, retriever_version = module.versions()
        batch = RolloutBatch.from_trajectories(
            trajectories,
            pad_token_id=tokenizer.pad_token_id,
            answers=[score.answer for score in scores],
            rewards=[score.reward for score in scores],
            choices=[score.choice for score in scores],
            golds=[ex.golden_answers for ex in per_traj],
            questions=[ex.question for ex in per_traj],
            example_ids=[ex.id for ex in per_traj],
            metadata=[ex.metadata for ex in per_traj],
            policy_version=policy_version,
            retriever_version=retriever_version,
            dataset=dataset,
            sampling=sampling,
            temperature=self.engine_args["temperature"] if training else 1.0,
        )
        if training and module.credit_queries() > 0:
            self._add_credit_sequences(batch, trajectories, per_traj, module, tokenizer)
        if training:
            batch.sampling["seconds"] = time.perf_counter() - start
        return batch

    def _generate(self, module: RolloutAgent, examples: list[QAExample], training: bool) -> list[Trajectory]:
        """Roll out the policy on ``examples``: ``n_samples`` sampled trajectories each, or one greedy."""
        policy = module.policy
        tokenizer = policy.tokenizer
        if self._engine is None:
            self._engine = self._build_engine(SearchEnv(self.env_config, tokenizer), policy)
            self._generator = torch.Generator(device=module.device).manual_seed(
                derive_seed(self.seed, "rollout", self.trainer.global_rank if self.trainer else 0)
            )
            if self._generator_state is not None:
                self._generator.set_state(self._generator_state)
        return self._engine.rollout(
            policy, [self.prompt_ids(tokenizer, ex.question, ex.metadata.get("options")) for ex in examples],
            search_fn=lambda queries: module.retrieve(queries, stochastic=training, generator=self._generator),
            n_samples=self.n_samples if training else 1, greedy=not training, generator=self._generator,
        )

    def _build_engine(self, env: SearchEnv, policy) -> MultiTurnEngine:
        """The ``data.engine`` backend; ``auto`` tries vLLM (one process, where it imports) and falls back to hf.
        In a run of several processes each rank builds its own engine (``vllm``) at its first rollout, together."""
        engine = self._vllm_engine(env, policy) if self._wants_vllm() else RolloutEngine(env, **self.engine_args)
        rank_zero_info(f"data.engine: rollouts generate with the {engine.name} backend")
        return engine

    def _wants_vllm(self) -> bool:
        single = self.trainer is None or self.trainer.world_size == 1
        return self.engine_name == "vllm" or (self.engine_name == "auto" and single and vllm_available())

    def _vllm_engine(self, env: SearchEnv, policy) -> MultiTurnEngine:
        """A vLLM backend, built and synced now; under ``auto`` the hf backend when vLLM cannot run the policy."""
        engine = VLLMRolloutEngine(env, **self.engine_args, config=self.vllm_config, seed=self.seed)
        try:
            engine.sync(policy)
        except Exception as error:
            engine.close()
            if self.engine_name == "vllm":
                raise
            rank_zero_warn(f"data.engine=auto: vLLM could not run this policy ({type(error).__name__}: "
                           f"{str(error).splitlines()[0] if str(error) else ''}); generating with hf")
            return RolloutEngine(env, **self.engine_args)
        return engine

    def _score(self, module: RolloutAgent, trajectories: list[Trajectory], per_traj: list[QAExample]
    ) -> list[Score]:
        """A :class:`Score` per trajectory, from one decode of what the policy wrote (env messages quote the answer
        tags too, so they are left out). A multiple-choice answer is read once, here, as an option letter (its
        ``choice``); the reward, the metrics and the predictions files all score that letter."""
        tokenizer = module.policy.tokenizer
        tags = dict(open_tag=self.env_config.open_tag("answer"), close_tag=self.env_config.close_tag("answer"))
        scores = []
        for trajectory, ex in zip(trajectories, per_traj):
            text = policy_text(trajectory, tokenizer)
            answer = extract_answer(text, **tags)
            if options := ex.metadata.get("options"):
                letter = choice_letter(answer, options)
                scores.append(Score(letter or answer, choice_scores(letter, ex.golden_answers)["em"], letter))
            else:
                scores.append(Score(answer, self.reward(text, ex.golden_answers), None))
        return scores

    def _sample_groups(self, module: RolloutAgent, examples: list[QAExample]):
        """The training groups: ``(trajectories, example per trajectory, Score per trajectory, stats)``.

        Without ``filter_groups``: one group of ``n_samples`` per prompt. With it (DAPO's dynamic sampling):
        groups whose rewards are all equal carry no GRPO signal and are dropped; while fewer than
        ``batch_size`` groups are kept, ``batch_size`` fresh training prompts are drawn (seeded by the data
        position and the round, so resumes repeat them) and sampled, for at most ``max_sampling_rounds``
        rounds. If no group has signal, the first round is kept as it is (the θ step is then skipped, the
        retriever still learns). Stats: ``sampled_groups``, ``sampled_groups_with_signal`` (share, before
        filtering), ``sampling_rounds``.
        """
        kept: list[list[tuple[Trajectory, QAExample, Score]]] = []
        first: list[list[tuple[Trajectory, QAExample, Score]]] = []
        sampled = with_signal = rounds = 0
        prompts = examples
        while True:
            trajectories = self._generate(module, prompts, training=True)
            per_traj = [prompts[t.prompt_index] for t in trajectories]
            scores = self._score(module, trajectories, per_traj)
            groups: dict[int, list[tuple[Trajectory, QAExample, Score]]] = {}
            for item in zip(trajectories, per_traj, scores):
                groups.setdefault(item[0].prompt_index, []).append(item)
            rounds += 1
            sampled += len(groups)
            signal = [g for g in groups.values() if len({score.reward for _, _, score in g}) > 1]
            with_signal += len(signal)
            first = first or list(groups.values())
            if not self.filter_groups:
                kept = list(groups.values())
                break
            kept += signal
            if len(kept) >= self.batch_size or rounds >= self.max_sampling_rounds:
                break
            prompts = self._stream().draw_share(random.Random(derive_seed(self.seed, "refill", self.consumed, rounds)))
        if self.filter_groups:
            kept = kept[: self.batch_size] or first
        flat = [(replace(t, prompt_index=g), ex, r) for g, group in enumerate(kept) for t, ex, r in group]
        stats = {"sampled_groups": float(sampled), "sampled_groups_with_signal": with_signal / max(1, sampled),
                 "sampling_rounds": float(rounds)}
        return [t for t, _, _ in flat], [ex for _, ex, _ in flat], [r for _, _, r in flat], stats

    def _add_credit_sequences(
        self, batch: RolloutBatch, trajectories: list[Trajectory], examples: list[QAExample], module: RolloutAgent,
        tokenizer,
    ) -> None:
        """For up to ``credit_queries`` search calls, the packed LM-credit sequence (docs/method.md section 2).

        Context = the prompt and the trajectory up to this search's observation (earlier observations kept);
        one branch per candidate slot = an observation holding only that candidate, then the answer open tag;
        target = the first gold answer, or on a multiple-choice question the gold option's text (its tokens alone
        are scored: a passage can support the text, while the letter is only its place in the prompt's list).
        """
        S = batch.search_traj.numel()
        if S == 0:
            return
        rng = random.Random(derive_seed(self.seed, "credit", self.consumed))
        chosen = sorted(rng.sample(range(S), min(S, module.credit_queries())))
        calls = [(t, call) for t, traj in enumerate(trajectories) for call in traj.searches]
        env, tags = self._engine.env, self.env_config

        def ids(text: str) -> list[int]:
            return tokenizer(text, add_special_tokens=False)["input_ids"]

        answer_open = ids(tags.open_tag("answer"))
        sequences = []
        for s in chosen:
            t, call = calls[s]
            traj = trajectories[t]
            prefix = traj.prompt_ids + traj.response_ids[: call.position]
            branches = [
                ids(env.observation([module.passage(row)])) + answer_open if row >= 0 else answer_open
                for row in batch.search_candidates[s].tolist()
            ]
            sequences.append(BranchedSequence(prefix, branches, ids(f" {examples[t].gold_text}")))
        batch.credit_searches = torch.tensor(chosen, dtype=torch.long)
        batch.credit_sequences = sequences
