"""The communication report: what the compiled step sends, read from its HLO with loop trip
counts; and the facts of the compiled step it rests on, each derived from the weights' types and
shapes (not from a formula of the model that every model edit would have to update)."""

import math

import jax
import pytest

import train
from fixtures import abstract_state, make_mesh
from seqax.analysis import communication
from seqax.analysis.startup_report import compile_step
from seqax.config import load_config
from seqax.muon_sharding import matrix_groups


def test_bytes_of_a_ring_collective():
    assert communication.sent_bytes("all-gather", 800, 4) == 600  # 3/4 of the gathered array
    assert communication.sent_bytes("reduce-scatter", 800, 4) == 600
    assert communication.sent_bytes("all-reduce", 800, 4) == 1200  # a reduce-scatter and an all-gather
    assert communication.sent_bytes("collective-permute", 800, 2) == 800
    assert communication.sent_bytes("all-to-all", 800, 4) == 600  # it keeps 1 of its 4 blocks
    assert communication.array_bytes("bf16[4,8]{1,0}") == ("bf16", 64)
    assert communication.array_bytes("(f32[2], f32[3,1])") == ("f32", 20)


@pytest.mark.parametrize("attributes,size", [("replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}", 4),
                                             ("replica_groups=[2,4]<=[8]", 4),
                                             ("replica_groups=[4,2]<=[2,4]T(1,0), channel_id=3", 2),
                                             ("replica_groups={}", 1)])
def test_group_size(attributes, size):
    assert communication.group_size(attributes) == size


def compiled_hlo(d: int, t: int, c: int = 1) -> tuple:
    blocks = [] if c == 1 else ["model.attention_block=16"]  # the 2c chunks of a row of 64 are whole blocks
    cfg = load_config("local_test_synthetic",
                      ["+paths.model_name=comm", f"mesh.d={d}", f"mesh.t={t}", f"mesh.c={c}", *blocks])
    mesh = make_mesh(d, t, c)
    with jax.set_mesh(mesh):
        state = abstract_state(cfg, mesh)
        return cfg, state, compile_step(train.training_step, cfg, state, mesh).as_text()


def splits(x, axes) -> int:
    """Devices along the mesh `axes` that split the array x (a ShapeDtypeStruct with a sharding)."""
    used = {a for entry in x.sharding.spec if entry for a in ((entry,) if isinstance(entry, str) else entry)}
    return math.prod(x.sharding.mesh.shape[a] for a in axes if a in used)


@pytest.mark.slow
@pytest.mark.parametrize("d,t,c", [(8, 1, 1), (4, 2, 1), (2, 2, 2)])
def test_the_compiled_step_sends_what_the_code_says(d, t, c):
    cfg, state, hlo = compiled_hlo(d, t, c)
    collectives = communication.step_collectives(hlo)
    layers = state.weights.layers
    # FSDP: every layer weight split over d or c is gathered as bf16 bits, the unembedding too; the
    # embedding table is not gathered (below). An empty weight (the experts of this dense model) sends nothing:
    # XLA drops its collectives. The backward pass's rematerialization gathers each layer weight
    # again, but XLA:CPU, seeing the layers unrolled (train.forward's Python loop), merges that
    # gather with the forward's and keeps the gathered weight until the backward pass: one gather
    # per layer weight here (the H200's compiler keeps both: 2 x 7 x 12 + 1 on gpu8_125m).
    gathered = [w for w in jax.tree.leaves(layers) if splits(w, ("d", "c")) > 1 and w.size]
    weight_gathers = [c for c in collectives if c.kind == "all-gather" and c.dtype == "u16"]
    assert sum(c.runs for c in weight_gathers) == len(gathered) * cfg.model.layers + 1
    # Muon: each group of its weights that share one shape, M first, goes to whole matrices and back as one
    # stack, as bf16 bits, by all-to-alls over the axes that split it (d and c, then t): each sends all but
    # its own block of the group's layers, padded to a multiple of the devices, once each way.
    devices = d * t * c
    expected, runs = 0.0, 0
    for names in matrix_groups(train.MUON, cfg.model.layers, devices):
        w = getattr(layers, names[0])
        if not w.size:
            continue
        stacked = w.shape[0] * len(names)
        padded_elements = -(-stacked // devices) * devices * math.prod(w.sharding.shard_shape(w.shape)[1:])
        for group in (splits(w, ("d", "c")), splits(w, ("t",))):
            if group > 1:
                expected += 2 * (group - 1) / group * padded_elements * 2
                runs += 2
    to_all = [x for x in collectives if x.kind == "all-to-all"]
    assert {x.dtype for x in to_all} == {"u16", "f32"}
    muon = [x for x in to_all if x.dtype == "u16"]
    assert sum(x.runs for x in muon) == runs
    assert sum(x.bytes_sent * x.runs for x in muon) == pytest.approx(expected, rel=1e-9)
    # The embedding (train.embed_tokens): each device looks the batch's token ids (gathered, u32) up in its
    # columns of the table, [B, L, M/d/c] in f32, and all-to-alls send each device its tokens' rows, one axis
    # at a time (c, then d), forward and backward; the table itself never crosses.
    B, L, M = cfg.training.tokens.batch, cfg.training.tokens.len, cfg.model.d_model
    moved = [g for g in (c, d) if g > 1]
    rows = [x for x in to_all if x.dtype == "f32"]
    assert sum(x.runs for x in rows) == 2 * len(moved)
    assert sum(x.bytes_sent * x.runs for x in rows) == pytest.approx(
        2 * sum((g - 1) / g for g in moved) * B * L * M // (d * c) * 4, rel=1e-9)
    # The ring: key and value blocks travel as bf16 bits, their gradients in f32; none without c. The
    # gradients of each shard's k and v take c - 1 hops round the ring and one home: 2 c a layer (the first
    # step, on the device's own shard, sends no zeros ahead).
    permutes = [x for x in collectives if x.kind == "collective-permute"]
    assert {x.dtype for x in permutes} == ({"u16", "u32", "f32"} if c > 1 else set())
    assert sum(x.runs for x in permutes if x.dtype == "f32") == (2 * c * cfg.model.layers if c > 1 else 0)
    if t == 1:  # FSDP only: weights go as bf16 bits and the token ids as u32, gradients come back in f32
        assert {c.dtype for c in collectives if c.kind == "reduce-scatter"} == {"f32"}
        assert {c.dtype for c in collectives if c.kind == "all-gather"} == {"u16", "u32"}
    else:  # the residual stream is B/d L M/t: no all-reduce carries [B/d, L, M]
        residual = cfg.training.tokens.batch // d * cfg.training.tokens.len * cfg.model.d_model * 4
        assert all(c.bytes_sent < residual / 4 for c in collectives if c.kind == "all-reduce")
    report = communication.report("test", collectives)
    total = sum(communication.totals(collectives).values())
    assert "NVLink" in report and "InfiniBand" in report and f"{total / 2**20:.3f} MiB" in report
    assert "all-to-all" in report
