#!/usr/bin/env bash
# GPU check of the scale-out path: two iterations of the Qwen2.5-3B BRIDGE recipe's shapes with tiny models on one
# GPU, (1) under strategy fsdp2 at the recipe's precision (bf16-mixed: float32 weights, bf16 compute) with the FAISS
# index on the GPU, (2) QLoRA (4-bit NF4 base computing in bf16, float32 LoRA weights) on one device, both with PPO
# (so every iteration steps θ). Prints each run's update time per iteration and peak GPU memory. Needs a CUDA GPU, faiss-gpu and bitsandbytes:
#   make install EXTRAS=gpu TORCH=torch && bash benchmarks/gpu_check.sh
# ACCELERATOR=cpu runs the same two fits on CPU in float32 (no GPU-only checks): a dry run of this script.
# FAISS_GPU=0 accepts a faiss build without GPU support (faiss-cpu): the index then stays on the CPU and the
# printed line says so. PY names the Python to use (default: the project's .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
ACCELERATOR=${ACCELERATOR:-gpu}
FAISS_GPU=${FAISS_GPU:-1}
OUT=$(mktemp -d)
if [ "$ACCELERATOR" = gpu ]; then
  PRECISION=bf16-mixed
  DTYPE=bfloat16  # the QLoRA base's compute dtype
  $PY -c "import torch, faiss; assert torch.cuda.is_available(), 'no CUDA GPU'; \
assert $FAISS_GPU == 0 or faiss.get_num_gpus() > 0, \
'faiss has no GPU support: install bridge-pl[gpu], or set FAISS_GPU=0 to check the rest with the index on the CPU'"
else
  PRECISION=32-true
  DTYPE=float32
fi
export ACCELERATOR PRECISION OUT
run() {  # run NAME ARGS...: one fit, then its timing and memory line
  local name=$1; shift
  $PY - "$name" "$@" <<'PYEOF'
import os, sys, time
import lightning as L
import torch
import faiss
from bridge_pl.cli import BridgeCLI
from bridge_pl.retrieval.index import faiss_gpu_available

name, args = sys.argv[1], sys.argv[2:]

class Clock(L.Callback):
    def __init__(self):
        self.times = []
    def on_train_batch_start(self, *_):  # the rollout runs before this hook; the update after it
        self.start = time.perf_counter()
    def on_train_batch_end(self, *_):
        self.times.append(time.perf_counter() - self.start)

gpu = os.environ["ACCELERATOR"] == "gpu"
cli = BridgeCLI(args=[
    "--config", "configs/qwen2.5/base.yaml", "--config", "configs/qwen2.5/bridge_3b.yaml",
    "--model.policy.init_args.model=tiny-llama", "--model.retriever.init_args.encoder=tiny-bert",
    "--model.retriever.init_args.corpus=world", "--model.retriever.init_args.batch_size=64",
    "--data.train=world/train", '--data.val={"world_dev": "world/dev"}', "--data.max_eval_examples=8",
    "--data.batch_size=4", "--data.n_samples=5", "--data.eval_batch_size=8", "--data.max_turns=2",
    "--data.max_new_tokens_per_turn=48", "--data.max_response_tokens=512",
    "--model.rl.algorithm=ppo",  # a value head: every iteration makes a θ step (an untrained policy earns no reward)
    f"--trainer.accelerator={os.environ['ACCELERATOR']}", "--trainer.devices=1",
    f"--trainer.precision={os.environ['PRECISION']}", "--trainer.max_steps=2", "--trainer.limit_val_batches=0",
    "--trainer.logger=false",
    f"--trainer.default_root_dir={os.environ['OUT']}/{name}", *args], run=False)
clock = Clock()
cli.trainer.callbacks.append(clock)
if gpu:
    torch.cuda.reset_peak_memory_stats()
cli.trainer.fit(cli.model, cli.datamodule)
index = getattr(cli.model.retriever, "index", None)
peak = f"{torch.cuda.max_memory_allocated() / 2**20:.0f} MiB" if gpu else "n/a (CPU)"
print(f"gpu_check {name}: strategy={type(cli.trainer.strategy).__name__} iterations={cli.trainer.global_step} "
      f"update s/iteration={[round(t, 2) for t in clock.times]} peak GPU memory={peak} "
      f"index device={getattr(index, 'device', None)} faiss GPUs={faiss_gpu_available() and faiss.get_num_gpus()} "
      f"trained dtypes={sorted({str(p.dtype) for p in cli.model.parameters() if p.requires_grad})}",
      flush=True)
PYEOF
}
run fsdp2_bf16 --trainer.strategy=fsdp2
run qlora --trainer.strategy=auto --model.policy.init_args.lora=true --model.policy.init_args.load_in_4bit=true \
  --model.policy.init_args.dtype=$DTYPE --model.policy.init_args.gradient_checkpointing=false
