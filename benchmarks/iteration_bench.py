"""Time and peak memory of one training iteration per mode, split by phase, against floors from the same run.

One iteration is what ``BridgeModule.training_step`` runs on a freshly generated batch, built the way the real
CLI builds it (``BridgeCLI(..., run=False)``: the config's module and data module; no trainer loop, so no
callback such as ``WarmStart`` runs)::

    batch = datamodule.rollout(module, examples, training=True, dataset="train")
    problem = module.problem(batch)
    module.solver.step(problem, updates)

Warm start: a config with a ``WarmStart`` callback (the demo's) first runs it once, in its own subprocess, and every
later process starts from the saved adapter (``--model.policy.init_args.adapter``), so the measured iteration is
one of a policy that searches (an untrained SmolLM2 makes no search, and then LM credit and the retriever steps
have nothing to do). The adapter is kept in ``runs/iteration_bench/warm_<config>_seed<seed>/adapter`` and reused
by later runs (the warm start is seeded; delete the folder to redo it); ``rollout_bench.py`` can start from it too
(``--model.policy.init_args.adapter=...``). ``--adapter PATH`` starts from a saved adapter instead;
``--no-warm-start`` from the config's policy as it is.

Each mode runs in its own subprocess (fresh allocator) with the same config and seed, so every mode sees the same
prompts (the first batch of the seeded training stream) and, from the same initial weights, the same rollout (the
fingerprint of the batch's token ids is printed to show it).

Phases (each method is wrapped with ``time.perf_counter`` in the benchmark process; a phase called inside another
one counts for the innermost, so nothing is counted twice):

- rollout: ``RolloutDataModule.rollout`` (generation, searches, the LM-credit input sequences);
- reference: ``BatchLosses._reference_logprobs`` (the KL reference forward);
- LM credit: ``BatchLosses._lm_scores``, every call (construction, ``refresh_teacher``, ``lower_loss`` with a live
  teacher);
- policy update: the solver's θ step (``Solver._policy_steps``: building the extra loss terms, e.g. ``implicit``'s
  hypergradient correction, and the θ ``ParamUpdate.step_parts``: forward and backward of the policy-loss parts and
  of the correction parts, clipping, the optimizer step), and the no-grad π_old forward of mini-batches 2..M
  (``BatchLosses._fill_old_logprobs``, at construction; with ``model.rl.minibatches`` > 1);
- coupling (``bridge``): the coupling terms of the θ step, taken out of the policy update so that it compares with
  the update floor: building each part of ``BatchLosses.coupling_loss_parts`` (its weights; ℓ_θ's forward when
  the LM-credit graph was not kept) and the policy update's backward of that part, through the LM-credit forward
  (whose own time is LM credit's);
- retriever steps: the φ and ψ ``ParamUpdate`` steps and the retriever losses ``lower_loss`` and
  ``retriever_upper_loss``, wherever they are called (also inside ``implicit``'s θ hypergradient);
- other: the rest of the iteration (advantages, log P_φ of the shown lists at construction, solver glue).

Memory: a background thread samples the process RSS (psutil, every 5 ms) and charges each sample to the innermost
phase running; on Linux the kernel's RSS high-water mark is also read and reset at every phase boundary, so short
peaks between samples are not missed. A phase's peak is its highest RSS minus the baseline RSS taken after setup
(models loaded, index built, optimizers built, the warm-up below done, freed heap returned to the OS).

RSS is what the process holds, not what its tensors hold: glibc raises its mmap threshold after large frees, then
carves tensors below it from a heap that keeps what is freed, so with the default allocator a phase's peak includes
memory freed by the phases before it (the demo's policy update alone: 2.0-2.7 GB held for 0.56 GB of live tensors).
``--pin-malloc`` sets ``MALLOC_MMAP_THRESHOLD_=131072`` in the children: RSS then follows the live tensors and
per-phase peaks compare across modes, but every large allocation pays fresh page faults (that update: +44-72% time
at a 1-4 MiB threshold), so that run's times are to be compared only with each other.

Warm-up: before the baseline, one *greedy* rollout of a single prompt through the same data module. It pays the
once-per-run costs (the engine's stop-token table, first-call kernel setup), which would otherwise land in the
measured rollout of whichever process runs it, and it consumes no randomness (greedy decoding and top-k
retrieval), so the measured rollout is exactly the one a fresh run would generate. No warm-up *iteration*: the
first backward and optimizer step are measured as they come, in every mode and in the update floor alike.

Steady-state adjustments (off with ``--as-is``): at a fresh start the KL reference equals the policy (a fresh
LoRA adapter, or the snapshot taken by a warm start), so the first iteration skips the reference pass that every
later iteration runs; here the reference snapshot is made to differ slightly from the adapter, so the pass runs
(the rollout and the policy are untouched). And when no group of the batch has differing rewards (an untrained
policy answers nothing right) the solver would skip the θ update; then the rewards are replaced by 0/1 alternating
within each group (same batch in every mode), so the update runs. The output says which applied.

Floors, in their own subprocess with the same config and seed, which regenerates the ``frozen`` batch:

- generate: one single-turn ``policy.model.generate`` (sampling, no search) for the batch's rows from the same
  prompts, with ``min_new_tokens = max_new_tokens`` = the mean number of policy-sampled tokens per trajectory;
- update: one forward + backward over the batch's tokens, ``(policy(ids, attn)[0] * action_mask).sum().backward()``,
  over the micro-batches the update uses (rows of similar length under ``model.rl.micro_batch_tokens``; one forward
  over the whole padded batch took twice the update's time), with ``score_mask=action_mask`` so the LM head runs
  only on the tokens the sum reads (same value and gradients; without it the head runs on every token, which on a
  small model with a large vocabulary costs more than the whole RL update and would be no floor). The report
  gives each mode's policy-update phase over this floor.

The update floor's matmul throughput ("MFU" on a CPU: achieved over what the same GEMMs reach here), in the
floors process after the floors:

- FLOPs (``update_flops``) from the model config and the micro-batches' real shapes: per micro-batch, rows x
  padded width, less the shared prefix, which the policy's forward runs once as one row
  (``Policy._shared_prefix_length``); per position and block the linear layers (q, k, v, o, gate, up, down for
  SmolLM2) and their LoRA A and B, attention's scores and values over the whole (masked) width, and the LM head on
  the scored tokens only. An ``[m, k] x [k, n]`` product is ``2 m k n``. Backward: a frozen base weight (and the
  tied LM head) needs its input's gradient only, one more product of the same size; LoRA's A and B also their
  weight gradients; attention both operands' gradients. Recomputation (the checkpointed LM-head chunks) is
  reported, not counted;
- the GEMM rate (``gemm_rate``) on the same shapes in the same process: each linear layer's forward
  ``[m, k] x [n, k]^T`` and input-gradient ``[m, n] x [n, k]`` at the micro-batch's m (the prefix row and the
  remainders), and the LM head's per log-prob chunk, as ``torch.mm`` in the policy's dtype and in bfloat16
  (random inputs; two warm-up calls, then the median of three blocks of >= 50 ms per shape), added up as often as
  the update runs each shape;
- printed: the update's FLOPs and seconds, achieved GFLOP/s, the GEMM GFLOP/s per dtype, and achieved / GEMM.
  ``--profile`` also runs one micro-batch's forward + backward under ``torch.profiler``: self CPU time by kind of
  op (matmul, SDPA, softmax, copies / casts, indexing, elementwise) and the top ops.

Usage (timings need an otherwise idle machine)::

    python benchmarks/iteration_bench.py                                   # configs/demo.yaml, a few minutes
    python benchmarks/iteration_bench.py --config configs/smoke.yaml --threads 1 --json /tmp/it.json
    python benchmarks/iteration_bench.py --modes frozen bridge --override --model.retrieval.credit_queries=4
    python benchmarks/iteration_bench.py --modes frozen --profile                   # + where the update's time goes
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import NamedTuple

from bridge_pl.memory import release_heap, reset_peak, status_kb

ROOT = Path(__file__).resolve().parents[1]
MODES = ("frozen", "retriever_first", "bridge", "implicit")
PHASES = ("rollout", "reference", "lm_credit", "policy_update", "coupling", "retriever_steps", "other")
LABELS = {
    "rollout": "rollout (generate + search + LM-credit inputs)",
    "reference": "reference log-probs",
    "lm_credit": "LM credit (ℓ_θ forward, all calls)",
    "policy_update": "policy update (θ policy-loss fwd/bwd + correction + step)",
    "coupling": "coupling (ℓ_θ backward in the θ step)",
    "retriever_steps": "retriever steps (φ/ψ steps + their losses)",
    "other": "other (advantages, P_φ of shown lists, glue)",
}
SAMPLE_S = 0.005


# ---- arguments -----------------------------------------------------------------------------------
def parse_args(argv: list[str]) -> argparse.Namespace:
    # ``--override --model.x=1``: the value starts with "--", which argparse would read as an option; take the
    # pairs out first.
    overrides, rest, i = [], [], 0
    while i < len(argv):
        if argv[i] == "--override" and i + 1 < len(argv):
            overrides.append(argv[i + 1])
            i += 2
            continue
        if argv[i].startswith("--override="):
            overrides.append(argv[i].split("=", 1)[1])
        else:
            rest.append(argv[i])
        i += 1
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(ROOT / "configs/demo.yaml"), help="bridge-pl config")
    parser.add_argument("--modes", nargs="+", default=list(MODES), help="modes to measure (ratios are to frozen)")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                        help="torch CPU threads (default: all cores)")
    parser.add_argument("--seed", type=int, help="sets seed_everything and data.seed (default: the config's)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--pin-malloc", action="store_true",
                        help="MALLOC_MMAP_THRESHOLD_=131072 in the children: RSS follows live tensors (slower; doc)")
    parser.add_argument("--as-is", action="store_true",
                        help="measure the first iteration exactly as a fresh run has it (no steady-state adjustments)")
    parser.add_argument("--override", metavar="ARG", help="a CLI override, e.g. --override "
                        "--model.retrieval.candidates=4 (repeatable)")
    parser.add_argument("--adapter", help="start every process from this saved policy adapter (no warm start)")
    parser.add_argument("--no-warm-start", action="store_true", help="do not run the config's WarmStart first")
    parser.add_argument("--profile", action="store_true",
                        help="torch.profiler over one micro-batch of the update floor: time by kind of op")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # internal: a mode, "floors" or "warm"
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    parser.add_argument("--warm-out", help=argparse.SUPPRESS)  # internal: where the warm child saves the adapter
    args = parser.parse_args(rest)
    args.override = overrides
    args.config = str(Path(args.config).resolve())  # the children run in the repository root
    if "frozen" in args.modes:  # frozen first: the other modes' ratios need it
        args.modes = ["frozen"] + [m for m in args.modes if m != "frozen"]
    return args


def child_argv(args: argparse.Namespace, child: str, out: str) -> list[str]:
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", child, "--child-out", out,
            "--config", args.config, "--threads", str(args.threads)]
    if args.seed is not None:
        argv += ["--seed", str(args.seed)]
    for flag in ("as_is", "pin_malloc", "profile"):
        if getattr(args, flag):
            argv.append("--" + flag.replace("_", "-"))
    for override in args.override:
        argv += ["--override", override]
    return argv


# ---- phases: time and memory ---------------------------------------------------------------------
class PhaseClock:
    """Exclusive time per phase (a nested phase's time is taken out of its caller's) and peak RSS per phase."""

    def __init__(self) -> None:
        import psutil

        self.process = psutil.Process()
        self.time = dict.fromkeys(PHASES, 0.0)
        self.calls = dict.fromkeys(PHASES, 0)
        self.peak = dict.fromkeys(PHASES, 0)  # bytes of RSS
        self.total = 0.0
        self.stack: list[list] = []  # [phase, start, seconds spent in nested phases]
        self.measuring = False
        self._hwm = _reset_hwm()  # whether the kernel's high-water mark can be reset
        self._lock = threading.Lock()  # the sampler thread and phase boundaries both update the peaks

    def current(self) -> str | None:
        return self.stack[-1][0] if self.stack else ("other" if self.measuring else None)

    def note(self, phase: str | None, rss: int) -> None:
        if phase is None:
            return
        with self._lock:
            self.peak[phase] = max(self.peak[phase], rss)

    def boundary(self) -> None:
        """Charge the high-water mark since the last boundary to the phase that ran until now."""
        if self._hwm:
            self.note(self.current(), _status_kb("VmHWM") * 1024)
            _reset_hwm()

    @contextlib.contextmanager
    def measure(self):
        """A measured stretch of the iteration (its time counts in the total; unphased time is 'other')."""
        self.boundary()
        self.measuring, start = True, time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - start
            self.boundary()
            self.measuring = False
            self.total += elapsed

    @contextlib.contextmanager
    def phase(self, name: str):
        self.boundary()
        self.stack.append([name, time.perf_counter(), 0.0])
        self.calls[name] += 1
        try:
            yield
        finally:
            self.boundary()
            _, start, nested = self.stack.pop()
            elapsed = time.perf_counter() - start
            self.time[name] += elapsed - nested
            if self.stack:
                self.stack[-1][2] += elapsed

    def wrap(self, owner, attr: str, name: str) -> None:
        """Replace ``owner.attr`` (a class or an instance) by a version timed as phase ``name``."""
        fn = getattr(owner, attr, None)
        if fn is None:
            warnings.warn(f"iteration_bench: {owner!r} has no '{attr}'; phase '{name}' misses it", stacklevel=2)
            return

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            with self.phase(name):
                return fn(*args, **kwargs)

        setattr(owner, attr, timed)


class RssSampler:
    """A daemon thread charging the process RSS every ``SAMPLE_S`` to the phase running at that moment."""

    def __init__(self, clock: PhaseClock) -> None:
        self.clock, self.stop = clock, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            phase = self.clock.current()
            self.clock.note(phase, self.clock.process.memory_info().rss)
            self.stop.wait(SAMPLE_S)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


_status_kb, _reset_hwm = status_kb, reset_peak  # bridge_pl.memory: /proc/self/status, /proc/self/clear_refs


def settle() -> int:
    """Collect garbage, return freed heap to the OS (``bridge_pl.memory.release_heap``); the RSS (bytes) after."""
    import psutil

    release_heap()
    return psutil.Process().memory_info().rss


# ---- building ------------------------------------------------------------------------------------
def build(args: argparse.Namespace, mode: str, root: str):
    """The config's module and data module for ``mode``, as the CLI builds them; the retriever index ready."""
    import torch

    from bridge_pl.bilevel import mode_arguments
    from bridge_pl.cli import BridgeCLI

    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message="LightningCLI's args parameter")  # our own flags are in sys.argv
    seed = [f"--seed_everything={args.seed}", f"--data.seed={args.seed}"] if args.seed is not None else []
    cli = BridgeCLI(args=["--config", args.config, "--trainer.logger=false", f"--trainer.default_root_dir={root}",
                          *seed, *args.override, *mode_arguments(mode)], run=False)
    cli.datamodule.trainer = cli.trainer
    cli.model.setup("fit")  # the retriever encodes (or loads) the corpus and builds its index
    cli.model.train()  # as during fit (the rollout engine switches to eval and back itself)
    return cli.model, cli.datamodule


