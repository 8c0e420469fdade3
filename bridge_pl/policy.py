"""The policy: a Hugging Face causal LM + tokenizer, LoRA by default, with masked per-token log-probs.

The reference policy for the KL penalty is the policy RL starts from: the base weights with the LoRA adapter
disabled, or a snapshot of a warm-started adapter, so no second model copy is held. Full fine-tuning is
available (then a frozen reference copy is kept only when a KL penalty is used). 4-bit QLoRA (bitsandbytes >= 0.45)
runs on CUDA and, slowly, on CPU.

Cost discipline (docs/method.md, "What one iteration computes"): the LM head runs only on the positions whose
log-prob is asked for, entropy is a no-grad diagnostic, and candidates that share a context are scored in one
packed row (:meth:`Policy.branch_loglik`).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from bridge_pl.attention import MIN_SHARED_PREFIX, SharedPrefixKV, use_bridge_attention
from bridge_pl.attention import NAME as BRIDGE_ATTENTION
from bridge_pl.distributed import (
    call_under_root,
    decoder_layers,
    full_tensor,
    is_dtensor,
    is_sharded,
    reshard,
    shard_like,
    shard_root,
)
from bridge_pl.models import load_causal_lm, load_tokenizer

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _token_logprobs(
    hidden: torch.Tensor, targets: torch.Tensor, head: nn.Module, temperature: float, entropy: str = "none"
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(head(hidden)/T) gathered at ``targets``, and the entropy (nats) of that softmax, from one head
    pass: ``[N, H], [N] -> [N], [N]`` (float32). ``entropy``: ``none`` (None), ``detached`` (a diagnostic, no grad)
    or ``grad`` (differentiable, for an entropy bonus)."""
    logits = head(hidden).float() / temperature
    logz = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logz
    if entropy == "none":
        return logp, None
    if entropy == "detached":
        logits, logz = logits.detach(), logz.detach()
    return logp, logz - (torch.softmax(logits, dim=-1) * logits).sum(-1)


def bf16_supported() -> bool:
    """Whether bfloat16 matrix work is native here: a CUDA GPU with bf16, or a CPU with AVX512-BF16/AMX."""
    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(flag in flags for flag in ("avx512_bf16", "amx_bf16"))


def resolve_dtype(name: str) -> torch.dtype:
    """``auto`` -> bfloat16 where :func:`bf16_supported`, else float32; other names map directly."""
    if name == "auto":
        return torch.bfloat16 if bf16_supported() else torch.float32
    return _DTYPES[name]


class BranchedSequence(NamedTuple):
    """One shared prefix continued by several alternative branches, each followed by the same target.

    ``prefix`` ids, ``branches`` (one id list per alternative), ``target`` ids (the scored tokens). Scored as
    one packed row: each branch attends to the prefix and to itself only (see :meth:`Policy.branch_loglik`).
    """

    prefix: list[int]
    branches: list[list[int]]
    target: list[int]

    @property
    def length(self) -> int:
        return len(self.prefix) + sum(len(b) + len(self.target) for b in self.branches)


def enable_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each decoder layer's activations in the backward (non-reentrant ``torch.utils.checkpoint``), under
    the method's current name (transformers >= 5.25; the older ``gradient_checkpointing_enable`` warns there)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


