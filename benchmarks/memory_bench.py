"""A whole run's memory per phase (``callbacks.MemoryAccount``) against floors computed from its shapes.

Runs the real CLI in this process, ``bridge_pl.cli.main(["fit", "--config", CONFIG, ...])``, with
``callbacks.MemoryAccount`` added as the last callback; every other argument is passed through to the CLI (e.g.
``--trainer.max_steps=2 --trainer.val_check_interval=2`` for a shorter run). Then it prints, per phase (the
callback's module doc says where each begins and ends), the peak RSS of its highest-peak run, how far that peak rose
above the RSS at the phase's start (the previous phase's end), what glibc's arenas kept free at its end (freed
``malloc`` memory not returned to the OS: ``mallinfo2().fordblks``, read without trimming), and a floor: the memory
the phase cannot do without, from the run's own shapes (``MemoryAccount``'s ``sizes`` record and its batch shapes):

- libraries: RSS of a fresh interpreter after importing torch, lightning, transformers, peft and ``bridge_pl.cli``
  (and vllm, from the engine's build on, when the run generates with it), measured in a subprocess of this run;
- policy weights: the frozen base's bytes (parameters x dtype bytes, as loaded);
- LoRA + AdamW: trainable parameters x 4 bytes x 4 (float32 parameter, gradient and AdamW's two moments);
- retriever: the retriever-side parameters (query and passage towers, ψ) and one gradient per trainable one
  (the retriever steps are SGD: no optimizer state), plus the corpus embeddings (passages x dim x 4 bytes);
- vLLM: a second copy of the policy's weights (merged) and the KV cache that the largest batch of the run needs:
  tokens (the batch's real tokens, every row's own length) x layers x 2 x kv_heads x head_dim x dtype bytes, at
  most the cache vLLM allocates, ``data.vllm.kv_cache_gb`` (a batch that needs more is scheduled in turns);
- update activations: one micro-batch of ``model.rl.micro_batch_tokens`` tokens (at most the training batch's
  rows x padded width) without gradient checkpointing, at an estimated number of bytes per token per layer of the
  tensors a LoRA Llama layer saves for backward (h hidden, kv = kv_heads x head_dim, i intermediate, d the weights'
  dtype bytes): two RMSNorms (float32 input 4h + output d h each), the float32 copy of its input peft makes for
  each of the 7 LoRA A matrices when the base is not float32 (6 x 4h + 4i; none in float32, where peft's cast is a
  no-op), q, k, v and the rotated q, k (d (2h + 3kv)), the attention output (d h) and the MLP's gate, up, activation
  and product (4 d i): ``42h + 6kv + 12i`` in bfloat16, ``28h + 12kv + 16i`` in float32. An estimate: the
  attention's own saved state (softmax weights, where the kernel keeps them) and the LoRA ranks' small tensors are
  left out. With gradient checkpointing: each layer's input (d h per token and layer) plus one layer's
  activations at that estimate. A solver that couples θ to the retriever (``bridge``) over a checkpointed policy
  keeps the LM-credit forward's graph from the batch's construction to the coupling backward
  (``keeps_credit_graph``): the layer inputs of all the batch's LM-credit tokens (packed rows: prefix + every branch
  + target) are live beside the micro-batch's. Without checkpointing none is kept: the coupling recomputes the
  credit forward one token budget at a time, after the policy's micro-batches. Plus the LM head's float32 logits for one
  ``policy.logprob_chunk`` of scored tokens (the policy chunks the head and recomputes each chunk in backward:
  chunk x vocab x 4 bytes; softmax and its gradient add about two more of that size while a chunk runs backward).

Floors by phase: setup = libraries + weights + LoRA parameters + retriever; warm start = setup + LoRA gradients and
AdamW moments (its demonstrations' activations are not counted); from the engine's build on, the persistent state =
libraries (with vllm) + weights + LoRA + AdamW + retriever + vLLM; update = persistent + activations (+ the kept
LM-credit graph) + logits. Each phase's ratio peak / floor is printed beside it.

Process peak: ``MemoryAccount`` resets the kernel's high-water mark at every phase boundary, which also resets what
``getrusage`` reports at exit, so ``/usr/bin/time -v`` around this script reports the peak since the last boundary
only. The process's peak is the highest phase peak; a thread of this script also samples RSS every 20 ms
(``/proc/self/status``) as a check on it (a sampler can miss a peak shorter than its period, never overstate one).

Usage (alone on the machine: the demo's peak RSS is 15-18 GiB)::

    /usr/bin/time -v python benchmarks/memory_bench.py --config configs/demo.yaml
    python benchmarks/memory_bench.py --config configs/demo.yaml --trainer.max_steps=2 --trainer.val_check_interval=2
    python benchmarks/memory_bench.py --config configs/smoke.yaml --json /tmp/memory.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30
IMPORTS = "import torch, lightning, transformers, peft, bridge_pl.cli"
PROBE = ("import sys; {imports}; from bridge_pl.memory import rss; sys.stdout.write(str(rss()))")


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--config", default=str(ROOT / "configs/demo.yaml"), help="bridge-pl config")
    parser.add_argument("--root", help="the run's default_root_dir (default: a temporary folder, removed after)")
    parser.add_argument("--json", help="write the records, sizes and floors here")
    parser.add_argument("--release", action="store_true",
                        help="MemoryAccount(release=True): gc + malloc_trim(0) at each phase end (changes later peaks)")
    return parser.parse_known_args(argv)


def library_rss(vllm: bool) -> int | None:
    """RSS (bytes) of a fresh interpreter after the imports (module doc); None if it failed."""
    imports = IMPORTS + ("; from vllm import LLM" if vllm else "")
    proc = subprocess.run([sys.executable, "-c", PROBE.format(imports=imports)], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"})
    try:
        return int(proc.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return None


class RssSampler:
    """A daemon thread keeping the highest RSS it reads every ``period`` seconds (module doc)."""

    def __init__(self, period: float = 0.02) -> None:
        from bridge_pl.memory import rss

        self.read, self.period, self.peak = rss, period, 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, self.read() or 0)
            self.stop.wait(self.period)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


def run(args: argparse.Namespace, passthrough: list[str], root: str) -> tuple[list[dict], dict, int]:
    from bridge_pl.cli import main

    path = Path(root) / "memory_account.jsonl"
    argv = ["fit", "--config", str(Path(args.config).resolve()), f"--trainer.default_root_dir={root}", *passthrough,
            "--trainer.callbacks+=callbacks.MemoryAccount", f"--trainer.callbacks.path={path}"]
    if args.release:
        argv.append("--trainer.callbacks.release=true")
    print(f"memory_bench: bridge-pl {' '.join(argv)}", file=sys.stderr, flush=True)
    status = 0
    try:
        main(argv)
    except SystemExit as stop:
        status = stop.code if isinstance(stop.code, int) else 1
    lines = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    records = [line for line in lines if "phase" in line]
    sizes = next((line["sizes"] for line in lines if "sizes" in line), {})
    return records, sizes, status


# ---- floors ---------------------------------------------------------------------------------------
def per_token_layer_bytes(config: dict, d: int) -> tuple[int, str]:
    """Estimated bytes saved for backward per token per decoder layer with ``d``-byte weights (module doc), and
    the formula."""
    h, i = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or h // heads
    kv = (config.get("num_key_value_heads") or heads) * head_dim
    lora_copies = (24 * h + 4 * i) if d != 4 else 0
    total = 2 * (4 * h + d * h) + lora_copies + d * (2 * h + 3 * kv) + d * h + 4 * d * i
    formula = "42h + 6kv + 12i" if d == 2 else "28h + 12kv + 16i" if d == 4 else f"d={d}"
    return total, formula


def kv_bytes_per_token(config: dict, dtype_bytes: int) -> int:
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return config["num_hidden_layers"] * 2 * (config.get("num_key_value_heads") or heads) * head_dim * dtype_bytes


DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def largest(records: list[dict], phase: str) -> dict:
    """The largest batch (by real tokens) among ``phase``'s runs: its ``info``."""
    infos = [r["info"] for r in records if r["phase"] == phase and r["info"].get("tokens")]
    return max(infos, key=lambda info: info["tokens"], default={})


