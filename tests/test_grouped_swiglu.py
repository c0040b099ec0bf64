"""seqax/kernels/grouped_swiglu.py against the plain statement of its math: every listed row's SwiGLU by its
group's weights (the dense SwiGLU's roundings), unlisted rows unchanged; values and gradients, in float32
and bfloat16, on one device and inside shard_map with each device's own groups."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fixtures import make_mesh
from seqax.kernels.grouped_swiglu import grouped_swiglu
from seqax.shardlib.shardtypes import f32, i32, typed_shard_map

rng = np.random.default_rng(0)


def reference(x, rows, gate_w, up_w, down_w, ends):
    """Each row listed in block i goes through the SwiGLU of block i's group, rounded to x's dtype; the
    others stay as they are."""
    n, b = rows.shape
    group = np.minimum(np.sum(np.arange(n)[:, None] >= np.asarray(ends)[None], axis=1), gate_w.shape[0] - 1)
    listed = np.asarray(rows).reshape(-1)
    used = (np.arange(n)[:, None] < np.asarray(ends)[-1]) & (np.asarray(rows) < x.shape[0])
    row_group = np.zeros(x.shape[0], np.int64)
    row_group[listed[used.reshape(-1)]] = np.repeat(group, b)[used.reshape(-1)]
    is_listed = np.zeros(x.shape[0], bool)
    is_listed[listed[used.reshape(-1)]] = True
    f32_ = jnp.float32
    gate = jnp.einsum("nm,nmh->nh", x, gate_w[row_group], preferred_element_type=f32_).astype(x.dtype).astype(f32_)
    up = jnp.einsum("nm,nmh->nh", x, up_w[row_group], preferred_element_type=f32_).astype(x.dtype)
    hidden = (gate * jax.nn.sigmoid(gate) * up).astype(x.dtype)
    out = jnp.einsum("nh,nhm->nm", hidden, down_w[row_group], preferred_element_type=f32_).astype(x.dtype)
    return jnp.where(is_listed[:, None], out, x)


def problem(dtype, N=20, M=8, H=6, G=4):
    x = jnp.asarray(rng.standard_normal((N, M)), dtype)
    gate_w, up_w = (jnp.asarray(rng.standard_normal((G, M, H)) / np.sqrt(M), dtype) for _ in range(2))
    down_w = jnp.asarray(rng.standard_normal((G, H, M)) / np.sqrt(H), dtype)
    return x, gate_w, up_w, down_w


@pytest.mark.parametrize("dtype", [pytest.param(jnp.float32, marks=pytest.mark.slow), jnp.bfloat16])
def test_each_listed_row_goes_through_its_groups_swiglu_and_no_other_row_moves(dtype):
    """20 rows in blocks of 3: groups of 2, 0, 2 and 1 blocks out of 7 (one block empty at the end,
    padding places in some blocks, rows 18 and 19 listed nowhere): output and every gradient equal
    the statement's (bf16: its roundings, float32 sums in a different order)."""
    x, gate_w, up_w, down_w = problem(dtype)
    N = x.shape[0]
    rows = jnp.array([[0, 5, 7], [2, N, N], [9, 1, 3], [4, 6, N], [8, 10, 11], [12, 13, 14], [15, 16, 17]],
                     jnp.int32)
    rows = rows.at[6].set(N)  # past the last group's end: listed, but no block
    ends = jnp.array([2, 2, 4, 5], jnp.int32)
    cotangent = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == jnp.float32 else dict(rtol=3e-2, atol=3e-2)

    got = jax.jit(grouped_swiglu, static_argnums=6)(x, rows, gate_w, up_w, down_w, ends, 2)
    want = reference(x, rows, gate_w, up_w, down_w, ends)
    np.testing.assert_allclose(got, want, **tol)
    assert got.dtype == dtype
    np.testing.assert_array_equal(got[15:], x[15:])  # rows of no block, or of the block past the end
    grads = jax.grad(lambda *a: jnp.sum(grouped_swiglu(*a, ends, 2) * cotangent), argnums=(0, 2, 3, 4))
    want_grads = jax.grad(lambda x, rows, *w: jnp.sum(reference(x, rows, *w, ends) * cotangent), argnums=(0, 2, 3, 4))
    for a, b in zip(grads(x, rows, gate_w, up_w, down_w), want_grads(x, rows, gate_w, up_w, down_w)):
        assert a.dtype == dtype
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), **tol)


