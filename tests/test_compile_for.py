"""bench/compile_for.py with the real GPU and TPU compilers (.venv-compilers, `make compilers`): the
synthetic config's step compiled for one H200, for a host of 8 and for a TPU v6e host (with the
Pallas attention kernels, the default there) fits their memory, has its collectives where the mesh
needs them (asynchronous on the GPUs; on the TPU the weights' gathers), and the roofline's matmul FLOPs
are exactly what the code computes: the model's, plus what the attention kernel (blockwise, or Pallas)
computes beyond the causal half and recomputes, plus Muon's Newton-Schulz; with model.matmul_dtype=float8, the layers'
matrices multiply as float8 GEMMs on an H200 and a B200 (and of an operand's cast, the H200's compiler folds
only a bare convert into the GEMM: bench/float8_fusion.py)."""

import json
import math
import os
import subprocess

import jax
import pytest

import train
from fixtures import ROOT
from seqax.config import load_config
from seqax.kernels.flash_attention import tiling_for
from seqax.kernels.flash_blocks import matmul_flops

COMPILERS_PYTHON = os.path.join(ROOT, ".venv-compilers", "bin", "python")
pytestmark = pytest.mark.slow  # real compiles, 10-30 s each


def compile_for(tmp_path, name: str, configs: list[str], targets: list[str], *overrides: str) -> list[dict]:
    assert os.path.exists(COMPILERS_PYTHON), "the compilers' venv is missing: run `make compilers` (make test does)"
    rows = tmp_path / f"{name}.json"
    command = [COMPILERS_PYTHON, "-m", "bench.compile_for", "--config", *configs, "--target", *targets,
               "--json", str(rows), "--", *overrides]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    # each compile is announced before it starts (a large one takes minutes), its report after it
    said = [line for line in result.stdout.splitlines() if line.startswith("compiling ")]
    assert len(said) == len(configs) * len(targets) and result.stdout.startswith("compiling "), result.stdout
    assert said[0].startswith(f"compiling {configs[0]}'s training step for "), said
    return json.loads(rows.read_text())


@pytest.fixture(scope="module")
def eight_devices(tmp_path_factory):
    """local_test_synthetic as it is (mesh d=4 t=2) on 8 H200s and on a TPU v6e host of 8 chips."""
    return {row["target"]: row for row in compile_for(tmp_path_factory.mktemp("eight"), "eight",
                                                      ["local_test_synthetic"], ["h200", "v6e"])}


def test_the_step_fits_each_device_and_its_compiler_says_how(eight_devices):
    """... and memory.py's estimate, which models what an accelerator holds (an upper bound of most terms),
    is within 35% of each target compiler's plan (2026-12-04: 0.81 of the H200's, 1.24 of the v6e's; 1.32 of
    the v6e's with its weights' gathers as rings of collective permutes, its plan 20.8 MiB, the estimate 27.4
    MiB). XLA:CPU plans more than either for the unrolled layers (0.65), so this is where the estimate is
    checked."""
    for row in eight_devices.values():
        assert 0 < row["memory_gib"] < 0.9 * row["device_memory_gib"], row
        assert 0.7 <= row["estimate_gib"] / row["memory_gib"] <= 1.35, row
        assert row["estimate_gib"] > 0 and row["compile_seconds"] > 0
        assert 0 < row["mfu_ceiling"] < 1 and row["step_seconds"] > 0
        # where the time goes: all of it
        assert abs(sum(row["seconds_by_kind"].values()) / row["step_seconds"] - 1) < 1e-6


def test_the_collectives_of_fsdp_and_tensor_parallelism_are_found(eight_devices):
    """d=4 t=2: the layers' weights are gathered and their gradients reduce-scattered every step; the
    GPU compiler runs its collectives asynchronously (beside the kernels), the TPU's most of them."""
    gpu = eight_devices["h200"]
    assert gpu["collectives_per_step"] > 20 and gpu["communication_mib"] > 0
    assert gpu["asynchronous_collectives"] > 0
    # On the TPU every all-gather and reduce-scatter runs on the SparseCores, beside the TensorCores (seqax/xla_tpu.py),
    # which take floats: as bf16's bits (uint16) the weights' gathers stayed synchronous (2026-12-07: 41 of 103
    # collectives asynchronous then, 69 of 104 now; the rest are all-to-alls and small all-reduces).
    tpu = eight_devices["v6e"]
    assert tpu["collectives_per_step"] > 20 and tpu["asynchronous_collectives"] > 0.6 * tpu["collectives_per_step"]
    assert not {"all-gather", "reduce-scatter"} & set(tpu["synchronous_collectives_by_op"]), tpu