class Policy(nn.Module):
    """Causal-LM policy π_θ.

    Args:
        model: required: a registry name (``smollm2-135m-instruct``, the packaged policy; ``tiny-llama``, a
            random-init test model), a local HF folder or a cached HF id.
        lora: train LoRA adapters (default) instead of all weights.
        lora_r, lora_alpha, lora_dropout, target_modules: peft LoRA settings
            (``target_modules="all-linear"`` or a list of module names).
        load_in_4bit: QLoRA: load the base weights in 4-bit NF4 (bitsandbytes >= 0.45; on the current CUDA device,
            else on CPU).
        dtype: ``auto`` | ``float32`` | ``bfloat16`` | ``float16`` for the base weights; ``auto`` (default) is
            bfloat16 where the hardware has native bf16 (CUDA, CPUs with AVX512-BF16/AMX), else float32, for a
            frozen LoRA base; with ``lora=False`` it is float32, since an optimizer step at RL learning rates is
            below a bfloat16 weight's resolution. LoRA weights stay float32 and log-probs are computed in float32.
        logprob_chunk: scored tokens per chunk when turning hidden states into log-probs; bounds the
            ``[chunk, V]`` logits held at once (chunks are recomputed in backward).
        gradient_checkpointing: trade compute for activation memory in the backbone.
        adapter: folder of a saved peft adapter to start from (e.g. one ``WarmStart(save_to=...)`` wrote);
            its own LoRA settings replace ``lora_r``/``lora_alpha``/``lora_dropout``/``target_modules``, and
            the loaded policy is the KL reference (see :meth:`rebase_reference`).
        merged_generation: rollouts and evaluations generate with each LoRA delta merged into its base weight
            (:meth:`generation_model`), not through peft's float32 side path; False: through the adapters.

    The KL reference is the policy RL starts from: the base model (adapter off) for a fresh adapter, or the
    warm-started / loaded policy after :meth:`rebase_reference`.
    """

    def __init__(
        self,
        model: str,
        lora: bool = True,
        lora_r: int = 8,
        lora_alpha: int = 16,
        lora_dropout: float = 0.0,
        target_modules: str | list[str] = "all-linear",
        load_in_4bit: bool = False,
        dtype: str = "auto",
        logprob_chunk: int = 1024,
        gradient_checkpointing: bool = False,
        adapter: str | None = None,
        merged_generation: bool = True,
    ) -> None:
        super().__init__()
        if dtype != "auto" and dtype not in _DTYPES:
            raise ValueError(f"policy.dtype must be 'auto' or one of {sorted(_DTYPES)}, got '{dtype}'")
        if load_in_4bit and not lora:
            raise ValueError("policy.load_in_4bit=True needs policy.lora=True (QLoRA trains adapters only)")
        if adapter is not None and not lora:
            raise ValueError("policy.adapter needs policy.lora=True (for full fine-tuning, point policy.model at the "
                             "saved folder)")
        if adapter is not None and not (Path(adapter) / "adapter_config.json").is_file():
            raise FileNotFoundError(f"policy.adapter: no peft adapter (adapter_config.json) in '{adapter}'")
        self.name = model
        self.lora = lora
        self.merged_generation = merged_generation
        self.logprob_chunk = logprob_chunk
        self.gradient_checkpointing = gradient_checkpointing
        self.tokenizer = load_tokenizer(model)
        # full fine-tuning trains every weight: ``auto`` keeps them float32 (bf16 compute is bf16-mixed's job)
        self.weight_dtype = torch.float32 if dtype == "auto" and not lora else resolve_dtype(dtype)
        kwargs = {}
        if load_in_4bit:
            kwargs = self._quantization_kwargs(self.weight_dtype)
        base = load_causal_lm(model, dtype=self.weight_dtype, **kwargs)
        use_bridge_attention(base)  # SDPA with the shared training prefix (bridge_pl.attention)
        if gradient_checkpointing:
            enable_activation_checkpointing(base)
        self.reference: nn.Module | None = None  # full fine-tuning: frozen copy of the reference weights
        self.reference_adapter: dict[str, torch.Tensor] | None = None  # LoRA: reference adapter weights
        if lora:
            from peft import LoraConfig, PeftModel, get_peft_model

            if load_in_4bit:
                from peft import prepare_model_for_kbit_training

                # non-reentrant, as enable_activation_checkpointing set it: peft would otherwise switch the layers to
                # torch's reentrant default, whose forward runs without grad (a shared prefix would get none)
                base = prepare_model_for_kbit_training(base, use_gradient_checkpointing=gradient_checkpointing,
                                                       gradient_checkpointing_kwargs={"use_reentrant": False})
            if adapter is not None:
                self.model = PeftModel.from_pretrained(base, adapter, is_trainable=True)
                self.rebase_reference()
            else:
                config = LoraConfig(
                    r=lora_r, lora_alpha=lora_alpha, lora_dropout=lora_dropout,
                    target_modules=target_modules, task_type="CAUSAL_LM",
                )
                self.model = get_peft_model(base, config)
        else:
            self.model = base
        # from_pretrained returns models in eval mode, and Lightning keeps each submodule's mode: left so, the
        # policy would train without its dropout and without activation checkpointing (transformers checkpoints
        # only in training mode), unless something (e.g. WarmStart) happened to switch it. Rollouts and scoring
        # passes that must not be stochastic use eval_mode.
        self.model.train()

    @staticmethod
    def _quantization_kwargs(compute_dtype: torch.dtype) -> dict:
        try:
            import bitsandbytes  # noqa: F401
        except ImportError as error:
            raise RuntimeError("policy.load_in_4bit=True needs bitsandbytes >= 0.45 (pip install bitsandbytes; "
                               "it is in bridge-pl's gpu and dev extras)") from error
        from transformers import BitsAndBytesConfig

        quant = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute_dtype,
            bnb_4bit_use_double_quant=True,
        )
        device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        return {"quantization_config": quant, "device_map": {"": device}}

    # ---- structure ------------------------------------------------------------------------------
    @property
    def hf_model(self) -> nn.Module:
        """The underlying transformers model (LoRA layers injected in place when ``lora``)."""
        return self.model.get_base_model() if self.lora else self.model

    @property
    def hidden_size(self) -> int:
        return self.hf_model.config.hidden_size

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def enable_reference_copy(self) -> None:
        """Full fine-tuning with a KL penalty needs a frozen copy of the initial weights."""
        if self.lora or self.reference is not None:
            return
        import copy

        self.reference = copy.deepcopy(self.model).requires_grad_(False).eval()

    def rebase_reference(self) -> None:
        """Make the current policy the KL reference (RL starts here, e.g. after a warm start).

        LoRA: the adapter weights are copied and swapped in while scoring under the reference (the copy is
        adapter-sized and travels in checkpoints); full fine-tuning: the frozen copy takes the current weights.
        """
        if self.lora:  # whole tensors (FSDP2: gathered from the shards), so comparing and saving need no mesh
            self.reference_adapter = {k: full_tensor(v.detach()).clone() for k, v in self.trained_state_dict().items()}
        elif self.reference is not None:
            self.reference.load_state_dict(self.model.state_dict())

    @torch.no_grad()
    def reference_is_current(self) -> bool:
        """Whether the reference policy computes exactly what the current policy does (so its pass can be
        skipped): LoRA with the reference snapshot equal to the adapter, or a fresh adapter whose B matrices
        are all zero (adapter off == adapter on). Full fine-tuning: False (not checked)."""
        if not self.lora:
            return False
        # FSDP2: a gathered unit names its full copies, a resharded one its shards: compare whole tensors
        params = dict(self.model.named_parameters())
        if self.reference_adapter is not None:
            return all(torch.equal(full_tensor(params[k].detach()), v.to(params[k].device))
                       for k, v in self.reference_adapter.items())
        return all(not bool(full_tensor(p.detach()).any()) for name, p in params.items() if "lora_B" in name)

    @contextlib.contextmanager
    def reference_mode(self) -> Iterator[nn.Module]:
        """Yield the reference policy: the adapter disabled or swapped for the reference adapter (LoRA), or
        the frozen copy (full fine-tuning). Use without grad: the LoRA swap writes the adapter in place."""
        if self.lora and self.reference_adapter is None:
            with self.model.disable_adapter():
                yield self.model
        elif self.lora:
            sharded = is_sharded(self.model)
            if sharded:  # FSDP2: swap the shards; the next forward gathers the swapped weights
                reshard(self.model)
            params = dict(self.model.named_parameters())
            current = {k: params[k].detach().clone() for k in self.reference_adapter}
            try:
                with torch.no_grad():
                    for k, v in self.reference_adapter.items():
                        params[k].copy_(shard_like(v, params[k]))
                yield self.model
            finally:
                if sharded:
                    reshard(self.model)
                with torch.no_grad():
                    for k, v in current.items():
                        params[k].copy_(v)
        elif self.reference is not None:
            yield self.reference
        else:
            raise RuntimeError("no reference policy: full fine-tuning without enable_reference_copy()")

    @contextlib.contextmanager
    def generation_model(self) -> Iterator[nn.Module]:
        """Yield the model to generate with (rollouts, evaluation; use without grad).

        With ``merged_generation`` and plain LoRA adapters on linear layers: the model with each active adapter's
        delta ``scaling * B @ A`` added to its base weight in float32 (autocast off) and rounded once to the base
        dtype, and the adapters switched off, so a forward is the base model's matmuls alone. Through the adapters,
        every adapted layer of every forward casts its input to float32 and adds a low-rank product over all of
        its output activations: a third of an evaluation batch of the demo's policy (docs/method.md section 10).
        The function is the same up to that rounding of the merged weights (none in float32 beyond the sum's own).
        The base weights are restored bit for bit on exit; until then a copy of each adapted base weight is held
        (the size of the adapted layers: 0.2 GB for SmolLM2-135M in bfloat16). Otherwise (full fine-tuning,
        4-bit bases, FSDP2 shards, DoRA or other adapter kinds, LoRA biases, ``modules_to_save``, adapters
        already switched off, base weights shared between layers or tied to the embeddings,
        ``merged_generation=False``) it yields the model as it is.
        """
        layers = self._mergeable_lora_layers()
        if not layers:
            yield self.model
            return
        originals = []
        try:
            for layer in layers:
                weight = layer.get_base_layer().weight
                merged = _merged_weight(layer)
                originals.append((weight, weight.detach().clone()))
                with torch.no_grad():
                    weight.copy_(merged)
            with self.model.disable_adapter():
                yield self.model
        finally:
            with torch.no_grad():
                for weight, original in reversed(originals):
                    weight.copy_(original)

    @torch.no_grad()
    def generation_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The base model's weights as :meth:`generation_model` computes with them, under their Hugging Face names
        (what an inference engine such as vLLM loads): ``(name, tensor)`` one weight at a time, each LoRA delta
        merged into its base weight in float32 and rounded once to the base dtype (a new tensor; the policy is not
        changed), every other weight as it is (a view). Full fine-tuning: the weights as they are. Under FSDP2
        each weight is gathered whole as it is reached (collective: every rank must consume the iterator to its
        end, in the same order).

        Raises:
            ValueError: adapters that cannot be merged into a plain weight (see :meth:`generation_model`), or
                trained embeddings tied to the LM head.
        """
        hf = self.hf_model
        if getattr(hf.config, "tie_word_embeddings", False) and hf.get_input_embeddings().weight.requires_grad:
            # vLLM reloads the embeddings but keeps its LM head's old copy of them
            raise ValueError("the policy trains input embeddings tied to its LM head, which a weight push into an "
                             "inference engine does not follow: use data.engine=hf")
        merged: dict[str, nn.Module] = {}
        if self.lora:
            layers = self._plain_lora_layers()
            if not layers:
                raise ValueError("the policy's adapters cannot be merged into plain weights (DoRA, LoRA biases, "
                                 "modules_to_save, 4-bit bases or shared weights): use data.engine=hf")
            by_id = {id(m) for m in layers}
            merged = {f"{name}.base_layer.weight": m for name, m in self.hf_model.named_modules() if id(m) in by_id}
        for name, param in self.hf_model.named_parameters():
            if ".lora_" in name:
                continue
            layer = merged.get(name)
            weight = _merged_weight(layer) if layer is not None else full_tensor(param.detach())
            yield name.replace(".base_layer.", "."), weight

    def _mergeable_lora_layers(self) -> list[nn.Module]:
        """The LoRA layers :meth:`generation_model` merges; empty when it must generate through the adapters."""
        if not self.merged_generation or is_sharded(self.model):
            return []
        return self._plain_lora_layers()

    def _plain_lora_layers(self) -> list[nn.Module]:
        """The LoRA layers, when every one is a plain linear adapter whose delta can be merged into its own base
        weight (no DoRA, bias, modules_to_save, disabled or merged adapters, nor shared or tied base weights);
        else empty."""
        from peft.tuners.lora import Linear as LoraLinear
        from peft.tuners.tuners_utils import BaseTunerLayer

        layers = [m for m in self.model.modules() if isinstance(m, BaseTunerLayer)]
        active = {name for m in layers for name in m.active_adapters}
        for name in active:  # what disabling the adapters would also switch off, or what a merge leaves out
            config = self.model.peft_config[name]
            if any(getattr(config, key, None) for key in ("modules_to_save", "use_dora", "lora_bias")):
                return []
        if not layers or not all(type(m) is LoraLinear and not m.merged and not m.disable_adapters
                                 and not getattr(m, "lora_variant", None) for m in layers):
            return []
        weights = [_storage(m.get_base_layer().weight) for m in layers]
        embedding = _storage(self.hf_model.get_input_embeddings().weight)
        if len(set(weights)) < len(weights) or embedding in weights:
            return []  # a merge would reach another layer too
        return layers

    def get_extra_state(self) -> dict:
        return {"reference_adapter": self.reference_adapter}

    def set_extra_state(self, state: dict) -> None:
        self.reference_adapter = state.get("reference_adapter")

    # ---- log-probs ------------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        temperature: float = 1.0,
        model: nn.Module | None = None,
        score_mask: torch.Tensor | None = None,
        entropy: bool = False,
        position_ids: torch.Tensor | None = None,
        entropy_grad: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Per-token log-probs of ``input_ids`` under the policy (or ``model``, e.g. the reference).

        Runs the backbone and the LM head as submodules; under FSDP2 the whole pass runs inside the root's
        forward hooks (``distributed.call_under_root``), so the root's sharded parameters are gathered for it.

        Args:
            input_ids: ``[B, T]``, right- or left-padded.
            attention_mask: ``[B, T]`` 0/1, or a ready ``[B, 1, T, T]`` bool mask (True = may attend; then
                ``position_ids`` must be given).
            score_mask: ``[B, T]``: the positions whose log-prob is wanted (default: every real token after the
                first). The LM head runs only there; elsewhere the result is 0.
            entropy: also return the entropy of the distribution that produced each scored token; a no-grad
                diagnostic unless ``entropy_grad`` (an entropy bonus in the loss).
            position_ids: ``[B, T]``; default ``cumsum(attention_mask) - 1``.
        Returns:
            logp ``[B, T]`` float32: ``logp[:, t] = log π(input_ids[:, t] | input_ids[:, :t])`` where scored.
            entropy ``[B, T]`` float32 where scored (None unless ``entropy``).
            hidden ``[B, T, H]``: last hidden states (for a value head).
        """
        model = self.model if model is None else model
        return call_under_root(model, self._forward, model, input_ids, attention_mask, temperature, score_mask,
                               entropy, position_ids, entropy_grad)

    def _forward(self, model, input_ids, attention_mask, temperature, score_mask, entropy, position_ids,
                 entropy_grad) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        hf = model.get_base_model() if hasattr(model, "get_base_model") else model
        backbone = getattr(hf, hf.base_model_prefix)
        head = hf.get_output_embeddings()
        prefix = self._shared_prefix_length(hf, input_ids, attention_mask, position_ids)
        if position_ids is None:
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        hidden = None
        if prefix:
            hidden = _backbone_after_shared_prefix(backbone, input_ids, attention_mask, position_ids, prefix,
                                                   hf.config.num_hidden_layers)
        if hidden is None:
            hidden = backbone(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
            ).last_hidden_state
        if score_mask is None:
            score_mask = attention_mask if attention_mask.dim() == 2 else torch.ones_like(input_ids)
        score_mask = score_mask.bool().clone()
        score_mask[:, 0] = False  # the first token has no context
        rows, cols = score_mask.nonzero(as_tuple=True)
        states, targets = hidden[rows, cols - 1], input_ids[rows, cols]
        mode = ("grad" if entropy_grad else "detached") if entropy else "none"
        logp_flat, ent_flat = [], []
        for start in range(0, len(targets), self.logprob_chunk):
            chunk = (states[start : start + self.logprob_chunk], targets[start : start + self.logprob_chunk])
            if torch.is_grad_enabled() and hidden.requires_grad:  # the [chunk, V] logits are recomputed in backward
                lp, ent = checkpoint(_token_logprobs, *chunk, head, temperature, mode, use_reentrant=False)
            else:
                lp, ent = _token_logprobs(*chunk, head, temperature, mode)
            logp_flat.append(lp)
            ent_flat.append(ent)
        logp = hidden.new_zeros(input_ids.shape, dtype=torch.float32)
        if logp_flat:
            logp = logp.index_put((rows, cols), torch.cat(logp_flat))
        ent = None
        if entropy:
            ent = logp.new_zeros(input_ids.shape)
            if ent_flat:
                ent = ent.index_put((rows, cols), torch.cat(ent_flat))
        return logp, ent, hidden

    def _shared_prefix_length(
        self, hf: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor | None
    ) -> int:
        """Leading positions that a forward may run once, as one row (0: none): the same real tokens in every row,
        at positions 0, 1, ..., seen by every later position of every row and seeing only each other, causally.
        That is a 2-D-masked batch's common prefix, or the part of a 4-D mask with its ``position_ids`` that is
        one (e.g. LM credit's packed rows, whose prompt every row shares). At least ``MIN_SHARED_PREFIX``, at most
        the width - 1, with bridge-pl's attention (:class:`~bridge_pl.attention.SharedPrefixKV`) in full-attention
        layers only (a sliding window would have to cut the prefix per query) and unsharded weights. A rollout
        batch's rows start with the same system prompt and instruction (116 tokens of the demo's ~335)."""
        rows, width = input_ids.shape
        positions_as_default = position_ids is None  # what a 2-D mask needs; a 4-D one comes with its positions
        if (rows < 2 or is_sharded(self.model) or positions_as_default != (attention_mask.dim() == 2)
                or getattr(hf.config, "_attn_implementation", None) != BRIDGE_ATTENTION
                or not _full_attention_only(hf.config)):
            return 0
        leading = (input_ids == input_ids[:1]).all(0)
        if attention_mask.dim() == 2:
            leading &= attention_mask.bool().all(0)
        else:
            mask = attention_mask[:, 0].bool()  # [B, query, key]
            causal = torch.ones(width, width, dtype=torch.bool, device=mask.device).tril()
            leading &= (position_ids == torch.arange(width, device=position_ids.device)).all(0)
            leading &= (mask | ~causal).all(1).all(0)  # key k: every query from k on, in every row, sees it
            leading &= (mask == causal).all(2).all(0)  # query q: sees exactly the keys up to q
        length = min(int(leading.long().cumprod(0).sum()), width - 1)
        return length if length >= MIN_SHARED_PREFIX else 0

    @torch.no_grad()
    def logprobs(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        micro_batch: int = 8,
        temperature: float = 1.0,
    ) -> torch.Tensor:
        """``[B, T]`` log-probs without grad at ``temperature``, ``micro_batch`` rows at a time (bounded memory)."""
        out = torch.zeros(input_ids.shape, dtype=torch.float32, device=input_ids.device)
        for start in range(0, input_ids.shape[0], micro_batch):
            rows = slice(start, start + micro_batch)
            out[rows] = self(input_ids[rows], attention_mask[rows], temperature=temperature)[0]
        return out

    def branch_loglik(self, sequences: Sequence[BranchedSequence], token_budget: int = 4096) -> torch.Tensor:
        """Mean log-prob of the target after each branch: ``[N, K]`` for N sequences of K branches each.

        Each sequence is packed into one row ``prefix, branch_1 + target, ..., branch_K + target``; a 4-D
        attention mask lets each branch see the prefix and itself only, and its positions continue the prefix,
        so every branch is scored exactly as ``prefix + branch + target`` would be on its own, while the prefix
        is computed once. Rows are grouped so that rows x padded length <= ``token_budget``. Differentiable when
        grad is enabled (ℓ_θ of docs/method.md, section 2).
        """
        device = next(self.model.parameters()).device
        if not sequences:
            return torch.zeros(0, 0, dtype=torch.float32, device=device)
        K = len(sequences[0].branches)
        if any(len(seq.branches) != K for seq in sequences):
            raise ValueError("Policy.branch_loglik: every sequence needs the same number of branches")
        out = []
        for group in budget_groups([seq.length for seq in sequences], token_budget):
            out.append(self._branch_loglik_rows([sequences[i] for i in group], K, device))
        return torch.cat(out)

    def _branch_loglik_rows(self, rows: list[BranchedSequence], K: int, device) -> torch.Tensor:
        T = max(seq.length for seq in rows)
        pad = self.tokenizer.pad_token_id
        ids = torch.full((len(rows), T), pad, dtype=torch.long)
        positions = torch.zeros(len(rows), T, dtype=torch.long)
        segment = torch.full((len(rows), T), -1, dtype=torch.long)  # -1 prefix, k branch k, -2 padding
        score = torch.zeros(len(rows), T, dtype=torch.bool)
        for r, seq in enumerate(rows):
            P = len(seq.prefix)
            ids[r, :P] = torch.tensor(seq.prefix)
            positions[r, :P] = torch.arange(P)
            start = P
            for k, branch in enumerate(seq.branches):
                tokens = branch + seq.target
                end = start + len(tokens)
                ids[r, start:end] = torch.tensor(tokens)
                positions[r, start:end] = torch.arange(P, P + len(tokens))
                segment[r, start:end] = k
                score[r, end - len(seq.target) : end] = True
                start = end
            segment[r, start:] = -2
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        q, kv = segment[:, :, None], segment[:, None, :]
        # padding (unscored) attends to the prefix and itself, like a branch: no empty softmax rows (NaN), and the
        # prefix is seen by every later position, so a prompt the rows share can run once (_shared_prefix_length)
        attend = causal & ((kv == -1) | (q == kv))
        ids, positions, score = ids.to(device), positions.to(device), score.to(device)
        logp = self(ids, attend[:, None].to(device), score_mask=score, position_ids=positions)[0]
        per_branch = torch.zeros(len(rows), K, dtype=torch.float32, device=device)
        counts = torch.zeros(len(rows), K, dtype=torch.float32, device=device)
        seg = segment.to(device).clamp(min=0)
        per_branch = per_branch.scatter_add(1, seg, logp * score)
        counts = counts.scatter_add(1, seg, score.float())
        return per_branch / counts.clamp(min=1)

    # ---- sharding and persistence -------------------------------------------------------------------
    def shard(self, mesh) -> None:
        """FSDP2: shard each decoder block, then the root (embeddings, final norm, LM head), of the policy and of
        a full-fine-tuning reference copy. A block may mix a bfloat16 base with peft's float32 LoRA weights: the
        installed torch's ``fully_shard`` gathers mixed dtypes (tested), so the adapters need no units of their own.
        """
        shard_root(self.model, mesh, decoder_layers(self.hf_model))
        if self.reference is not None:
            shard_root(self.reference, mesh, decoder_layers(self.reference))

    def save_adapter(self, path: str | Path, every_rank: bool = False) -> None:
        """Save in the standard peft layout (``PeftModel.from_pretrained(base, path)`` loads it). In a
        multi-process run every rank calls it and rank 0 writes (``every_rank``: each rank writes to its own
        ``path``); sharded (FSDP2) weights are gathered first."""
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        state = None
        if is_sharded(self.model):
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            options = StateDictOptions(full_state_dict=True, cpu_offload=not every_rank)  # offload: rank 0's only
            state = get_model_state_dict(self.model, options=options)
        if not distributed or every_rank or torch.distributed.get_rank() == 0:
            self.model.save_pretrained(str(path), state_dict=state)
            self.tokenizer.save_pretrained(str(path))
        if distributed:
            torch.distributed.barrier()

    def trained_state_dict(self) -> dict[str, torch.Tensor]:
        """Only what trains (adapters, or all weights for full fine-tuning): what a checkpoint holds."""
        names = {n for n, p in self.model.named_parameters() if p.requires_grad}
        return {k: v for k, v in self.model.state_dict().items() if k in names}