def first_batch(data) -> list:
    """The prompts of the first training iteration: the first batch of the seeded training stream."""
    return list(next(iter(data.train_dataloader())))


def warm_up(module, data, examples) -> None:
    """One greedy single-prompt rollout: pays the once-per-run costs, consumes no randomness (module doc)."""
    data.rollout(module, examples[:1], training=False, dataset="warmup")


def shape(batch, data) -> dict:
    import torch

    ids = batch.input_ids[batch.attention_mask.bool()]
    return {
        "trajectories": batch.batch_size,
        "prompts": batch.batch_size // max(1, data.n_samples),
        "sampled_tokens": float(batch.action_mask.sum(-1).float().mean()),
        "trajectory_tokens": float(batch.attention_mask.sum(-1).float().mean()),
        "searches": int(batch.search_traj.numel()),
        "credit_searches": int(batch.credit_searches.numel()),
        "credit_tokens": sum(seq.length for seq in batch.credit_sequences),
        "reward": float(batch.rewards.mean()),
        "fingerprint": hashlib.blake2b(ids.to(torch.int64).numpy().tobytes(), digest_size=4).hexdigest(),
    }


def reference_differs(module) -> str | None:
    """Make the KL reference differ from the current LoRA adapter so that the reference pass runs (module doc)."""
    policy = module.policy
    if module.rl_config.kl_coef == 0 or not policy.lora or not policy.reference_is_current():
        return None
    policy.rebase_reference()
    policy.reference_adapter = {k: v + 1e-3 for k, v in policy.reference_adapter.items()}
    return "KL reference set apart from the adapter, so the reference pass runs"


