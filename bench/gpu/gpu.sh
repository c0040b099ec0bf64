#!/usr/bin/env bash
# Throughput of the 1-GPU ladder (configs/gpu1_125m, gpu1_350m, gpu1_1b, gpu1_2b, smallest first)
# on this machine's GPU within 8 minutes in all: bench/throughput.py's table, printed last.
# Written for the lent H200 machine (python3 with jax 0.11.2 and CUDA 13, no internet) and meant
# for any machine with a GPU and JAX; run there on 2026-12-04 (docs/performance.md, "GPU and TPU:
# measured"), and end to end on CPU by tests/test_bench.py. bench/gpu/device_run.sh runs it with
# the GPU's other checks.
#
#   bash bench/gpu/gpu_wheels.sh    # once, where pip reaches PyPI: the wheels the H200 image lacks, into .whl/
#   bash bench/gpu/gpu.sh           # on the GPU machine, with .whl carried along with the working tree
#
# Wheels in .whl/ are installed into a temporary folder put first on PYTHONPATH (the image's own
# packages are left alone). Whatever is missing (a GPU, a new enough jax, a package, the .whl
# folder) stops the script within seconds with one line naming it and the fix, and status 1.
# A config that fails, runs out of memory or out of time is a row of the table saying so.
#
# Environment, [default]:
#   PYTHON                  the interpreter [python3]
#   SEQAX_BENCH_CONFIGS     configs, in order [gpu1_125m gpu1_350m gpu1_1b gpu1_2b]
#   SEQAX_BENCH_OVERRIDES   hydra overrides for every config, space-separated []
#   SEQAX_BENCH_STEPS       timed steps per config, after SEQAX_BENCH_WARMUP untimed ones [10, 3]
#   SEQAX_BENCH_TIMEOUT     seconds per config, start-up and compile included [180]
#   SEQAX_BENCH_BUDGET      seconds for the whole script, checks and installs included [480]
#   SEQAX_BENCH_WHEELS      the wheels folder [.whl]
#   SEQAX_BENCH_JSON        also write the rows there as JSON [$OUT/throughput.json if $OUT is set]
#   SEQAX_BENCH_ALLOW_CPU   1: accept a CPU backend (the tests run this script end to end on CPU)
set -euo pipefail
cd "$(dirname "$0")/../.."

PYTHON=${PYTHON:-python3}
CONFIGS=${SEQAX_BENCH_CONFIGS:-gpu1_125m gpu1_350m gpu1_1b gpu1_2b}
OVERRIDES=${SEQAX_BENCH_OVERRIDES:-}
STEPS=${SEQAX_BENCH_STEPS:-10}
WARMUP=${SEQAX_BENCH_WARMUP:-3}
TIMEOUT=${SEQAX_BENCH_TIMEOUT:-180}
BUDGET=${SEQAX_BENCH_BUDGET:-480}
WHEELS=${SEQAX_BENCH_WHEELS:-.whl}
JSON=${SEQAX_BENCH_JSON:-${OUT:+$OUT/throughput.json}}
ALLOW_CPU=${SEQAX_BENCH_ALLOW_CPU:-0}
# Time kept back from the benchmark for printing the table and exiting.
MARGIN=10

fail() {
    echo "bench/gpu/gpu.sh: error: $*" >&2
    exit 1
}

# JAX preallocates 75% of the GPU's memory by default: 104 GiB of an H200's 139, and gpu1_1b
# peaked at 111.2 GiB on one (2026-12-04), so the pool is larger. 90% (NVIDIA's usual setting)
# leaves the rest to CUDA, cuBLAS and cuDNN. The peak memory in the table is what the step used, not this pool.
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}
# The latency-hiding scheduler overlaps collectives with computation (FSDP's all-gathers and
# reduce-scatters on several GPUs; NVIDIA's JAX images set it); with one GPU it changes nothing.
# Only flags that jaxlib 0.10 and 0.11 know (0.11.2 ran it on an H200): XLA aborts on an unknown
# flag, which bench.gpu.gpu_check reports within seconds.
export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_latency_hiding_scheduler=true"
export PYTHONUNBUFFERED=1

command -v "$PYTHON" >/dev/null || fail "no Python interpreter '$PYTHON': set PYTHON to the python3 that has jax"

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT

if [ -d "$WHEELS" ]; then
    compgen -G "$WHEELS/*.whl" >/dev/null || fail "the wheels folder $WHEELS holds no .whl files: run bash bench/gpu/gpu_wheels.sh where pip reaches PyPI"
    "$PYTHON" -m pip --version >/dev/null 2>&1 || fail "$PYTHON has no pip to install the wheels in $WHEELS: use a Python with pip (set PYTHON)"
    if ! "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$scratch/site" "$WHEELS"/*.whl \
            >"$scratch/pip.log" 2>&1; then
        fail "pip could not install $WHEELS/*.whl for $PYTHON ($(grep -m1 -i error "$scratch/pip.log" || tail -n1 "$scratch/pip.log")); run bash bench/gpu/gpu_wheels.sh again (wheels for Python 3.12, manylinux x86_64)"
    fi
    export PYTHONPATH="$scratch/site${PYTHONPATH:+:$PYTHONPATH}"
fi

check_args=(--wheels-dir "$WHEELS")
[ "$ALLOW_CPU" = 1 ] && check_args+=(--allow-cpu)
set +e
devices=$("$PYTHON" -m bench.gpu.gpu_check "${check_args[@]}" 2>"$scratch/check.err")
status=$?
set -e
if [ "$status" != 0 ]; then
    # gpu_check prints what is missing on stdout; anything it did not foresee (an exception, XLA
    # refusing a flag in XLA_FLAGS, a crash) leaves its reason as the last line of stderr.
    reason=${devices:-$(grep -v '^[[:space:]]*$' "$scratch/check.err" | tail -n1)}
    fail "${reason:-checking JAX with $PYTHON ended with status $status and no message}"
fi
echo "bench/gpu/gpu.sh: $devices; configs: $CONFIGS" >&2

left=$((BUDGET - SECONDS - MARGIN))
[ "$left" -gt 0 ] || fail "no time left of SEQAX_BENCH_BUDGET=$BUDGET s after the checks ($SECONDS s)"
# Word splitting of CONFIGS and OVERRIDES is intended: each is a space-separated list. Not exec:
# the EXIT trap removes the installed wheels afterwards.
# shellcheck disable=SC2086
"$PYTHON" -m bench.throughput --config $CONFIGS --steps "$STEPS" --warmup "$WARMUP" --timeout "$TIMEOUT" --budget "$left" \
    ${JSON:+--json "$JSON"} -- $OVERRIDES