def test_inside_shard_map_each_device_loops_over_its_own_groups():
    """On 4x2 devices, each device with 2 groups of its own sizes (one with none at all): the loops'
    bounds are each device's data, and each device's output is its statement's."""
    x, gate_w, up_w, down_w = problem(jnp.float32, N=4 * 6, G=4 * 2)
    rows = np.tile(np.array([[0, 1], [2, 3], [4, 5]], np.int32), (4, 1))
    ends = np.array([[0, 3], [1, 3], [2, 2], [0, 0]], np.int32)

    @typed_shard_map
    def run(x: f32[b"N/d M"], rows: i32[b"n/d b"], gate_w: f32[b"G/d M H"], up_w: f32[b"G/d M H"],
            down_w: f32[b"G/d H M"], ends: i32[b"G/d"]) -> f32[b"N/d M"]:
        return grouped_swiglu(x, rows, gate_w, up_w, down_w, ends, 2)

    with jax.set_mesh(make_mesh(4, 2)):
        got = np.asarray(jax.jit(run)(x, rows, gate_w, up_w, down_w, ends.reshape(-1)))
    for i in range(4):
        here = slice(6 * i, 6 * i + 6), slice(3 * i, 3 * i + 3), slice(2 * i, 2 * i + 2)
        want = reference(x[here[0]], rows[here[1]], gate_w[here[2]], up_w[here[2]], down_w[here[2]], ends[i])
        np.testing.assert_allclose(got[here[0]], want, rtol=1e-5, atol=1e-5)


def test_bad_shapes_are_one_line():
    x, gate_w, up_w, down_w = problem(jnp.float32)
    with pytest.raises(ValueError, match=r"grouped_swiglu: x \[N, M\], rows \[n, b\]"):
        grouped_swiglu(x, jnp.zeros((2, 3), jnp.int32), gate_w, up_w, down_w[:, :, :5], jnp.zeros(4, jnp.int32), 1)


@pytest.mark.slow
def test_float8_is_within_float8s_rounding_on_operands_e4m3_cannot_hold_unscaled():
    """multiply_in="float8": rows of 1e3 (e4m3's largest is 448), weights of 1e-4 and an output gradient of 1e-6
    (below e4m3's smallest value): unscaled, the casts give NaN and zeros. Scaled, the output and every
    gradient are e4m3's rounding of the exact ones (the output's gradient is cast to e4m3 too, as the dense
    layers' are): each relative L2 error from float64 below 16x the bfloat16 run's (e4m3's unit roundoff over
    bfloat16's), and above 2x it (the float8 cast is in effect). Measured: 12.9-13.4x (with the gradients in
    e5m2: 13-20x)."""
    N, M, H, G = 64, 32, 24, 4
    x = rng.standard_normal((N, M)) * 1e3
    gate_w, up_w = (rng.standard_normal((G, M, H)) / np.sqrt(M) * 1e-4 for _ in range(2))
    down_w = rng.standard_normal((G, H, M)) / np.sqrt(H) * 1e-2
    rows = jnp.asarray(np.arange(N - 4).reshape(-1, 6), jnp.int32)  # 10 blocks of 6, rows 60-63 listed nowhere
    ends = jnp.array([3, 5, 5, 10], jnp.int32)
    cotangent = jnp.asarray(rng.standard_normal((N, M)) * 1e-6, jnp.float32)

    def run(dtype, multiply_in):
        def f(*a):
            return grouped_swiglu(*a, ends, 3, multiply_in)
        args = [jnp.asarray(a, dtype) for a in (x, gate_w, up_w, down_w)]
        y, vjp = jax.vjp(lambda x, *w: f(x, rows, *w), *args)
        dx, *dw = vjp(cotangent.astype(dtype))
        return [np.asarray(a, np.float64) for a in (y[:60], dx[:60], *dw)]  # rows 60-63 pass through

    exact = run(jnp.float32, None)
    bf16, float8 = run(jnp.bfloat16, None), run(jnp.bfloat16, "float8")
    for name, e, b, f in zip(("output", "x", "gate_w", "up_w", "down_w"), exact, bf16, float8):
        b_err, f_err = (np.linalg.norm(a - e) / np.linalg.norm(e) for a in (b, f))
        assert 2 * b_err < f_err < 16 * b_err, f"{name}: float8 {f_err:.2e}, bf16 {b_err:.2e} from float32"
