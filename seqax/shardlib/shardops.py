"""Collectives and einsums driven by spec strings that show the layout before and after.

Every op parses its spec before touching data and raises `SpecError` with the spec and the
reason when the spec is not a legal gather, scatter, einsum or lookup. All ops run inside
`shard_map`; array shapes are per device.

    all_gather('M/d F/t -> M F/t', w)            gather w over d along M
    all_gather_cast('M/d F/t -> M F/t', w, bf16) the same, sent as bf16; its gradient a float32 reduce-scatter
    psum_scatter('B/d L M -> B/d L M/t', x)       sum partials over t, keep a 1/t slice of M
    psum('B/d L M', x, 't')                       sum partials over t, keep all of M
    einsum_unreduced('B/d L M, M F/t -> B/d L F/t', x, w)
    index_unreduced('V/t M, B/d L -> B/d L M', table, ids)
    take_unreduced('B/d L V/t, B/d L -> B/d L', logits, targets)
    ring_pass('B/d S/c K/t D', k, 'c')            send k to the next device along c, receive the previous one's
    global_norm(grads, Model)                     the L2 norm of arrays sharded as Model's annotations say
    all_to_all('layers M/d F/t -> layers/d/t M F', w)  move d and t from M and F to layers: whole matrices
    inverse('layers M/d F/t -> layers/d/t M F')       the spec that undoes it: 'layers/d/t M F -> layers M/d F/t'
    ragged_all_to_all('R M -> d R M', rows, sizes)  rows sorted by destination, sizes[j] of them to device j of d
    ragged_all_to_all('d R M -> R M', received, sizes)  each slot's rows back to their sender, in place
"""

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from seqax.shardlib.bits import through_bits
from seqax.shardlib.float8 import E4M3, E5M2, scaled
from seqax.shardlib.shardtypes import (
    Dim,
    ShapeError,
    dims_str,
    make_partition_specs,
    parse_dims,
    spec_axes,
)


class SpecError(ValueError):
    """A spec string is not a legal instance of the op it was given to."""


def _parse(spec: str, op: str) -> tuple[list[tuple[Dim, ...]], tuple[Dim, ...]]:
    if spec.count("->") != 1:
        raise SpecError(f"{op}: spec {spec!r} needs exactly one '->'")
    lhs, rhs = spec.split("->")
    try:
        inputs = [parse_dims(part) for part in lhs.split(",")]
        output = parse_dims(rhs)
    except ShapeError as e:
        raise SpecError(f"{op}: {e}") from None
    return inputs, output


def _check_ndim(op: str, spec: str, dims: tuple[Dim, ...], x, which: str = "operand"):
    if x.ndim != len(dims):
        raise SpecError(f"{op}: spec {spec!r} gives the {which} {len(dims)} dims ({dims_str(dims)}), "
                        f"but its shape is {x.shape}")


def _parse_unary(spec: str, op: str) -> tuple[tuple[Dim, ...], tuple[Dim, ...]]:
    """A one-operand spec whose two sides name the same dimensions in the same order."""
    inputs, output = _parse(spec, op)
    if len(inputs) != 1:
        raise SpecError(f"{op}: spec {spec!r} takes exactly one operand")
    if [d.name for d in inputs[0]] != [d.name for d in output]:
        raise SpecError(f"{op}: spec {spec!r} must keep the same dimensions in the same order on both sides")
    return inputs[0], output


def _require_f32(op: str, x):
    # Sums that cross devices are done in float32 so that results depend on the mesh only
    # as much as float32 rounding does (summing bf16 partials costs ~1e-3 relative).
    if x.dtype != jnp.float32:
        raise SpecError(f"{op}: partial sums must be float32 to reduce across devices, got {x.dtype}; cast first")


def all_gather(spec: str, x):
    """Gathers the innermost mesh axes that the output drops from each dimension."""
    return _gather(_gathers("all_gather", spec, x), x)


def all_gather_cast(spec: str, x, dtype):
    """all_gather of x cast to `dtype` before it crosses the wire (FSDP: a float32 weight sent
    as bfloat16, half the bytes); the gradient flows back as a float32 reduce-scatter, so that
    the cross-device sum is float32 whatever `dtype` is. Each device's part of that sum arrives
    in `dtype`, though (the gradient of a `dtype` array, as an einsum returns it): rounded before
    the sum, which is why bf16 gradients differ between meshes by ~1e-3. x must be float32.
    GPUs run the gather asynchronously, beside the kernels; TPUs on their SparseCores (seqax/xla_tpu.py)."""
    op = "all_gather_cast"
    gathers = _gathers(op, spec, x)
    _require_f32(op, x)
    return _gather_cast(x, tuple(gathers), jnp.dtype(dtype))


@partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _gather_cast(x, gathers, dtype):
    return through_bits(partial(_gather, gathers), x.astype(dtype))  # on a CPU as its bits (bits.py)


def _gather_cast_forward(x, gathers, dtype):
    return _gather_cast(x, gathers, dtype), None


def _gather_cast_backward(gathers, dtype, _, cotangent):
    return (_scatter(reversed(gathers), cotangent.astype(jnp.float32)),)


_gather_cast.defvjp(_gather_cast_forward, _gather_cast_backward)


def _gathers(op: str, spec: str, x) -> list[tuple[int, tuple[str, ...]]]:
    """(dimension, mesh axes gathered into it) of a gather spec, checked against x."""
    return _axis_changes(op, spec, x, "gather", "drop")


def _axis_changes(op: str, spec: str, x, what: str, verb: str) -> list[tuple[int, tuple[str, ...]]]:
    """(dimension, the innermost mesh axes a gather drops from it or a scatter adds to it) of a spec
    whose every other axis stays; checked against x."""
    src, dst = _parse_unary(spec, op)
    kept, changed = (dst, src) if what == "gather" else (src, dst)
    changes = []
    for i, (a, b) in enumerate(zip(kept, changed)):
        if b.axes[: len(a.axes)] != a.axes:
            shown = f"{b} -> {a}" if what == "gather" else f"{a} -> {b}"
            raise SpecError(f"{op}: in spec {spec!r}, {shown} is not a {what}: "
                            f"the output may only {verb} innermost axes")
        if len(b.axes) > len(a.axes):
            changes.append((i, b.axes[len(a.axes) :]))
    if not changes:
        raise SpecError(f"{op}: spec {spec!r} {what}s nothing")
    _check_ndim(op, spec, src, x)
    return changes


# XLA's collectives need each device's block contiguous in memory. For a dimension that is
# not the first, XLA would get that by giving the array (and, through layout assignment, every
# op that touches it: the residual stream's adds, norms and matmuls) a layout with that
# dimension outermost, which makes all of those ops strided. Instead the blocks are put in
# front explicitly, one transpose at each collective, and every other op keeps the row-major
# layout: [.., n * b, ..] <-> [n, .., b, ..].


def _gather(gathers, x):
    for dim, axes in gathers:
        n = lax.axis_size(axes)
        if n > 1:  # over one device the identity: no op at all (and no change of type)
            blocks = lax.all_gather(x, axes if len(axes) > 1 else axes[0], axis=0, tiled=False)  # [n, ..., b, ...]
            x = _joined(blocks, dim)
    return x


def _joined(blocks, dim: int):
    """Blocks [n, ..., b, ...] of a gather, one after another along `dim`: [..., n b, ...]."""
    n, shape = blocks.shape[0], blocks.shape[1:]
    return jnp.moveaxis(blocks, 0, dim).reshape(shape[:dim] + (n * shape[dim],) + shape[dim + 1 :])