def _storage(weight: torch.Tensor) -> int:
    """Where ``weight``'s elements (this rank's shard of an FSDP2 DTensor) start in memory: equal for shared weights."""
    return (weight.to_local() if is_dtensor(weight) else weight).data_ptr()


@torch.no_grad()
def _merged_weight(layer: nn.Module) -> torch.Tensor:
    """A LoRA layer's base weight plus its active adapters' deltas ``scaling * B @ A``, summed in float32 (autocast
    off) and rounded once to the base weight's dtype: a new ``[out, in]`` tensor. FSDP2 shards are gathered first
    (collective)."""
    weight = full_tensor(layer.get_base_layer().weight.detach())
    names = [name for name in layer.active_adapters if name in layer.lora_A]
    with torch.autocast(weight.device.type, enabled=False):
        if is_dtensor(layer.lora_A[names[0]].weight):  # peft's get_delta_weight would mix shards and whole tensors
            deltas = (full_tensor(layer.lora_B[n].weight.detach()).float()
                      @ full_tensor(layer.lora_A[n].weight.detach()).float() * layer.scaling[n] for n in names)
            delta = sum(d.T if layer.fan_in_fan_out else d for d in deltas)
        else:
            delta = sum(layer.get_delta_weight(name).float() for name in names)
        return (weight.float() + delta).to(weight.dtype)


