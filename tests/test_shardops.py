"""Each shardops op on 8 simulated devices against plain numpy, forward and gradient, and
every malformed spec rejected before any computation."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from fixtures import make_mesh
from seqax.shardlib import bits, shardops
from seqax.shardlib.shardops import (
    SpecError,
    all_gather,
    all_gather_cast,
    einsum_unreduced,
    index_unreduced,
    psum,
    psum_scatter,
    take_unreduced,
)
from seqax.shardlib.shardtypes import f32, i32, typed_shard_map

rng = np.random.default_rng(0)


def rand(*shape):
    return rng.standard_normal(shape).astype(np.float32)


@pytest.fixture
def mesh():
    mesh = make_mesh(4, 2)
    with jax.set_mesh(mesh):
        yield mesh


def check_close(actual, expected):
    np.testing.assert_allclose(np.asarray(actual), expected, rtol=1e-5, atol=1e-5)


def test_all_gather_forward_and_gradient(mesh):
    w, c = rand(8, 6), rand(4, 8, 6)  # c: one cotangent per d-device

    @typed_shard_map
    def gathered(w: f32[b"M/d F/t"]) -> f32[b"X/d M F/t"]:
        return all_gather("M/d F/t -> M F/t", w)[None]  # each d-device returns what it got

    out = jax.jit(gathered)(w)
    for i in range(4):
        check_close(out[i], w)

    @typed_shard_map
    def loss(w: f32[b"M/d F/t"], c: f32[b"X/d M F/t"]) -> f32[b""]:
        return lax.psum(jnp.sum(all_gather("M/d F/t -> M F/t", w) * c[0]), ("d", "t"))

    value, grad = jax.jit(jax.value_and_grad(loss))(w, c)
    check_close(value, np.sum(w[None] * c))
    check_close(grad, c.sum(0))  # the transpose is a reduce-scatter over d


@pytest.mark.parametrize("platform", ["cpu", "tpu"])
def test_all_gather_cast_sends_bf16_and_sums_gradients_in_f32(mesh, monkeypatch, platform):
    """The gathered weight is w rounded to bfloat16 (as the matmul would cast it), and its
    gradient is the float32 sum over d of each device's bfloat16 cotangent: no bf16 sum. Two bytes a value
    on the wire: on a CPU as their bits (u16, which XLA:CPU does not widen), elsewhere as bfloat16 (a TPU runs
    float collectives, not integer ones, on its SparseCores)."""
    monkeypatch.setattr(bits, "traced_device", lambda: (platform, ""))
    w, c = rand(8, 6), rand(4, 8, 6)
    bf16 = lambda x: np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32))  # noqa: E731

    @typed_shard_map
    def gathered(w: f32[b"M/d F/t"]) -> f32[b"X/d M F/t"]:
        return all_gather_cast("M/d F/t -> M F/t", w, jnp.bfloat16).astype(jnp.float32)[None]

    out = jax.jit(gathered)(w)
    for i in range(4):
        np.testing.assert_array_equal(np.asarray(out[i]), bf16(w))

    @typed_shard_map
    def loss(w: f32[b"M/d F/t"], c: f32[b"X/d M F/t"]) -> f32[b""]:
        g = all_gather_cast("M/d F/t -> M F/t", w, jnp.bfloat16)
        return lax.psum(jnp.sum(g * c[0].astype(jnp.bfloat16), dtype=jnp.float32), ("d", "t"))

    grad = jax.jit(jax.grad(loss))(w, c)
    assert grad.dtype == jnp.float32
    check_close(grad, sum(bf16(c[i]) for i in range(4)))
    lowered = jax.jit(jax.value_and_grad(loss)).lower(w, c)
    wire = re.findall(r"stablehlo\.all_gather.*-> tensor<[0-9x]*(\w+)>", lowered.as_text())
    assert wire and set(wire) == {"ui16" if platform == "cpu" else "bf16"}, wire
    text = lowered.compile().as_text()
    assert " all-gather(" in text
    assert all("f32[" in line.split("=")[1].split("reduce-scatter(")[0]
               for line in text.splitlines() if " reduce-scatter(" in line)
    with pytest.raises(SpecError, match="partial sums must be float32"):
        all_gather_cast("M/d -> M", jnp.zeros(4, jnp.bfloat16), jnp.bfloat16)


def test_all_gather_over_two_axes_of_one_dimension(mesh):
    w = rand(16, 3)

    @typed_shard_map
    def gathered(w: f32[b"M/d/t F"]) -> f32[b"X/d/t M F"]:
        return all_gather("M/d/t F -> M F", w)[None]

    out = jax.jit(gathered)(w)
    for i in range(8):
        check_close(out[i], w)


def test_psum_scatter_forward_and_gradient(mesh):
    x, c = rand(2, 5, 6), rand(5, 6)  # x: a partial sum per t-device

    @typed_shard_map
    def scattered(x: f32[b"X/t B M"]) -> f32[b"B M/t"]:
        return psum_scatter("B M -> B M/t", x[0])

    check_close(jax.jit(scattered)(x), x.sum(0))

    @typed_shard_map
    def loss(x: f32[b"X/t B M"], c: f32[b"B M/t"]) -> f32[b""]:
        return lax.psum(jnp.sum(psum_scatter("B M -> B M/t", x[0]) * c), "t")

    value, grad = jax.jit(jax.value_and_grad(loss))(x, c)
    check_close(value, np.sum(x.sum(0) * c))
    check_close(grad, np.broadcast_to(c, x.shape))  # the transpose is an all-gather


def test_psum_scatter_over_two_axes(mesh):
    x = rand(8, 3, 16)

    @typed_shard_map
    def scattered(x: f32[b"X/d/t B M"]) -> f32[b"B M/d/t"]:
        return psum_scatter("B M -> B M/d/t", x[0])

    check_close(jax.jit(scattered)(x), x.sum(0))


def test_gather_and_scatter_of_an_inner_dimension_move_its_blocks_to_the_front(mesh):
    """A gather or scatter over a dimension that is not the first gives the right values and
    gradients, and compiles to collectives over dimension 0 with every array row-major: XLA
    would otherwise make the whole array (and what touches it) strided."""
    x, c = rand(3, 16, 5), rand(3, 16, 5)

    @typed_shard_map
    def round_trip(x: f32[b"B M/d/t L"], c: f32[b"B M L"]) -> f32[b""]:
        gathered = all_gather("B M/d/t L -> B M L", x)
        return lax.psum(jnp.sum(psum_scatter("B M L -> B M/d/t L", gathered * c) * x), ("d", "t"))

    value, grad = jax.jit(jax.value_and_grad(round_trip))(x, c)
    check_close(value, 8 * np.sum(x * x * c))  # every device's partial sum is the same gathered * c
    check_close(grad, 16 * x * c)
    text = jax.jit(jax.value_and_grad(round_trip)).lower(x, c).compile().as_text()
    collectives = [line for line in text.splitlines() if " all-gather(" in line or " reduce-scatter(" in line]
    assert collectives and all("dimensions={0}" in line for line in collectives), collectives
    computed = "\n".join(line for line in text.splitlines()
                         if " transpose(" not in line)  # a transpose's layout says which copy it is
    layouts = re.findall(r"\[[\d,]+\]\{([\d,]+)\}", computed)
    assert all(layout == ",".join(str(i) for i in reversed(range(layout.count(",") + 1)))
               for layout in layouts), set(layouts)


def test_einsum_unreduced_gradient_runs_in_the_operands_dtype():
    """The gradient of a bf16 x bf16 -> f32 einsum rounds the output's gradient to bf16 and
    multiplies in bf16 with f32 accumulation (no float32 matmul); with float32 operands it is
    autodiff's gradient."""
    x, w, c = rand(8, 16), rand(16, 4), rand(8, 4)
    bf = lambda a: jnp.asarray(a).astype(jnp.bfloat16)  # noqa: E731

    def loss(x, w, c):
        return jnp.sum(einsum_unreduced("B M, M F -> B F", x, w) * c)

    gx, gw = jax.jit(jax.grad(loss, argnums=(0, 1)))(bf(x), bf(w), c)
    assert gx.dtype == gw.dtype == jnp.bfloat16
    g = np.asarray(bf(c), np.float32)  # d loss / d output, rounded as the backward pass rounds it
    exact_x = g @ np.asarray(bf(w), np.float32).T
    exact_w = np.asarray(bf(x), np.float32).T @ g
    np.testing.assert_array_equal(np.asarray(gx), np.asarray(bf(exact_x)))
    np.testing.assert_array_equal(np.asarray(gw), np.asarray(bf(exact_w)))
    lowered = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(bf(x), bf(w), c).as_text()
    dots = [line for line in lowered.splitlines() if "dot_general" in line]
    assert len(dots) >= 2 and all("xf32>" not in line.split("->")[0].split(":")[-1] for line in dots), dots

    # In float32 both ours and autodiff's gradients are one float32 matmul each. How it rounds
    # depends on the CPU's kernel (summation order, FMA: an AMD EPYC and an Intel Xeon differ in
    # the last bit), so each is held to the textbook bound of a length-n float32 dot product
    # around the exact product: |error| <= gamma_n (|a| @ |b|), gamma_n = n u / (1 - n u).
    f32_grads = jax.grad(loss, argnums=(0, 1))(x, w, c)
    autodiff = jax.grad(lambda x, w, c: jnp.sum(jnp.einsum("bm,mf->bf", x, w) * c), argnums=(0, 1))(x, w, c)
    for ours, theirs, (a, b) in zip(f32_grads, autodiff, ((c, w.T), (x.T, c))):
        a, b = a.astype(np.float64), b.astype(np.float64)
        n, u = a.shape[1], 2.0**-24
        bound = n * u / (1 - n * u) * (np.abs(a) @ np.abs(b))
        for grad in (ours, theirs):
            assert np.all(np.abs(np.asarray(grad, np.float64) - a @ b) <= bound)

    # A dimension that one operand alone sums over (B here) gets its gradient broadcast back.
    summed = jax.grad(lambda x, w: jnp.sum(einsum_unreduced("B M, M F -> F", x, w) * c[0]), argnums=(0, 1))(x, w)
    autodiff = jax.grad(lambda x, w: jnp.sum(jnp.einsum("bm,mf->f", x, w) * c[0]), argnums=(0, 1))(x, w)
    for ours, theirs in zip(summed, autodiff):
        np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=1e-6)


