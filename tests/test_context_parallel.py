"""Context parallelism (mesh axis c): the zigzag layout of rows, ring attention against dense
attention, training steps against one device, and checkpoints that do not depend on c."""

import os
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from omegaconf import OmegaConf

import sample
import train
from fixtures import abstract_state, make_mesh, tiny_config
from seqax.analysis import memory
from seqax.checkpoint import Checkpointer
from seqax.config import ConfigError
from seqax.data.data_loader import make_loader, zigzag_chunks, zigzag_order
from seqax.data.flat_tokens import open_flat_tokens
from seqax.kernels import attention
from seqax.shardlib.shardtypes import f32, make_shardings, typed_shard_map, u32
from seqax.validation import validate_config

B, L, Q, K, D = 2, 64, 2, 2, 8


def test_zigzag_chunks_give_every_device_the_same_causal_work():
    """Device r holds chunks r and 2c-1-r of 2c; every device has 2c + 1 (query chunk, key
    chunk) pairs at or below the diagonal, and c = 1 keeps the row whole."""
    assert zigzag_chunks(16, 1) == [(0, 16)]
    assert zigzag_chunks(16, 2) == [(0, 4), (12, 16), (4, 12)]  # device 1's chunks 1 and 2 are adjacent: merged
    for c in (2, 4, 8):
        order = zigzag_order(16 * c, c).reshape(c, 2, 8)  # [device, its chunk, position]
        chunk_of = order[:, :, 0] // 8
        assert sorted(chunk_of.ravel()) == list(range(2 * c))
        pairs = [sum(int(q >= k) for q in chunk_of[r] for k in range(2 * c)) for r in range(c)]
        assert pairs == [2 * c + 1] * c


def attention_inputs(seed: int):
    """float32 q, k, v, where each token's document starts (documents of ~10 tokens, so many
    of them cross from one device's chunk into another's) and an output cotangent, in row order."""
    rng = np.random.default_rng(seed)
    q, cotangent = (rng.normal(size=(B, L, Q, K, D)).astype(np.float32) for _ in range(2))
    k, v = (rng.normal(size=(B, L, K, D)).astype(np.float32) * s for s in (2, 1))
    starts = rng.random((B, L)) < 0.1
    starts[:, 0] = True
    starts[1, 1:] = False  # one row is a single document across every device
    doc_start = np.maximum.accumulate(np.where(starts, np.arange(L), 0), axis=1).astype(np.uint32)
    return q, k, v, doc_start, cotangent


def dense_output_and_gradients(q, k, v, doc_start, cotangent):
    position = jnp.arange(L)
    mask = attention.causal_document_mask(position, position, doc_start, doc_start)
    out, pullback = jax.vjp(lambda q, k, v: attention.dense_attention(q, k, v, mask), q, k, v)
    return (out, *pullback(cotangent))


@pytest.mark.parametrize("c", [2, pytest.param(4, marks=pytest.mark.slow), pytest.param(8, marks=pytest.mark.slow)])
def test_ring_attention_equals_dense_attention_in_float32(c):
    """On a ring of c devices, each holding its two chunks of every row, the output and the
    gradients of q, k and v equal dense attention over whole rows to 1e-5 relative."""
    q, k, v, doc_start, cotangent = attention_inputs(c)
    order = zigzag_order(L, c)
    device_of = np.empty(L, int)
    device_of[order] = np.arange(L) // (L // c)
    assert any(len(set(device_of[doc_start[b] == s])) > 1
               for b in range(B) for s in set(doc_start[b]))  # documents span devices

    @jax.jit
    @typed_shard_map
    def ring(q: f32[b"B L/c Q K D"], k: f32[b"B S/c K D"], v: f32[b"B S/c K D"], doc_start: u32[b"B L/c"],
             row_position: u32[b"L/c"], cotangent: f32[b"B L/c Q K D"]
             ) -> tuple[f32[b"B L/c Q K D"], f32[b"B L/c Q K D"], f32[b"B S/c K D"], f32[b"B S/c K D"]]:
        out, pullback = jax.vjp(lambda q, k, v: attention.ring_attention(q, k, v, doc_start, row_position, 4), q, k, v)
        return (out, *pullback(cotangent))

    with jax.set_mesh(make_mesh(1, 1, c)):
        laid_out = ring(q[:, order], k[:, order], v[:, order], doc_start[:, order], order.astype(np.uint32),
                        cotangent[:, order])
    expected = jax.jit(dense_output_and_gradients)(q, k, v, doc_start, cotangent)
    for name, x, y in zip(["output", "dq", "dk", "dv"], laid_out, expected):
        in_row_order = np.empty_like(np.asarray(x))
        in_row_order[:, order] = np.asarray(x)
        error = np.linalg.norm(in_row_order - np.asarray(y)) / np.linalg.norm(np.asarray(y))
        assert error < 1e-5, (name, c, error)


