"""What only a GPU can check: our Pallas kernels compiled by Triton (not interpreted) and the mixture of
experts' ragged exchange (lax.ragged_all_to_all, which XLA:CPU lacks) computing what the float32
statements say. Skipped where JAX's backend is not a GPU, so CI (no GPU) never runs them; run them on
one with `python -m pytest tests/test_gpu.py` (bench/gpu/device_run.sh does, with the benchmarks).

Float32 matmuls run at JAX's highest precision here: a GPU's default takes TF32 (10 bits of
mantissa), which no float32 comparison of ours allows.
"""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from fixtures import make_mesh
from seqax.kernels import attention
from seqax.kernels.flash_attention import lowering_for
from test_flash_attention import check, doc_starts, exact, qkv_and_cotangent
from test_moe import assert_equals_reference, moe_problem, reference_of

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU (JAX's backend here is not one)")


@pytest.mark.parametrize("kernel", ["pallas_triton", "pallas_hopper"])
@pytest.mark.parametrize("q_per_kv", [1, 4])
def test_the_flash_kernels_meet_the_bfloat16_bounds(q_per_kv, kernel):
    """The GPU kernels as training compiles them (model.attention_kernel=pallas_triton or pallas_hopper:
    Triton's and, on a Hopper, Mosaic GPU's; blocks per flash_attention.tiling_for) on the ladder's head
    size and a length of 2048 with packed documents (one crossing many blocks, short ones, one a block
    long), grouped-query attention: o, dq, dk and dv against float32 attention with every score
    materialized, each element within twice its bfloat16 bound (tests/test_flash_attention.py states
    them)."""
    device = jax.devices()[0]
    if kernel == "pallas_hopper" and lowering_for("pallas", "gpu", device.device_kind, 128, 512) != "hopper":
        pytest.skip(f"the Hopper kernels need a Hopper; this is {device.device_kind}")
    B, L, K, D, block = 2, 2048, 2, 128, 512
    q, k, v, do = qkv_and_cotangent(1, B, L, L, q_per_kv, K, D)
    doc = doc_starts([[3, 64, 65, 700, 1536], [1024]], L)
    position = np.arange(L, dtype=np.uint32)
    attend = attention.kernel_for(kernel, "gpu", device.device_kind)
    rows = P(None, "c")

    def run(q, k, v, doc_start, row_position, do):
        o, pullback = jax.vjp(lambda q, k, v: attend(q, k, v, doc_start, row_position, block), q, k, v)
        return (o, *pullback(do))

    on_gpu = jax.jit(jax.shard_map(run, mesh=make_mesh(1, 1, 1), in_specs=(rows, rows, rows, rows, P("c"), rows),
                                   out_specs=rows))
    got = on_gpu(q, k, v, doc, position, do)
    with jax.default_matmul_precision("highest"):
        want, bounds = exact(q, k, v, doc, doc, position, position, do)
    check(f"{kernel}, Q={q_per_kv}, on the GPU", got, want, bounds)


def test_float32_moe_loss_loads_and_gradients_equal_every_expert_on_every_token():
    """tests/test_moe.py's check on one GPU: the tiny MoE's loss (1e-6), expert loads (exact) and every
    gradient (1e-4) against the reference that runs every expert on every token, through the ragged
    exchange's GPU branch. Attention is the reference kernel here: float32 throughout."""
    with jax.default_matmul_precision("highest"):
        cfg, weights, batch = moe_problem("model.attention_kernel=reference")
        assert_equals_reference(cfg, weights, batch, reference_of(cfg, weights, batch, 0.3), make_mesh(1, 1, 1), 0.3)
