"""The mixture of experts (train.experts_block) against tests/reference.py, which runs every expert
on every position and weighs the outputs: dropless dispatch, the router, the gates, the balance loss
and the bias's update, on meshes of 8 devices; and MoE training runs that agree across meshes and
resume after kill -9."""

import dataclasses
import json
import math
import operator
import os
import subprocess
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import reference
import train
from fixtures import (
    float32_config,
    make_mesh,
    metrics_on_meshes,
    perturbed_weights,
    put_batch,
    random_batch,
    reference_config,
    start_train,
    synthetic_dataset,
    tiny_config,
    tiny_overrides,
    train_args,
)
from reference import weights_to_dicts
from seqax.shardlib.shardtypes import bool_, f32, leaf_dims, make_shardings, typed_shard_map, u32

# The tiny model with 8 experts of H 32 (a mesh of 8 devices splits them over d and H over t), 2 a token, blocks
# of 8 rows, and the dense SwiGLU kept as a shared expert.
MOE = ("+model.experts=8", "+model.experts_per_token=2", "+model.expert_d_ff=32", "+model.expert_block=8")
# Against the reference: 2 kv heads (its loop over heads compiles in seconds), so meshes with t <= 2;
# attention blocks of 4, so that c = 2 fits rows of 16.
FEW_HEADS = ("model.n_kv=2", "model.attention_block=4")


def moe_problem(*overrides: str, bias=(0.3, -0.2, 0.0, 0.1, -0.1, 0.2, 0.0, -0.3)):
    """(config, float32 weights with the given expert bias, batch) of the tiny MoE model with FEW_HEADS."""
    cfg = tiny_config(*MOE, *FEW_HEADS, *overrides)
    w = jax.device_get(perturbed_weights(cfg))
    bias = np.broadcast_to(np.float32(bias), (cfg.model.layers, len(bias)))
    layers = train.Layer(**{**vars(w.layers), "expert_bias": bias})
    batch = random_batch(0, cfg.training.tokens.batch, cfg.training.tokens.len, cfg.model.vocab)
    return cfg, train.Model(w.embed, layers, w.final_norm, w.unembed), batch


def reference_of(cfg, weights, batch, balance_weight=0.0):
    """The float32 reference's loss, the gradients of loss + balance_weight x the balance losses, and
    per layer (loads [E], balance loss)."""
    ref_cfg = reference_config(cfg.model)
    w = weights_to_dicts(weights, cfg.model.layers)

    def objective(w):
        balance = sum(b for _, b in reference.loads_and_balance(w, ref_cfg, *batch[:2]))
        return reference.loss(w, ref_cfg, *batch) + balance_weight * balance

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(reference, "bf16", jnp.float32)
        grads = jax.jit(jax.grad(objective))(w)
        loss = jax.jit(lambda w: reference.loss(w, ref_cfg, *batch))(w)
        routing = jax.jit(lambda w: reference.loads_and_balance(w, ref_cfg, *batch[:2]))(w)
    return float(loss), grads, [(np.asarray(load), float(balance)) for load, balance in routing]


def sharded(cfg, mesh, weights, batch, balance_weight: float, matmul_dtype: str = "float32"):
    """train.model_loss on `mesh` with `matmul_dtype` matmuls: (objective, cross-entropy, loads [layers, E],
    gradients)."""
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, matmul_dtype=matmul_dtype))
    @typed_shard_map
    def on_device(w: train.Model, targets: u32[b"B/d L/c"], starts: bool_[b"B/d L/c"],
                  mask: bool_[b"B/d L/c"]) -> tuple[f32[b""], f32[b""], f32[b"layers E"], train.Model]:
        loss_fn = partial(train.model_loss, cfg.model, balance_weight)
        (objective, (loss, load)), grads = jax.value_and_grad(loss_fn, has_aux=True)(w, targets, starts, mask)
        load = lax.psum(load, ("d", "c", "t")) / lax.axis_size("t")
        return lax.psum(objective, ("d", "c")), lax.psum(loss, ("d", "c")), load, grads

    with jax.set_mesh(mesh):
        w = jax.device_put(weights, make_shardings(train.Model, mesh))
        return jax.device_get(jax.jit(on_device)(w, *put_batch(mesh, batch)))