def test_psum_forward_and_gradient(mesh):
    x, c = rand(2, 4, 3), rand(4, 3)

    @typed_shard_map
    def summed(x: f32[b"X/t B/d M"]) -> f32[b"B/d M"]:
        return psum("B/d M", x[0], "t")

    check_close(jax.jit(summed)(x), x.sum(0))

    @typed_shard_map
    def loss(x: f32[b"X/t B/d M"], c: f32[b"B/d M"]) -> f32[b""]:
        return lax.psum(jnp.sum(psum("B/d M", x[0], "t") * c), "d")

    value, grad = jax.jit(jax.value_and_grad(loss))(x, c)
    check_close(value, np.sum(x.sum(0) * c))
    check_close(grad, np.broadcast_to(c, x.shape))


def test_einsum_unreduced_sharded_output_dims(mesh):
    x, w = rand(8, 6), rand(6, 4)

    @typed_shard_map
    def product(x: f32[b"B/d M"], w: f32[b"M F/t"]) -> f32[b"B/d F/t"]:
        return einsum_unreduced("B/d M, M F/t -> B/d F/t", x, w)

    check_close(jax.jit(product)(x, w), x @ w)


def test_einsum_unreduced_sharded_contraction_forward_and_gradient(mesh):
    x, w, c = rand(8, 6), rand(6, 4), rand(8, 4)

    @typed_shard_map
    def loss(x: f32[b"B/d M/t"], w: f32[b"M/t F"], c: f32[b"B/d F"]) -> f32[b""]:
        partial = einsum_unreduced("B/d M/t, M/t F -> B/d F", x, w)  # a partial sum over t
        return lax.psum(jnp.sum(psum("B/d F", partial, "t") * c), "d")

    value, (gx, gw) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, w, c)
    check_close(value, np.sum((x @ w) * c))
    check_close(gx, c @ w.T)
    check_close(gw, x.T @ c)