def floors(records: list[dict], sizes: dict, libraries: dict[str, int | None]) -> dict:
    """Floor components (bytes, with their formulas) and the floor of each phase (module doc)."""
    parts = sizes["parts"]
    policy, config = parts["policy"], sizes["policy_config"]
    dtype_bytes = DTYPE_BYTES.get(sizes.get("policy_dtype"), 4)
    weights = policy["bytes"] - policy["trainable_bytes"]
    lora = policy["trainable_params"] * 4
    adamw = policy["trainable_params"] * 4 * 3
    side = {name: part for name, part in parts.items() if name != "policy"}
    retriever_params = sum(part["bytes"] for part in side.values())
    retriever_grads = sum(part["trainable_bytes"] for part in side.values())
    corpus = sizes.get("corpus") or {}
    embeddings = (corpus.get("passages") or 0) * (corpus.get("dim") or 0) * 4
    data = sizes.get("data") or {}
    vllm = data.get("engine_built") == "vllm"
    kv_token = kv_bytes_per_token(config, dtype_bytes)
    train, evaluation = largest(records, "rollout"), largest(records, "evaluation")
    kv_tokens = max(train.get("tokens", 0), evaluation.get("tokens", 0))
    cache = (data.get("kv_cache_gb") or 0) * GIB  # vLLM schedules a larger batch in turns within its cache
    kv_need = min(kv_tokens * kv_token, cache or kv_tokens * kv_token) if vllm else 0
    vllm_weights = (policy["params"] - policy["trainable_params"]) * dtype_bytes if vllm else 0
    layers = config["num_hidden_layers"]
    micro_tokens = min(sizes.get("micro_batch_tokens") or 0, train.get("rows", 0) * train.get("width", 0))
    per_token, formula = per_token_layer_bytes(config, dtype_bytes)
    checkpointing = sizes.get("gradient_checkpointing")
    # checkpointed: each layer's input (hidden x dtype bytes per token and layer) plus one layer recomputed
    kept_per_token = config["hidden_size"] * dtype_bytes * layers
    activations = micro_tokens * (kept_per_token + per_token) if checkpointing else micro_tokens * layers * per_token
    credit_tokens = max((r["info"].get("credit_tokens", 0) for r in records if r["phase"] == "rollout"), default=0)
    credit = credit_tokens * kept_per_token if sizes.get("keeps_credit_graph") else 0
    chunk = min(sizes.get("logprob_chunk") or 0, train.get("sampled_tokens", micro_tokens))  # the head scores those
    logits = chunk * config["vocab_size"] * 4
    lib, lib_vllm = libraries.get("base") or 0, libraries.get("vllm") or libraries.get("base") or 0
    c = {
        "libraries": (lib, f"RSS after `{IMPORTS}` (measured in a subprocess)"),
        "libraries_vllm": (lib_vllm - lib, "+ `from vllm import LLM` (measured)") if vllm else (0, "no vLLM engine"),
        "weights": (weights, f"{policy['params'] - policy['trainable_params']:,} frozen policy parameters x "
                             f"{dtype_bytes} B ({sizes.get('policy_dtype')})"),
        "lora": (lora, f"{policy['trainable_params']:,} LoRA parameters x 4 B"),
        "adamw": (adamw, "LoRA gradients + AdamW's 2 moments: 3 x 4 B per LoRA parameter"),
        "retriever": (retriever_params + retriever_grads + embeddings,
                      f"retriever-side parameters {retriever_params / 2**20:.0f} MiB ("
                      + " + ".join(f"{n} {p['params']:,}" for n, p in side.items() if p["params"])
                      + f") + their gradients {retriever_grads / 2**20:.0f} MiB + corpus embeddings "
                      f"{corpus.get('passages')} x {corpus.get('dim')} x 4 B"),
        "vllm": (vllm_weights + kv_need,
                 f"vLLM's weight copy {vllm_weights / GIB:.2f} GiB + KV of the largest batch: {kv_tokens:,} tokens x "
                 f"{kv_token:,} B ({layers} layers x 2 x kv heads x head_dim x {dtype_bytes} B) = "
                 f"{kv_tokens * kv_token / GIB:.2f} GiB, at most the configured cache "
                 f"({data.get('kv_cache_gb')} GiB)") if vllm
                else (0, "no vLLM engine"),
        "activations": (activations, f"{micro_tokens:,} tokens (one micro-batch) x {layers} layers x "
                                     f"{per_token:,} B ({formula}; estimate)"
                        if not checkpointing else
                        f"gradient checkpointing: {micro_tokens:,} tokens (one micro-batch) x ({layers} layers x "
                        f"{config['hidden_size']} x {dtype_bytes} B layer inputs + one layer's {per_token:,} B)"),
        "credit_graph": (credit, f"LM-credit graph kept through the update ({sizes.get('solver')} solver, "
                                 f"checkpointed): {credit_tokens:,} packed tokens (largest batch) x {layers} layers x "
                                 f"{config['hidden_size']} x {dtype_bytes} B layer inputs"
                         if sizes.get("keeps_credit_graph") else "none kept (recomputed one token budget at a time)"),
        "logits": (logits, f"{chunk:,} tokens (one logprob_chunk; at most the batch's {train.get('sampled_tokens')} "
                           f"sampled tokens) x {config['vocab_size']:,} vocab x 4 B"),
    }
    b = {k: v[0] for k, v in c.items()}
    setup = b["libraries"] + b["weights"] + b["lora"] + b["retriever"]
    persistent = setup + b["libraries_vllm"] + b["adamw"] + b["vllm"]
    phases = {
        "setup": (setup, "libraries + weights + LoRA + retriever"),
        "warm_start": (setup + b["adamw"], "setup + AdamW (no activations)"),
        "engine_build": (persistent - b["adamw"], "libraries + vllm + weights + LoRA + retriever + vLLM"),
        "update": (persistent + b["activations"] + b["credit_graph"] + b["logits"],
                   "persistent + activations + LM-credit graph + logits"),
    }
    for phase in ("rollout", "evaluation", "landscape", "checkpoint", "other"):
        phases[phase] = (persistent, "persistent (weights + LoRA + AdamW + retriever + vLLM + libraries)")
    shapes = {"train": train, "evaluation": evaluation, "micro_tokens": micro_tokens, "kv_tokens": kv_tokens,
              "kv_bytes_per_token": kv_token, "credit_tokens": credit_tokens}
    return {"components": c, "phases": phases, "shapes": shapes}