def _full_attention_only(config) -> bool:
    """Whether every decoder layer of a transformers ``config`` attends to all earlier positions (no sliding window,
    chunked attention or layer kinds other than ``full_attention``)."""
    kinds = getattr(config, "layer_types", None)
    if kinds is not None:
        return all(kind == "full_attention" for kind in kinds)
    return getattr(config, "sliding_window", None) is None and getattr(config, "attention_chunk_size", None) is None


def _backbone_after_shared_prefix(
    backbone: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, length: int,
    layers: int,
) -> torch.Tensor | None:
    """The backbone's last hidden states ``[B, T, H]`` with the first ``length`` positions (a prefix every row
    shares, :meth:`Policy._shared_prefix_length`) run once, as one row, and each row's remainder attending to that
    prefix's keys and values under the rest of its 2-D or 4-D mask; the prefix's gradient is the sum of the rows'.
    Same function as one forward over the batch, except that dropout (LoRA's, attention's) draws one mask for the
    prefix instead of one per row.

    None (after the prefix pass; the caller then runs the batch as it is) when not all ``layers`` recorded their keys
    and values, or none came with grad where the prefix's output has it (reentrant checkpointing runs its forward
    without grad): sharing would be wrong there, not only slow.
    """
    shared = SharedPrefixKV()
    head = backbone(input_ids=input_ids[:1, :length], attention_mask=torch.ones_like(input_ids[:1, :length]),
                    position_ids=position_ids[:1, :length], use_cache=False, record_prefix=shared).last_hidden_state
    grad_lost = head.requires_grad and not any(key.requires_grad for key in [*shared.keys.values(),
                                                                              *shared.values.values()])
    if len(shared.keys) != layers or grad_lost:
        warnings.warn("bridge-pl: the policy's layers did not record a shared prefix (or recorded it without grad); "
                      "its forwards run every row in full", stacklevel=3)
        return None
    rest_mask = attention_mask[:, length:] if attention_mask.dim() == 2 else attention_mask[:, :, length:, length:]
    rest = backbone(input_ids=input_ids[:, length:], attention_mask=rest_mask,
                    position_ids=position_ids[:, length:], use_cache=False, after_prefix=shared).last_hidden_state
    return torch.cat([head.expand(input_ids.shape[0], -1, -1), rest], dim=1)


def budget_groups(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Consecutive index groups whose (rows x longest length) stays within ``token_budget`` (>= 1 row each)."""
    groups: list[list[int]] = []
    longest = 0
    for i, n in enumerate(lengths):
        if groups and max(longest, n) * (len(groups[-1]) + 1) <= token_budget:
            groups[-1].append(i)
            longest = max(longest, n)
        else:
            groups.append([i])
            longest = n
    return groups


def length_sorted_groups(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """:func:`budget_groups` over the indices ordered by length (shortest first, ties in index order), so that each
    group's rows, padded to its longest, carry little padding."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    return [[order[i] for i in group] for group in budget_groups([lengths[i] for i in order], token_budget)]