# reads the default synthetic dataset (written once per session, seconds): the fast tier keeps the
# layout's arithmetic above
@pytest.mark.slow
def test_the_loader_hands_each_device_its_two_chunks(default_dataset):
    """With mesh.c = 4 the batch is the c = 1 batch with each row in zigzag order, and the
    shard of device (d, c=r) holds row positions of chunks r and 7 - r."""
    dataset = open_flat_tokens(default_dataset)
    cfg = tiny_config("training.tokens.len=64")
    batches = {}
    for c in (1, 4):
        loader = make_loader(cfg.dataset, dataset, "train", 8, 64, make_mesh(2, 1, c))
        try:
            batches[c] = loader.batch(3)
        finally:
            loader.close()
    order = zigzag_order(64, 4)
    for field in ("targets", "is_seq_start", "loss_mask"):
        np.testing.assert_array_equal(np.asarray(getattr(batches[4], field)),
                                      np.asarray(getattr(batches[1], field))[:, order])
    for shard in batches[4].targets.addressable_shards:
        r = shard.index[1].start // 16
        np.testing.assert_array_equal(order[shard.index[1]], np.r_[8 * r : 8 * r + 8, 8 * (7 - r) : 8 * (8 - r)])


@pytest.mark.parametrize("overrides,message", [
    (["mesh.d=2", "mesh.t=2", "mesh.c=4"], r"mesh.d=2 x mesh.t=2 x mesh.c=4 = 16 must equal the 8 devices"),
    (["mesh.d=4", "mesh.t=1", "mesh.c=2", "training.tokens.len=48"],
     r"training.tokens.len=48 must be a multiple of 2 x mesh.c x model.attention_block = 32"),
    (["mesh.d=2", "mesh.t=1", "mesh.c=4", "model.d_model=36", "training.tokens.len=64"],
     r"model.d_model=36 is not divisible by mesh.d x mesh.c=8"),
])
def test_a_mesh_that_does_not_fit_stops_with_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate_config(tiny_config(*overrides), 8, 255, train.Model)


# ---------------------------------------------------------------------------------------------
# Training steps on real batches of long rows: c = 2 and c = 4 against one device.

LONG = ("training.tokens.len=1024", "model.attention_block=64", "training.tokens.batch=4")


def run_steps(cfg, mesh, batches, state, steps) -> tuple[train.State, list[float]]:
    losses = []
    with jax.set_mesh(mesh):
        for step in steps:
            b = batches(step, mesh)
            state, metrics = train.training_step(state, jnp.uint32(step), b.targets, b.is_seq_start, b.loss_mask, cfg)
            losses.append(float(metrics.loss))
    return state, losses


@pytest.fixture(scope="module")
def long_rows(tmp_path_factory, default_dataset):
    """The losses of steps 0-2 on 1x1x1 and on d=2 t=2 c=2, and the c=2 run's checkpoint 2."""
    root = tmp_path_factory.mktemp("context")
    dataset = open_flat_tokens(default_dataset)
    configs = {c: tiny_config(*LONG, f"mesh.d={d}", f"mesh.t={t}", f"mesh.c={c}", f"dataset.path={default_dataset}")
               for d, t, c in [(1, 1, 1), (2, 2, 2), (1, 2, 4)]}

    def batches(step, mesh):
        loader = make_loader(configs[1].dataset, dataset, "train", 4, 1024, mesh)
        try:
            return loader.batch(step)
        finally:
            loader.close()

    one, two = make_mesh(1, 1, 1), make_mesh(2, 2, 2)
    _, one_device = run_steps(configs[1], one, batches, train.init_state(configs[1], one), range(3))
    state, first_two = run_steps(configs[2], two, batches, train.init_state(configs[2], two), range(2))
    checkpoints = root / "run" / "checkpoints"
    checkpointer = Checkpointer(str(checkpoints), configs[2].checkpoints)
    checkpointer.save(2, state)
    checkpointer.close()
    _, third = run_steps(configs[2], two, batches, state, [2])
    return configs, batches, one_device, first_two + third, checkpoints, root