# ---- report ---------------------------------------------------------------------------------------
def report(args, passthrough, records, sizes, floor, libraries, status, seconds, sampled) -> str:
    from callbacks.memory import summary

    def gib(value) -> str:
        return "-" if value is None else f"{round(value / GIB, 2) + 0.0:.2f}"  # + 0.0: no "-0.00"

    rows = summary(records)
    process_peak = max((r["peak"] for r in records if r["peak"]), default=None)
    config, data = sizes.get("policy_config", {}), sizes.get("data", {})
    shapes = floor["shapes"]
    train, evaluation = shapes["train"], shapes["evaluation"]
    lora = sizes.get("lora") or {}
    targets = lora.get("target_modules")
    lora_modules = f"{len(targets)} modules" if isinstance(targets, list) else targets
    lines = [
        f"# memory_bench: {Path(args.config).name} {' '.join(passthrough)}".rstrip(), "",
        f"- run: exit status {status}, {seconds:.0f} s; process peak RSS {gib(process_peak)} GiB (highest phase peak; "
        f"sampled every 20 ms: {gib(sampled)} GiB); backend {data.get('engine_built')}; allocator glibc"
        + (", trimmed at every phase end (--release)" if args.release else " (no trimming)"),
        f"- policy: {config.get('model_type')} {config.get('num_hidden_layers')} layers, hidden "
        f"{config.get('hidden_size')}, intermediate {config.get('intermediate_size')}, "
        f"{config.get('num_attention_heads')} heads / {config.get('num_key_value_heads')} kv heads, vocab "
        f"{config.get('vocab_size')}, {sizes.get('policy_dtype')}; "
        f"LoRA r {lora.get('r')} on {lora_modules}; micro_batch_tokens {sizes.get('micro_batch_tokens')}, "
        f"logprob_chunk {sizes.get('logprob_chunk')}, gradient checkpointing {sizes.get('gradient_checkpointing')}",
        f"- largest training rollout: {train.get('rows')} rows x {train.get('width')} padded width "
        f"({train.get('tokens')} tokens, {train.get('sampled_tokens')} sampled; {shapes['credit_tokens']} packed "
        f"LM-credit tokens in the largest credit set); largest evaluation batch: {evaluation.get('rows')} rows x "
        f"{evaluation.get('width')} ({evaluation.get('tokens')} tokens); vLLM kv_cache_gb "
        f"{data.get('kv_cache_gb')}",
        "",
        "| phase | runs | seconds | peak RSS (GiB) | peak above the previous phase's end | kept by the allocator | "
        "RSS at end | floor (GiB) | peak / floor | what the floor is |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for phase, row in rows.items():
        value, what = floor["phases"].get(phase, (None, "-"))
        ratio = f"{row['peak'] / value:.2f}" if value and row.get("peak") else "-"
        lines.append(f"| {phase} | {row['runs']} | {row['seconds']:.0f} | {gib(row.get('peak'))} | "
                     f"{gib(row.get('rise'))} | {gib(row.get('free'))} | {gib(row.get('rss_end'))} | {gib(value)} | "
                     f"{ratio} | {what} |")
    lines += ["", "Each phase's row is its run with the highest peak (step in the jsonl). 'kept by the allocator': "
              "glibc's free bytes in its arenas at that run's end (mallinfo2 fordblks).", "",
              "| floor component | GiB | how |", "|---|---|---|"]
    for name, (value, how) in floor["components"].items():
        lines.append(f"| {name} | {gib(value)} | {how} |")
    lines += ["", "Runs of each phase (GiB: peak / peak above start / kept free at end):", ""]
    for phase in rows:
        runs = [r for r in records if r["phase"] == phase]
        cells = ", ".join(f"step {r['step']}: {gib(r['peak'])} / {gib(r['peak'] - r['rss_start'])} / {gib(r['free'])}"
                          for r in runs if r["peak"] is not None)
        lines.append(f"- {phase}: {cells}")
    lines.append(f"\nlibraries measured: {({k: gib(v) for k, v in libraries.items()})} GiB")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args, passthrough = parse_args(sys.argv[1:] if argv is None else list(argv))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    print("memory_bench: measuring the libraries' RSS ...", file=sys.stderr, flush=True)
    libraries = {"base": library_rss(vllm=False)}
    try:
        import importlib.util

        if importlib.util.find_spec("vllm") is not None:
            libraries["vllm"] = library_rss(vllm=True)
    except (ImportError, ValueError):
        pass
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="memory_bench_") as tmp:
        root = args.root or tmp
        with RssSampler() as sampler:
            records, sizes, status = run(args, passthrough, root)
    seconds = time.perf_counter() - start
    sampled = sampler.peak
    if not records or not sizes:
        print(f"memory_bench: the run wrote no memory account (exit status {status})", file=sys.stderr)
        return 1
    floor = floors(records, sizes, libraries)
    print(report(args, passthrough, records, sizes, floor, libraries, status, seconds, sampled))
    if args.json:
        out = {"records": records, "sizes": sizes, "libraries": libraries, "sampled_peak": sampled,
               "floors": {"components": {k: v[0] for k, v in floor["components"].items()},
                          "phases": {k: v[0] for k, v in floor["phases"].items()}}}
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 1 if status else 0


if __name__ == "__main__":
    sys.exit(main())