def ensure_signal(batch) -> str | None:
    """Replace the rewards by 0/1 alternating within each group when no group's rewards differ (module doc)."""
    import torch

    from bridge_pl import rl

    if rl.groups_with_signal(batch.rewards, batch.group_ids) > 0:
        return None
    seen: dict[int, int] = {}
    synthetic = []
    for g in batch.group_ids.tolist():
        synthetic.append(float(seen.get(g, 0) % 2))
        seen[g] = seen.get(g, 0) + 1
    batch.rewards = torch.tensor(synthetic, dtype=batch.rewards.dtype, device=batch.rewards.device)
    return "no reward signal: rewards set to 0/1 within groups"


def time_coupling(clock: PhaseClock, losses_cls, policy_update) -> None:
    """Charge ``bridge``'s coupling terms in the θ step to the ``coupling`` phase: building each part of
    ``coupling_loss_parts`` (its weights; ℓ_θ's forward when the LM-credit graph was not kept) and the policy
    update's backward of that part (through the LM-credit forward), so that the ``policy_update`` phase holds the
    policy-loss parts, the step and any correction, as the update floor does (bar the step)."""
    parts_fn, backward, pending = losses_cls.coupling_loss_parts, policy_update.backward, set()

    @functools.wraps(parts_fn)
    def coupling_loss_parts(self, *args, **kwargs):
        parts = parts_fn(self, *args, **kwargs)
        while True:
            with clock.phase("coupling"):
                part = next(parts, None)
            if part is None:
                return
            pending.add(id(part))
            yield part

    def timed_backward(loss):
        if id(loss) not in pending:
            return backward(loss)
        pending.discard(id(loss))
        with clock.phase("coupling"):
            return backward(loss)

    losses_cls.coupling_loss_parts = coupling_loss_parts
    policy_update.backward = timed_backward