def assert_equals_reference(cfg, weights, batch, reference_results, mesh, balance_weight):
    ref_loss, ref_grads, ref_routing = reference_results
    objective, loss, load, grads = sharded(cfg, mesh, weights, batch, balance_weight)
    assert abs(loss - ref_loss) <= 1e-6 * ref_loss, (loss, ref_loss)
    np.testing.assert_array_equal(load, np.stack([load for load, _ in ref_routing]))  # integer counts
    balance = sum(b for _, b in ref_routing)
    assert abs((objective - loss) - balance_weight * balance) <= 1e-5 * balance_weight * balance + 1e-9
    flat = jax.tree_util.tree_flatten_with_path(weights_to_dicts(grads, cfg.model.layers))[0]
    for (path, g), r in zip(flat, jax.tree.leaves(ref_grads), strict=True):
        if "expert_bias" in jax.tree_util.keystr(path):  # picks experts, weighs nothing: no gradient
            assert not np.any(g) and not np.any(r)
            continue
        err = np.linalg.norm(np.float64(g) - np.float64(r)) / np.linalg.norm(np.float64(r))
        assert err < 1e-4, f"gradient {jax.tree_util.keystr(path)}: relative L2 error {err:.2e}"


@pytest.fixture(scope="module")
def problem():
    cfg, weights, batch = moe_problem()
    return cfg, weights, batch, reference_of(cfg, weights, batch, 0.3)


def test_the_dispatch_computes_every_chosen_expert_of_every_token():
    """experts_block alone on one device (float32), against NumPy's statement: each token's chosen
    experts (top k of sigmoid score + bias), each one's SwiGLU, weighed by its normalized score; with
    blocks of 4 rows, so that experts span several blocks and most blocks are padded. Fast: no model."""
    cfg = tiny_config("model.matmul_dtype=float32", "+model.experts=4", "+model.experts_per_token=2",
                      "+model.expert_d_ff=8", "+model.expert_block=4",
                      "model.d_ff=0", "model.d_model=16")
    h, rng = cfg.model, np.random.default_rng(0)
    B, L, M, E, H = 2, 6, h.d_model, h.experts, h.expert_d_ff
    x = rng.standard_normal((B, L, M)).astype(np.float32)
    w = {"router": rng.standard_normal((M, E)), "expert_bias": rng.standard_normal(E) * 0.3,
         "expert_gate": rng.standard_normal((E, M, H)), "expert_up": rng.standard_normal((E, M, H)),
         "expert_down": rng.standard_normal((E, H, M))}
    w = {k: (v / np.sqrt(v.shape[-2]) if v.ndim > 1 else v).astype(np.float32) for k, v in w.items()}
    # The experts' weights above, every other weight of the layer as init_weights makes it (the block reads none).
    layer = jax.tree.map(operator.itemgetter(0), train.init_weights(h, jax.random.key(0)).layers)
    layer = train.Layer(**{**vars(layer), **w})
    mesh = make_mesh(1, 1)
    run = jax.shard_map(lambda x, w: train.experts_block(h, x, x, w)[0], mesh=mesh,
                        in_specs=jax.sharding.PartitionSpec(), out_specs=jax.sharding.PartitionSpec(),
                        check_vma=False)  # one device: the rows sent over d come back to it
    got = np.asarray(jax.jit(run)(x, layer))
    scores = 1 / (1 + np.exp(-(x @ w["router"])))
    want = np.zeros_like(x)
    for b in range(B):
        for i in range(L):
            chosen = np.argsort(-(scores[b, i] + w["expert_bias"]), kind="stable")[: h.experts_per_token]
            for e in chosen:
                g, u = x[b, i] @ w["expert_gate"][e], x[b, i] @ w["expert_up"][e]
                gate = scores[b, i, e] / scores[b, i, chosen].sum()
                want[b, i] += gate * ((g / (1 + np.exp(-g)) * u) @ w["expert_down"][e])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("d,t,c", [pytest.param(4, 2, 1, marks=pytest.mark.slow),
                                   pytest.param(1, 1, 1, marks=pytest.mark.slow),
                                   pytest.param(8, 1, 1, marks=pytest.mark.slow),
                                   pytest.param(2, 2, 2, marks=pytest.mark.slow)])
