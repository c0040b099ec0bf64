"""save_for_backward keeps exactly what it marks; fold_in_str; typed config loading."""

import contextlib
import dataclasses
import io
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import print_saved_residuals

import attention
import jax_extra
import train
from config import ConfigError, config_from_dict
from jax_extra import explicit_activation_checkpointing, fold_in_str, save_for_backward
from model_fixtures import make_mesh, tiny_config
from shardlib.shardtypes import f32, make_shardings, typed_shard_map, u32


def saved_residuals(f, *args) -> list[str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_saved_residuals(f, *args)
    return out.getvalue().strip().splitlines()


def test_only_marked_values_are_saved_in_a_small_function():
    def f(x):
        a = jnp.sin(x)
        b = save_for_backward(jnp.cos(a))
        return jnp.sum(jnp.exp(b) * a)

    lines = saved_residuals(explicit_activation_checkpointing(f), jnp.ones(3))
    assert sorted(lines) == sorted(["f32[3] from the argument x", next(l for l in lines if "named" in l)])
    assert len(lines) == 2
    # Without the policy JAX would keep several intermediates: the marking is what decides.
    assert len(saved_residuals(f, jnp.ones(3))) > 2


def test_transformer_layer_saves_exactly_its_marked_values(monkeypatch):
    """Every residual of a layer is an argument or a value marked in train.py, and every
    marked value is saved: adding or removing a mark changes this list."""
    h = tiny_config()
    marked = []

    def recording_save(x):
        marked.append((x.dtype, tuple(x.shape)))
        return save_for_backward(x)

    monkeypatch.setattr(train, "save_for_backward", recording_save)
    monkeypatch.setattr(attention, "save_for_backward", recording_save)
    mesh = make_mesh(4, 2)
    B, L, M = h.training.tokens.batch, h.training.tokens.len, h.model.d_model
    layer = jax.tree.map(lambda w: w[0], train.init_weights(h.model, jax.random.key(0)).layers)
    lines = []

    @typed_shard_map
    def probe(x: f32[b"B/d L M"], w: train.Layer, doc_start: u32[b"B/d L"], position: u32[b"B/d L"]) -> f32[b""]:
        body = explicit_activation_checkpointing(lambda x, w: train.training_layer(h.model, x, w, doc_start, position))
        lines.extend(saved_residuals(body, x, w))
        return jnp.zeros(())

    with jax.set_mesh(mesh):
        args = (jnp.ones((B, L, M)), jax.device_put(layer, make_shardings(train.Layer, mesh)), jnp.zeros((B, L), jnp.uint32), jnp.zeros((B, L), jnp.uint32))
        jax.eval_shape(probe, *args)
    named = [l for l in lines if f"named '{jax_extra.SAVED_NAME}'" in l]
    others = [l for l in lines if l not in named]
    assert all(re.search(r"from (the argument|a constant)", l) for l in others), others
    assert len(named) == len(marked) == 10  # 9 activations and the attention log-sum-exp
    saved_shapes = sorted(re.match(r"(\w+)\[([\d,]*)\]", l).groups() for l in named)
    marked_shapes = sorted((jnp.dtype(d).name.replace("float", "f").replace("bfloat16", "bf16"), ",".join(map(str, s))) for d, s in marked)
    assert saved_shapes == marked_shapes


PINNED_EMBED_KEY = [4081611562, 4053798224]  # fold_in_str(key(0), "embed"), recorded once


def test_fold_in_str_is_stable_and_distinct():
    key = jax.random.key(0)
    a = jax.random.key_data(fold_in_str(key, "w_q"))
    assert np.array_equal(a, jax.random.key_data(fold_in_str(key, "w_q")))
    assert not np.array_equal(a, jax.random.key_data(fold_in_str(key, "w_k")))
    # Pinned: sha256-based, so it cannot change with Python's hash seed or between processes.
    assert jax.random.key_data(fold_in_str(jax.random.key(0), "embed")).tolist() == PINNED_EMBED_KEY



@dataclasses.dataclass(frozen=True)
class Inner:
    rate: float
    name: str


@dataclasses.dataclass(frozen=True)
class Outer:
    steps: int
    inner: Inner
    flag: bool


def test_config_loads_nested_frozen_dataclasses():
    c = config_from_dict(Outer, {"steps": 3, "inner": {"rate": 1, "name": "x"}, "flag": True})
    assert c == Outer(3, Inner(1.0, "x"), True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.steps = 4


@pytest.mark.parametrize(
    "values,message",
    [
        ({"steps": 3, "inner": {"rate": 1.0}, "flag": True}, r"config is missing key inner.name \(set it in the YAML or with \+inner.name=...\)"),
        ({"steps": 3, "inner": {"rate": 1.0, "name": "x", "nmae": 2}, "flag": True}, r"unknown config key inner.nmae \(known keys here: name, rate\)"),
        ({"steps": "3", "inner": {"rate": 1.0, "name": "x"}, "flag": True}, r"config key steps must be int, got '3'"),
        ({"steps": True, "inner": {"rate": 1.0, "name": "x"}, "flag": True}, r"config key steps must be int, got True"),
        ({"steps": 3, "inner": 5, "flag": True}, r"config key inner must be a mapping, got 5"),
    ],
)
def test_config_errors_name_the_key(values, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict(Outer, values)