# ---- the update's matmul work ---------------------------------------------------------------------
class MicroBatch(NamedTuple):
    """One forward + backward of the update: ``rows`` x ``width`` (the padded length, tokens); ``prefix``: leading
    tokens every row shares, run once as one row (0: none; ``Policy._shared_prefix_length``); ``scored``: tokens the
    LM head runs on; ``tokens``: real (unpadded) tokens."""

    rows: int
    width: int
    prefix: int
    scored: int
    tokens: int

    @property
    def positions(self) -> int:
        """Positions the decoder layers run: the prefix once and each row's remainder."""
        return self.prefix + self.rows * (self.width - self.prefix)

    @property
    def attended(self) -> int:
        """(query, key) pairs a layer's attention computes: the prefix row's P x P, each remainder's (W - P) x W
        (masked pairs included: SDPA with a mask computes the whole product)."""
        return self.prefix ** 2 + self.rows * (self.width - self.prefix) * self.width


class ModelShape(NamedTuple):
    """What the FLOP count reads of the policy: ``projections``, one ``(in k, out n, LoRA rank r)`` per linear layer
    of one decoder block (r = 0: no adapter), alike in all ``layers``; query ``heads`` of ``head_dim``; the LM head's
    ``hidden`` x ``vocab``; ``train_base``: the base weights train (full fine-tuning), else only LoRA does."""

    projections: tuple[tuple[int, int, int], ...]
    layers: int
    heads: int
    head_dim: int
    hidden: int
    vocab: int
    train_base: bool


def model_shape(policy) -> ModelShape:
    """The :class:`ModelShape` of a :class:`~bridge_pl.policy.Policy` (its first decoder block's linear layers)."""
    from peft.tuners.lora import Linear as LoraLinear
    from torch import nn

    from bridge_pl.distributed import decoder_layers

    blocks = decoder_layers(policy.hf_model)
    adapted = {name: m for name, m in blocks[0].named_modules() if isinstance(m, LoraLinear)}
    projections = []
    for name, m in blocks[0].named_modules():
        if name in adapted:
            base = m.get_base_layer()
            rank = sum(m.r[a] for a in m.active_adapters if a in m.lora_A)
            projections.append((base.in_features, base.out_features, rank))
        elif isinstance(m, nn.Linear) and not any(name.startswith(a + ".") for a in adapted):
            projections.append((m.in_features, m.out_features, 0))
    config = policy.hf_model.config
    head = policy.hf_model.get_output_embeddings().weight
    return ModelShape(tuple(projections), len(blocks), config.num_attention_heads,
                      getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
                      head.shape[1], head.shape[0], not policy.lora)


def update_flops(micro_batches: list[MicroBatch], model: ModelShape) -> dict[str, float]:
    """Matmul FLOPs of one forward + backward over ``micro_batches`` (FLOPs; a multiply-add is 2).

    Forward: an ``[m, k] x [k, n]`` product is ``2 m k n``, with m the positions a layer runs
    (:attr:`MicroBatch.positions`) for each linear layer and its LoRA ``A`` (k -> r) and ``B`` (r -> n); attention
    is ``2 x 2 d`` per (query, key) pair and head (scores and values, :attr:`MicroBatch.attended`); the LM head
    ``2 hidden vocab`` per scored token. Backward: a frozen base weight needs its input's gradient only (one more
    product of the same size), a trained weight (LoRA's A and B; the base under full fine-tuning) also its weight
    gradient (two), attention the gradients of both operands of both products (two); the frozen (tied) LM head its
    input's gradient. Every block counts alike (block 0's q, k and v need no input gradient: about 0.2 % of the
    demo's count). Recomputation is not counted: the LM head's forward again in the backward
    (``head_recompute``, the log-prob chunks are checkpointed) and the attention scores that a fused kernel
    recomputes. Returns the FLOPs by ``projections``, ``lora``, ``attention``, ``head`` and their ``total``.
    """
    flops = dict.fromkeys(("projections", "lora", "attention", "head"), 0.0)
    recompute = 0.0
    base_passes = 3 if model.train_base else 2  # forward + input grad (+ weight grad)
    for mb in micro_batches:
        m = mb.positions
        for k, n, r in model.projections:
            flops["projections"] += model.layers * base_passes * 2 * m * k * n
            flops["lora"] += model.layers * 3 * 2 * m * r * (k + n)
        flops["attention"] += model.layers * 3 * 2 * 2 * mb.attended * model.heads * model.head_dim
        flops["head"] += 2 * 2 * mb.scored * model.hidden * model.vocab
        recompute += 2 * mb.scored * model.hidden * model.vocab
    flops["total"] = sum(flops.values())
    flops["head_recompute"] = recompute
    return flops


