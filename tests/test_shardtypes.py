"""Shape, dtype, dimension and mesh-axis checking, and specs derived from annotations."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fixtures import make_mesh
from seqax.shardlib.shardtypes import (
    Array,
    Masked,
    ShapeError,
    abstract_arrays,
    bf16,
    f32,
    make_partition_specs,
    make_shardings,
    parse_dims,
    pytree_dataclass,
    typechecked,
    typed_shard_map,
    u32,
)


@pytree_dataclass
class Block:
    w: f32[b"M/d F/t"]
    norm: f32[b"M"]


@pytree_dataclass
class Net:
    embed: bf16[b"V/t M/d"]
    blocks: Array[b"layers", Block]
    step: u32[b""]


def test_partition_specs_follow_annotations():
    specs = make_partition_specs(Net)
    assert specs.embed == P("t", "d")
    assert specs.blocks.w == P(None, "d", "t")  # the stacked layers dimension is not sharded
    assert specs.blocks.norm == P(None, None)
    assert specs.step == P()
    assert make_partition_specs(f32[b"B/d/t L"]) == P(("d", "t"), None)
    assert make_partition_specs(tuple[f32[b"B/d"], u32[b""]]) == (P("d"), P())


def test_shardings_are_named_shardings_on_the_mesh():
    mesh = make_mesh(4, 2)
    shardings = make_shardings(Net, mesh)
    assert shardings.blocks.w == NamedSharding(mesh, P(None, "d", "t"))


def test_unknown_mesh_axis_in_sharding_is_rejected():
    with pytest.raises(ShapeError, match=r"unknown mesh axis 'x'.*the mesh has axes \('d', 'c', 't'\)"):
        make_shardings(f32[b"B/x L"], make_mesh(4, 2))


def test_malformed_specs_are_rejected():
    with pytest.raises(ShapeError, match="bad dimension"):
        parse_dims(b"B/d L-1")
    with pytest.raises(ShapeError, match="shards two dimensions"):
        parse_dims(b"B/d M/d")
    with pytest.raises(ShapeError, match="name repeats"):
        parse_dims(b"L L")
    with pytest.raises(ShapeError, match="cannot be sharded"):
        parse_dims(b"2/d M")


@typechecked
def matmul(x: f32[b"B L M"], w: f32[b"M F"]) -> f32[b"B L F"]:
    return x @ w


def test_checker_accepts_consistent_shapes():
    assert matmul(jnp.zeros((2, 3, 4)), jnp.zeros((4, 5))).shape == (2, 3, 5)


def test_wrong_dtype_names_argument_and_dtypes():
    with pytest.raises(ShapeError, match=r"argument 'w': expected dtype float32 .* got bfloat16"):
        matmul(jnp.zeros((2, 3, 4)), jnp.zeros((4, 5), jnp.bfloat16))


def test_wrong_rank_names_argument_and_shape():
    with pytest.raises(ShapeError, match=r"argument 'x': expected 3 dimensions \(B L M\), got shape \(2, 4\)"):
        matmul(jnp.zeros((2, 4)), jnp.zeros((4, 5)))


def test_inconsistent_dimension_names_dimension_and_both_sizes():
    with pytest.raises(ShapeError, match=r"argument 'w': dimension M of f32\[b'M F'\] is 6, but M was 4 earlier"):
        matmul(jnp.zeros((2, 3, 4)), jnp.zeros((6, 5)))


def test_wrong_return_shape_is_caught():
    @typechecked
    def bad(x: f32[b"B L"]) -> f32[b"B L"]:
        return x.T

    with pytest.raises(ShapeError, match=r"return value: dimension B"):
        bad(jnp.zeros((2, 3)))


def test_scopes_are_per_call():
    """Each call records its own sizes: two calls with different B, M and F both run (each checked
    against itself), and a mismatch inside one call is still caught after them."""
    assert matmul(jnp.zeros((2, 3, 4)), jnp.zeros((4, 5))).shape == (2, 3, 5)
    assert matmul(jnp.zeros((7, 3, 8)), jnp.zeros((8, 1))).shape == (7, 3, 1)
    with pytest.raises(ShapeError, match=r"dimension M .* is 8, but M was 4"):
        matmul(jnp.zeros((2, 3, 4)), jnp.zeros((8, 5)))


def test_fixed_size_dimension():
    @typechecked
    def pair(x: f32[b"2 M"]) -> f32[b"M"]:
        return x[0]

    pair(jnp.zeros((2, 3)))
    with pytest.raises(ShapeError, match=r"dimension 2 of f32\[b'2 M'\] must be 2, got 3"):
        pair(jnp.zeros((3, 3)))


def test_dataclass_fields_and_stacked_layers_are_checked():
    @typechecked
    def first(net: Net) -> f32[b"M/d F/t"]:
        return net.blocks.w[0]

    good = Net(jnp.zeros((8, 4), jnp.bfloat16), Block(jnp.zeros((3, 4, 6)), jnp.zeros((3, 4))),
               jnp.zeros((), jnp.uint32))
    first(good)
    bad = Net(good.embed, Block(jnp.zeros((3, 5, 6)), jnp.zeros((3, 4))), good.step)
    with pytest.raises(ShapeError,
                       match=r"argument 'net'.blocks.w: dimension M of f32\[b'layers M/d F/t'\] is 5, but M was 4"):
        first(bad)


def test_inside_shard_map_sizes_are_per_device_and_checked_as_global():
    mesh = make_mesh(4, 2)

    @typed_shard_map
    def local(x: f32[b"B/d M/t"], w: f32[b"M/t"]) -> f32[b"B/d M/t"]:
        assert x.shape == (2, 3)  # per device: 8/4 rows, 6/2 columns
        return x * w

    with jax.set_mesh(mesh):
        out = jax.jit(local)(jnp.ones((8, 6)), jnp.arange(6.0))
    assert out.shape == (8, 6)

    @typed_shard_map
    def mismatch(x: f32[b"B/d M/t"], w: f32[b"M"]) -> f32[b"B/d M/t"]:
        return x

    with (jax.set_mesh(mesh),
          pytest.raises(ShapeError, match=r"argument 'w': dimension M of f32\[b'M'\] is 3, but M was 6 earlier")):
        jax.jit(mismatch)(jnp.ones((8, 6)), jnp.arange(3.0))


def test_unknown_mesh_axis_inside_shard_map_is_caught():
    mesh = make_mesh(4, 2)

    @typechecked
    def inner(x: f32[b"B/q"]) -> f32[b"B/q"]:
        return x

    @typed_shard_map
    def outer(x: f32[b"B/d"]) -> f32[b"B/d"]:
        return inner(x)

    with (jax.set_mesh(mesh),
          pytest.raises(ShapeError, match=r"unknown mesh axis 'q'.*the mesh has axes \('d', 'c', 't'\)")):
        jax.jit(outer)(jnp.ones(8))


def test_not_an_array_is_caught():
    with pytest.raises(ShapeError, match=r"argument 'x': expected an array f32\[b'B L M'\], got list"):
        matmul([1.0], jnp.zeros((4, 5)))


@pytree_dataclass
class TwoStates:
    net: Net
    moments: Masked[Net]  # of some of net's leaves


def test_masked_leaves_may_be_absent_and_the_present_ones_are_checked():
    """Masked[Net]: any leaf may be None (an optimizer's state of the weights it does not update);
    those present are checked as Net's annotations say, and a None outside Masked is still an error.
    jit places the present leaves with the shardings derived from the annotation."""

    @typechecked
    def use(state: TwoStates) -> f32[b"layers M/d F/t"]:
        return state.moments.blocks.w

    net = Net(jnp.zeros((8, 4), jnp.bfloat16), Block(jnp.zeros((3, 4, 6)), jnp.zeros((3, 4))),
              jnp.zeros((), jnp.uint32))
    only_w = Net(None, Block(jnp.zeros((3, 4, 6)), None), None)
    use(TwoStates(net, only_w))
    with pytest.raises(ShapeError, match=r"'state'.moments.blocks.w: dimension M of f32\[b'layers M/d F/t'\] is 5"):
        use(TwoStates(net, Net(None, Block(jnp.zeros((3, 5, 6)), None), None)))
    with pytest.raises(ShapeError, match=r"'state'.net.embed: expected an array"):
        use(TwoStates(Net(None, net.blocks, net.step), only_w))
    mesh = make_mesh(4, 2)
    placed = jax.jit(lambda: TwoStates(net, only_w), out_shardings=make_shardings(TwoStates, mesh))()
    assert placed.moments.embed is None and placed.moments.blocks.w.sharding.spec == P(None, "d", "t")
    shapes = abstract_arrays(jax.eval_shape(lambda: TwoStates(net, only_w)), TwoStates, mesh)
    assert shapes.moments.embed is None and shapes.moments.blocks.w.sharding == placed.moments.blocks.w.sharding


def test_arrays_of_no_elements_pass_through_typed_shard_map():
    """Arrays of no elements (a dense model's experts) go in and come out of typed_shard_map with
    their shapes and dtypes, inside with their per-device shapes, beside ordinary arrays computed as
    usual and absent Masked leaves left absent. (typed_shard_map makes them inside and outside
    instead of passing them through, which crashes jax 0.11.2's partitioner on several devices.)"""

    @typed_shard_map
    def step(state: TwoStates, x: f32[b"B/d X"]) -> tuple[TwoStates, f32[b"B/d X"], f32[b"E/d X"]]:
        assert state.net.blocks.w.shape == (3, 0, 3) and x.shape == (2, 5)
        doubled = jax.tree.map(lambda a: a * 2, state)
        return doubled, x + jnp.sum(state.net.blocks.norm), jnp.zeros((0, 5)) + jnp.sum(x)

    net = Net(jnp.ones((8, 0), jnp.bfloat16), Block(jnp.zeros((3, 0, 6)), jnp.ones((3, 0))), jnp.ones((), jnp.uint32))
    only_w = Net(None, Block(jnp.zeros((3, 0, 6)), None), None)
    with jax.set_mesh(make_mesh(4, 2)):
        state, y, empty = jax.jit(step)(TwoStates(net, only_w), jnp.ones((8, 5)))
    assert state.net.embed.shape == (8, 0) and state.net.embed.dtype == jnp.bfloat16
    assert state.net.blocks.w.shape == (3, 0, 6) and state.net.blocks.norm.shape == (3, 0)
    assert int(state.net.step) == 2 and state.moments.embed is None and state.moments.blocks.w.shape == (3, 0, 6)
    assert y.shape == (8, 5) and bool(jnp.all(y == 1.0)) and empty.shape == (0, 5) and empty.dtype == jnp.float32


def test_masked_takes_only_a_pytree_dataclass():
    with pytest.raises(ShapeError, match="Masked"):
        Masked[f32[b"M"]]
