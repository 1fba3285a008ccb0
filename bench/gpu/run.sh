#!/usr/bin/env bash
# The GPU path, in one command, on a machine with GPUs and a CUDA torch:
#   bash bench/gpu/run.sh [OUT_DIR]
# 1. builds hetcomm against the installed (CUDA) torch and checks build_info();
# 2. runs every GPU test (marker cuda: one GPU, several ranks sharing it over
#    gloo and NCCL with one rank; cuda2: one GPU per rank, skipped with a
#    reason on a one-GPU machine);
# 3. the codec benchmark on the GPU (each codec next to torch's own kernels and
#    a device-to-device copy of the same bytes);
# 4. DDP steps with CUDA buckets, every mode next to PyTorch's hooks: 2 gloo
#    ranks sharing GPU 0, and with 2+ GPUs one rank per GPU on NCCL (plus the
#    all-reduce busbw per size on hetcomm's NCCL communicator).
# 5. time to accuracy with CUDA buckets (`bench train --device cuda`: digits and
#    the language model, SGD-momentum and AdamW, fp32 / PowerSGD / fp8 /
#    onebit+m / auto; about 2 minutes on one H200).
# Writes run.log and the JSON and tables to OUT_DIR (default bench/gpu/results).
# 6. (stage "testbed", not by default) time to accuracy with CUDA buckets on the 2 x 2 testbed at 100 Mbit
#    (network namespaces: root and iproute2; skipped with the reason otherwise), the ranks under SCHED_BATCH:
#    there the model's compute is the GPU's and the link is what is left (the issue's 0.1x of fp32's time).
#    HETCOMM_GPU_TESTBED_TASKS / _SEEDS / _RATE / _MODES pick its tasks ("classify lm"; "lm:1" gives a task its own
#    seeds), seeds (2), link rate (100mbit) and modes (fp32,torch-powersgd,auto); one invocation and JSON a task.
# 7. (stage "layouts", not by default) DDP's one bucket against bucket_cap_mb=0.5 on the same 2 x 2 testbed with
#    the models on the GPU (bench/bucket_layouts.py --device cuda, the layouts taking turns): whether splitting a
#    model of one bucket pays where the ranks' compute is not four processes on the CPU's cores.
#    HETCOMM_GPU_LAYOUTS ("rnn:int3 lm:int3"): task:mode pairs, AdamW, 150 steps, 4 repetitions each.
# 8. (stage "profile", not by default) Nsight Compute's speed of light and
#    occupancy of each codec kernel, into OUT_DIR/ncu_codecs.txt.
# HETCOMM_GPU_STAGES (default "build tests compress ddp train") picks stages;
# HETCOMM_GPU_TRAIN_TASKS / _OPTIMS / _MODES the train stage's tasks, optimizers and modes;
# HETCOMM_WHEELS=DIR installs missing Python packages from wheels there (a
# machine without a package index).
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-bench/gpu/results}
mkdir -p "$out"
stages=${HETCOMM_GPU_STAGES:-build tests compress ddp train}
jobs=${HETCOMM_GPU_JOBS:-8}  # pytest-xdist workers sharing the GPU(s), where xdist is installed
export PYTHONUNBUFFERED=1
exec > >(tee -a "$out/run.log") 2>&1
has() { [[ " $stages " == *" $1 "* ]] && echo "# stage $1 at $((SECONDS)) s"; }
py=${PYTHON:-python3}

nvidia-smi -L || true
"$py" -c "import torch; assert torch.cuda.is_available(), 'no GPU visible'; \
print('torch', torch.__version__, 'CUDA', torch.version.cuda, torch.cuda.get_device_name(0), \
'x', torch.cuda.device_count())"
if has build; then
  t0=$SECONDS
  CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} \
    "$py" -m pip install -q --no-build-isolation ${HETCOMM_WHEELS:+--no-index --find-links "$HETCOMM_WHEELS"} -e .
  echo "# build: $((SECONDS - t0)) s"
fi
"$py" -c "import hetcomm; i = hetcomm.build_info(); print(i); assert i['cuda'], 'not a CUDA build of hetcomm'"
ngpu=$("$py" -c "import torch; print(torch.cuda.device_count())")
if has tests; then
  # HETCOMM_GPU_TESTS: more pytest arguments (e.g. -k NAME)
  xdist=$("$py" -c "import xdist" 2>/dev/null && echo "-n $jobs" || true)
  timeout "${HETCOMM_GPU_TEST_TIMEOUT:-3600}" "$py" -m pytest -q -rs --durations=15 -p no:cacheprovider $xdist \
    -m "cuda or cuda2" tests ${HETCOMM_GPU_TESTS:-} --junitxml "$out/gpu_tests.xml" || echo "# GPU TESTS FAILED"