def update_gemms(micro_batches: list[MicroBatch], model: ModelShape, chunk: int) -> dict[tuple, int]:
    """The dense products of the update's projections and LM head: ``{(m, k, n, transposed): count}``, one
    ``[m, k] x [k, n]`` each (``transposed``: the right operand is an ``[n, k]`` weight read transposed, as
    ``nn.Linear``'s forward reads it; not transposed: the input gradient's ``[m, n] x [n, k]`` read as stored).
    m: the prefix row and the remainders of each micro-batch (:attr:`MicroBatch.positions`), the LM head's
    ``chunk`` of scored tokens. Forward and input gradient only; LoRA's rank-r and attention's products are left
    out (their FLOPs count in :func:`update_flops`)."""
    gemms: dict[tuple, int] = {}

    def add(key: tuple, count: int) -> None:
        gemms[key] = gemms.get(key, 0) + count

    for mb in micro_batches:
        ms = [mb.prefix, mb.rows * (mb.width - mb.prefix)] if mb.prefix else [mb.rows * mb.width]
        for m in ms:
            for k, n, _ in model.projections:
                add((m, k, n, True), model.layers)
                add((m, n, k, False), model.layers)
        for start in range(0, mb.scored, chunk):
            c = min(chunk, mb.scored - start)
            add((c, model.hidden, model.vocab, True), 1)
            add((c, model.vocab, model.hidden, False), 1)
    return gemms


def gemm_seconds(m: int, k: int, n: int, transposed: bool, dtype, blocks: int = 3, min_s: float = 0.05) -> float:
    """Seconds of one ``torch.mm`` of ``[m, k] x [k, n]`` in ``dtype`` (see :func:`update_gemms`): two warm-up
    calls, then the median of ``blocks`` timed blocks of at least ``min_s`` each."""
    import statistics

    import torch

    a = torch.randn(m, k).to(dtype)
    b = torch.randn(n, k).to(dtype).t() if transposed else torch.randn(k, n).to(dtype)
    for _ in range(2):
        torch.mm(a, b)
    start = time.perf_counter()
    torch.mm(a, b)
    reps = max(1, round(min_s / max(time.perf_counter() - start, 1e-6)))
    times = []
    for _ in range(blocks):
        start = time.perf_counter()
        for _ in range(reps):
            torch.mm(a, b)
        times.append((time.perf_counter() - start) / reps)
    return statistics.median(times)


def gemm_rate(gemms: dict[tuple, int], dtype) -> dict[str, float]:
    """The update's GEMMs (:func:`update_gemms`) run back to back in ``dtype``: ``flops``, ``seconds`` and
    ``gflops`` (GFLOP/s) over all of them, each shape timed once (:func:`gemm_seconds`) and counted as often as
    the update runs it."""
    flops = seconds = 0.0
    for (m, k, n, transposed), count in gemms.items():
        flops += count * 2 * m * k * n
        seconds += count * gemm_seconds(m, k, n, transposed, dtype)
    return {"flops": flops, "seconds": seconds, "gflops": flops / seconds / 1e9}


PROFILE_KINDS = {  # category -> what an op's name contains (torch.profiler names; the first category that matches)
    "matmul (mm/addmm/bmm)": ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"),
    "SDPA (fused attention, fwd/bwd)": ("scaled_dot_product", "flash_attention", "efficient_attention"),
    "softmax / log_softmax / logsumexp (fwd/bwd)": ("softmax", "logsumexp", "Logsumexp", "Softmax"),
    "copies / casts / cat": ("aten::copy_", "aten::_to_copy", "aten::clone", "aten::contiguous", "aten::cat",
                             "aten::repeat"),
    "indexing / gather / scatter": ("aten::index", "aten::gather", "aten::scatter", "aten::nonzero",
                                    "aten::embedding", "aten::masked"),
    "fill / zeros / empty": ("aten::fill_", "aten::zero_", "aten::zeros", "aten::empty", "aten::new_zeros",
                             "aten::ones"),
}


def _kind(name: str) -> str | None:
    return next((kind for kind, parts in PROFILE_KINDS.items() if any(part in name for part in parts)), None)


def profile_update(policy, ids, attn, mask) -> dict:
    """torch.profiler over one micro-batch's ``policy(...)`` forward + backward (the update floor's step).

    Each op's self CPU time goes to the :data:`PROFILE_KINDS` category of the innermost op around it (itself
    included) that has one, so a composite op's parts count with it (logsumexp's amax, exp and sum as logsumexp);
    the rest is ``elementwise / reductions / other`` (aten ops) or ``non-aten`` (autograd engine, Python). Returns
    seconds by category, the top ops by self time and the step's wall time (profiling adds overhead)."""
    from torch.profiler import ProfilerActivity, profile

    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        logp = policy(ids, attn, score_mask=mask)[0]
        (logp * mask).sum().backward()
    wall = time.perf_counter() - start
    by_kind: dict[str, float] = {}
    for event in prof.events():
        seconds, kind, around = event.self_cpu_time_total / 1e6, None, event
        while around is not None and kind is None:
            kind, around = _kind(around.name), around.cpu_parent
        if kind is None:
            kind = ("elementwise / reductions / other ops" if event.name.startswith("aten::")
                    else "non-aten (autograd engine, Python ops, profiler)")
        by_kind[kind] = by_kind.get(kind, 0.0) + seconds
    ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:15]
    return {"wall_s": wall, "self_s": sum(by_kind.values()), "by_kind": by_kind,
            "top_ops": [{"op": e.key, "self_s": e.self_cpu_time_total / 1e6, "calls": e.count} for e in ops]}