def _scatter(scatters, x):
    for dim, axes in scatters:
        n = lax.axis_size(axes)
        if n > 1:
            # [n, ..., b, ...]
            blocks = jnp.moveaxis(x.reshape(x.shape[:dim] + (n, x.shape[dim] // n) + x.shape[dim + 1 :]), dim, 0)
            x = lax.psum_scatter(blocks, axes if len(axes) > 1 else axes[0], scatter_dimension=0, tiled=False)
    return x


def psum_scatter(spec: str, x):
    """Sums float32 partials over the axes the output adds, leaving each device its slice."""
    op = "psum_scatter"
    scatters = _axis_changes(op, spec, x, "scatter", "add")
    _require_f32(op, x)
    return _scatter(scatters, x)


def psum(spec: str, x, axes: str | tuple[str, ...]):
    """Sums float32 partials over `axes` (an all-reduce); `spec` is the layout, unchanged."""
    return lax.psum(_all_reduced("psum", spec, x, axes), axes)  # (also over one device: psum types the result
    # as the same on every device)


def pmean(spec: str, x, axes: str | tuple[str, ...]):
    """The mean of float32 values over `axes` (an all-reduce); `spec` is the layout, unchanged."""
    return lax.pmean(_all_reduced("pmean", spec, x, axes), axes)


def pmax(spec: str, x, axes: str | tuple[str, ...]):
    """The largest of float32 values over `axes` (an all-reduce); `spec` is the layout, unchanged."""
    return lax.pmax(_all_reduced("pmax", spec, x, axes), axes)


def _all_reduced(op: str, spec: str, x, axes):
    """x, checked to be a float32 value laid out as `spec` that the devices of `axes` each hold whole."""
    try:
        dims = parse_dims(spec)
    except ShapeError as e:
        raise SpecError(f"{op}: {e}") from None
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    used = {a for d in dims for a in d.axes}
    if not axes or used & set(axes):
        verb = {"psum": "sum", "pmean": "average", "pmax": "take the maximum"}[op]
        raise SpecError(f"{op}: cannot {verb} over {axes} a value laid out as {spec!r}: "
                        "an axis that shards it holds different parts, not partials")
    _check_ndim(op, spec, dims, x)
    _require_f32(op, x)
    return x


def einsum_unreduced(spec: str, *operands, preferred_element_type=jnp.float32, multiply_in: str | None = None,
                     first_amax=None, gradient_amax=None, gradient_float8=E4M3):
    """einsum on per-device blocks. A contracted dimension that is sharded leaves a partial sum
    (unreduced) that the caller reduces with psum or psum_scatter. Accumulates in float32 by
    default: bf16 operands with f32 results are the fast and accurate path.

    The gradient of a two-operand einsum is two einsums with the forward's operand dtype: the
    output's gradient is rounded to it (bfloat16 x bfloat16 -> float32, as forward; plain
    autodiff would multiply the float32 gradient by the widened operand, a float32 matmul that
    runs 3-10x slower on CPUs with bfloat16 units and 2-16x on GPUs). With float32 operands
    the rounding is the identity and the gradient is autodiff's.

    multiply_in="float8" (model.matmul_dtype; two operands, float32 output): the operands, in any
    float type, are multiplied as e4m3 and the output's gradient as `gradient_float8` (e4m3, or e5m2 for a
    gradient whose values span more than e4m3's range: the logits'), each scaled by its amax (float8.py); the
    gradients come back in the operands' types. The first operand (the activations, in
    train.py) is kept for the backward pass as its e4m3 cast, under FLOAT8_OPERAND_NAME; the second (a weight)
    is cast again there. `first_amax`, a bound on the first operand's magnitude known before it is computed,
    gives that operand's scale instead of its own amax (float8.scaled); `gradient_amax`, a bound on the output's
    gradient known before the backward pass computes it, gives that gradient's. Any other value, or None: the
    operands' own type, as above, and the bounds unused."""
    op = "einsum_unreduced"
    inputs, output = _parse(spec, op)
    if len(inputs) != len(operands):
        raise SpecError(f"{op}: spec {spec!r} names {len(inputs)} operands, got {len(operands)}")
    axes_of: dict[str, tuple[str, ...]] = {}
    for dims in inputs:
        for d in dims:
            if d.name.isdecimal():
                raise SpecError(f"{op}: spec {spec!r} uses a number {d.name!r} as a dimension name")
            if axes_of.setdefault(d.name, d.axes) != d.axes:
                ways = " and ".join("/".join(a) or "unsharded" for a in (axes_of[d.name], d.axes))
                raise SpecError(f"{op}: in spec {spec!r}, dimension {d.name} is sharded two ways ({ways})")
    dim_of_axis: dict[str, str] = {}
    for name, axes in axes_of.items():
        for axis in axes:
            if dim_of_axis.setdefault(axis, name) != name:
                raise SpecError(f"{op}: in spec {spec!r}, mesh axis {axis!r} splits both {dim_of_axis[axis]} "
                                f"and {name}; blocks would not line up")
    for d in output:
        if d.name not in axes_of:
            raise SpecError(f"{op}: in spec {spec!r}, output dimension {d.name} is not in any operand")
        if axes_of[d.name] != d.axes:
            raise SpecError(f"{op}: in spec {spec!r}, output dimension {d} must keep its input sharding "
                            f"{'/'.join((d.name,) + axes_of[d.name])}")
    letters = {name: chr(ord("a") + i) for i, name in enumerate(axes_of)}
    if len(letters) > 26:
        raise SpecError(f"{op}: spec {spec!r} has more than 26 dimensions")
    for dims, x in zip(inputs, operands):
        _check_ndim(op, spec, dims, x)
    plain = ",".join("".join(letters[d.name] for d in dims) for dims in inputs)
    plain += "->" + "".join(letters[d.name] for d in output)
    float8 = multiply_in == "float8"
    if float8 and (len(operands) != 2 or jnp.dtype(preferred_element_type) != jnp.float32):
        raise SpecError(f"{op}: a float8 multiply takes two operands and gives float32, not {len(operands)} "
                        f"operands giving {jnp.dtype(preferred_element_type)} (spec {spec!r})")
    if len(operands) != 2:
        return jnp.einsum(plain, *operands, preferred_element_type=preferred_element_type)
    # Both operands vary over the same mesh axes before the custom gradient (check_vma): the
    # gradient of one made varying is then summed over those axes by autodiff, as for jnp.einsum.
    a, b = (_varying(x, _varying_axes(operands[0]) | _varying_axes(operands[1])) for x in operands)
    if float8 and jnp.dtype(gradient_float8) not in (jnp.dtype(E4M3), jnp.dtype(E5M2)):
        raise SpecError(f"{op}: gradient_float8 must be e4m3 or e5m2 (what float8 GEMMs multiply by e4m3), "
                        f"not {jnp.dtype(gradient_float8)} (spec {spec!r})")
    bounds = (first_amax, gradient_amax) if float8 else (None, None)
    return _einsum_pair(a, b, bounds, plain, jnp.dtype(preferred_element_type),
                        jnp.dtype(gradient_float8) if float8 else None)


def _varying_axes(x) -> frozenset:
    """The mesh axes over which x holds different values on different devices (shard_map's
    check_vma typing; empty outside shard_map). jax 0.10 keeps them in the abstract value's
    manual_axis_type, earlier versions in its vma."""
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)
    return frozenset(manual.varying if manual is not None else getattr(aval, "vma", ()))


def vary_as(x, *operands):
    """x typed as varying over every mesh axis any of `operands` varies over (shard_map's check_vma:
    a loop's carry, or a buffer the operands' values are written into, must have their type)."""
    return _varying(x, frozenset().union(*(_varying_axes(a) for a in operands)))


def zeros_after(shape, dtype, *values):
    """Zeros that exist only once `values` do. A buffer of zeros depends on nothing, so XLA may create
    it anywhere, and on a GPU it gathers those of every layer into one kernel at the start: all of
    them alive at once. Tied to the values it is made where it is used. Typed as varying as they are."""
    held = [v for v in jax.tree.leaves(values) if v.size]
    zero = lax.optimization_barrier((jnp.zeros((), dtype), held))[0] if held else jnp.zeros((), dtype)
    return vary_as(jnp.broadcast_to(zero, shape), *values)


def _varying(x, axes):
    """x typed as varying over mesh `axes` too (a no-op on the values)."""
    missing = tuple(sorted(set(axes) - _varying_axes(x)))
    return lax.pcast(x, missing, to="varying") if missing else x


# The name under which a float8 einsum keeps its first operand's cast for the backward pass: the activation
# checkpointing policy (jax_extra.explicit_activation_checkpointing) keeps values of this name as it keeps
# save_for_backward's.
FLOAT8_OPERAND_NAME = "seqax_float8_operand"


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _einsum_pair(a, b, bounds, plain: str, out_dtype, gradient_float8):
    """`bounds`: (a bound on |a|, a bound on the output's gradient), each None where the amax is to be taken.
    `gradient_float8`: the float8 type of the output's gradient, None where nothing is multiplied in float8."""
    return _einsum_pair_forward(a, b, bounds, plain, out_dtype, gradient_float8)[0]


def _einsum_pair_forward(a, b, bounds, plain, out_dtype, gradient_float8):
    if gradient_float8 is None:
        return jnp.einsum(plain, a, b, preferred_element_type=out_dtype), (a, b, bounds)
    # The first operand (train.py's activations) is kept as its cast, half a bfloat16's bytes: the backward
    # multiplies the same float8 values without casting them again. The second (a weight, gathered again under
    # FSDP) is cast again.
    (qa, a_inverse), (qb, b_inverse) = scaled(a, E4M3, bounds[0]), scaled(b, E4M3)
    kept = [through_bits(partial(checkpoint_name, name=FLOAT8_OPERAND_NAME), x) for x in (qa, a_inverse)]
    out = jnp.einsum(plain, qa, qb, preferred_element_type=jnp.float32) * (a_inverse * b_inverse)
    return out, (*kept, b, jnp.zeros((0,), a.dtype), bounds)  # the fourth: a's type (for its gradient's), no values


def _einsum_pair_backward(plain, out_dtype, gradient_float8, residuals, cotangent):
    (a_letters, b_letters), out_letters = plain.split("->")[0].split(","), plain.split("->")[1]
    *residuals, bounds = residuals
    no_bound_gradient = jax.tree.map(jnp.zeros_like, bounds)  # bounds, not functions of a or b
    if gradient_float8 is not None:  # the output's gradient rounded to the operands' type first: written at their width
        qa, a_inverse, b, a_type = residuals
        a = jax.ShapeDtypeStruct(qa.shape, a_type.dtype)
        g = cotangent.astype(jnp.promote_types(a.dtype, b.dtype))
        (g, g_inverse), (qb, b_inverse) = scaled(g, gradient_float8, bounds[1]), scaled(b, E4M3)
        return (_einsum_gradient(g, out_letters, qb, b_letters, a, a_letters, g_inverse * b_inverse),
                _einsum_gradient(g, out_letters, qa, a_letters, b, b_letters, g_inverse * a_inverse), no_bound_gradient)
    a, b = residuals
    g = cotangent.astype(jnp.promote_types(a.dtype, b.dtype))  # the forward's operand dtype
    return (_einsum_gradient(g, out_letters, b, b_letters, a, a_letters),
            _einsum_gradient(g, out_letters, a, a_letters, b, b_letters), no_bound_gradient)


def _einsum_gradient(g, g_letters: str, other, other_letters: str, x, x_letters: str, inverse_scale=None):
    """The gradient of operand x of einsum(x, other) from the output's gradient g: an einsum of
    g and the other operand, accumulated in float32 (times `inverse_scale`: float8's) and returned
    in x's dtype. A letter of x that is in neither (a dimension x alone sums over) is broadcast back."""
    present = "".join(letter for letter in x_letters if letter in g_letters + other_letters)
    grad = jnp.einsum(f"{g_letters},{other_letters}->{present}", g, other, preferred_element_type=jnp.float32)
    if inverse_scale is not None:
        grad = grad * inverse_scale
    if present != x_letters:
        grad = jnp.expand_dims(grad, [i for i, letter in enumerate(x_letters) if letter not in present])
        grad = jnp.broadcast_to(grad, x.shape)
    return grad.astype(x.dtype)


_einsum_pair.defvjp(_einsum_pair_forward, _einsum_pair_backward)


def index_unreduced(spec: str, table, indices):
    """Looks `indices` up in the first dimension of `table`. When that dimension is sharded,
    each device answers only for its own rows and gives zeros elsewhere: the sum over the
    sharding axes (the caller's psum) is the full lookup."""
    op = "index_unreduced"
    inputs, output = _parse(spec, op)
    if len(inputs) != 2:
        raise SpecError(f"{op}: spec {spec!r} needs two operands: table, indices")
    table_dims, index_dims = inputs
    if not table_dims:
        raise SpecError(f"{op}: spec {spec!r} has a table with no dimension to index")
    shared = {a for d in table_dims for a in d.axes} & {a for d in index_dims for a in d.axes}
    if shared:
        raise SpecError(f"{op}: in spec {spec!r}, the indices are split over {sorted(shared)}, "
                        "which also split the table")
    expected = index_dims + table_dims[1:]
    if [str(d) for d in output] != [str(d) for d in expected]:
        raise SpecError(f"{op}: spec {spec!r} must produce the index dims then the table's other dims: "
                        f"{dims_str(expected)}")
    _check_ndim(op, spec, table_dims, table, "table")
    _check_ndim(op, spec, index_dims, indices, "indices")
    if not table_dims[0].axes:
        return table[indices]
    local, inside = _local_indices(table_dims[0].axes, table.shape[0], indices)
    return jnp.where(inside.reshape(inside.shape + (1,) * (table.ndim - 1)), table[local], jnp.zeros((), table.dtype))


def take_unreduced(spec: str, values, indices):
    """values[..., indices[...]]: for every entry of `indices`, the entry it names in the last
    dimension of `values`, whose other dimensions are the indices' own ('B/d L V/t, B/d L -> B/d L'
    picks each position's target logit). When that last dimension is sharded, each device
    answers only for its own entries and gives zeros elsewhere: the sum over the sharding axes
    (the caller's psum) is the full lookup. Written as a sum over a one-hot mask, not a gather: its
    gradient is then a select that fuses with its neighbours, where a gather's is a scatter into
    a zeroed copy of `values` (the logits: two extra passes over [B, L, V] on an H200)."""
    op = "take_unreduced"
    inputs, output = _parse(spec, op)
    if len(inputs) != 2:
        raise SpecError(f"{op}: spec {spec!r} needs two operands: values, indices")
    value_dims, index_dims = inputs
    if ([str(d) for d in value_dims[:-1]] != [str(d) for d in index_dims]
            or [str(d) for d in output] != [str(d) for d in index_dims]):
        raise SpecError(f"{op}: spec {spec!r} must read 'DIMS X, DIMS -> DIMS': "
                        "the values' dims but the last are the indices' dims and the output's")
    _check_ndim(op, spec, value_dims, values, "values")
    _check_ndim(op, spec, index_dims, indices, "indices")
    axes = value_dims[-1].axes
    size = values.shape[-1]
    offset = lax.axis_index(axes if len(axes) > 1 else axes[0]) * size if axes else 0
    hit = jnp.arange(size, dtype=jnp.int32) == (indices.astype(jnp.int32) - offset)[..., None]
    return jnp.sum(jnp.where(hit, values, jnp.zeros((), values.dtype)), axis=-1)


def _local_indices(axes: tuple[str, ...], size: int, indices):
    """Indices into a dimension split over mesh `axes` into pieces of `size`, made local to
    this device's piece (clipped into it), and whether each one falls in it."""
    offset = lax.axis_index(axes if len(axes) > 1 else axes[0]) * size
    local = indices.astype(jnp.int32) - offset.astype(jnp.int32)
    return jnp.clip(local, 0, size - 1), (local >= 0) & (local < size)


def ring_pass(spec: str, x, axis: str):
    """Each device sends its block x (laid out as `spec`) to the next device along mesh axis
    `axis` (the last sends to the first) and receives the block of the one before: one step of a
    ring (ring attention passes key and value blocks this way). `axis` must split a dimension of
    `spec`: it names the blocks that travel. Its transpose passes the other way round."""
    op = "ring_pass"
    try:
        dims = parse_dims(spec)
    except ShapeError as e:
        raise SpecError(f"{op}: {e}") from None
    if not any(axis in d.axes for d in dims):
        raise SpecError(f"{op}: mesh axis {axis!r} splits no dimension of {spec!r}, "
                        "so its devices hold the same block and there is nothing to pass")
    _check_ndim(op, spec, dims, x)
    size = lax.axis_size(axis)
    if size == 1:  # a ring of one device: the block stays (no op, as for _gather)
        return x
    return _permute(x, axis, tuple((i, (i + 1) % size) for i in range(size)))


@partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _permute(x, axis, perm):
    return through_bits(partial(lax.ppermute, axis_name=axis, perm=perm), x)  # a bf16 block as its bits (bits.py)


def _permute_forward(x, axis, perm):
    return _permute(x, axis, perm), None


def _permute_backward(axis, perm, _, cotangent):
    # the gradient goes back the way the block came
    return (_permute(cotangent, axis, tuple((dst, src) for src, dst in perm)),)


_permute.defvjp(_permute_forward, _permute_backward)


def global_norm(tree, annotation):
    """The L2 norm of all the arrays of `tree`, laid out as `annotation` says (a gradient is laid
    out as its weight), on every device: each array's sum of squares is summed over the mesh axes
    that split it, with one all-reduce (a psum) per distinct set of axes, not one per array."""
    specs = jax.tree.leaves(make_partition_specs(annotation),
                            is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    squares_by_axes: dict[tuple[str, ...], list] = {}
    for x, spec in zip(jax.tree.leaves(tree), specs, strict=True):
        squares_by_axes.setdefault(tuple(sorted(spec_axes(spec))), []).append(
            jnp.sum(jnp.square(x.astype(jnp.float32))))
    return jnp.sqrt(sum(lax.psum(sum(parts), axes) if axes else sum(parts) for axes, parts in squares_by_axes.items()))


def all_to_all(spec: str, x):
    """Moves mesh axes from some dimensions to others: each device swaps blocks with every device
    along the axes that move. 'layers M/d/c F/t -> layers/d/c/t M F' turns a stack of matrices split
    over d, c and t into whole matrices, layers / (d c t) of them on each device; the reversed spec
    sends them back. An axis leaves a dimension as its innermost and joins another as its
    innermost, so the dimension it joins must divide evenly. 16-bit floats travel as their bits."""
    op = "all_to_all"
    src, dst = _parse_unary(spec, op)
    _check_ndim(op, spec, src, x)
    moves = _moves(op, spec, src, dst)
    shape = list(x.shape)
    for axes, leaving, joining in moves:
        size = lax.axis_size(axes)
        if shape[joining] % size:
            raise SpecError(f"{op}: in spec {spec!r}, dimension {src[joining].name} ({shape[joining]} per device) "
                            f"cannot be split over {'/'.join(axes)} ({size} devices); pad it to a multiple of {size}")
        shape[joining], shape[leaving] = shape[joining] // size, shape[leaving] * size
    return _all_to_all(x, tuple(moves))


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def _all_to_all(x, moves):
    def exchange(y):
        for axes, leaving, joining in moves:
            if lax.axis_size(axes) > 1:
                y = lax.all_to_all(y, axes if len(axes) > 1 else axes[0], split_axis=joining, concat_axis=leaving,
                                   tiled=True)
        return y

    return through_bits(exchange, x)  # a bf16 matrix as its bits (bits.py)


def _all_to_all_forward(x, moves):
    return _all_to_all(x, moves), None


def _all_to_all_backward(moves, _, cotangent):  # the blocks go back the way they came
    return (_all_to_all(cotangent, tuple((axes, joining, leaving) for axes, leaving, joining in reversed(moves))),)


_all_to_all.defvjp(_all_to_all_forward, _all_to_all_backward)


def ragged_all_to_all(spec: str, x, sizes):
    """Sends rows to the devices of one mesh axis, a different number to each, named as a dimension
    by the spec. 'R M -> d R M': x [R, M] holds rows sorted by their destination along d, sizes[j]
    of them (an int32 [d], summing to at most R) for device j; the result [d, R, M] holds in slot s
    the rows device s sent here, from the slot's start, zeros after. 'd R M -> R M' sends each slot
    back to its device, which finds the rows where it had them in x; `sizes` is the same array (each
    device's sizes as a sender of the first exchange). Each is the other's gradient.

    On GPUs and TPUs one ragged collective moves only the real rows; XLA:CPU has none, so there each
    device sends a whole slot of R rows to every device (d times the bytes, the same result). Over an
    axis of one device nothing moves: the rows stay (XLA's ragged kernel on a GPU copied them at
    about 3 GB/s, 2026-12-04 on an H200: 1.4 s of a 1.7 s step)."""
    op = "ragged_all_to_all"
    src, dst = _parse(spec, op)
    src = src[0]
    sending = len(dst) == len(src) + 1
    slotted, rows = (dst, src) if sending else (src, dst)
    if len(slotted) != len(rows) + 1 or slotted[1:] != rows or slotted[0].axes:
        raise SpecError(f"{op}: spec {spec!r} must add or drop one leading dimension named by a mesh axis "
                        "('R M -> d R M' or 'd R M -> R M'), the others unchanged")
    axis = slotted[0].name
    _check_ndim(op, spec, src, x)
    try:
        d = lax.axis_size(axis)
    except NameError:
        raise SpecError(f"{op}: in spec {spec!r}, {axis!r} is not a mesh axis") from None
    if sizes.shape != (d,) or not jnp.issubdtype(sizes.dtype, jnp.integer):
        raise SpecError(f"{op}: sizes must be integers [{d}] (one a device of {axis}), got {sizes.dtype}{sizes.shape}")
    if not sending and x.shape[0] != d:
        raise SpecError(f"{op}: in spec {spec!r}, {axis} has {d} devices but the operand {x.shape[0]} slots")
    sizes = sizes.astype(jnp.int32)
    return (_send_rows if sending else _return_rows)(x, sizes, axis)


def _exchange(x, axis):  # slot j of x to device j; slot s of the result from device s
    return through_bits(lambda y: lax.all_to_all(y, axis, 0, 0, tiled=True), x)


def _starts(sizes):
    return jnp.cumsum(sizes) - sizes


def _first_rows(x, n):  # x's first n rows, zeros after
    kept = (jnp.arange(x.shape[0]) < n).reshape((-1,) + (1,) * (x.ndim - 1))
    return jnp.where(kept, x, jnp.zeros((), x.dtype))


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _send_rows(x, sizes, axis):
    R, d = x.shape[0], sizes.shape[0]
    if d == 1:  # the rows stay here: the first sizes[0] of them, zeros after
        return _varying(_first_rows(x, sizes[0])[None], {axis})
    starts, received = _starts(sizes), _exchange(sizes, axis)

    def fixed(x):  # XLA:CPU: a whole slot to every device
        at = starts[:, None] + jnp.arange(R)
        slots = jnp.where((at < starts[:, None] + sizes[:, None])[..., None], x[jnp.minimum(at, R - 1)], 0)
        return _exchange(slots.astype(x.dtype), axis)

    def ragged(x):
        out = zeros_after((d * R,) + x.shape[1:], x.dtype, x)
        here = jnp.full((d,), lax.axis_index(axis) * R, jnp.int32)
        return lax.ragged_all_to_all(x, out, starts, sizes, here, received, axis_name=axis).reshape((d,) + x.shape)

    varying = _varying_axes(x) | {axis}
    return lax.platform_dependent(x, cpu=lambda x: _varying(fixed(x), varying),
                                  default=lambda x: _varying(ragged(x), varying))


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _return_rows(y, sizes, axis):
    d, R = y.shape[:2]
    if d == 1:
        return _varying(_first_rows(y[0], sizes[0]), {axis})
    starts, received = _starts(sizes), _exchange(sizes, axis)

    def fixed(y):
        back = _exchange(y, axis)  # slot j: the rows device j returns, in the order they were sent
        row = jnp.arange(R)
        to = jnp.minimum(jnp.sum(row[:, None] >= jnp.cumsum(sizes), axis=1), d - 1)  # each row's device
        return jnp.where((row < jnp.sum(sizes))[:, None], back[to, row - starts[to]], 0).astype(y.dtype)

    def ragged(y):
        out = zeros_after(y.shape[1:], y.dtype, y)
        return lax.ragged_all_to_all(y.reshape((d * R,) + y.shape[2:]), out, jnp.arange(d, dtype=jnp.int32) * R,
                                     received, _exchange(starts, axis), sizes, axis_name=axis)

    varying = _varying_axes(y) | {axis}
    return lax.platform_dependent(y, cpu=lambda y: _varying(fixed(y), varying),
                                  default=lambda y: _varying(ragged(y), varying))


def _send_rows_forward(x, sizes, axis):
    return _send_rows(x, sizes, axis), sizes


def _send_rows_backward(axis, sizes, cotangent):
    return _return_rows(cotangent, sizes, axis), None


def _return_rows_forward(y, sizes, axis):
    return _return_rows(y, sizes, axis), sizes


def _return_rows_backward(axis, sizes, cotangent):
    return _send_rows(cotangent, sizes, axis), None


_send_rows.defvjp(_send_rows_forward, _send_rows_backward)
_return_rows.defvjp(_return_rows_forward, _return_rows_backward)


def inverse(spec: str) -> str:
    """The spec of the collective that undoes `spec`'s: its two sides swapped ('A/d B -> A B/d' gives
    'A B/d -> A/d B'), as all_to_all needs to send whole matrices back where they came from."""
    if spec.count("->") != 1:
        raise SpecError(f"inverse: spec {spec!r} needs exactly one '->'")
    source, result = spec.split("->")
    return f"{result.strip()} -> {source.strip()}"


def _moves(op: str, spec: str, src, dst) -> list[tuple[tuple[str, ...], int, int]]:
    """(mesh axes, the dimension they leave, the one they join) of an all-to-all spec, in an order
    in which each group leaves a dimension as its innermost axes and joins another as its innermost."""
    now, final = [list(d.axes) for d in src], [list(d.axes) for d in dst]
    if sorted(a for axes in now for a in axes) != sorted(a for axes in final for a in axes) or now == final:
        raise SpecError(f"{op}: spec {spec!r} must move mesh axes between dimensions, keeping every axis "
                        "(a gather or a scatter changes which axes split the array)")
    for a, b in zip(now, final):
        if a[: len(b)] != b and b[: len(a)] != a:
            raise SpecError(f"{op}: in spec {spec!r}, an axis may only leave a dimension or join one as its innermost")
    moves = []
    while now != final:
        move = next(((tuple(now[leaving][-k:]), leaving, joining)
                     for joining in range(len(now)) for leaving in range(len(now))
                     for k in range(len(now[leaving]) - len(final[leaving]), 0, -1)
                     if now[joining] == final[joining][: len(now[joining])]
                     and now[leaving][-k:] == final[joining][len(now[joining]) : len(now[joining]) + k]), None)
        if move is None:
            raise SpecError(f"{op}: spec {spec!r} cannot be done as moves of innermost axes")
        axes, leaving, joining = move
        del now[leaving][-len(axes) :]
        now[joining] += axes
        moves.append(move)
    return moves


def axis_size(axes: str | tuple[str, ...]) -> int:
    """Number of devices along mesh axes (a Python int at trace time, inside shard_map)."""
    return lax.axis_size(axes)
