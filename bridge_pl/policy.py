"""The policy: a Hugging Face causal LM + tokenizer, LoRA by default, with masked per-token log-probs.

The reference policy for the KL penalty is the same weights with the LoRA adapter disabled, so no
second model copy is held. Full fine-tuning is available (then a frozen reference copy is kept only when
a KL penalty is used). 4-bit QLoRA (bitsandbytes) is available on CUDA.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from bridge_pl.models import load_causal_lm, load_tokenizer

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _chunk_token_logprobs(hidden: torch.Tensor, targets: torch.Tensor, head: nn.Module, temperature: float):
    """log softmax(head(hidden)/T) gathered at ``targets``, plus the entropy. Shapes [B, C, H] -> [B, C]."""
    logits = head(hidden).float() / temperature
    logz = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logz
    probs = torch.softmax(logits, dim=-1)
    entropy = logz - (probs * logits).sum(-1)
    return logp, entropy


class Policy(nn.Module):
    """Causal-LM policy π_θ.

    Args:
        model: registry name (``tiny-llama``, ``smollm2-135m-instruct``), local HF folder or cached HF id.
        lora: train LoRA adapters (default) instead of all weights.
        lora_r, lora_alpha, lora_dropout, target_modules: peft LoRA settings
            (``target_modules="all-linear"`` or a list of module names).
        load_in_4bit: QLoRA: load the base weights in 4-bit NF4 (bitsandbytes, CUDA only).
        dtype: ``float32`` | ``bfloat16`` | ``float16`` for the base weights.
        logprob_chunk: time steps per chunk when turning hidden states into log-probs; bounds the
            ``[B, chunk, V]`` logits held at once (chunks are recomputed in backward).
        gradient_checkpointing: trade compute for activation memory in the backbone.
        adapter: folder of a saved peft adapter to start from (e.g. one ``WarmStart(save_to=...)`` wrote);
            its own LoRA settings replace ``lora_r``/``lora_alpha``/``lora_dropout``/``target_modules``, and
            the loaded policy is the KL reference (see :meth:`rebase_reference`).

    The KL reference is the policy RL starts from: the base model (adapter off) for a fresh adapter, or the
    warm-started / loaded policy after :meth:`rebase_reference`.
    """

    def __init__(
        self,
        model: str = "tiny-llama",
        lora: bool = True,
        lora_r: int = 8,
        lora_alpha: int = 16,
        lora_dropout: float = 0.0,
        target_modules: str | list[str] = "all-linear",
        load_in_4bit: bool = False,
        dtype: str = "float32",
        logprob_chunk: int = 64,
        gradient_checkpointing: bool = False,
        adapter: str | None = None,
    ) -> None:
        super().__init__()
        if dtype not in _DTYPES:
            raise ValueError(f"policy.dtype must be one of {sorted(_DTYPES)}, got '{dtype}'")
        if load_in_4bit and not lora:
            raise ValueError("policy.load_in_4bit=True needs policy.lora=True (QLoRA trains adapters only)")
        if adapter is not None and not lora:
            raise ValueError("policy.adapter needs policy.lora=True (for full fine-tuning, point policy.model at the "
                             "saved folder)")
        if adapter is not None and not (Path(adapter) / "adapter_config.json").is_file():
            raise FileNotFoundError(f"policy.adapter: no peft adapter (adapter_config.json) in '{adapter}'")
        self.name = model
        self.lora = lora
        self.logprob_chunk = logprob_chunk
        self.tokenizer = load_tokenizer(model)
        kwargs = {}
        if load_in_4bit:
            kwargs = self._quantization_kwargs(_DTYPES[dtype])
        base = load_causal_lm(model, dtype=_DTYPES[dtype], **kwargs)
        if gradient_checkpointing:
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.reference: nn.Module | None = None  # full fine-tuning: frozen copy of the reference weights
        self.reference_adapter: dict[str, torch.Tensor] | None = None  # LoRA: reference adapter weights
        if lora:
            from peft import LoraConfig, PeftModel, get_peft_model

            if load_in_4bit:
                from peft import prepare_model_for_kbit_training

                base = prepare_model_for_kbit_training(base, use_gradient_checkpointing=gradient_checkpointing)
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

    @staticmethod
    def _quantization_kwargs(compute_dtype: torch.dtype) -> dict:
        if not torch.cuda.is_available():
            raise RuntimeError(
                "policy.load_in_4bit=True needs a CUDA GPU and bitsandbytes (pip install bridge-pl[gpu])"
            )
        from transformers import BitsAndBytesConfig

        quant = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute_dtype,
            bnb_4bit_use_double_quant=True,
        )
        return {"quantization_config": quant, "device_map": {"": torch.cuda.current_device()}}

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
        if self.lora:
            self.reference_adapter = {k: v.detach().clone() for k, v in self.trained_state_dict().items()}
        elif self.reference is not None:
            self.reference.load_state_dict(self.model.state_dict())

    @contextlib.contextmanager
    def reference_mode(self) -> Iterator[nn.Module]:
        """Yield the reference policy: the adapter disabled or swapped for the reference adapter (LoRA), or
        the frozen copy (full fine-tuning). Use without grad: the LoRA swap writes the adapter in place."""
        if self.lora and self.reference_adapter is None:
            with self.model.disable_adapter():
                yield self.model
        elif self.lora:
            params = dict(self.model.named_parameters())
            current = {k: params[k].detach().clone() for k in self.reference_adapter}
            try:
                with torch.no_grad():
                    for k, v in self.reference_adapter.items():
                        params[k].copy_(v)
                yield self.model
            finally:
                with torch.no_grad():
                    for k, v in current.items():
                        params[k].copy_(v)
        elif self.reference is not None:
            yield self.reference
        else:
            raise RuntimeError("no reference policy: full fine-tuning without enable_reference_copy()")

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
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-token log-probs of ``input_ids`` under the policy (or ``model``, e.g. the reference).

        Args:
            input_ids, attention_mask: ``[B, T]`` right- or left-padded.
        Returns:
            logp ``[B, T]``: ``logp[:, t] = log π(input_ids[:, t] | input_ids[:, :t])``; ``logp[:, 0] = 0``.
            entropy ``[B, T]``: entropy of the distribution that produced token t (0 at t=0).
            hidden ``[B, T, H]``: last hidden states (for a value head).
        """
        model = self.model if model is None else model
        hf = model.get_base_model() if hasattr(model, "get_base_model") else model
        backbone = getattr(hf, hf.base_model_prefix)
        head = hf.get_output_embeddings()
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        hidden = backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state
        B, T = input_ids.shape
        logp = hidden.new_zeros(B, T, dtype=torch.float32)
        entropy = hidden.new_zeros(B, T, dtype=torch.float32)
        for start in range(0, T - 1, self.logprob_chunk):
            end = min(start + self.logprob_chunk, T - 1)
            h, tgt = hidden[:, start:end], input_ids[:, start + 1 : end + 1]
            if torch.is_grad_enabled() and hidden.requires_grad:
                lp, ent = checkpoint(_chunk_token_logprobs, h, tgt, head, temperature, use_reentrant=False)
            else:
                lp, ent = _chunk_token_logprobs(h, tgt, head, temperature)
            logp[:, start + 1 : end + 1] = lp
            entropy[:, start + 1 : end + 1] = ent
        return logp, entropy, hidden

    @torch.no_grad()
    def logprobs(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, micro_batch: int = 8, reference: bool = False
    ) -> torch.Tensor:
        """``[B, T]`` log-probs without grad, ``micro_batch`` rows at a time (bounded memory).

        ``reference=True`` scores under the reference policy (:meth:`reference_mode`).
        """
        context = self.reference_mode() if reference else contextlib.nullcontext(None)
        out = torch.zeros(input_ids.shape, dtype=torch.float32, device=input_ids.device)
        with context as model:
            for start in range(0, input_ids.shape[0], micro_batch):
                rows = slice(start, start + micro_batch)
                out[rows] = self(input_ids[rows], attention_mask[rows], model=model)[0]
        return out

    def reference_logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """``[B, T]`` log-probs under the reference policy, without grad."""
        return self.logprobs(input_ids, attention_mask, reference=True)

    def sequence_loglik(self, sequences: list[tuple[list[int], list[int]]], batch_size: int = 32) -> torch.Tensor:
        """Mean log-prob of each target given its context: ``[N]`` for N (context_ids, target_ids) pairs.

        Differentiable when grad is enabled (used for ℓ_θ(d) of METHOD.md section 2).
        """
        device = next(self.model.parameters()).device
        pad = self.tokenizer.pad_token_id
        out = []
        for i in range(0, len(sequences), batch_size):
            chunk = sequences[i : i + batch_size]
            T = max(len(c) + len(t) for c, t in chunk)
            ids = torch.full((len(chunk), T), pad, dtype=torch.long)
            attn = torch.zeros(len(chunk), T, dtype=torch.long)
            tmask = torch.zeros(len(chunk), T)
            for r, (ctx, tgt) in enumerate(chunk):
                n = len(ctx) + len(tgt)
                ids[r, :n] = torch.tensor(ctx + tgt)
                attn[r, :n] = 1
                tmask[r, len(ctx) : n] = 1
            ids, attn, tmask = ids.to(device), attn.to(device), tmask.to(device)
            logp = self(ids, attn)[0]
            out.append((logp * tmask).sum(-1) / tmask.sum(-1).clamp(min=1))
        return torch.cat(out) if out else torch.zeros(0, device=device)

    # ---- persistence ----------------------------------------------------------------------------
    def save_adapter(self, path: str | Path) -> None:
        """Save in the standard peft layout (``PeftModel.from_pretrained(base, path)`` loads it)."""
        self.model.save_pretrained(str(path))
        self.tokenizer.save_pretrained(str(path))

    def trained_state_dict(self) -> dict[str, torch.Tensor]:
        """Only what trains (adapters, or all weights for full fine-tuning): what a checkpoint holds."""
        names = {n for n, p in self.model.named_parameters() if p.requires_grad}
        return {k: v for k, v in self.model.state_dict().items() if k in names}