def test_einsum_unreduced_accumulates_bf16_in_f32():
    x = jnp.full((1, 4096), 1.0 + 2**-7, jnp.bfloat16)
    out = einsum_unreduced("B M, M F -> B F", x, jnp.ones((4096, 1), jnp.bfloat16))
    assert out.dtype == jnp.float32
    assert float(out[0, 0]) == pytest.approx(4096 * (1 + 2**-7))


def test_index_unreduced_forward_and_gradient(mesh):
    table, c = rand(16, 3), rand(8, 5, 3)
    ids = rng.integers(0, 16, size=(8, 5)).astype(np.int32)

    @typed_shard_map
    def lookup(table: f32[b"V/t M"], ids: i32[b"B/d L"]) -> f32[b"B/d L M"]:
        return psum("B/d L M", index_unreduced("V/t M, B/d L -> B/d L M", table, ids), "t")

    check_close(jax.jit(lookup)(table, ids), table[ids])

    def loss(table, ids, c):
        return jnp.sum(lookup(table, ids) * c)

    expected = np.zeros_like(table)
    np.add.at(expected, ids, c)
    check_close(jax.jit(jax.grad(loss))(table, ids, c), expected)


def test_axis_size(mesh):
    @typed_shard_map
    def sizes(x: f32[b"B/d"]) -> f32[b"B/d"]:
        return x * 0 + shardops.axis_size("d") * 10 + shardops.axis_size(("d", "t"))

    check_close(jax.jit(sizes)(np.zeros(4, np.float32)), np.full(4, 48.0))