# ---- children --------------------------------------------------------------------------------------
def run_mode(args: argparse.Namespace, mode: str, root: str) -> dict:
    """Child: one measured iteration of ``mode``."""
    import torch

    from bridge_pl.batch_losses import BatchLosses

    module, data = build(args, mode, root)
    examples = first_batch(data)
    warm_up(module, data, examples)
    optimizers, _ = module.configure_optimizers()
    updates = module.updates_from(optimizers, backward=torch.Tensor.backward)
    notes = [] if args.as_is else [n for n in [reference_differs(module)] if n]

    clock = PhaseClock()
    clock.wrap(data, "rollout", "rollout")
    clock.wrap(BatchLosses, "_reference_logprobs", "reference")
    clock.wrap(BatchLosses, "_lm_scores", "lm_credit")
    clock.wrap(BatchLosses, "lower_loss", "retriever_steps")
    clock.wrap(BatchLosses, "retriever_upper_loss", "retriever_steps")
    clock.wrap(module.solver, "_policy_steps", "policy_update")
    clock.wrap(BatchLosses, "_fill_old_logprobs", "policy_update")
    for update, name in [(updates.policy, "policy_update"), (updates.phi, "retriever_steps"),
                         (updates.psi, "retriever_steps")]:
        if update is not None:
            for attr in ("step", "step_parts", "apply_grads"):
                clock.wrap(update, attr, name)
    time_coupling(clock, BatchLosses, updates.policy)

    baseline = settle()
    _reset_hwm()
    with RssSampler(clock):
        with clock.measure():
            batch = data.rollout(module, examples, training=True, dataset="train")
        reward = float(batch.rewards.mean())
        if not args.as_is:
            notes += [n for n in [ensure_signal(batch)] if n]
        with clock.measure():
            problem = module.problem(batch)
            logs = module.solver.step(problem, updates)
    if logs.get("policy/skipped"):
        notes.append("the solver skipped the θ update (no reward signal)")

    def mb(rss: int) -> float:
        return max(0.0, (rss - baseline) / 2**20)

    phases = {p: {"time_s": clock.time[p], "peak_mb": mb(clock.peak[p]) if clock.peak[p] else 0.0,
                  "calls": clock.calls[p]} for p in PHASES}
    phases["other"]["time_s"] = max(0.0, clock.total - sum(clock.time[p] for p in PHASES if p != "other"))
    return {"time_s": clock.total, "peak_mb": mb(max(clock.peak.values())), "phases": phases,
            "shape": shape(batch, data) | {"reward": reward}, "notes": notes, "threads": torch.get_num_threads(),
            "dtype": str(module.policy.weight_dtype).replace("torch.", ""), "baseline_mb": baseline / 2**20}


def run_warm(args: argparse.Namespace, adapter: str) -> dict:
    """The config's ``WarmStart`` callbacks (no RL iteration, no evaluation), the adapter saved to ``adapter``."""
    import torch

    from bridge_pl.cli import BridgeCLI
    from callbacks.warm_start import WarmStart

    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
    seed = [f"--seed_everything={args.seed}", f"--data.seed={args.seed}"] if args.seed is not None else []
    # No enable_checkpointing=false: Lightning refuses it beside the config's own checkpoint callback; the warm
    # start runs in a fit of max_steps=0, which saves no checkpoint anyway.
    cli = BridgeCLI(args=["--config", args.config, "--trainer.logger=false",
                          f"--trainer.default_root_dir={Path(adapter).parent}",
                          "--trainer.max_steps=0", *seed, *args.override], run=False)
    warm = [c for c in cli.trainer.callbacks if isinstance(c, WarmStart)]
    for callback in warm:
        callback.evaluate, callback.save_to = False, adapter
    if warm:
        cli.trainer.fit(cli.model, cli.datamodule)
    return {"adapter": adapter if warm else None, "shape": {}}


def run_floors(args: argparse.Namespace, root: str) -> dict:
    """Child: the generate floor and the update floor on the ``frozen`` batch (module doc)."""
    import torch

    from bridge_pl.policy import length_sorted_groups

    module, data = build(args, "frozen", root)
    examples = first_batch(data)
    warm_up(module, data, examples)
    batch = data.rollout(module, examples, training=True, dataset="train")
    policy, tok = module.policy, module.policy.tokenizer
    n_tokens = max(1, round(float(batch.action_mask.sum(-1).float().mean())))

    prompts = [data.collector.prompts.ids(tok, ex.question) for ex in examples]
    rows = [p for p in prompts for _ in range(data.n_samples)]  # prompt-major, as the rollout
    width = max(len(p) for p in rows)
    ids = torch.full((len(rows), width), tok.pad_token_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for r, p in enumerate(rows):  # left-padded, as generation needs
        ids[r, width - len(p):] = torch.tensor(p)
        attn[r, width - len(p):] = 1
    ids, attn = ids.to(module.device), attn.to(module.device)
    sampling = {"do_sample": True, "temperature": data.collector.limits.temperature,
                "top_p": data.collector.limits.top_p, "pad_token_id": tok.pad_token_id}
    with policy.generation_model() as model, torch.no_grad():  # LoRA merged, as the data module generates
        model.eval()
        model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=2, min_new_tokens=2, **sampling)  # warm-up
        start = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=n_tokens, min_new_tokens=n_tokens,
                             **sampling)
        generate_s = time.perf_counter() - start
        model.train()
    assert out.shape[1] - width == n_tokens, (out.shape, width, n_tokens)

    lengths = batch.attention_mask.sum(-1).tolist()
    cells = [(group, slice(0, max(lengths[i] for i in group)))  # the update's micro-batches
             for group in length_sorted_groups(lengths, module.rl_config.micro_batch_tokens)]
    start = time.perf_counter()
    for where in cells:
        mask = batch.action_mask[where]  # score_mask: the LM head only where the sum reads (same value and grads)
        logp = policy(batch.input_ids[where], batch.attention_mask[where], score_mask=mask)[0]
        (logp * mask).sum().backward()
    update_s = time.perf_counter() - start
    policy.zero_grad(set_to_none=True)

    micro_batches = []
    for group, cols in cells:
        ids, attn = batch.input_ids[group, cols], batch.attention_mask[group, cols]
        scored = batch.action_mask[group, cols].bool().clone()
        scored[:, 0] = False  # as Policy.forward: the first token has no context
        prefix = policy._shared_prefix_length(policy.hf_model, ids, attn, None)  # what the forward ran once
        micro_batches.append(MicroBatch(len(group), cols.stop, prefix, int(scored.sum()), int(attn.sum())))
    model = model_shape(policy)
    flops = update_flops(micro_batches, model)
    gemms = update_gemms(micro_batches, model, policy.logprob_chunk)
    dtype = str(policy.weight_dtype).replace("torch.", "")
    rates = {str(d).replace("torch.", ""): gemm_rate(gemms, d) for d in dict.fromkeys([policy.weight_dtype,
                                                                                        torch.bfloat16])}
    mfu = {"flops": flops, "micro_batches": [m._asdict() for m in micro_batches], "dtype": dtype, "gemm": rates,
           "flops_unshared": update_flops([m._replace(prefix=0) for m in micro_batches], model)["total"],
           "gflops": flops["total"] / update_s / 1e9}
    mfu["ratio"] = mfu["gflops"] / rates[dtype]["gflops"]
    if args.profile:  # the largest micro-batch, once more, under the profiler
        i = max(range(len(cells)), key=lambda j: micro_batches[j].positions)
        (group, cols), mask = cells[i], batch.action_mask[cells[i]]
        mfu["profile"] = profile_update(policy, batch.input_ids[group, cols], batch.attention_mask[group, cols], mask)
        mfu["profile"]["micro_batch"] = micro_batches[i]._asdict()
        policy.zero_grad(set_to_none=True)
    return {"generate_s": generate_s, "update_s": update_s, "generate_rows": len(rows),
            "generate_tokens": n_tokens, "shape": shape(batch, data), "update_mfu": mfu}


