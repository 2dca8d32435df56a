#!/usr/bin/env bash
# Starts the trainer with the megatron backend under torchrun: one rank per GPU, tensor parallel
# over groups of [trainer] tensor_parallel GPUs (0: all of them), data parallel across the groups.
# Rank 0 (on the node with NODE_RANK=0) is `polar serve trainer`, the trainer the rest of Polar
# talks to; every other rank follows it. Run it once on each node, with the same arguments, which
# are those of `polar serve trainer` (--backend is set to megatron):
#
#   scripts/launch_megatron.sh --model /models/Qwen3-4B --run-dir runs/r1 --dataset tasks.jsonl \
#       --rollout HOST:PORT --inference HOST:PORT
#
# Environment (the usual torchrun variables), with single-node defaults:
#   NNODES=1  NODE_RANK=0  GPUS_PER_NODE=<GPUs visible>  MASTER_ADDR=127.0.0.1  MASTER_PORT=29500
#   PYTHON=python (the interpreter whose environment has Polar, torch and megatron-core)
# The model folder of [trainer] model (and the run folder's checkpoints) must be readable at the same
# path on every node.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${PYTHON:-python}
gpus=${GPUS_PER_NODE:-$("$python" -c 'import torch; print(max(torch.cuda.device_count(), 1))')}

# Less fragmentation of GPU memory; one hardware queue per GPU, so that the tensor-parallel all-reduces
# run in the order they are issued. Values already set are kept.
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}

cd "$root"
exec "$python" -m torch.distributed.run \
  --nnodes "${NNODES:-1}" \
  --node-rank "${NODE_RANK:-0}" \
  --nproc-per-node "$gpus" \
  --master-addr "${MASTER_ADDR:-127.0.0.1}" \
  --master-port "${MASTER_PORT:-29500}" \
  -m trainer.backends.megatron.launch "$@"