@pytest.mark.parametrize("target", ["v6e", "v5p"])
def test_fsdp_over_a_whole_torus_reduce_scatters_and_gathers_beside_the_cores(tmp_path, target):
    """FSDP over 16 chips, a group that spans two of the torus's dimensions (v6e 4x4) or all three (v5p
    2x2x4): without seqax/xla_tpu.py's flags for such groups libtpu reduces the gradients by all-reducing
    the whole array (twice a reduce-scatter's bytes, and the whole array in memory), and a v5p gathers the
    weights synchronously (2026-12-07: no reduce-scatter, all-reduces 15.0 MiB, plan 29.4 / 32.7 MiB; the
    8B's step 427 ms and 25.7 GiB). With them: reduce-scatters and all-gathers, beside the cores (6.8 MiB
    reduce-scattered, 1.4 all-reduced: w_o's gradient, scattered along its last dimension, and the small
    sums; plan 19.0 / 24.0 MiB; the 8B's step 341 ms, 19.2 GiB)."""
    [row] = compile_for(tmp_path, target, ["local_test_synthetic"], [target], "mesh.d=16", "mesh.t=1")
    sent = row["communication_mib_by_kind"]
    assert sent.get("reduce-scatter", 0) > 0 and sent["all-gather"] > 0, sent
    assert sent.get("all-reduce", 0) < 0.5 * sent["reduce-scatter"], sent
    assert not {"all-gather", "reduce-scatter"} & set(row["synchronous_collectives_by_op"]), row


@pytest.mark.parametrize("kernel", ["blockwise", "pallas"])
def test_the_roofline_counts_every_matmul_the_step_computes(tmp_path, kernel):
    """One H200 (mesh 1x1): the HLO's matmul FLOPs are the model's (6 per parameter of the matrices a
    token goes through, and attention's causal half, x 3 for forward and backward) with attention's
    replaced by what the kernel computes, plus Newton-Schulz on the one device, plus what the backward
    pass computes again (a matmul whose output it needs and no save_for_backward keeps: none in train.py
    as it is; a model edit that leaves one unmarked adds it, and compile_for reports it). Blockwise: every
    block pair on or below the diagonal, forward QK^T and PV, backward QK^T again, dV, dP, dQ and
    dK: 14 B H b^2 D a pair, N(N + 1)/2 pairs of N blocks. Pallas: the FLOPs its kernels state, the
    same pairs of their own blocks with 2 block matmuls forward, 3 for dq and 4 for dk and dv."""
    [row] = compile_for(tmp_path, "one", ["local_test_synthetic"], ["h200"], "mesh.d=1", "mesh.t=1",
                        f"model.attention_kernel={kernel}")
    cfg = load_config("local_test_synthetic", ["+paths.model_name=x", "mesh.d=1", "mesh.t=1"])
    h, B, L = cfg.model, cfg.training.tokens.batch, cfg.training.tokens.len
    heads, b = h.n_q_per_kv * h.n_kv, h.attention_block
    N = L // b
    attention_model = h.layers * 6 * B * heads * h.d_head * L * L  # 3 x 2 x 2 x (QK^T and PV over half the keys)
    if kernel == "blockwise":
        attention = h.layers * 14 * B * heads * b * b * h.d_head * N * (N + 1) / 2
    else:
        tiling = tiling_for("gpu", h.n_q_per_kv, b, L)
        attention = h.layers * matmul_flops(B, L, h.n_q_per_kv, h.n_kv, h.d_head, L, tiling, matmuls=2 + 3 + 4)
    model = train.model_flops_per_token(h, L) * B * L
    _, newton_schulz = train.newton_schulz_flops(h, 1)
    recomputed = row["hlo_recomputed_matmul_tflop_per_device"] * 1e12
    expected = model - attention_model + attention + newton_schulz + recomputed
    assert row["model_tflop_per_device"] * 1e12 == pytest.approx(model, rel=1e-9)
    assert row["hlo_matmul_tflop_per_device"] * 1e12 == pytest.approx(expected, rel=1e-3), (row, expected)


