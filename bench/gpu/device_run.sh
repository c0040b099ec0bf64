#!/usr/bin/env bash
# Everything a lent GPU is for, in one run of about 10 minutes, the parts in order of priority, so that
# a call's time limit cuts the last ones (device time is short; docs/performance.md, "GPU and TPU: measured"):
#   1. attention: the Hopper kernels (flash_hopper.py, never run on a device before) checked against exact
#      attention on the GPU (tests/test_gpu.py, beside Triton's), then timed alone beside Triton's, cuDNN's
#      causal kernel and JAX's Mosaic GPU example (forward only) at L = 2048, 8192, 32768 (bench/attention.py);
#   2. gpu1_1b's throughput (bench/gpu/gpu.sh's table: step time, MFU, peak memory, the roofline's
#      prediction beside the measurement) with the device's Pallas kernels (the Hopper ones on an H100 or
#      H200) and with Triton's, side by side;
#   2b. gpu1_1b with model.matmul_dtype=float8, the same table: float8 against bf16, side by side (the
#      roofline forecasts 1.36x tokens/s on an H200; docs/performance.md, "Float8 matmuls");
#   3. the other checks only a GPU can make (the MoE dispatch and a training step with the Pallas kernels,
#      from test_moe.py and test_flash_attention.py, which run on one device of any kind);
#   4. the mixture of experts against dense on one GPU (gpu8_1b_moe and gpu1_1b cut to 10 layers and
#      one GPU's batch of 24: the same active FLOPs per token);
#   5. the rest of the 1-GPU ladder (gpu1_350m, gpu1_125m, gpu1_2b) as long as time is left.
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

part "attention: the Hopper kernels checked on the GPU"
JAX_DEFAULT_MATMUL_PRECISION=highest timeout 120 "$PYTHON" -m pytest -q -s -p no:cacheprovider \
    "tests/test_gpu.py::test_the_flash_kernels_meet_the_bfloat16_bounds" 2>&1 | tail -n 12

part "attention alone, forward and backward"
timeout 150 "$PYTHON" -m bench.attention --batch 8 --heads 16 --kv-heads 4 --d-head 128 --lengths 2048 8192 \
    --documents 1 --methods pallas_triton pallas_hopper cudnn jax_mgpu 2>&1 | tee "$OUT/attention.txt"
timeout 90 "$PYTHON" -m bench.attention --batch 1 --heads 16 --kv-heads 4 --d-head 128 --lengths 32768 \
    --blocks 512 --documents 1 --methods pallas_triton pallas_hopper cudnn 2>&1 | tee -a "$OUT/attention.txt"

part "gpu1_1b, the device's Pallas kernels"
ladder ladder_1b 120 gpu1_1b

part "gpu1_1b, Triton's kernels"
ladder ladder_1b_triton 120 gpu1_1b "model.attention_kernel=pallas_triton"

part "gpu1_1b in float8"
ladder ladder_1b_float8 120 gpu1_1b "model.matmul_dtype=float8"

part "other checks only a GPU can make"
JAX_DEFAULT_MATMUL_PRECISION=highest timeout 150 "$PYTHON" -m pytest -q -s -p no:cacheprovider \
    tests/test_gpu.py::test_float32_moe_loss_loads_and_gradients_equal_every_expert_on_every_token \
    tests/test_moe.py::test_the_dispatch_computes_every_chosen_expert_of_every_token \
    tests/test_flash_attention.py::test_training_steps_with_the_pallas_kernel_equal_blockwise 2>&1 | tail -n 25

part "mixture of experts against dense, 10 layers, batch 24"
ladder moe 150 "gpu8_1b_moe gpu1_1b" "mesh.d=1 training.tokens.batch=24 model.layers=10"

part "the rest of the ladder"
ladder ladder_rest 140 "gpu1_350m gpu1_125m gpu1_2b"
part "done"