@pytest.mark.parametrize(
    "op,spec,message",
    [
        (all_gather, "M/d F/t", "exactly one '->'"),
        (all_gather, "M/d F/t -> F M/t", "same dimensions in the same order"),
        (all_gather, "M/d F/t -> M/t F", "not a gather"),
        (all_gather, "M/d/t -> M/t", "not a gather"),  # only innermost axes may go
        (all_gather, "M/d F -> M/d F", "gathers nothing"),
        (all_gather, "M/d, F -> M F", "exactly one operand"),
        (all_gather, "M/d F/d -> M F", "shards two dimensions"),
        (psum_scatter, "B M/t -> B M", "not a scatter"),
        (psum_scatter, "B M -> B M", "scatters nothing"),
        (psum_scatter, "B M/t -> B/d M", "not a scatter"),  # may only add axes
        (psum_scatter, "B M -> M/t B", "same dimensions"),
        (psum_scatter, "B-2 M -> B M/t", "bad dimension"),
    ],
)
def test_malformed_gather_and_scatter_specs(op, spec, message):
    with pytest.raises(SpecError, match=message):
        op(spec, np.zeros((4, 4), np.float32))  # outside shard_map: the spec fails first


@pytest.mark.parametrize(
    "spec,message",
    [
        ("B M, M F", "exactly one '->'"),
        ("B M/t, M F -> B F", "sharded two ways"),
        ("B M, M F -> B G", "output dimension G is not in any operand"),
        ("B/d M, M F -> B F", "must keep its input sharding"),
        ("B M, M F, F G -> B G", "names 3 operands, got 2"),
        ("B/t M, M F/t -> B/t F", "mesh axis 't' splits both B and F"),
        ("B M N, M F -> B F", r"gives the operand 3 dims \(B M N\), but its shape is \(2, 3\)"),
    ],
)
def test_malformed_einsum_specs(spec, message):
    with pytest.raises(SpecError, match=message):
        einsum_unreduced(spec, np.zeros((2, 3), np.float32), np.zeros((3, 4), np.float32))


@pytest.mark.parametrize(
    "spec,message",
    [
        ("V/t M -> B L M", "needs two operands"),
        ("V/t M, B L -> B L", "must produce the index dims then the table's other dims: B L M"),
        ("V/t M, B L -> B L M/t", "must produce the index dims then the table.s other dims: B L M"),
        ("V/t M, B/t L -> B/t L M", r"indices are split over \['t'\], which also split the table"),
    ],
)
def test_malformed_index_specs(spec, message):
    with pytest.raises(SpecError, match=message):
        index_unreduced(spec, np.zeros((4, 3), np.float32), np.zeros((2, 2), np.int32))


def test_psum_refuses_bf16_partials_and_sharded_axes():
    with pytest.raises(SpecError, match="partial sums must be float32"):
        psum("B M", jnp.zeros((2, 3), jnp.bfloat16), "t")
    with pytest.raises(SpecError, match="cannot sum over"):
        psum("B M/t", jnp.zeros((2, 3)), "t")
    with pytest.raises(SpecError, match="partial sums must be float32"):
        psum_scatter("B M -> B M/t", jnp.zeros((2, 4), jnp.bfloat16))