@pytest.mark.slow
def test_training_steps_with_c2_equal_one_device(long_rows):
    """Mesh d=2 t=2 c=2, rows of 1024 packed documents that cross the devices' chunks: the
    step-0 loss equals the 1x1x1 run's within 1e-5 relative, steps 1-2 within 1e-4."""
    configs, batches, one_device, two, _, _ = long_rows
    starts = np.asarray(batches(0, make_mesh(1, 1, 1)).is_seq_start)
    assert (starts.sum() > 8
            and not starts[:, [256, 512, 768]].all())  # packed documents; some go on across the chunks' boundaries
    assert abs(two[0] - one_device[0]) <= 1e-5 * abs(one_device[0]), (two, one_device)
    for a, b in zip(two, one_device):
        assert abs(a - b) <= 1e-4 * abs(b), (two, one_device)


@pytest.mark.slow
@pytest.mark.parametrize("c", [1, 4])
def test_a_checkpoint_written_with_c2_continues_with_another_c(long_rows, c):
    """Checkpoint 2 of the c=2 run restores onto c=1 (1x1x1) and c=4 (d=1 t=2 c=4) and step 2
    there gives the loss the c=2 run had, within 1e-4."""
    configs, batches, _, two, checkpoints, _ = long_rows
    cfg, mesh = configs[c], make_mesh(*((1, 1, 1) if c == 1 else (1, 2, 4)))
    checkpointer = Checkpointer(str(checkpoints), cfg.checkpoints)
    with jax.set_mesh(mesh):
        step, state = checkpointer.restore(jax.eval_shape(lambda: train.init_state(cfg, mesh)),
                                           make_shardings(train.State, mesh))
    checkpointer.close()
    assert step == 2
    _, losses = run_steps(cfg, mesh, batches, state, [2])
    assert abs(losses[0] - two[2]) <= 1e-4 * abs(two[2]), (losses, two)


@pytest.mark.slow
def test_sample_reads_a_run_trained_with_c2_and_says_it_runs_with_c1(long_rows, capsys):
    configs, _, _, _, checkpoints, root = long_rows
    run_dir = os.path.dirname(checkpoints)
    OmegaConf.save(OmegaConf.create(OmegaConf.to_yaml(OmegaConf.structured(configs[2]))),
                   os.path.join(run_dir, "config.yaml"))
    sample.main(["--run-dir", run_dir, "--prompt-ids", "5", "6", "--max-new-tokens", "3", "--temperature", "0"])
    out = capsys.readouterr()
    assert "checkpoint 2 of" in out.err and "c=1 (the run trained with mesh.c=2" in out.err
    assert len(out.out.split("\n")[1].split()) == 5  # the prompt's 2 ids and 3 new ones


def test_the_memory_reports_activations_fall_as_one_over_c():
    """What the layers save for backward and the logits, per device from the annotations, at c
    = 1, 2, 4 on c devices: exactly 1/c; the ring's shards in flight are a term of their own."""
    activations, ring = {}, {}
    for c in (1, 2, 4):
        cfg, mesh = tiny_config("training.tokens.len=64", "model.attention_block=4", "mesh.d=1", "mesh.t=1",
                                f"mesh.c={c}"), make_mesh(1, 1, c)
        with jax.set_mesh(mesh):
            state = abstract_state(cfg, mesh)
            layer = memory.memory_annotations(cfg, mesh, state, partial(train.training_layer, cfg.model), train.forward)
            terms, _ = memory.memory_estimate(state, layer, train.MUON)
        activations[c] = sum(size for name, size in terms if name.startswith(("saved for backward", "logits")))
        ring[c] = sum(size for name, size in terms if name.startswith("ring attention"))
    assert activations[1] == 2 * activations[2] == 4 * activations[4]
    # A backward ring step passes on k and v (bf16), their f32 gradients and the shard's document
    # starts and row positions (u32), and receives as much: twice those bytes.
    B, K, D = 8, cfg.model.n_kv, cfg.model.d_head
    step_bytes = {c: 64 // c * (B * K * D * (2 + 2 + 4 + 4) + (B + 1) * 4) for c in (2, 4)}
    assert ring == {1: 0, 2: 2 * step_bytes[2], 4: 2 * step_bytes[4]}