def test_float32_loss_loads_balance_and_gradients_equal_every_expert_on_every_token(problem, d, t, c):
    """The loss, each layer's expert loads and every gradient (router and experts included) equal the
    reference's, which computes all experts at every position: no row dropped or misrouted, on meshes
    that split the batch, H and the rows' positions (with context parallelism a row's positions are
    routed on c devices). With expert_balance_loss 0.3 the objective is the cross-entropy plus 0.3 x
    the layers' sequence-wise balance losses as the reference states them (each device's share of a
    row adds up; the t devices of a group count theirs once)."""
    assert_equals_reference(*problem, make_mesh(d, t, c), balance_weight=0.3)


@pytest.mark.slow
def test_float8_experts_are_within_float8s_rounding_of_exact():
    """model.matmul_dtype=float8 with the experts and no dense SwiGLU (d_ff 0: its weights are empty, which a
    float8 cast must take) on a 4x2 mesh: the loss and every gradient against the float32 model, as
    tests/test_model.py bounds the dense layers': each gradient's error below 32x the bf16 model's (the logits'
    gradient's e5m2 unit roundoff over bf16's), their mean below 20x its mean, and the loss within bf16's unit
    roundoff. One layer: its router reads the float32 embeddings, so all three route alike (in a second layer a
    rounding can flip a choice, an error no rounding bound holds). Measured: 13.8-21.3x, the mean 16.4x bf16's
    (the experts' and layers' gradients in e5m2: 14.9-22.6x, 18.1x; the logits in bf16 too: 9.3-18.8x); the
    loss 2.9e-4 from exact."""
    cfg, weights, batch = moe_problem("model.d_ff=0", "model.layers=1")
    mesh = make_mesh(4, 2)
    runs = {dtype: sharded(cfg, mesh, weights, batch, 0.0, dtype) for dtype in ("float32", "bfloat16", "float8")}
    exact = runs["float32"]
    assert abs(runs["float8"][1] / exact[1] - 1) < 2.0**-8, (runs["float8"][1], exact[1])
    errors = {}
    for dtype in ("bfloat16", "float8"):
        flat = jax.tree_util.tree_flatten_with_path(runs[dtype][3])[0]
        errors[dtype] = {jax.tree_util.keystr(path): np.linalg.norm(np.float64(g) - np.float64(e)) / np.linalg.norm(e)
                         for (path, g), e in zip(flat, jax.tree.leaves(exact[3]), strict=True) if np.any(e)}
    assert any("expert_gate" in path for path in errors["float8"]), errors  # the experts are among them
    ratios = {path: errors["float8"][path] / errors["bfloat16"][path] for path in errors["float8"]}
    assert all(ratio < 32 for ratio in ratios.values()), ratios
    assert np.mean(list(errors["float8"].values())) < 20 * np.mean(list(errors["bfloat16"].values())), errors


@pytest.mark.slow
def test_dropless_when_every_token_picks_the_same_two_experts():
    """A bias that sends every token to experts 0 and 1 (the worst load the blocks must hold) changes
    nothing: all rows computed, as the reference."""
    cfg, weights, batch = moe_problem(bias=(50.0, 50.0) + (0.0,) * 6)
    routing = reference_of(cfg, weights, batch)[2]
    tokens = cfg.training.tokens.batch * cfg.training.tokens.len
    assert all(load.tolist() == [tokens, tokens] + [0] * 6 for load, _ in routing)
    assert_equals_reference(cfg, weights, batch, reference_of(cfg, weights, batch), make_mesh(4, 2), 0.0)


