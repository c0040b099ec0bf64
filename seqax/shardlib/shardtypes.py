"""Array types that carry their sharding, and a checker that enforces them.

An annotation `f32[b'B/d L M/t']` says: a float32 array of three dimensions named B, L and M,
with B split over mesh axis `d` and M split over mesh axis `t`. `B/d/t` splits B over `d` and
then `t` (major to minor). A dimension may also be a number (`f32[b'2 M']`).

The spec is a bytes literal so that linters do not parse it as a forward-referenced type.

Outside `shard_map` an annotated array has its global shape. Inside `shard_map` it has its
per-device shape, and the checker divides by the sizes of the manual mesh axes to recover the
global size. Each function decorated with `typechecked` opens a scope in which every named
dimension is recorded the first time it is seen and compared with every later occurrence.
"""

import contextvars
import dataclasses
import functools
import inspect
import math
import typing

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec


class ShapeError(TypeError):
    """An array does not match its annotation (shape, dtype, dimension or mesh axis)."""


@dataclasses.dataclass(frozen=True)
class Dim:
    name: str  # an identifier, or a decimal number for a fixed size
    axes: tuple[str, ...]  # mesh axes that split this dimension, major to minor

    def __str__(self):
        return "/".join((self.name, *self.axes))


def parse_dims(spec: str | bytes) -> tuple[Dim, ...]:
    """Parses 'B/d L M/t' into dimensions; rejects malformed names and reused mesh axes."""
    if isinstance(spec, bytes):
        spec = spec.decode()
    if not isinstance(spec, str):
        raise ShapeError(f"a shape spec must be bytes or str, got {spec!r}")
    dims = []
    used_axes: set[str] = set()
    for token in spec.split():
        name, *axes = token.split("/")
        if not (name.isidentifier() or name.isdecimal()):
            raise ShapeError(f"bad dimension {token!r} in spec {spec!r}: a name must be an identifier or a number")
        for axis in axes:
            if not axis.isidentifier():
                raise ShapeError(f"bad mesh axis {axis!r} in {token!r} of spec {spec!r}")
            if axis in used_axes:
                raise ShapeError(f"mesh axis {axis!r} shards two dimensions in spec {spec!r}")
            used_axes.add(axis)
        if name.isdecimal() and axes:
            raise ShapeError(f"fixed-size dimension {token!r} in spec {spec!r} cannot be sharded")
        dims.append(Dim(name, tuple(axes)))
    names = [d.name for d in dims if not d.name.isdecimal()]
    if len(set(names)) != len(names):
        raise ShapeError(f"a dimension name repeats in spec {spec!r}")
    return tuple(dims)


def dims_str(dims: tuple[Dim, ...]) -> str:
    return " ".join(str(d) for d in dims)


@dataclasses.dataclass(frozen=True)
class ArrayType:
    """The annotation object made by `f32[b'...']`."""

    dtype: jnp.dtype
    dtype_name: str
    dims: tuple[Dim, ...]

    def __repr__(self):
        return f"{self.dtype_name}[b'{dims_str(self.dims)}']"


class DType:
    """`f32[b'B/d L']` makes an ArrayType of this dtype."""

    def __init__(self, dtype, name: str):
        self.dtype = jnp.dtype(dtype)
        self.name = name

    def __getitem__(self, spec: str | bytes) -> ArrayType:
        return ArrayType(self.dtype, self.name, parse_dims(spec))


f32 = DType(jnp.float32, "f32")
bf16 = DType(jnp.bfloat16, "bf16")
f16 = DType(jnp.float16, "f16")
u32 = DType(jnp.uint32, "u32")
i32 = DType(jnp.int32, "i32")
u8 = DType(jnp.uint8, "u8")
bool_ = DType(jnp.bool_, "bool_")


@dataclasses.dataclass(frozen=True)
class Stacked:
    """`Array['layers', Layer]`: every leaf of Layer gets a leading dimension `layers`."""

    dims: tuple[Dim, ...]
    inner: typing.Any  # a pytree_dataclass type


class Array:
    """`Array[b'layers', Cls]` stacks a pytree dataclass (or an ArrayType) over a dimension."""

    def __class_getitem__(cls, params):
        if not (isinstance(params, tuple) and len(params) == 2):
            raise ShapeError("use Array[b'dims', Cls], e.g. Array[b'layers', Layer]")
        dims, inner = parse_dims(params[0]), params[1]
        if isinstance(inner, ArrayType):
            return ArrayType(inner.dtype, inner.dtype_name, dims + inner.dims)
        if isinstance(inner, Stacked):
            return Stacked(dims + inner.dims, inner.inner)
        if not is_pytree_dataclass(inner):
            raise ShapeError(f"Array[{params[0]!r}, ...] needs a pytree_dataclass or an array type, got {inner!r}")
        return Stacked(dims, inner)