def test_the_layers_matrices_experts_and_unembedding_multiply_in_float8_on_hopper_and_blackwell(tmp_path):
    """model.matmul_dtype=float8 on one H200 and one B200, a mixture of experts beside the dense SwiGLU: their
    compilers multiply the layers' matrices, the experts and the unembedding as float8 GEMMs (the HLO's dot
    takes both operands in float8, not widened to bf16 first). The float8 matmul FLOPs are exactly 6 per
    parameter of every dense matrix of the layers and of the unembedding per token (the forward and both
    gradients) plus the experts' blocks' 11 matmuls (counted as the next test counts them), which the roofline
    prices at the float8 rate (test_roofline); the other matmuls (attention, the router, the gates' sum,
    Newton-Schulz) stay bf16 or float32."""
    moe = ["+model.experts=4", "+model.experts_per_token=2", "+model.expert_d_ff=512", "+model.expert_block=64"]
    rows = compile_for(tmp_path, "float8", ["local_test_synthetic"], ["h200", "b200"], "mesh.d=1", "mesh.t=1",
                       "model.matmul_dtype=float8", "model.attention_kernel=blockwise", *moe)
    cfg = load_config("local_test_synthetic", ["+paths.model_name=x", "mesh.d=1", "mesh.t=1", *moe])
    h, tokens = cfg.model, cfg.training.tokens.batch * cfg.training.tokens.len
    layers = jax.eval_shape(lambda: train.init_weights(h, jax.random.key(0))).layers
    layer_matrices = ("w_q", "w_k", "w_v", "w_o", "w_gate", "w_up", "w_down")
    matrices = sum(math.prod(getattr(layers, name).shape) for name in layer_matrices) + h.d_model * h.vocab
    blocks = -(-(tokens * h.experts_per_token // h.experts + h.expert_block // 2) // h.expert_block)
    experts = h.layers * 2 * h.d_model * h.expert_d_ff * 11 * h.experts * blocks * h.expert_block
    for row in rows:
        assert row["hlo_float8_matmul_tflop_per_device"] * 1e12 == pytest.approx(6 * matrices * tokens + experts,
                                                                                 rel=1e-9), row
        assert 0.5 < row["hlo_float8_matmul_tflop_per_device"] / row["hlo_matmul_tflop_per_device"] < 1, row


def test_the_roofline_counts_the_experts_padded_blocks_and_prices_their_dispatch(tmp_path):
    """A mixture of experts (4 experts of 512, 2 a token, the dense SwiGLU as a shared expert) on one
    H200: the HLO's matmul FLOPs are the model's (active experts only) with the experts' rows replaced
    by the blocks the step computes at a balanced load (each expert's loop runs the trips it names:
    B L k / E rows and half a block, in whole blocks of b rows), each block's 3 matmuls forward once
    (the experts' output is saved: the recomputed forward pass does not run them) and 8 backward (gate
    and up recomputed, then the gradients of the hidden values, the input and the 3 weights), the
    gates' weighted sum (a batched dot over the k choices), blockwise attention's, Newton-Schulz's and
    the recomputed ones, as above; the experts' matmuls and dispatch are priced."""
    moe = ["+model.experts=4", "+model.experts_per_token=2", "+model.expert_d_ff=512", "+model.expert_block=64"]
    [row] = compile_for(tmp_path, "moe", ["local_test_synthetic"], ["h200"], "mesh.d=1", "mesh.t=1",
                        "model.attention_kernel=blockwise", *moe)
    cfg = load_config("local_test_synthetic", ["+paths.model_name=x", "mesh.d=1", "mesh.t=1", *moe])
    h, B, L = cfg.model, cfg.training.tokens.batch, cfg.training.tokens.len
    heads, b, N = h.n_q_per_kv * h.n_kv, h.attention_block, L // h.attention_block
    attention = h.layers * (14 * B * heads * b * b * h.d_head * N * (N + 1) / 2 - 6 * B * heads * h.d_head * L * L)
    k, E, H, M = h.experts_per_token, h.experts, h.expert_d_ff, h.d_model
    blocks = -(-(B * L * k // E + h.expert_block // 2) // h.expert_block)  # balanced, half a block of padding
    computed = E * blocks * h.expert_block
    experts = h.layers * 2 * M * H * (11 * computed - 9 * B * L * k)  # less the model's active experts: 3 x 3 matmuls
    combine = h.layers * 3 * 2 * B * L * k * M
    model = train.model_flops_per_token(h, L) * B * L
    recomputed = row["hlo_recomputed_matmul_tflop_per_device"] * 1e12
    expected = model + attention + experts + combine + train.newton_schulz_flops(h, 1)[1] + recomputed
    assert row["hlo_matmul_tflop_per_device"] * 1e12 == pytest.approx(expected, rel=1e-3), (row, expected)
    assert row["seconds_by_kind"]["experts: matmuls"] > 0
    assert row["seconds_by_kind"]["experts: dispatch (routing, gathers, combine)"] > 0


def test_the_pallas_kernels_compile_around_the_ring(tmp_path):
    """Mesh d=2 t=2 c=2 on 8 H200s: the Pallas kernels at every ring step, forward and backward, and
    their block pairs' FLOPs counted (XLA's GPU compiler failed on this ring until its loop carried
    k and v as their bits: flash_attention.carried)."""
    [row] = compile_for(tmp_path, "ring", ["local_test_synthetic"], ["h200"], "mesh.d=2", "mesh.t=2", "mesh.c=2",
                        "training.tokens.len=128")
    assert 0 < row["memory_gib"] < 0.9 * row["device_memory_gib"], row
    assert row["seconds_by_kind"]["attention"] > 0 and row["collectives_per_step"] > 20


def test_the_hopper_kernels_compile_for_hopper_and_are_priced_at_their_flops(tmp_path):
    """flash_hopper.py's kernels (model.attention_kernel=pallas_hopper: Mosaic GPU custom calls) compiled for an
    H100 and an H200 with the 1b model's heads at L = 8192: the roofline reads the matmul FLOPs they state, so
    their forward + backward lies just above causal attention's FLOPs bound (1.5x: the backward's recomputed
    scores; a little more: the operands XLA transposes for them), as Triton's kernels do. On a B200 (no wgmma:
    its lowering refuses the kernels) the request stops with one line. And a training step with them around
    the context-parallel ring compiles for 8 H200s."""
    rows = tmp_path / "rows.json"
    command = [COMPILERS_PYTHON, "-m", "bench.attention_for", "--target", "h100", "h200", "--models", "1b",
               "--lengths", "8192", "--methods", "pallas_hopper", "pallas_triton", "--json", str(rows)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    found = {(row["target"], row["method"]): row for row in json.loads(rows.read_text())}
    for target in ("h100", "h200"):
        hopper, triton = found[target, "pallas_hopper"], found[target, "pallas_triton"]
        assert 1.5 < hopper["roofline_seconds"] / hopper["bound_seconds"] < 1.7, hopper
        assert hopper["roofline_seconds"] < 1.1 * triton["roofline_seconds"], (hopper, triton)
    command[command.index("h100"):command.index("--models")] = ["b200"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode != 0 and "pallas_hopper needs a Hopper GPU" in result.stderr, result.stderr[-2000:]
    # and in the training step, around the ring (c = 2: float32 results staged apart) on 8 H200s
    [row] = compile_for(tmp_path, "hopper_ring", ["local_test_synthetic"], ["h200"], "mesh.d=2", "mesh.t=2",
                        "mesh.c=2", "training.tokens.len=256", "model.d_head=64", "model.attention_block=64",
                        "model.attention_kernel=pallas_hopper")
    assert row["seconds_by_kind"]["attention"] > 0 and row["collectives_per_step"] > 20, row


def test_the_pallas_kernels_are_near_their_flops_bound_and_linear_in_memory(tmp_path):
    """bench/attention_for.py on one H200 with the 1b model's heads (4 x 4 of 128), one row: per the
    roofline, the Triton kernels' forward + backward at L = 8192 takes at most 1.6x causal
    attention's FLOPs at the peak (1.5x is what they compute: the backward recomputes the scores in
    both of its kernels, 9 block matmuls a pair against the 6 the count has; 1.57 when written),
    where blockwise takes over 10x; their temporary memory grows as L, from 2048 to 8192 at most
    4.5x, and so does the Hopper kernels'. (A fused backward that added dq with atomics priced 1.28x here
    and ran 2.9x slower on an H200, 2026-12-04: the roofline does not price atomics,
    docs/flash-attention.md.)"""
    rows = tmp_path / "rows.json"
    command = [COMPILERS_PYTHON, "-m", "bench.attention_for", "--target", "h200", "--models", "1b", "--lengths",
               "2048", "8192", "--methods", "blockwise", "pallas_triton", "pallas_hopper", "--json", str(rows)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    found = {(row["method"], row["length"]): row for row in json.loads(rows.read_text())}
    triton, blockwise = found["pallas_triton", 8192], found["blockwise", 8192]
    assert 1.5 < triton["roofline_seconds"] / triton["bound_seconds"] < 1.6, triton
    assert blockwise["roofline_seconds"] / blockwise["bound_seconds"] > 10, blockwise
    for kernels in ("pallas_triton", "pallas_hopper"):
        assert 0 < found[kernels, 8192]["temp_bytes"] <= 4.5 * found[kernels, 2048]["temp_bytes"], kernels


def test_a_compiler_that_is_not_installed_is_one_line(tmp_path):
    """The tool in the ordinary venv, which has no GPU compiler: one line naming it, exit 1."""
    result = subprocess.run([os.path.join(ROOT, ".venv", "bin", "python"), "-m", "bench.compile_for", "--config",
                             "local_test_synthetic", "--target", "h200"], cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    assert "jax-cuda12-plugin" in lines[0] and "make compilers" in lines[0]


def test_a_context_parallel_mesh_is_made_on_a_tpu_torus_whose_axes_it_does_not_match():
    """tpu256_8b's mesh d=128 c=2 on a v6e 16x16 slice: no subset of the torus's axes (16, 16) has c's size 2,
    which jax.make_mesh refuses; make_mesh then splits a physical axis, so every device is used once."""
    code = ("from jax.experimental import topologies\n"
            "from seqax.multihost import make_mesh\n"
            "devices = topologies.get_topology_desc('v6e:16x16', 'tpu', chips_per_host_bounds=[2, 4, 1]).devices\n"
            "mesh = make_mesh(128, 1, 2, devices=devices)\n"
            "print(dict(mesh.shape), len({d.id for d in mesh.devices.flat}))\n")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "TPU_WORKER_HOSTNAMES": "localhost", "TPU_ACCELERATOR_TYPE": "v6e-256",
           "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
    result = subprocess.run([COMPILERS_PYTHON, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "{'d': 128, 'c': 2, 't': 1} 256"


def test_the_gpu_compiler_folds_only_a_bare_convert_into_a_float8_gemm():
    """bench/float8_fusion.py on an H200, at a small product: the compiler reads a bf16 operand into its float8
    GEMM when the cast is a bare convert, and leaves a cast kernel (one pass over the operand more) for any
    scale or clip on the way, float8.scaled's included: what docs/performance.md ("What XLA fuses into a float8
    GEMM") builds its estimates on, checked again whenever the compilers change."""
    result = subprocess.run([COMPILERS_PYTHON, "-m", "bench.float8_fusion", "--shape", "4096", "1024", "2048"],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    verdicts = {line[:50].strip(): line[50:].strip() for line in result.stdout.splitlines()[1:]}
    assert len(verdicts) == 8, result.stdout
    folded = {name for name, verdict in verdicts.items() if verdict.startswith("folded into the GEMM")}
    assert folded == {"bare convert"}, result.stdout