@pytest.mark.slow
def test_a_step_moves_each_bias_by_the_rate_against_its_load():
    """After one training step each expert's bias moved by expert_bias_rate: up if the batch gave it
    fewer rows than its layer's mean, down if more (the reference's loads); no other rule touches it."""
    cfg, weights, batch = moe_problem("+training.expert_bias_rate=0.01")
    mesh = make_mesh(4, 2)
    with jax.set_mesh(mesh):  # float32 routing, as the reference's
        state = jax.jit(train.fresh_state, out_shardings=make_shardings(train.State, mesh))(weights)
        new, metrics = train.training_step(state, jnp.uint32(0), *put_batch(mesh, batch), float32_config(cfg))
    loads = np.stack([load for load, _ in reference_of(cfg, weights, batch)[2]])
    moved = np.asarray(new.weights.layers.expert_bias) - weights.layers.expert_bias
    np.testing.assert_allclose(moved, 0.01 * np.sign(loads.mean(axis=1, keepdims=True) - loads), atol=1e-7)
    assert np.any(moved > 0) and np.any(moved < 0)
    assert float(metrics.expert_load) == pytest.approx(np.max(loads / loads.mean(axis=1, keepdims=True)))
    assert new.muon_momentum.layers.expert_bias is None and new.adam_mu.layers.expert_bias is None


def test_model_flops_count_the_active_experts_only():
    """A token goes through experts_per_token of the E experts: the FLOPs per token grow with
    experts_per_token by one expert's matrices (their sizes read off init_weights, whatever the experts
    compute) and with E only by the router's E columns, 2 x 3 FLOPs an element (forward + backward)."""
    def shapes_and_flops(experts: int, per_token: int):
        arch = tiny_config(f"+model.experts={experts}", f"+model.experts_per_token={per_token}",
                           "+model.expert_d_ff=32", "+model.expert_block=8").model
        shapes = jax.eval_shape(lambda: train.init_weights(arch, jax.random.key(0))).layers
        return shapes, train.model_flops_per_token(arch, 16)

    shapes, two = shapes_and_flops(8, 2)
    _, four = shapes_and_flops(8, 4)
    wider, twice_the_experts = shapes_and_flops(16, 2)
    # The experts' matrices: the Layer weights of 2 or more dimensions that E leads (after the layers').
    one_expert = sum(math.prod(getattr(shapes, field.name).shape[2:])
                     for field, dims in zip(dataclasses.fields(train.Layer), leaf_dims(train.Layer), strict=True)
                     if len(dims) > 2 and dims[0].name == "E")
    assert one_expert and four - two == 6 * 2 * one_expert * shapes.router.shape[0]
    assert twice_the_experts - two == 6 * (wider.router.size - shapes.router.size)


# ---------------------------------------------------------------------------------------------
# Training runs.


MESHES = [(1, 1, 1), (8, 1, 1), (4, 2, 1), (2, 4, 1)]  # 8, 1, 2, 4 experts a device; tokens split 1, 2, 4 ways over t


def mesh_config(dataset: str):
    """The tiny MoE config of the mesh tests, rows of 64 positions of `dataset`."""
    return tiny_config(*MOE, "training.tokens.len=64", "model.attention_block=16", f"dataset.path={dataset}")


@pytest.mark.slow
def test_float32_training_steps_agree_on_every_mesh(default_dataset):
    """The tiny MoE model (Muon on every expert) on rows of the synthetic dataset, steps 0-2 on meshes 1x1,
    8x1, 4x2 and 2x4 with float32 matmuls: every step's loss within 1e-6 relative of the 1x1 run's, with the
    same load: the dispatch does not depend on how tokens are grouped per device (measured at most 8.2e-8).
    (Context parallelism: the float32 test above, on 2x2x2.) A test of its own, apart from the bf16 one
    below, so that the two run side by side."""
    runs = metrics_on_meshes(float32_config(mesh_config(default_dataset)), MESHES, steps=3)
    exact = {mesh: [(m["loss"], m["expert_load"]) for m in run] for mesh, run in runs.items()}
    for mesh_shape, run in exact.items():
        for a, b in zip(run, exact[1, 1, 1]):
            assert abs(a[0] / b[0] - 1) <= 1e-6 and a[1] == b[1], (mesh_shape, run, exact[1, 1, 1])