@dataclasses.dataclass(frozen=True)
class MaskedType:
    inner: typing.Any  # a pytree_dataclass type


class Masked:
    """`Masked[Model]`: a Model whose leaves may each be None (absent), with the types and shardings
    of Model where present. An optimizer's state is one: it holds values for the weights it updates."""

    def __class_getitem__(cls, inner):
        if not is_pytree_dataclass(inner):
            raise ShapeError(f"Masked[...] needs a pytree_dataclass, got {inner!r}")
        return MaskedType(inner)


def pytree_dataclass(cls):
    """A frozen dataclass whose fields are pytree children, named by field in key paths."""
    cls = dataclasses.dataclass(frozen=True)(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    jax.tree_util.register_dataclass(cls, data_fields=names, meta_fields=[])
    cls.__seqax_pytree__ = True
    return cls


def is_pytree_dataclass(t) -> bool:
    return isinstance(t, type) and getattr(t, "__seqax_pytree__", False)


def _tuple_args(annotation):
    """The element annotations of `tuple[A, B]`, or None if it is not a tuple annotation."""
    if typing.get_origin(annotation) is tuple:
        args = typing.get_args(annotation)
        if Ellipsis in args:
            raise ShapeError(f"variable-length {annotation} is not supported; list each element")
        return args
    return None


# ---- partition specs and shardings derived from annotations ----


def _partition_spec(dims: tuple[Dim, ...]) -> PartitionSpec:
    entries = [None if not d.axes else d.axes[0] if len(d.axes) == 1 else d.axes for d in dims]
    return PartitionSpec(*entries)


def make_partition_specs(annotation, prefix: tuple[Dim, ...] = ()):
    """A pytree of PartitionSpecs with the structure that `annotation` describes."""
    if isinstance(annotation, ArrayType):
        return _partition_spec(prefix + annotation.dims)
    if isinstance(annotation, Stacked):
        return make_partition_specs(annotation.inner, prefix + annotation.dims)
    # a spec where a leaf is absent is a prefix of nothing: jit and shard_map skip it
    if isinstance(annotation, MaskedType):
        return make_partition_specs(annotation.inner, prefix)
    if is_pytree_dataclass(annotation):
        return annotation(**{f.name: make_partition_specs(f.type, prefix) for f in dataclasses.fields(annotation)})
    args = _tuple_args(annotation)
    if args is not None:
        return tuple(make_partition_specs(a, prefix) for a in args)
    raise ShapeError(f"cannot derive a sharding from annotation {annotation!r}")


def leaf_dims(annotation, prefix: tuple[Dim, ...] = ()) -> list[tuple[Dim, ...]]:
    """The dimensions (names and mesh axes) of every array that `annotation` describes, in order."""
    if isinstance(annotation, ArrayType):
        return [prefix + annotation.dims]
    if isinstance(annotation, Stacked):
        return leaf_dims(annotation.inner, prefix + annotation.dims)
    if isinstance(annotation, MaskedType):
        return leaf_dims(annotation.inner, prefix)
    if is_pytree_dataclass(annotation):
        return [dims for f in dataclasses.fields(annotation) for dims in leaf_dims(f.type, prefix)]
    args = _tuple_args(annotation)
    if args is not None:
        return [dims for a in args for dims in leaf_dims(a, prefix)]
    raise ShapeError(f"cannot read dimensions from annotation {annotation!r}")


def spec_axes(spec: PartitionSpec) -> tuple[str, ...]:
    """All mesh axes that a PartitionSpec shards over."""
    axes = []
    for entry in spec:
        if entry is None:
            continue
        axes.extend(entry if isinstance(entry, tuple) else (entry,))
    return tuple(axes)


def make_shardings(annotation, mesh: jax.sharding.Mesh):
    """A pytree of NamedShardings on `mesh`; an axis the mesh lacks is an error."""
    specs = make_partition_specs(annotation)

    def to_sharding(spec):
        for axis in spec_axes(spec):
            if axis not in mesh.axis_names:
                raise ShapeError(f"unknown mesh axis {axis!r} in {annotation!r}; the mesh has axes {mesh.axis_names}")
        return NamedSharding(mesh, spec)

    return jax.tree.map(to_sharding, specs, is_leaf=lambda x: isinstance(x, PartitionSpec))


def abstract_arrays(shapes, annotation, mesh: jax.sharding.Mesh):
    """`shapes` (leaves with .shape and .dtype, e.g. from jax.eval_shape; None where a leaf is absent)
    as ShapeDtypeStructs with the shardings that `annotation` gives them on `mesh`."""
    def abstract(sharding, x):
        return None if x is None else jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    return jax.tree.map(abstract, make_shardings(annotation, mesh), shapes)


def traced_device() -> tuple[str, str]:
    """(platform, device kind) of the devices being traced for, as JAX names them ("gpu", "NVIDIA H200"): the
    current mesh's (which may be devices that are not here: bench/compile_for), else the default backend's."""
    device = jax.sharding.get_abstract_mesh().abstract_device
    if device is None:
        return jax.default_backend(), jax.devices()[0].device_kind
    return device.platform, device.device_kind


# ---- run-time checking ----

_scope: contextvars.ContextVar[dict | None] = contextvars.ContextVar("seqax_shape_scope", default=None)


def _axis_divisor(dim: Dim, where: str, annotation) -> int:
    """How many per-device pieces this dimension is cut into here (1 outside shard_map)."""
    mesh = jax.sharding.get_abstract_mesh()
    divisor = 1
    for axis in dim.axes:
        if mesh.axis_names and axis not in mesh.axis_names:
            raise ShapeError(f"{where}: unknown mesh axis {axis!r} in {annotation!r}; "
                             f"the mesh has axes {mesh.axis_names}")
        if axis in mesh.manual_axes:
            divisor *= mesh.shape[axis]
    return divisor


def check_array(annotation: ArrayType, value, where: str, scope: dict, prefix=()):
    dims = prefix + annotation.dims
    shown = f"{annotation.dtype_name}[b'{dims_str(dims)}']"
    if not (hasattr(value, "shape") and hasattr(value, "dtype")):
        raise ShapeError(f"{where}: expected an array {shown}, got {type(value).__name__}")
    if jnp.dtype(value.dtype) != annotation.dtype:
        raise ShapeError(f"{where}: expected dtype {annotation.dtype} for {shown}, got {value.dtype}")
    if len(value.shape) != len(dims):
        raise ShapeError(f"{where}: expected {len(dims)} dimensions ({dims_str(dims)}), got shape {tuple(value.shape)}")
    for dim, local in zip(dims, value.shape):
        divisor = _axis_divisor(dim, where, shown)
        size = local * divisor
        per_device = f" ({local} per device x {divisor})" if divisor > 1 else ""
        if dim.name.isdecimal():
            if size != int(dim.name):
                raise ShapeError(f"{where}: dimension {dim} of {shown} must be {dim.name}, got {size}")
            continue
        expected = scope.get(dim.name)
        if expected is None:
            scope[dim.name] = size
        elif expected != size:
            raise ShapeError(
                f"{where}: dimension {dim.name} of {shown} is {size}{per_device}, "
                f"but {dim.name} was {expected} earlier in this scope (shape {tuple(value.shape)})"
            )


def check(annotation, value, where: str, scope: dict, prefix=(), masked: bool = False):
    """Checks `value` against `annotation`; annotations that are not ours are not checked. Under
    Masked[...] (`masked`), an array may be None."""
    if isinstance(annotation, ArrayType):
        if not (masked and value is None):
            check_array(annotation, value, where, scope, prefix)
    elif isinstance(annotation, Stacked):
        check(annotation.inner, value, where, scope, prefix + annotation.dims, masked)
    elif isinstance(annotation, MaskedType):
        check(annotation.inner, value, where, scope, prefix, masked=True)
    elif is_pytree_dataclass(annotation):
        if not isinstance(value, annotation):
            raise ShapeError(f"{where}: expected {annotation.__name__}, got {type(value).__name__}")
        for f in dataclasses.fields(annotation):
            check(f.type, getattr(value, f.name), f"{where}.{f.name}", scope, prefix, masked)
    elif (args := _tuple_args(annotation)) is not None:
        if not isinstance(value, tuple) or len(value) != len(args):
            raise ShapeError(f"{where}: expected a tuple of {len(args)}, got {type(value).__name__}")
        for i, (a, v) in enumerate(zip(args, value)):
            check(a, v, f"{where}[{i}]", scope, prefix, masked)


def _name(f) -> str:
    """f's qualified name, or for a functools.partial its function's."""
    return getattr(f, "__qualname__", None) or _name(f.func)


def typechecked(f):
    """Checks annotated arguments and the return value of `f` (a function, or a partial of one) in
    a fresh dimension scope."""
    signature = inspect.signature(f)

    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        scope: dict[str, int] = {}
        token = _scope.set(scope)
        try:
            bound = signature.bind(*args, **kwargs)
            for name, value in bound.arguments.items():
                annotation = signature.parameters[name].annotation
                check(annotation, value, f"{_name(f)}: argument {name!r}", scope)
            result = f(*args, **kwargs)
            check(signature.return_annotation, result, f"{_name(f)}: return value", scope)
            return result
        finally:
            _scope.reset(token)

    return wrapper


def typed_shard_map(f, mesh: jax.sharding.Mesh | None = None):
    """shard_map with in/out specs read from `f`'s annotations, and `f` typechecked inside.

    Without `mesh`, the mesh set by `jax.set_mesh` is used.
    """
    signature = inspect.signature(f)
    for name, p in signature.parameters.items():
        if p.annotation is inspect.Parameter.empty:
            raise ShapeError(f"typed_shard_map: argument {name!r} of {_name(f)} has no annotation")
    in_specs = tuple(make_partition_specs(p.annotation) for p in signature.parameters.values())
    out_specs = make_partition_specs(signature.return_annotation)
    checked = typechecked(f)

    @functools.wraps(f)
    def mapped(*args):
        the_mesh = mesh if mesh is not None else jax.sharding.get_abstract_mesh()
        return _without_empty_arrays(checked, the_mesh, in_specs, out_specs, args)

    return mapped


def _is_spec(x) -> bool:
    return isinstance(x, PartitionSpec)


def _without_empty_arrays(f, mesh, in_specs, out_specs, args):
    """jax.shard_map(f)(*args), with the arrays of no elements made inside and outside instead of
    passed through: they hold no data, and jax 0.11's partitioner (Shardy) crashes compiling, over
    several devices, a shard_map that an array of no elements flows through (a segfault, jax
    0.11.2; a dense model's experts are such arrays). Inside, each is zeros of its per-device shape,
    varying over its spec's mesh axes; outside, zeros of its global shape. Which outputs are empty is
    known only from f's result: jax.eval_shape of a shard_map of every output finds them, then a
    shard_map of the others runs. f is traced once either way: `call` is jitted, so the second
    shard_map finds its trace in jit's cache (the step's trace, a second on local_test_synthetic, is not
    paid twice; the optimized HLO is the same but for metadata)."""
    in_tree = jax.tree.structure(in_specs, is_leaf=_is_spec)
    parts = in_tree.flatten_up_to(args)  # an array, or None where a Masked leaf is absent
    specs = jax.tree.leaves(in_specs, is_leaf=_is_spec)
    empty = {i: x for i, x in enumerate(parts) if x is not None and x.size == 0}
    if not empty:
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs)(*args)
    kept = [i for i in range(len(parts)) if i not in empty]
    out_tree = jax.tree.structure(out_specs, is_leaf=_is_spec)
    out_specs_flat = jax.tree.leaves(out_specs, is_leaf=_is_spec)

    @jax.jit
    def call(*kept_parts):
        whole = dict(zip(kept, kept_parts))
        for i, x in empty.items():
            local = jnp.zeros(NamedSharding(mesh, specs[i]).shard_shape(x.shape), x.dtype)
            axes = tuple(sorted(set(spec_axes(specs[i]))))
            whole[i] = jax.lax.pcast(local, axes, to="varying") if axes else local
        return out_tree.flatten_up_to(f(*in_tree.unflatten([whole[i] for i in range(len(parts))])))

    def shard_mapped(out_index):
        def selected(*a):
            outs = call(*a)
            return [outs[j] for j in out_index]

        return jax.shard_map(selected, mesh=mesh,
                             in_specs=tuple(specs[i] for i in kept),
                             out_specs=[out_specs_flat[j] for j in out_index])

    every_out = list(range(len(out_specs_flat)))
    shapes = jax.eval_shape(shard_mapped(every_out), *(parts[i] for i in kept))
    out_kept = [j for j in every_out if shapes[j] is not None and math.prod(shapes[j].shape) > 0]
    results = dict(zip(out_kept, shard_mapped(out_kept)(*(parts[i] for i in kept))))
    outs = [results[j] if j in results else None if shapes[j] is None else jnp.zeros(shapes[j].shape, shapes[j].dtype)
            for j in every_out]
    return out_tree.unflatten(outs)


__all__ = [
    "Array", "ArrayType", "Dim", "Masked", "ShapeError", "Stacked", "abstract_arrays", "bf16", "bool_", "check", "f16",
    "f32", "i32", "is_pytree_dataclass", "leaf_dims", "make_partition_specs", "make_shardings", "parse_dims",
    "pytree_dataclass", "spec_axes", "typechecked", "typed_shard_map", "u32", "u8",
]