def test_take_unreduced_forward_and_gradient(mesh):
    """Each position's entry of a vocabulary split over t, summed over t: the full lookup, and
    the gradient lands on exactly the picked entries."""
    values, c = rand(8, 5, 16), rand(8, 5)
    ids = rng.integers(0, 16, size=(8, 5)).astype(np.int32)

    @typed_shard_map
    def pick(values: f32[b"B/d L V/t"], ids: i32[b"B/d L"]) -> f32[b"B/d L"]:
        return psum("B/d L", take_unreduced("B/d L V/t, B/d L -> B/d L", values, ids), "t")

    expected = np.take_along_axis(values, ids[..., None], axis=-1)[..., 0]
    check_close(jax.jit(pick)(values, ids), expected)
    gradient = np.zeros_like(values)
    np.put_along_axis(gradient, ids[..., None], c[..., None], axis=-1)
    check_close(jax.jit(jax.grad(lambda v: jnp.sum(pick(v, ids) * c)))(values), gradient)


@pytest.mark.parametrize(
    "spec,message",
    [
        ("B L V, B -> B", "the values' dims but the last are the indices' dims"),
        ("B L V, B L -> B", "the values' dims but the last are the indices' dims"),
        ("B L V, B L, B L -> B L", "needs two operands"),
    ],
)
def test_malformed_take_specs(spec, message):
    with pytest.raises(SpecError, match=message):
        take_unreduced(spec, np.zeros((2, 2, 4), np.float32), np.zeros((2, 2), np.int32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_ring_pass_forward_and_gradient(dtype):
    """Over c = 4 each device receives the block of the device before it (the first the last's),
    bf16 values bit for bit; the gradient of a device's block comes back from the device it was
    sent to."""
    x, c = rand(8, 3), rand(8, 3)  # S = 8 positions, 2 per device of c

    @typed_shard_map
    def passed(x: f32[b"S/c D"], c: f32[b"S/c D"]) -> tuple[f32[b"S/c D"], f32[b"S/c D"]]:
        def loss(x):
            return jnp.sum(shardops.ring_pass("S/c D", x.astype(dtype), "c").astype(jnp.float32) * c)

        return shardops.ring_pass("S/c D", x.astype(dtype), "c").astype(jnp.float32), jax.grad(loss)(x)

    with jax.set_mesh(make_mesh(1, 1, 4)):
        out, grad = jax.jit(passed)(x, c)
    rounded = np.asarray(jnp.asarray(x).astype(dtype).astype(jnp.float32))
    np.testing.assert_array_equal(np.asarray(out), np.roll(rounded, 2, axis=0))  # device r holds what r - 1 held
    np.testing.assert_array_equal(np.asarray(grad),
                                  np.roll(np.asarray(jnp.asarray(c).astype(dtype).astype(jnp.float32)), -2, axis=0))


def test_ring_pass_refuses_an_axis_that_splits_nothing():
    with pytest.raises(SpecError, match=r"ring_pass: mesh axis 'c' splits no dimension of 'B/d S K/t D'"):
        shardops.ring_pass("B/d S K/t D", jnp.zeros((2, 4, 2, 8)), "c")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_all_to_all_spreads_stacked_matrices_whole_and_sends_them_back(dtype):
    """On d=2 c=2 t=2, 'layers M/d/c K/t D -> layers/d/c/t M K D' leaves device (i, j, k) layer
    4i + 2j + k whole (bf16 values bit for bit), and the reversed spec restores the layout it came
    in; the gradient goes back the way the blocks came."""
    x, c = rand(8, 4, 6, 2), rand(8, 4, 6, 2)  # layers, M, K, D

    @typed_shard_map
    def spread(x: f32[b"layers M/d/c K/t D"], c: f32[b"layers/d/c/t M K D"]) -> tuple[
            f32[b"layers/d/c/t M K D"], f32[b"layers M/d/c K/t D"], f32[b"layers M/d/c K/t D"]]:
        whole = shardops.all_to_all("layers M/d/c K/t D -> layers/d/c/t M K D", x.astype(dtype))
        back = shardops.all_to_all("layers/d/c/t M K D -> layers M/d/c K/t D", whole)

        def loss(x):
            moved = shardops.all_to_all("layers M/d/c K/t D -> layers/d/c/t M K D", x.astype(dtype))
            return lax.psum(jnp.sum(moved.astype(jnp.float32) * c), ("d", "c", "t"))

        return whole.astype(jnp.float32), back.astype(jnp.float32), jax.grad(loss)(x)

    with jax.set_mesh(make_mesh(2, 2, 2)):
        whole, back, grad = jax.jit(spread)(x, c)
    rounded = np.asarray(jnp.asarray(x).astype(dtype).astype(jnp.float32))
    np.testing.assert_array_equal(np.asarray(whole), rounded)  # global layer i is on device i, whole
    np.testing.assert_array_equal(np.asarray(back), rounded)
    np.testing.assert_array_equal(np.asarray(grad), np.asarray(jnp.asarray(c).astype(dtype).astype(jnp.float32)))


def test_all_to_all_puts_each_layer_on_the_device_its_spec_names():
    """The blocks land where the spec says, not merely somewhere: device (i, j, k) of d=2 c=2 t=2
    holds layer 4i + 2j + k."""
    x = np.arange(8, dtype=np.float32)[:, None, None] * np.ones((8, 4, 2), np.float32)  # layer l is all l

    @typed_shard_map
    def first_value(x: f32[b"layers M/d/c F/t"]) -> f32[b"X/d/c/t"]:
        whole = shardops.all_to_all("layers M/d/c F/t -> layers/d/c/t M F", x)
        return whole[:, 0, 0]

    with jax.set_mesh(make_mesh(2, 2, 2)):
        held = np.asarray(jax.jit(first_value)(x))
    np.testing.assert_array_equal(held, np.arange(8))


@pytest.mark.parametrize(
    "spec,message",
    [
        ("layers M/d F/t -> layers/d M F", "keeping every axis"),  # t dropped: a gather
        ("layers M/d F -> layers/d/t M F", "keeping every axis"),  # t added: a scatter
        ("layers M/d F/t -> layers M/d F/t", "keeping every axis"),  # nothing moves
        ("layers M/d/t F -> layers/d M/t F", "innermost"),  # d is not M's innermost axis
        ("layers M/d F/t -> layers F M/d/t", "same dimensions in the same order"),
    ],
)
def test_malformed_all_to_all_specs(spec, message):
    with pytest.raises(SpecError, match=message):
        shardops.all_to_all(spec, np.zeros((4, 4, 4), np.float32))


def test_all_to_all_needs_the_dimension_it_splits_to_divide(mesh):
    @typed_shard_map
    def spread(x: f32[b"layers M/d F/t"]) -> f32[b"layers/d/t M F"]:
        return shardops.all_to_all("layers M/d F/t -> layers/d/t M F", x)

    with pytest.raises(SpecError, match=r"cannot be split over d \(4 devices\); pad it to a multiple of 4"):
        jax.jit(spread)(rand(6, 8, 4))


def test_global_norm_sums_each_shard_once(mesh):
    """The L2 norm of arrays split over d and t, over t only and not at all (replicated) is the
    norm of the whole arrays on every device: each array's squares are summed over the axes that
    split it and no other."""
    a, b, c = rand(8, 6), rand(3, 4), rand(5)

    @typed_shard_map
    def norm(a: f32[b"M/d F/t"], b: f32[b"X Y/t"], c: f32[b"Z"]) -> f32[b""]:
        return shardops.global_norm((a, b, c), tuple[f32[b"M/d F/t"], f32[b"X Y/t"], f32[b"Z"]])

    got = float(jax.jit(norm)(a, b, c))
    assert got == pytest.approx(np.sqrt(sum(np.sum(np.square(x, dtype=np.float64)) for x in (a, b, c))), rel=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_ragged_all_to_all_sends_each_device_its_rows_and_brings_them_back(dtype):
    """On d=4 t=2, each device's rows, sorted by destination and a different number to each (some
    none, one device keeping a row unsent), land in the destination's slot for their sender, in
    order, zeros after; 'd R M -> R M' returns each slot where its rows came from; the gradient of
    either is the other applied to the cotangent."""
    d, R, M = 4, 6, 3
    sizes = np.array([[1, 2, 3, 0], [0, 0, 6, 0], [2, 2, 1, 1], [3, 0, 0, 2]], np.int32)  # [sender, destination]
    x, c = rand(d * R, M), rand(d * d * R, M)

    @typed_shard_map
    def exchange(x: f32[b"R/d M"], sizes: i32[b"D/d"], c: f32[b"S/d M"]) -> tuple[
            f32[b"S/d M"], f32[b"R/d M"], f32[b"R/d M"]]:
        slots = shardops.ragged_all_to_all("R M -> d R M", x.astype(dtype), sizes)
        back = shardops.ragged_all_to_all("d R M -> R M", slots, sizes)

        def loss(x):
            moved = shardops.ragged_all_to_all("R M -> d R M", x.astype(dtype), sizes)
            return lax.psum(jnp.sum(moved.astype(jnp.float32).reshape(d * R, M) * c), "d")

        return slots.astype(jnp.float32).reshape(d * R, M), back.astype(jnp.float32), jax.grad(loss)(x)

    with jax.set_mesh(make_mesh(4, 2)):
        slots, back, grad = (np.asarray(a) for a in jax.jit(exchange)(x, sizes.reshape(-1), c))
    rounded = np.asarray(jnp.asarray(x).astype(dtype).astype(jnp.float32)).reshape(d, R, M)
    expected = np.zeros((d, d, R, M), np.float32)  # [destination, sender, row, M]
    for s in range(d):
        starts = np.cumsum(sizes[s]) - sizes[s]
        for j in range(d):
            expected[j, s, : sizes[s, j]] = rounded[s, starts[j] : starts[j] + sizes[s, j]]
    np.testing.assert_array_equal(slots.reshape(d, d, R, M), expected)
    sent = (np.arange(R) < sizes.sum(axis=1)[:, None])[..., None]  # device 3 sends 5 of its 6 rows
    np.testing.assert_array_equal(back.reshape(d, R, M), np.where(sent, rounded, 0))
    cotangent = np.asarray(jnp.asarray(c).astype(dtype).astype(jnp.float32)).reshape(d, d, R, M)
    expected_grad = np.zeros((d, R, M), np.float32)
    for s in range(d):
        starts = np.cumsum(sizes[s]) - sizes[s]
        for j in range(d):
            expected_grad[s, starts[j] : starts[j] + sizes[s, j]] = cotangent[j, s, : sizes[s, j]]
    np.testing.assert_array_equal(grad.reshape(d, R, M), expected_grad)


def test_ragged_all_to_all_over_one_device_keeps_the_rows_sent_and_zeros_the_rest():
    """Over an axis of one device (d=1 t=8) nothing is exchanged: the slot holds the first sizes[0]
    rows, zeros after, and the way back returns them where they were; the gradient is the cotangent's
    first rows."""
    R, M = 5, 3
    x, c = rand(8 * R, M), rand(8 * R, M)
    sizes = np.array([3, 0, 5, 1, 2, 4, 5, 0], np.int32)  # each t device's rows to send

    @typed_shard_map
    def exchange(x: f32[b"R/d/t M"], sizes: i32[b"D/d/t"], c: f32[b"R/d/t M"]) -> tuple[
            f32[b"R/d/t M"], f32[b"R/d/t M"], f32[b"R/d/t M"]]:
        slots = shardops.ragged_all_to_all("R M -> d R M", x, sizes)
        back = shardops.ragged_all_to_all("d R M -> R M", slots, sizes)
        loss = lambda x: jnp.sum(shardops.ragged_all_to_all("R M -> d R M", x, sizes)[0] * c)  # noqa: E731
        return slots[0], back, jax.grad(loss)(x)

    with jax.set_mesh(make_mesh(1, 8)):
        slots, back, grad = (np.asarray(a).reshape(8, R, M) for a in jax.jit(exchange)(x, sizes, c))
    sent = (np.arange(R)[None, :] < sizes[:, None])[..., None]
    np.testing.assert_array_equal(slots, np.where(sent, x.reshape(8, R, M), 0))
    np.testing.assert_array_equal(back, slots)
    np.testing.assert_array_equal(grad, np.where(sent, c.reshape(8, R, M), 0))


@pytest.mark.parametrize(
    "spec,message",
    [
        ("R M -> R M d", "leading dimension named by a mesh axis"),
        ("R M -> d/t R M", "leading dimension named by a mesh axis"),
        ("R M -> d R F", "leading dimension named by a mesh axis"),
        ("R M -> x R M", "'x' is not a mesh axis"),
    ],
)
def test_malformed_ragged_all_to_all_specs(spec, message, mesh):
    @typed_shard_map
    def send(x: f32[b"R/d M"], sizes: i32[b"D/d"]) -> f32[b"R/d M"]:
        return shardops.ragged_all_to_all(spec, x, sizes)[0]

    with pytest.raises(SpecError, match=message):
        jax.jit(send)(rand(16, 2), np.zeros(16, np.int32))