@pytest.mark.slow
def test_bf16_training_steps_agree_on_every_mesh(default_dataset):
    """The same steps in bf16: step 0's loss within 1e-5 with the same load, steps 1 and 2 within 5e-4:
    the gradients, summed from parts each device rounded to bf16, differ between meshes by about 1e-3,
    and step 0's update moves some routing near-ties, which moves the loss by a few 1e-4, as reversing
    each batch's rows on one device does (measured on an Intel Xeon, 2026-12-05: step 1 at most 2.9e-4,
    on 4x2, step 2 2.6e-4, step 0 3.2e-7; the rows reversed on 1x1: 1.3e-4 and 5.4e-5; docs/moe.md says
    where the gap comes from). The dense model's bound is 1e-4 (test_optimizer)."""
    runs = {mesh: [(m["loss"], m["expert_load"]) for m in run]
            for mesh, run in metrics_on_meshes(mesh_config(default_dataset), MESHES, steps=3).items()}
    one = runs[1, 1, 1]
    assert one[2][0] < one[0][0] - 0.05
    for mesh_shape, run in runs.items():
        assert abs(run[0][0] / one[0][0] - 1) <= 1e-5, (mesh_shape, run, one)
        assert all(abs(a[0] / b[0] - 1) <= 5e-4 for a, b in zip(run[1:], one[1:])), (mesh_shape, run, one)
        assert run[0][1] == one[0][1], (mesh_shape, run, one)


STEPS = 24


def metric(run_dir, key: str = "loss") -> dict[int, float]:
    """{step: its metric `key`} of a run's metrics.jsonl."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return {line["step"]: line[key] for line in map(json.loads, f) if key in line}


@pytest.mark.slow
def test_a_run_killed_and_resumed_on_another_mesh_continues_the_same(tmp_path):
    """An MoE run killed with SIGKILL once its checkpoint at step 4 is committed resumes from its newest
    checkpoint with the same losses, bitwise, as a run never stopped (the bias, router and experts all
    restored). Checkpoint 4 resumed on a 2x4 mesh (4 experts a device, not 2; M split 4 ways) runs to the end as
    it does resumed on 4x2, the mesh that wrote it: every step's loss within 1e-6 (measured 1.1e-7) and
    the same expert load, so every part of the state (optimizer moments, expert bias) was resharded. Those
    two runs' matmuls are float32: in bf16 two meshes' runs drift by a few 1e-4 within steps (routing
    near-ties move), and even step 4's loss, from the same weights, differs by 1.7e-5 on some CPUs."""
    dataset = synthetic_dataset(tmp_path / "data.zarr", "--train-tokens", "100000", "--validation-tokens", "10000")
    overrides = tiny_overrides(*MOE, f"training.steps={STEPS}", "checkpoint_interval=4", "checkpoints.keep=0",
                               "eval_interval=0", "eval_batches=0")

    def run(name, *changes, kill_after=None, float32=False):
        process = start_train(train_args(tmp_path, dataset, name, *overrides, *changes), graph=False, float32=float32,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if kill_after is None:
            assert process.wait(timeout=300) == 0, process.stderr.read()
            return
        checkpoint = tmp_path / name / "checkpoints" / f"{kill_after:010d}" / "zarr.json"
        while not (checkpoint.exists() and json.loads(checkpoint.read_text())["attributes"].get("write_completed")):
            assert process.poll() is None, process.stderr.read()
            time.sleep(0.001)
        process.kill()
        process.wait()

    run("whole")
    run("killed", kill_after=4)
    assert max(metric(tmp_path / "killed")) < STEPS - 1  # it did not reach the end
    run("killed")
    assert metric(tmp_path / "killed") == metric(tmp_path / "whole")
    for name, mesh in (("stayed", ("mesh.d=4", "mesh.t=2")), ("moved", ("mesh.d=2", "mesh.t=4"))):
        os.makedirs(tmp_path / name / "checkpoints")
        os.symlink(tmp_path / "killed" / "checkpoints" / f"{4:010d}", tmp_path / name / "checkpoints" / f"{4:010d}")
        run(name, *mesh, float32=True)
    moved, stayed = metric(tmp_path / "moved"), metric(tmp_path / "stayed")
    assert sorted(moved) == sorted(stayed) == list(range(4, STEPS))
    assert all(abs(moved[step] / stayed[step] - 1) <= 1e-6 for step in moved), (moved, stayed)
    assert metric(tmp_path / "moved", "expert_load") == metric(tmp_path / "stayed", "expert_load")
