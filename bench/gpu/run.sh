#!/usr/bin/env bash
# The GPU rows, in one command, on a machine with GPUs and a CUDA torch:
#   bash bench/gpu/run.sh [OUT_DIR]
# Builds hetcomm against the installed (CUDA) torch, runs the GPU tests, then
# the codec benchmark on the GPU (vs a device-to-device copy) and, with 2+
# GPUs, all-reduce busbw per size (hetcomm's algorithms and wire formats on its
# own NCCL communicator next to torch.distributed's NCCL all-reduce) and
# hetcomm's DDP step times next to PyTorch's hooks on NCCL.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-bench/gpu/results}
mkdir -p "$out"
python -c "import torch; assert torch.cuda.is_available(), 'no GPU visible'; print(torch.__version__, torch.version.cuda)"
pip install -q --no-build-isolation -e .
python -c "import hetcomm; i = hetcomm.build_info(); print(i); assert i['cuda'], 'not a CUDA build of hetcomm'"
python -m pytest -q -m "cuda or cuda2" tests | tee "$out/gpu_tests.txt"
python -m hetcomm.cli bench compress --device cuda -b 1M -e 256M -f 4 --json "$out/compress_cuda.json" | tee "$out/compress_cuda.txt"
ngpu=$(python -c "import torch; print(torch.cuda.device_count())")
if [ "$ngpu" -ge 2 ]; then
  python -m hetcomm.cli bench allreduce --device cuda --ranks "$ngpu" -b 1M -e 256M -f 4 -n 20 -w 5 \
    --json "$out/allreduce_cuda.json" | tee "$out/allreduce_cuda.txt"
  torchrun --nproc_per_node "$ngpu" -m hetcomm.benchmarks.gpu_ddp --json "$out/ddp_cuda.json" | tee "$out/ddp_cuda.txt"
fi
