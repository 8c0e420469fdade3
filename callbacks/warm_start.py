"""``WarmStart``: a short supervised phase on search demonstrations before RL (see bridge_pl.demonstrations)."""

from __future__ import annotations

import random
import time
from typing import ClassVar, Literal

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info
from tqdm.auto import tqdm

from bridge_pl.config import UNIT_INTERVAL, Rule, raise_problems, require_choice, rule_problems
from bridge_pl.demonstrations import demonstration_segments, sft_loss, tokenize_demonstration
from bridge_pl.distributed import average_replicated_grads, is_sharded
from bridge_pl.policy import length_sorted_groups
from bridge_pl.rollout.env import SearchEnv
from bridge_pl.seeding import derive_seed
from bridge_pl.terminal import plain_line, stdout_is_terminal

ChoiceAnswer = Literal["letter", "text"]


class WarmStart(L.Callback):
    """Supervised steps on demonstrations built from the training set, run once at the start of ``fit``.

    Skipped when the run resumes from a checkpoint (the warm-started weights are in it).

    Args:
        steps: optimizer steps. batch_size: demonstrations per step. lr: AdamW learning rate.
        noise: probability that a demonstration's hop query is replaced by a weaker one (the raw question, or
            the hop's entity alone when the raw question was searched already; ``bridge_pl.demonstrations``).
        source: QA source of the demonstrations (default: the datamodule's training set).
        seed: seeds which examples are used and the noise (None, the default: the datamodule's seed).
        evaluate: measure greedy EM on the validation sets after the warm start, and before it unless
            ``evaluate_before`` is False (printed and logged as ``warm_start/{before,after}/<dataset>/em``), so the
            run shows what RL adds on top; at the end of ``fit`` one line per dataset sums up (before /) after the
            warm start / last validation.
        evaluate_before: with ``evaluate``, also measure before the warm start (False: after it only, one
            evaluation less; the summary then starts at the warm-started policy).
        choice_answer: what a multiple-choice demonstration answers: ``"letter"`` (the gold letter, as the
            prompt's example shows) or ``"text"`` (the gold option's text, which answer extraction maps to its
            letter; for a policy too small to map the evidence to a letter: ``configs/world_mc.yaml``).
        save_to: folder to save the warm-started policy in (peft layout; rank 0), so later runs can start
            from it with ``policy.adapter`` instead of repeating the warm start.
    """

    RULES: ClassVar[dict[str, Rule]] = {"noise": UNIT_INTERVAL}

    def __init__(
        self, steps: int = 50, batch_size: int = 8, lr: float = 1e-3, noise: float = 0.3,
        source: str | None = None, seed: int | None = None, grad_clip: float = 1.0, evaluate: bool = True,
        evaluate_before: bool = True, choice_answer: ChoiceAnswer = "letter", save_to: str | None = None,
    ) -> None:
        require_choice("WarmStart.choice_answer", choice_answer, ChoiceAnswer)
        raise_problems(rule_problems("WarmStart", locals(), self.RULES))  # the arguments by name
        self.steps, self.batch_size, self.lr, self.noise = steps, batch_size, lr, noise
        self.source, self.seed, self.grad_clip, self.evaluate = source, seed, grad_clip, evaluate
        self.evaluate_before, self.choice_answer, self.save_to = evaluate_before, choice_answer, save_to
        self.em: dict[str, dict[str, float]] = {}  # "before"/"after" -> dataset -> EM
        self.accuracy: dict[str, dict[str, float]] = {}  # the same, multiple-choice questions' accuracy

    def _evaluate(self, trainer: L.Trainer, pl_module, when: str) -> None:
        """Greedy EM on every validation set, with the module's current policy and retriever."""
        data = trainer.datamodule
        self.em[when] = {}
        # the forwards run in the steps' precision context (bf16-mixed: autocast), which Lightning opens only around
        # its own steps: the EM after the warm start is step 0 of the val/<dataset>/em curve
        with trainer.precision_plugin.forward_context():
            results = data.evaluate(pl_module)
        for name, result in results.items():
            values = {key: result[key] for key in ("em", "accuracy") if key in result}
            self.em[when][name] = values["em"]
            if "accuracy" in values:  # multiple-choice questions: their accuracy, as val/<name>/accuracy
                self.accuracy.setdefault(when, {})[name] = values["accuracy"]
            if trainer.logger is not None:
                metrics = {f"warm_start/{when}/{name}/{key}": value for key, value in values.items()}
                if when == "after":  # the first point of the val/<name>/em curve: RL starts here (step 0)
                    metrics.update({f"val/{name}/{key}": value for key, value in values.items()})
                trainer.logger.log_metrics(metrics, step=0)
            shown = ", ".join(f"{key} {value:.3f}" for key, value in values.items())
            rank_zero_info(f"WarmStart: {name} {when} warm start: {shown} ({result['questions']:.0f} questions, "
                           f"{result['multiple_choice']:.0f} multiple choice)")

    def on_fit_start(self, trainer: L.Trainer, pl_module) -> None:
        if trainer.ckpt_path is not None or trainer.global_step > 0:
            rank_zero_info("WarmStart: resuming from a checkpoint, warm start skipped")
            return
        if self.evaluate and self.evaluate_before:
            self._evaluate(trainer, pl_module, "before")
        data = trainer.datamodule
        policy = pl_module.policy
        tokenizer = policy.tokenizer
        env = SearchEnv(data.collector.prompts.env, tokenizer)
        examples = data.load(self.source or data.train_source)
        seed = self.seed if self.seed is not None else data.seed
        rng = random.Random(derive_seed(seed, "warm_start", trainer.global_rank))
        params = policy.trainable_parameters()
        optimizer = torch.optim.AdamW(params, lr=self.lr)
        was_training = policy.training
        policy.train()
        plain = not stdout_is_terminal()  # a log file gets one line per step instead of a bar
        bar = tqdm(range(self.steps), desc="warm start", disable=plain or not trainer.is_global_zero)
        started = time.perf_counter()
        for step in bar:
            demos = []
            for example in rng.sample(examples, self.batch_size):
                segments = demonstration_segments(
                    example, env, lambda qs: pl_module.retrieve(qs, stochastic=False), rng, self.noise,
                    self.choice_answer,
                )
                prompt = data.collector.prompts.ids(tokenizer, example.question, example.metadata.get("options"))
                demos.append(tokenize_demonstration(prompt, segments, tokenizer))
            optimizer.zero_grad(set_to_none=True)
            loss = self._accumulate_loss(trainer, pl_module, demos)
            average_replicated_grads(params)  # keep the ranks' weights identical (FSDP2 shards are reduced already)
            torch.nn.utils.clip_grad_norm_(params, self.grad_clip)
            optimizer.step()
            bar.set_postfix(loss=f"{loss:.3f}")
            if plain:
                plain_line(f"WarmStart: step {step + 1}/{self.steps}, loss {loss:.3f}, "
                           f"{time.perf_counter() - started:.1f} s")
                started = time.perf_counter()
            if trainer.logger is not None:
                trainer.logger.log_metrics({"warm_start/loss": loss}, step=step)
        policy.train(was_training)
        policy.rebase_reference()  # RL's KL term pulls towards the warm-started policy, not the base model
        rank_zero_info(f"WarmStart: {self.steps} supervised steps done (last loss {loss:.3f}); "
                       "the warm-started policy is the KL reference from here on")
        if self.save_to is not None:  # every rank: a sharded adapter is gathered first; rank 0 writes
            policy.save_adapter(self.save_to)
            rank_zero_info(f"WarmStart: warm-started policy saved in {self.save_to}")
        if self.evaluate:
            self._evaluate(trainer, pl_module, "after")

    def on_fit_end(self, trainer: L.Trainer, pl_module) -> None:
        """Print each validation set's EM before the warm start (when measured), after it, and at the last
        validation, and the gain of each phase."""
        for name, after in self.em.get("after", {}).items():
            final = trainer.callback_metrics.get(f"val/{name}/em")
            if final is not None:
                rank_zero_info(self._summary(f"{name} EM", self.em.get("before", {}).get(name), after, float(final),
                                             trainer.global_step))
            accuracy = trainer.callback_metrics.get(f"val/{name}/accuracy")
            if accuracy is not None and name in self.accuracy.get("after", {}):
                rank_zero_info(self._summary(f"{name} multiple-choice accuracy",
                                             self.accuracy.get("before", {}).get(name), self.accuracy["after"][name],
                                             float(accuracy), trainer.global_step))

    @staticmethod
    def _accumulate_loss(trainer: L.Trainer, pl_module, demos: list) -> float:
        """Backward of the demonstrations' mean NLL, one group of at most ``model.rl.micro_batch_tokens`` tokens
        (rows x padded width) at a time, so the warm start's activations are bounded as the update's are; the
        batch's mean loss is returned. A sharded (FSDP2) policy reduces its gradients in every backward, so
        there every rank runs its batch as one group: the ranks' group counts could differ."""
        policy = pl_module.policy
        tokens = sum(sum(demo.loss_mask) for demo in demos)
        lengths = [len(d.input_ids) for d in demos]
        budget = len(lengths) * max(lengths) if is_sharded(policy.model) else pl_module.rl_config.micro_batch_tokens
        loss = 0.0
        for group in length_sorted_groups(lengths, budget):
            with trainer.precision_plugin.forward_context():  # the forward only, as in Lightning's steps
                part = sft_loss(policy, [demos[i] for i in group], normalizer=tokens)
            part.backward()
            loss += part.item()
        return loss

    @staticmethod
    def _summary(what: str, before: float | None, after: float, final: float, step: int) -> str:
        """The end-of-fit line: ``what`` before the warm start (when measured), after it and after RL, and what
        each phase added."""
        if before is None:
            return (f"WarmStart: {what} {after:.3f} after the warm start -> {final:.3f} after RL (step {step}): "
                    f"RL {final - after:+.3f}")
        return (f"WarmStart: {what} {before:.3f} before the warm start -> {after:.3f} after it -> {final:.3f} after "
                f"RL (step {step}): warm start {after - before:+.3f}, RL {final - after:+.3f}")