# ---- parent ----------------------------------------------------------------------------------------
def spawn(args: argparse.Namespace, child: str, tmp: str, out: str | None = None) -> dict | None:
    """Run ``child`` in its own process; its result record (None if it failed). ``out``: the warm adapter's path."""
    argv = child_argv(args, child, str(Path(tmp) / f"{child}.json"))
    if out is not None:
        argv += ["--warm-out", out]
    out = str(Path(tmp) / f"{child}.json")
    print(f"iteration_bench: running {child} ...", file=sys.stderr, flush=True)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": str(args.threads)}
    if args.pin_malloc:
        env["MALLOC_MMAP_THRESHOLD_"] = "131072"
    start = time.perf_counter()
    proc = subprocess.run(argv, env=env, cwd=ROOT)
    if proc.returncode != 0 or not Path(out).is_file():
        print(f"iteration_bench: {child} failed (exit {proc.returncode})", file=sys.stderr, flush=True)
        return None
    result = json.loads(Path(out).read_text())
    summary = {k: result[k] for k in ("time_s", "peak_mb", "generate_s", "update_s") if k in result}
    print(f"iteration_bench: {child} done in {time.perf_counter() - start:.0f} s: {summary} {result['shape']}",
          file=sys.stderr, flush=True)
    return result


def cell(time_s: float, peak_mb: float) -> str:
    return f"{time_s:.2f} s / {peak_mb:.0f} MB"


def mfu_lines(update_s: float, mfu: dict) -> list[str]:
    """The update floor's matmul throughput beside the GEMM rate on its shapes, and the profile if taken."""
    f, dtype = mfu["flops"], mfu["dtype"]
    mbs = [MicroBatch(**m) for m in mfu["micro_batches"]]
    positions, rows_width = sum(m.positions for m in mbs), sum(m.rows * m.width for m in mbs)
    real = sum(m.tokens - (m.rows - 1) * m.prefix for m in mbs)  # real tokens the layers run (the prefix once)
    gemm = mfu["gemm"]
    lines = [
        f"Update floor's matmul work: {len(mbs)} micro-batches (rows x width / shared prefix: "
        + ", ".join(f"{m.rows}x{m.width}/{m.prefix}" for m in mbs) + f"), {positions} positions through the "
        f"layers ({rows_width} rows x width without the shared prefix; padding {1 - real / positions:.1%} of the "
        f"positions run), {sum(m.scored for m in mbs)} scored tokens.",
        f"- update FLOPs {f['total'] / 1e12:.3f} T (projections {f['projections'] / f['total']:.1%}, LoRA "
        f"{f['lora'] / f['total']:.1%}, attention {f['attention'] / f['total']:.1%}, LM head "
        f"{f['head'] / f['total']:.1%}; not counted: the LM head's recompute, {f['head_recompute'] / 1e12:.3f} T; "
        f"every row in full would be {mfu['flops_unshared'] / 1e12:.3f} T)",
        f"- update {update_s:.2f} s: achieved {mfu['gflops']:.1f} GFLOP/s",
        "- GEMM on the update's projection and LM-head shapes, same process: " + ", ".join(
            f"{d} {g['gflops']:.1f} GFLOP/s ({g['seconds']:.2f} s for its {g['flops'] / 1e12:.3f} T)"
            for d, g in gemm.items()),
        f"- achieved / GEMM ({dtype}) = {mfu['ratio']:.2f}"
        + (f"; achieved / GEMM (bfloat16) = {mfu['gflops'] / gemm['bfloat16']['gflops']:.2f}"
           if dtype != "bfloat16" else ""),
        "",
    ]
    prof = mfu.get("profile")
    if prof:
        m = MicroBatch(**prof["micro_batch"])
        lines += [f"Profile of one micro-batch forward + backward ({m.rows} x {m.width}, shared prefix {m.prefix}; "
                  f"{prof['wall_s']:.2f} s under the profiler, {prof['self_s']:.2f} s of ops' self CPU time):", "",
                  "| kind of op | self CPU s | share |", "|---|---|---|"]
        for kind, sec in sorted(prof["by_kind"].items(), key=lambda kv: -kv[1]):
            lines.append(f"| {kind} | {sec:.2f} | {sec / prof['self_s']:.1%} |")
        lines += ["", "Top ops (self CPU s, calls): " + "; ".join(
            f"{o['op']} {o['self_s']:.2f} ({o['calls']})" for o in prof["top_ops"][:10]), ""]
    return lines


