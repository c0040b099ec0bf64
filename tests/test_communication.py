"""The communication report: what the compiled step sends, read from its HLO with loop trip
counts, against communication.predicted_per_step's formula; and the HLO facts it rests on."""

import jax
import pytest

import communication
import train
from config import load_config
from fixtures import abstract_state, make_mesh


def test_bytes_of_a_ring_collective():
    assert communication.sent_bytes("all-gather", 800, 4) == 600  # 3/4 of the gathered array
    assert communication.sent_bytes("reduce-scatter", 800, 4) == 600
    assert communication.sent_bytes("all-reduce", 800, 4) == 1200  # a reduce-scatter and an all-gather
    assert communication.sent_bytes("collective-permute", 800, 2) == 800
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
        return cfg, train.compile_training_step(cfg, abstract_state(cfg, mesh), mesh).as_text()


@pytest.mark.slow
@pytest.mark.parametrize("d,t,c", [(8, 1, 1), (4, 2, 1), (2, 2, 2)])
def test_the_formula_agrees_with_the_compiled_step_within_5_percent(d, t, c):
    cfg, hlo = compiled_hlo(d, t, c)
    collectives = communication.step_collectives(hlo)
    measured, predicted = communication.totals(collectives), communication.predicted_per_step(cfg)
    assert set(measured) == set(predicted), (measured, predicted)
    for key, value in predicted.items():
        assert abs(measured[key] / value - 1) <= 0.05, (key, measured[key], value)
    # The layers' scan body counts once per layer: FSDP gathers each layer weight twice per step.
    weight_gathers = [c for c in collectives if c.kind == "all-gather" and c.dtype == "u16"]
    # 7 matmul weights a layer, + the unembedding
    assert sum(c.runs for c in weight_gathers) == 2 * 7 * cfg.model.layers + 1
    # The ring: key and value blocks travel as bf16 bits, their gradients in f32; none without c.
    assert ({x.dtype for x in collectives if x.kind == "collective-permute"}
            == ({"u16", "u32", "f32"} if c > 1 else set()))
    if t == 1:  # FSDP only: weights go as bf16 bits (the embedding table in f32), gradients come back in f32
        assert {c.dtype for c in collectives if c.kind == "reduce-scatter"} == {"f32"}
        assert ({(c.dtype, c.bytes_sent) for c in collectives if c.kind == "all-gather" and c.dtype != "u16"}
                == {("f32", 7 / 8 * 1280 * 256 * 4)})
    else:  # the residual stream is B/d L M/t: no all-reduce carries [B/d, L, M]
        residual = cfg.training.tokens.batch // d * cfg.training.tokens.len * cfg.model.d_model * 4
        assert all(c.bytes_sent < residual / 4 for c in collectives if c.kind == "all-reduce")
    report = communication.report("test", measured, predicted)
    assert "NVLink" in report and "InfiniBand" in report and f"{sum(measured.values()) / 2**20:.3f} MiB" in report