fi
if has compress; then
  "$py" -m hetcomm.cli bench compress --device cuda -b 1M -e 256M -f 4 -n 20 -w 3 --json "$out/compress_cuda.json"
fi
if has ddp; then
  modes=torch-allreduce,torch-fp16,torch-powersgd,none,fp16,bf16,fp8,int3,onebit,topk,lowrank,auto,auto+m
  "$py" -m hetcomm.cli bench ddp --device cuda --ranks 2 --params 25M --global-batch 256 -n 20 -w 5 \
    --modes "$modes" --json "$out/ddp_cuda_shared.json"
  if [ "$ngpu" -ge 2 ]; then
    "$py" -m hetcomm.cli bench allreduce --device cuda --ranks "$ngpu" -b 1M -e 256M -f 4 -n 20 -w 5 \
      --json "$out/allreduce_cuda.json"
    "$py" -m torch.distributed.run --nproc_per_node "$ngpu" -m hetcomm.cli bench ddp --device cuda --params 25M --global-batch 256 \
      -n 20 -w 5 --modes "$modes" --json "$out/ddp_cuda_nccl.json"
  fi
fi
if has train; then
  "$py" -m hetcomm.cli bench train --device cuda --tasks "${HETCOMM_GPU_TRAIN_TASKS:-classify,lm}" --optims "${HETCOMM_GPU_TRAIN_OPTIMS:-sgd,adamw}" \
    --modes "${HETCOMM_GPU_TRAIN_MODES:-fp32,torch-powersgd,fp8,onebit+m,auto}" --json "$out/train_cuda.json" --png "$out/train_cuda.png"
fi
if has testbed; then
  why=$("$py" -c "from hetcomm import testbed; ok, why = testbed.netns_support(); print('ok' if ok else why)")
  if [ "$why" = ok ]; then
    # one invocation a task, each with its own JSON (written after every run: a cut-off call keeps what ran)
    for t in ${HETCOMM_GPU_TESTBED_TASKS:-classify lm}; do
      task=${t%%:*}; seeds=${HETCOMM_GPU_TESTBED_SEEDS:-2}; [[ $t == *:* ]] && seeds=${t#*:}
      echo "# testbed: $task, $seeds seeds, at $((SECONDS)) s"
      "$py" -m hetcomm.cli testbed --nodes 2 --ranks-per-node 2 --inter-node-rate "${HETCOMM_GPU_TESTBED_RATE:-100mbit}" \
        --sched batch --timeout 1800 -- "$py" -m hetcomm.cli bench train --device cuda \
        --tasks "$task" --optims sgd,adamw --seeds "$seeds" --modes "${HETCOMM_GPU_TESTBED_MODES:-fp32,torch-powersgd,auto}" \
        --json "$out/train_cuda_testbed_$task.json" --png "$out/train_cuda_testbed_$task.png" \
        || echo "# testbed stage failed on $task"
    done
  else
    echo "# testbed stage skipped: $why"
  fi
fi
if has layouts; then
  why=$("$py" -c "from hetcomm import testbed; ok, why = testbed.netns_support(); print('ok' if ok else why)")
  if [ "$why" = ok ]; then
    for tm in ${HETCOMM_GPU_LAYOUTS:-rnn:int3 lm:int3}; do
      echo "# layouts: ${tm%%:*} ${tm#*:} at $((SECONDS)) s"
      "$py" -m hetcomm.cli testbed --nodes 2 --ranks-per-node 2 --inter-node-rate "${HETCOMM_GPU_TESTBED_RATE:-100mbit}" \
        --sched batch --timeout 900 -- "$py" bench/bucket_layouts.py "${tm%%:*}" "${tm#*:}" adamw 150 30 4 -,0.5 \
        --device cuda > "$out/bucket_layouts_${tm%%:*}_${tm#*:}.txt" 2>&1 || echo "# layouts failed on $tm"
      grep -v "^\[W" "$out/bucket_layouts_${tm%%:*}_${tm#*:}.txt" | tail -4 || true
    done
  else
    echo "# layouts stage skipped: $why"
  fi
fi
if has profile; then
  ncu --section SpeedOfLight --section Occupancy --kernel-name regex:'sign|fp8|int3|cast|select|sample|accumulate|outer' \
    --launch-skip 0 "$py" bench/gpu/profile_codecs.py > "$out/ncu_codecs.txt" 2>&1 || echo "# ncu failed"
  grep -E "^  [a-z_:<>0-9A-Z]+.*\(|Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Registers Per" \
    "$out/ncu_codecs.txt" || true
fi
echo "# done at $SECONDS s"