def report(args: argparse.Namespace, results: dict, floors: dict | None, load: float) -> str:
    modes = list(results)
    lines = [f"# iteration_bench: {Path(args.config).name}, one iteration per mode", ""]
    any_result = next(iter(results.values()), None) or floors
    if any_result is not None:
        s = any_result["shape"]
        threads = any_result.get("threads", args.threads)
        lines += [
            f"- settings: {threads} torch thread(s); policy dtype {any_result.get('dtype', '?')}; "
            f"seed {'config' if args.seed is None else args.seed}; overrides {args.override or 'none'}",
            f"- shapes: {s['trajectories']} trajectories ({s['prompts']} prompts x "
            f"{s['trajectories'] // max(1, s['prompts'])} samples), {s['sampled_tokens']:.1f} policy-sampled tokens "
            f"and {s['trajectory_tokens']:.1f} tokens (prompt + response) per trajectory on average "
            f"({s['trajectory_tokens'] * s['trajectories']:.0f} in all), "
            f"{s['searches']} searches",
        ]
    for mode, r in results.items():
        s = r["shape"]
        notes = "; ".join(r["notes"]) or "no adjustment"
        lines.append(f"- {mode}: rollout {s['fingerprint']}, {s['credit_searches']} LM-credit searches "
                     f"({s['credit_tokens']} packed tokens), mean reward {s['reward']:.2f}, "
                     f"baseline RSS {r['baseline_mb']:.0f} MB; {notes}")
    allocator = ("MALLOC_MMAP_THRESHOLD_=131072 (--pin-malloc): RSS follows live tensors; slower" if args.pin_malloc
                 else "glibc default: RSS includes freed memory the allocator keeps, so a phase's peak includes what "
                 "the phases before it freed (--pin-malloc for comparable per-phase peaks)")
    lines += [f"- allocator: {allocator}",
              f"- load average when started: {load:.2f} (timings need an otherwise idle machine; cells are "
              "time / peak RSS above the post-setup baseline)", ""]
    if modes:
        lines += ["| phase | " + " | ".join(modes) + " |", "|---|" + "---|" * len(modes)]
        for p in PHASES:
            cells = []
            for m in modes:
                ph = results[m]["phases"][p]
                ran = ph["calls"] or (p == "other" and ph["time_s"] > 0)
                cells.append(cell(ph["time_s"], ph["peak_mb"]) if ran else "-")
            lines.append(f"| {LABELS[p]} | " + " | ".join(cells) + " |")
        lines.append("| **total** | " + " | ".join(f"**{cell(results[m]['time_s'], results[m]['peak_mb'])}**"
                                                 for m in modes) + " |")
        lines += ["", "A phase called inside another counts for the innermost: LM credit inside a retriever loss or "
                  "the θ step counts as LM credit; the retriever losses inside implicit's θ correction count as "
                  "retriever steps (its HVPs and backward stay in the policy update). '-': not run in that mode.", ""]
    if floors is not None:
        fs = floors["shape"]
        lines += [f"Floors: generate {floors['generate_s']:.2f} s (one HF generate, {floors['generate_rows']} rows x "
                  f"{floors['generate_tokens']} sampled tokens, no search); update {floors['update_s']:.2f} s (one "
                  f"forward + backward over {fs['trajectories']} x {fs['trajectory_tokens']:.0f} tokens)."]
        if "frozen" in results:
            floor = floors["generate_s"] + floors["update_s"]
            lines.append(f"frozen total / (generate floor + update floor) = {results['frozen']['time_s']:.2f} / "
                         f"{floor:.2f} = {results['frozen']['time_s'] / floor:.2f}")
        if results:
            lines.append("policy update phase / update floor (the phase without the coupling row: policy-loss "
                         "forward + backward, correction, clipping, optimizer step): " + ", ".join(
                             f"{m} {results[m]['phases']['policy_update']['time_s'] / floors['update_s']:.2f}"
                             for m in modes))
        lines.append("")
        if "update_mfu" in floors:
            lines += mfu_lines(floors["update_s"], floors["update_mfu"])
    if "frozen" in results:
        base = results["frozen"]
        lines += ["| mode | time / frozen | peak MB / frozen |", "|---|---|---|"]
        for m in modes:
            mem = f"{results[m]['peak_mb'] / base['peak_mb']:.2f}" if base["peak_mb"] > 0 else "-"
            lines.append(f"| {m} | {results[m]['time_s'] / base['time_s']:.2f} | {mem} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else list(argv))
    if args.child:
        with tempfile.TemporaryDirectory(prefix="iteration_bench_") as root:
            if args.child == "warm":
                result = run_warm(args, args.warm_out)
            else:
                result = run_floors(args, root) if args.child == "floors" else run_mode(args, args.child, root)
        Path(args.child_out).write_text(json.dumps(result))
        return 0
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="iteration_bench_") as tmp:
        adapter = args.adapter
        seed = "config" if args.seed is None else args.seed
        cached = ROOT / "runs" / "iteration_bench" / f"warm_{Path(args.config).stem}_seed{seed}" / "adapter"
        if adapter is None and not args.no_warm_start:
            if (cached / "adapter_config.json").is_file():  # the warm start is deterministic: reuse it
                adapter = str(cached)
            else:
                warm = spawn(args, "warm", tmp, out=str(cached))
                if warm is None:  # measuring the untrained policy instead would answer another question
                    print("iteration_bench: the warm start failed; use --no-warm-start to measure the config's "
                          "policy as it is", file=sys.stderr)
                    return 1
                adapter = warm["adapter"]
        if adapter is not None:
            args.override.append(f"--model.policy.init_args.adapter={Path(adapter).resolve()}")
            print(f"iteration_bench: every process starts from the policy adapter {adapter}", file=sys.stderr)
        results = {m: r for m in args.modes if (r := spawn(args, m, tmp)) is not None}
        floors = spawn(args, "floors", tmp)
    print(report(args, results, floors, load))
    if args.json:
        data = {
            "floors": {k: floors[k] for k in ("generate_s", "update_s", "update_mfu")} if floors else {},
            "modes": {m: {"time_s": r["time_s"], "peak_mb": r["peak_mb"],
                          "phases": {p: {"time_s": v["time_s"], "peak_mb": v["peak_mb"]}
                                     for p, v in r["phases"].items()}}
                      for m, r in results.items()},
        }
        Path(args.json).write_text(json.dumps(data, indent=2) + "\n")
    failed = len(results) < len(args.modes) or floors is None
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
