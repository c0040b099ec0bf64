#!/usr/bin/env bash
# Everything a lent GPU is for, in one run of about 10 minutes, the parts in order of priority, so that
# a call's time limit cuts the last ones (device time is short; docs/performance.md, "GPU and TPU: measured"):
#   1. gpu1_1b's throughput (bench/gpu/gpu.sh's table: step time, MFU, peak memory, the roofline's
#      prediction beside the measurement);
#   1b. gpu1_1b with model.matmul_dtype=float8, the same table: float8 against bf16, side by side (the
#      roofline forecasts 1.27x tokens/s on an H200; docs/performance.md, "Float8 matmuls");
#   2. the checks only a GPU can make (tests/test_gpu.py; the MoE dispatch and a training step with the
#      Pallas kernels, from test_moe.py and test_flash_attention.py, which run on one device of any kind);
#   3. the mixture of experts against dense on one GPU (gpu8_1b_moe and gpu1_1b cut to 10 layers and
#      one GPU's batch of 24: the same active FLOPs per token);
#   4. the rest of the 1-GPU ladder (gpu1_350m, gpu1_125m, gpu1_2b) as long as time is left;
#   5. attention alone (bench/attention.py: ours, cuDNN's causal kernel as the anchor, blockwise), one
#      document a row, so that ours does cuDNN's work.
# Each part has a time limit of its own, so that a part that hangs or fails leaves the others their time.
# The limits are the second H200 run's times plus a margin (2026-12-04: 55 s, 136 s of tests, 84 s to
# compile the mixture and 35 s for dense, 40-56 s a ladder config, 43 s of attention).
# Everything printed is kept in $OUT/run.log; the tables as Markdown, the rows as JSON.
#
#   bash bench/gpu/gpu_wheels.sh        # here, once: .whl
#   bash bench/gpu/device_run.sh        # there, with .whl carried
set -uo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
OUT=${OUT:-$(mktemp -d)}
exec > >(tee "$OUT/run.log") 2>&1
export PYTHONUNBUFFERED=1

"$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/seqax-site .whl/*.whl \
    || { echo "device_run.sh: the wheels in .whl do not install: run bash bench/gpu/gpu_wheels.sh here first"; exit 1; }
export PYTHONPATH=/tmp/seqax-site${PYTHONPATH:+:$PYTHONPATH}
# gpu.sh installs .whl itself where it is a folder; here they are installed once for every part.
export SEQAX_BENCH_WHEELS=/nonexistent PYTHON
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv

part() { echo; echo "=== $1 ($SECONDS s so far)"; }

ladder() {  # ladder NAME SECONDS CONFIGS [OVERRIDES]
    SEQAX_BENCH_CONFIGS=$3 SEQAX_BENCH_OVERRIDES=${4:-} SEQAX_BENCH_STEPS=6 SEQAX_BENCH_WARMUP=2 \
        SEQAX_BENCH_TIMEOUT=$2 SEQAX_BENCH_BUDGET=$2 SEQAX_BENCH_JSON="$OUT/$1.json" \
        bash bench/gpu/gpu.sh | tee "$OUT/$1.md"
}

part "gpu1_1b"
ladder ladder_1b 120 gpu1_1b

part "gpu1_1b in float8"
ladder ladder_1b_float8 120 gpu1_1b "model.matmul_dtype=float8"

part "checks only a GPU can make"
JAX_DEFAULT_MATMUL_PRECISION=highest timeout 150 "$PYTHON" -m pytest -q -s -p no:cacheprovider tests/test_gpu.py \
    tests/test_moe.py::test_the_dispatch_computes_every_chosen_expert_of_every_token \
    tests/test_flash_attention.py::test_training_steps_with_the_pallas_kernel_equal_blockwise 2>&1 | tail -n 25

part "mixture of experts against dense, 10 layers, batch 24"
ladder moe 150 "gpu8_1b_moe gpu1_1b" "mesh.d=1 training.tokens.batch=24 model.layers=10"

part "the rest of the ladder"
ladder ladder_rest 140 "gpu1_350m gpu1_125m gpu1_2b"

part "attention alone, forward and backward"
timeout 60 "$PYTHON" -m bench.attention --batch 8 --heads 16 --kv-heads 4 --d-head 128 --lengths 2048 8192 \
    --documents 1 --methods pallas cudnn blockwise 2>&1 | tee "$OUT/attention.txt"
part "done"
