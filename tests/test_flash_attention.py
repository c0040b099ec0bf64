"""The Pallas flash-attention kernels (flash_gpu.py, flash_tpu.py, around the ring of
flash_attention.py) in Pallas's interpret mode on this CPU, against float32 attention with every
score of a row materialized, against attention.py's blockwise kernel and its reference_attention,
and a training step with them against one with the blockwise kernel.

Tolerances: first-order bounds on the bfloat16 roundings the kernels make, per element, from the
exact (float32) values. q, k, v are bf16 and the exact attention upcasts the same values, and the
output's cotangent is bf16 (o is), so only roundings inside the kernels count, each a relative
error of at most u = 2^-8 (bf16's unit roundoff). They are: the softmax weights P rounded before
P V and P^T dO, the scores' gradient dS rounded before dS K and dS^T Q, and every result (o, dq,
dk, dv) rounded once. Products of bf16 numbers are exact in float32 and float32 sums add ~2^-24 a
term, negligible here. With A = P |V| (so |o| <= A), exact values throughout and dO the cotangent:
    o:   2u A                                   (P rounded, then o)
    dv:  u (2 P^T |dO| + |dv|)                  (P rounded, then dv; the factor 2 is slack)
    dS:  P (u |dO| |V|^T + 3u rowsum(|dO| A)) + u |dS|   (delta = rowsum(dO o) reads the rounded o;
                                                          the first term is slack for dO)
    dq:  scale |dS error| |K| + u |dq|          dk: scale |dS error|^T |Q| (over the group) + u |dk|
A result passes when every element's error is at most 2 x its bound (room for second-order
terms) + 1e-5 (float32 noise where the bound is ~0). attention.py's blockwise kernel and
reference_attention make the same roundings, so they meet the same bounds, and any two of them
differ by at most twice that. The largest error / bound seen is printed (pytest -s) and in
docs/flash-attention.md.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import train
from fixtures import make_mesh, put_batch, random_batch, tiny_config
from seqax.config import ConfigError
from seqax.data.data_loader import zigzag_order
from seqax.kernels import attention, flash_gpu, flash_hopper, flash_tpu
from seqax.kernels.flash_attention import _ring_flash_attention, merge, tiling_for
from seqax.kernels.flash_blocks import Tiling, key_block_ranges, query_block_ranges

F32 = jnp.float32
U = 2.0**-8  # bf16's unit roundoff


def doc_starts(starts_per_row, length: int) -> np.ndarray:
    """[B, length] uint32: where each position's document starts, from each row's document starts
    (train.document_positions's result)."""
    is_start = np.zeros((len(starts_per_row), length), bool)
    for b, starts in enumerate(starts_per_row):
        is_start[b, [0, *starts]] = True
    return np.maximum.accumulate(np.where(is_start, np.arange(length), 0), axis=1).astype(np.uint32)


def bf16_normal(rng, *shape) -> np.ndarray:
    """Numpy arrays throughout: an eager jnp op compiles on first use, which costs more than these tests' arithmetic."""
    return rng.standard_normal(shape, np.float32).astype(jnp.bfloat16)


def qkv_and_cotangent(seed: int, B: int, L: int, S: int, Q: int, K: int, D: int):
    rng = np.random.default_rng(seed)
    return (bf16_normal(rng, B, L, Q, K, D), bf16_normal(rng, B, S, K, D), bf16_normal(rng, B, S, K, D),
            bf16_normal(rng, B, L, Q, K, D))


@jax.jit
def exact(q, k, v, q_doc, k_doc, q_pos, k_pos, do):
    """Float32 attention with every score materialized, written out here (independent of the
    code under test): (o, dq, dk, dv) for the output cotangent do, and the bound of each."""
    q, k, v, do = (x.astype(F32) for x in (q, k, v, do))
    scale = q.shape[-1] ** -0.5
    mask = (k_pos[None, None, :] <= q_pos[None, :, None]) & (k_doc[:, None, :] == q_doc[:, :, None])  # [B, L, S]
    scores = jnp.where(mask[:, None, None], jnp.einsum("blqkd,bskd->bqkls", q, k) * scale, -jnp.inf)
    p = jax.nn.softmax(scores, axis=-1)  # [B, Q, K, L, S]
    o = jnp.einsum("bqkls,bskd->blqkd", p, v)
    dv = jnp.einsum("bqkls,blqkd->bskd", p, do)
    dp = jnp.einsum("blqkd,bskd->bqkls", do, v)
    ds = p * (dp - jnp.einsum("blqkd,blqkd->bqkl", do, o)[..., None])
    dq = scale * jnp.einsum("bqkls,bskd->blqkd", ds, k)
    dk = scale * jnp.einsum("bqkls,blqkd->bskd", ds, q)
    a = jnp.einsum("bqkls,bskd->blqkd", p, jnp.abs(v))
    d_delta = 3 * U * jnp.einsum("blqkd,blqkd->bqkl", jnp.abs(do), a)
    ds_err = p * (U * jnp.einsum("blqkd,bskd->bqkls", jnp.abs(do), jnp.abs(v)) + d_delta[..., None]) + U * jnp.abs(ds)
    bounds = (2 * U * a, scale * jnp.einsum("bqkls,bskd->blqkd", ds_err, jnp.abs(k)) + U * jnp.abs(dq),
              scale * jnp.einsum("bqkls,blqkd->bskd", ds_err, jnp.abs(q)) + U * jnp.abs(dk),
              2 * U * jnp.einsum("bqkls,blqkd->bskd", p, jnp.abs(do)) + U * jnp.abs(dv))
    return (o, dq, dk, dv), bounds


def check(name: str, got, want, bounds, slack: float = 2.0) -> list[float]:
    """Every element of o, dq, dk, dv within slack x its bound + 1e-5; returns error / bound, worst."""
    ratios = []
    for part, g, w, bound in zip(("o", "dq", "dk", "dv"), got, want, bounds):
        g, w, bound = (np.asarray(x, np.float32) for x in (g, w, bound))
        error = np.abs(g - w)
        ratios.append(float(np.max(error / (bound + 1e-30))))
        assert np.all(error <= slack * bound + 1e-5), f"{name} {part}: error beyond {slack} x bound ({ratios[-1]:.2f})"
    print(f"  {name}: max error / bound (o, dq, dk, dv) {', '.join(f'{r:.2f}' for r in ratios)}")
    return ratios


def compiled(f, *args):
    """f compiled for args at XLA's backend optimization level 0: interpret mode makes each kernel a
    large program run once on tiny arrays, so compiling it is most of a test's time, and level 0
    halves that (the code generator's effort; float semantics are the same)."""
    return jax.jit(f).lower(*args).compile({"xla_backend_optimization_level": 0})


def plain(lowering: str, block: int) -> Tiling:
    """A lowering's kernels in Pallas's plain interpret mode (which needs a shard_map that does not
    check varying axes: tiling_for says why)."""
    return Tiling(lowering, block, block, interpret=True)


KERNELS = {  # name -> (q, k, v, doc_start, row_position, block) -> o, inside shard_map
    "flash gpu": lambda *a: _ring_flash_attention(*a[:5], plain("gpu", a[5])),
    "flash tpu": lambda *a: _ring_flash_attention(*a[:5], plain("tpu", a[5])),
    "flash hopper": lambda *a: _ring_flash_attention(*a[:5], plain("hopper", a[5])),
    "blockwise": attention.ring_attention,
    "reference": attention.reference_attention,
}


def on_ring(c: int, block: int, kernels=("flash gpu", "flash tpu", "blockwise", "reference")):
    """Each kernel's output and gradients (for the output cotangent do) on a ring of c devices,
    every device holding its two chunks of each row (zigzag_order), in one compiled program;
    inputs and results in row order."""
    def each(q, k, v, doc_start, row_position, do):
        def run(name):
            o, pullback = jax.vjp(lambda q, k, v: KERNELS[name](q, k, v, doc_start, row_position, block), q, k, v)
            return (o, *pullback(do))
        return {name: run(name) for name in kernels}

    rows = P(None, "c")
    on_devices = jax.shard_map(each, mesh=make_mesh(1, 1, c), in_specs=(rows, rows, rows, rows, P("c"), rows),
                               out_specs=rows, check_vma=False)

    def run(q, k, v, doc_start, do):
        order = zigzag_order(q.shape[1], c)
        args = (*(x[:, order] for x in (q, k, v, doc_start)), order.astype(np.uint32), do[:, order])
        laid_out = compiled(on_devices, *args)(*args)
        undo = np.argsort(order)
        return {name: [np.asarray(x, np.float32)[:, undo] for x in results] for name, results in laid_out.items()}

    return run


def check_all(results, want, bounds):
    for name, got in results.items():
        check(name, got, want, bounds)
    for name in ("blockwise", "reference"):  # the kernels against attention.py's: twice the bound at most
        for flash in ("flash gpu", "flash tpu"):
            check(f"{flash} against {name}", results[flash], results[name], bounds, slack=4.0)


@pytest.mark.slow
def test_packed_documents_on_one_device():
    """Two rows of packed documents of mixed lengths (1 to 40 tokens), documents crossing block
    edges and one starting exactly on one, grouped-query attention (Q = 2 query heads per kv head),
    4 blocks of 16 positions: forward and the three gradients of both lowerings, blockwise and
    reference, against exact attention."""
    B, L, Q, K, D, block = 2, 64, 2, 2, 16, 16
    q, k, v, do = qkv_and_cotangent(0, B, L, L, Q, K, D)
    doc = doc_starts([[5, 23, 40, 41, 60], [32, 47]], L)
    position = np.arange(L, dtype=np.uint32)
    start = time.perf_counter()
    results = on_ring(1, block)(q, k, v, doc, do)
    print(f"  four kernels, forward and backward (compile and interpret): {time.perf_counter() - start:.1f} s")
    check_all(results, *exact(q, k, v, doc, doc, position, position, do))


@pytest.mark.slow
@pytest.mark.parametrize("c", [2, 4])
def test_a_ring_of_c_devices(c):
    """Context parallelism as train.py runs it: rows of 8 blocks over c devices, each holding two
    chunks (zigzag), documents spanning chunks and devices; some ring steps hold only keys that a
    device's queries cannot see (o = 0, lse = -inf from the kernel, nothing in the merge). Each
    ring step's kernel output merges through its log-sum-exp; the backward ring's dk and dv travel
    home. Against exact attention over whole rows."""
    B, Q, K, D, block = 2, 2, 1, 16, 8
    L = 8 * block
    q, k, v, do = qkv_and_cotangent(c, B, L, L, Q, K, D)
    doc = doc_starts([[9, 30, 35, 53], [25]], L)
    position = np.arange(L, dtype=np.uint32)
    start = time.perf_counter()
    results = on_ring(c, block)(q, k, v, doc, do)
    print(f"  c = {c}: four kernels around the ring (compile and interpret): {time.perf_counter() - start:.1f} s")
    check_all(results, *exact(q, k, v, doc, doc, position, position, do))


@pytest.mark.slow
def test_the_hopper_kernels_on_packed_documents():
    """flash_hopper.py's kernels in Mosaic GPU's interpret mode (warpgroups as threads, shared memory, TMA
    copies and barriers simulated), at their shapes (blocks of 64, D = 64), as training calls them: a row
    of packed documents, some crossing block edges, one starting on one; Q = 2 query heads per kv head; 4
    blocks. Forward and the three gradients against exact attention, and against the blockwise kernel."""
    B, Q, K, D, block = 1, 2, 1, 64, 64
    L = 4 * block
    q, k, v, do = qkv_and_cotangent(10, B, L, L, Q, K, D)
    doc = doc_starts([[5, 63, 64, 130, 131, 200]], L)
    position = np.arange(L, dtype=np.uint32)
    start = time.perf_counter()
    results = on_ring(1, block, ("flash hopper", "blockwise"))(q, k, v, doc, do)
    print(f"  hopper and blockwise (compile and interpret): {time.perf_counter() - start:.1f} s")
    want, bounds = exact(q, k, v, doc, doc, position, position, do)
    for name, got in results.items():
        check(name, got, want, bounds)
    check("flash hopper against blockwise", results["flash hopper"], results["blockwise"], bounds, slack=4.0)


@pytest.mark.slow
def test_the_hopper_kernels_keep_the_rings_contract():
    """A ring step's work, as flash_attention.ring_forward and ring_backward give it to the kernels, on one
    device: a device's queries (its two zigzag chunks of a row of 4 blocks, c = 2) against each device's
    keys in turn, the results in float32; the two steps' (o, lse) merged, each step's gradients taken with
    the merged o and lse, dq summed. Some queries see none of a step's keys (o = 0, lse = -inf there).
    Against exact attention over the row. (Mosaic GPU's interpreter cannot run inside a shard_map of
    several devices: their warpgroup threads block one another, so the ring itself runs Triton's and the
    TPU's kernels only, test_a_ring_of_c_devices.)"""
    B, Q, K, D, block = 1, 2, 1, 64, 64
    L = 4 * block
    q, k, v, do = qkv_and_cotangent(12, B, L, L, Q, K, D)
    doc = doc_starts([[30, 100, 190]], L).astype(np.int32)
    order = zigzag_order(L, 2)
    here, there = order[: L // 2], order[L // 2:]  # device 0's rows (positions 0..63, 192..255), device 1's
    tiling = Tiling("hopper", block, block, interpret=True)

    def ring(q, k, v, do):
        shards = [(k[:, rows], v[:, rows], doc[:, rows], rows.astype(np.int32)) for rows in (here, there)]
        q, do = q[:, here], do[:, here]
        steps = [flash_hopper.forward(q, *shard[:2], doc[:, here], shard[2], here.astype(np.int32), shard[3], tiling,
                                      F32) for shard in shards]
        o, lse = merge(*steps[0], *steps[1])
        delta = jnp.einsum("blqkd,blqkd->blqk", do.astype(F32), o)
        grads = [flash_hopper.backward(q, *shard[:2], do, lse, delta, doc[:, here], shard[2], here.astype(np.int32),
                                       shard[3], tiling, F32) for shard in shards]
        return o, grads[0][0] + grads[1][0], *(jnp.concatenate([g[i] for g in grads], axis=1) for i in (1, 2))

    got = compiled(ring, q, k, v, do)(q, k, v, do)
    # exact: this device's queries over the whole row (dk and dv: their part of the keys' gradients)
    want, bounds = exact(q[:, here], k, v, doc[:, here], doc, here, np.arange(L), do[:, here])
    keys = np.concatenate([here, there])  # the kernels' dk and dv: the shards' keys in turn
    check("hopper ring steps", got, (*want[:2], *(w[:, keys] for w in want[2:])),
          (*bounds[:2], *(b[:, keys] for b in bounds[2:])))


@pytest.mark.parametrize("lowering, block, D", [(flash_gpu, 16, 16), (flash_tpu, 16, 16),
                                                pytest.param(flash_hopper, 64, 64, marks=pytest.mark.slow)],
                         ids=["gpu", "tpu", "hopper"])
def test_skipped_blocks_are_not_read(lowering, block, D):
    """Queries at positions 3b..5b - 1 (L = 2b, for blocks of b) over keys 0..8b - 1 (S = 8b: L != S), all in
    one document that starts at 2.5b, inside key block 2b..3b - 1. The key blocks wholly before 2.5b
    (0..2b - 1) and wholly after 5b - 1 (5b..8b - 1) hold NaN: a visited one would put NaN into o through
    P V (0 x NaN = NaN) and into dk and dv. Their dk and dv must be exactly 0. Q = 3 query heads (not a
    power of 2, as the ladder's 125m and 2b have 3 and 5) share the one kv head."""
    B, Q, K = 1, 3, 1
    q, k, v, do = qkv_and_cotangent(4, B, 2 * block, 8 * block, Q, K, D)
    q_pos, k_pos = np.arange(3 * block, 5 * block, dtype=np.int32), np.arange(8 * block, dtype=np.int32)
    k_doc = np.where(2 * k_pos >= 5 * block, 5 * block // 2, 0).astype(np.int32)[None, :]
    q_doc = k_doc[:, 3 * block:5 * block]
    want, bounds = exact(q, k, v, q_doc, k_doc, q_pos, k_pos, do)
    poisoned = ((k_pos < 2 * block) | (k_pos >= 5 * block))[None, :, None, None]
    k, v = (np.where(poisoned, np.nan, x).astype(jnp.bfloat16) for x in (k, v))
    tiling = plain({flash_gpu: "gpu", flash_tpu: "tpu", flash_hopper: "hopper"}[lowering], block)

    def forward_and_backward(q, k, v, do):
        o, lse = lowering.forward(q, k, v, q_doc, k_doc, q_pos, k_pos, tiling, q.dtype)
        delta = jnp.einsum("blqkd,blqkd->blqk", do.astype(F32), o.astype(F32))
        return (o, *lowering.backward(q, k, v, do, lse, delta, q_doc, k_doc, q_pos, k_pos, tiling, q.dtype))

    got = compiled(forward_and_backward, q, k, v, do)(q, k, v, do)
    check(tiling.lowering, got, want, bounds)
    for gradient in got[2:]:
        assert np.all(np.where(poisoned, np.asarray(gradient, np.float32), 0) == 0)


def test_block_ranges_visit_every_visible_pair_and_no_hopeless_one():
    """query_block_ranges visits every block pair that holds a visible (query, key), and no pair
    wholly in the future or wholly before the block's earliest document start; key_block_ranges is
    exactly its transpose. 20 random document layouts, queries and keys of random devices of a
    zigzag ring of 4."""
    rng = np.random.default_rng(0)
    block_q, block_k, row, c = 4, 8, 128, 4
    order = zigzag_order(row, c).reshape(c, -1)  # [device, its positions]
    ranges = jax.jit(lambda *a: (query_block_ranges(*a, block_q, block_k), key_block_ranges(*a, block_q, block_k)))
    for _ in range(20):
        doc = doc_starts([sorted(rng.choice(row, size=rng.integers(1, 12), replace=False)) for _ in range(2)], row)
        qp, kp = order[rng.integers(c)], order[rng.integers(c)]
        qd, kd = doc[:, qp], doc[:, kp]
        by_query, by_key = (np.asarray(x) for x in ranges(qd.astype(np.int32), qp.astype(np.int32),
                                                           kp.astype(np.int32)))
        for b in range(2):
            visible = (kp[None, :] <= qp[:, None]) & (qd[b][:, None] == kd[b][None, :])
            for n in range(len(qp) // block_q):
                for j in range(len(kp) // block_k):
                    rows, keys = slice(n * block_q, (n + 1) * block_q), slice(j * block_k, (j + 1) * block_k)
                    visited = by_query[b, n, 0] <= j < by_query[b, n, 1]
                    assert visited or not visible[rows, keys].any()
                    assert not visited or (kp[keys].min() <= qp[rows].max() and kp[keys].max() >= qd[b][rows].min())
                    assert visited == (by_key[b, j, 0] <= n < by_key[b, j, 1])


def test_tiling_divides_the_blocks_and_fits_each_target():
    """Blocks divide model.attention_block; the GPU's query blocks halve beyond 3 query heads per
    kv head (shared memory); a TPU block is a multiple of 128 or the whole length."""
    assert tiling_for("gpu", 2, 512, 2048) == Tiling("gpu", 64, 64)
    assert tiling_for("gpu", 4, 512, 2048) == Tiling("gpu", 32, 64)
    assert tiling_for("gpu", 2, 16, 64) == Tiling("gpu", 16, 16)
    assert tiling_for("tpu", 5, 512, 2048) == Tiling("tpu", 256, 256)
    assert tiling_for("tpu", 2, 32, 64) == Tiling("tpu", 64, 64)
    assert tiling_for("cpu", 4, 8, 16) == Tiling("gpu", 8, 8, interpret=True)


@pytest.mark.parametrize("head_dim, block", [(8, 16), (16, 8)])
def test_pallas_on_a_gpu_refuses_heads_or_blocks_under_16(head_dim, block):
    """On a GPU (traced here, never compiled) the kernels stop with a ConfigError naming d_head, the blocks
    and the way out when d_head or a block is under 16, the smallest matrix product Triton takes; at 16 they
    trace. On an H200 a step with d_head 8 and blocks of 8 had run, 1.4% off in its loss."""
    kernel = attention.kernel_for("pallas", "gpu")

    def shapes(head_dim, block):
        q = jax.ShapeDtypeStruct((1, 32, 2, 1, head_dim), jnp.bfloat16)
        kv = jax.ShapeDtypeStruct((1, 32, 1, head_dim), jnp.bfloat16)
        rows = jax.ShapeDtypeStruct((1, 32), jnp.uint32)
        attend = jax.shard_map(lambda *a: kernel(*a, block), mesh=make_mesh(1, 1, 1), in_specs=P(), out_specs=P())
        return jax.eval_shape(attend, q, kv, kv, rows, jax.ShapeDtypeStruct((32,), jnp.uint32))

    with pytest.raises(ConfigError, match=f"d_head \\(here {head_dim}\\) and their blocks \\(here {block} x {block}.*"
                                          "model.attention_kernel=blockwise"):
        shapes(head_dim, block)
    assert shapes(16, 16).shape == (1, 32, 2, 1, 16)


def test_pallas_on_a_cpu_inside_a_checked_shard_map_stops_with_one_line():
    """The training step's shard_map checks varying mesh axes, which Pallas's plain interpret mode
    cannot run under (below): model.attention_kernel=pallas on a CPU stops with a ConfigError that
    names the key and what to choose instead, before any kernel is traced."""
    kernel = attention.kernel_for("pallas", "cpu")
    rows = P(None, "c")
    attend = jax.shard_map(lambda q, k, v, d, p: kernel(q, k, v, d, p, 8), mesh=make_mesh(1, 1, 2),
                           in_specs=(rows, rows, rows, rows, P("c")), out_specs=rows)
    q, k, v, _ = qkv_and_cotangent(0, 1, 32, 32, 2, 1, 16)
    with pytest.raises(ConfigError, match=r"model.attention_kernel=pallas cannot run on a CPU here.*choose "
                                          r"model.attention_kernel=blockwise or reference"):
        jax.eval_shape(attend, q, k, v, np.zeros((1, 32), np.uint32), np.arange(32, dtype=np.uint32))


@pytest.mark.slow
def test_a_ring_in_the_tpu_interpret_mode():
    """The TPU kernels in the TPU interpret mode (scratch memory starts as NaN, the pipeline's copies
    simulated), around a ring of c = 2 inside a shard_map that checks varying mesh axes, which
    Pallas's plain interpret mode cannot run in: it evaluates a kernel's body with the blocks of
    varying inputs next to invariant constants, and that check rejects them (JAX 0.10.2)."""
    B, Q, K, D, block, c = 1, 2, 1, 16, 8, 2
    L = 4 * c * block // 2
    q, k, v, do = qkv_and_cotangent(7, B, L, L, Q, K, D)
    doc = doc_starts([[5, 19]], L)
    order = zigzag_order(L, c)
    rows = P(None, "c")
    tiling = Tiling("tpu", block, block, interpret=True, simulate_tpu=True)

    def run(q, k, v, doc_start, row_position, do):
        o, pullback = jax.vjp(lambda q, k, v: _ring_flash_attention(q, k, v, doc_start, row_position, tiling), q, k, v)
        return (o, *pullback(do))

    args = (*(x[:, order] for x in (q, k, v, doc)), order.astype(np.uint32), do[:, order])
    on_devices = jax.shard_map(run, mesh=make_mesh(1, 1, c), in_specs=(rows, rows, rows, rows, P("c"), rows),
                               out_specs=rows)
    undo = np.argsort(order)
    position = np.arange(L, dtype=np.uint32)
    check("flash tpu (TPU interpret mode)", [np.asarray(x, np.float32)[:, undo] for x in
                                             compiled(on_devices, *args)(*args)],
          *exact(q, k, v, doc, doc, position, position, do))


@pytest.mark.slow
def test_training_steps_with_the_pallas_kernel_equal_blockwise(monkeypatch):
    """Three training steps of a small model on one device with model.attention_kernel=pallas (on a
    CPU: the GPU kernels in Pallas's interpret mode) and with reference, against blockwise: the same
    losses within 1e-3 relative. Attention's bf16 roundings (within the bounds above) differ between
    the kernels; the loss, an average over every token, moves by far less. Heads and blocks of 16, the
    smallest the kernels take on a GPU (bench/gpu/device_run.sh runs this test on one too).

    The step's shard_map runs without its check of varying mesh axes: Pallas's interpret mode
    evaluates a kernel's body with the blocks of varying inputs next to invariant constants, which
    that check rejects (JAX 0.10.2). On one device nothing varies, so the step computes the same."""
    shard_map = jax.shard_map
    monkeypatch.setattr(jax, "shard_map", lambda *a, **kw: shard_map(*a, **{**kw, "check_vma": False}))
    mesh = make_mesh(1, 1, 1)
    losses = {}
    with jax.set_mesh(mesh):
        for kernel in ("blockwise", "pallas", "reference"):
            cfg = tiny_config("model.n_kv=2", "model.d_head=16", "model.attention_block=16", "model.layers=1",
                              "training.tokens.batch=2", "training.tokens.len=32", "mesh.d=1", "mesh.t=1",
                              f"model.attention_kernel={kernel}")
            state, losses[kernel] = train.init_state(cfg, mesh), []
            for step in range(3):
                batch = put_batch(mesh, random_batch(step, 2, 32, cfg.model.vocab))
                state, metrics = train.training_step(state, jnp.uint32(step), *batch, cfg)
                losses[kernel].append(float(metrics.loss))
    print(f"  losses: {losses}")
    for kernel in ("pallas", "reference"):
        np.testing.assert_allclose(losses[kernel], losses["blockwise"], rtol=1e-3)
