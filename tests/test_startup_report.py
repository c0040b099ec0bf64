"""startup_report.py: the FLOPs formula by hand and against XLA's count, and the HLO graph's
drawing (without graphviz, and at the lowest priority)."""

import math
import os
import re
import shutil
import types
import xml.etree.ElementTree as ElementTree

import jax
import jax.extend.core as jax_core
import jax.numpy as jnp
import pytest
from jax import lax

import train
from fixtures import abstract_state, make_mesh
from seqax import config
from seqax.analysis import startup_report
from seqax.analysis.startup_report import StartupReport, compile_step
from seqax.config import load_config
from seqax.kernels import attention
from seqax.shardlib.shardtypes import bool_, f32, typed_shard_map, u32


def dot_flops(jaxpr) -> int:
    """2 FLOPs per multiply-add of every dot_general in `jaxpr` and the jaxprs inside it; a scan's
    body counts `length` times, any other inner jaxpr (a while loop's body too) once."""
    total = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (contracted, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            total += 2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[i] for i in contracted)
        inner = [v for value in eqn.params.values() for v in (value if isinstance(value, tuple | list) else [value])]
        inner = [v.jaxpr if isinstance(v, jax_core.ClosedJaxpr) else v for v in inner
                 if isinstance(v, jax_core.ClosedJaxpr | jax_core.Jaxpr)]
        total += (eqn.params["length"] if eqn.primitive.name == "scan" else 1) * sum(map(dot_flops, inner))
    return total


def test_flops_formula_counts_the_matmuls_of_the_forward_pass():
    """The formula against the matmuls that train.forward actually traces, counted from its
    jaxpr (one attention block, so the block loop runs once; a 1x1 mesh, so shapes are global):
    the same count once the attention's QK^T and PV, measured on dense_attention, are taken at
    the causal half, as the formula's convention is; times 3 for forward and backward. Every
    dimension differs, so a swapped or missing factor shows."""
    m = config.ModelConfig(d_model=8, n_q_per_kv=2, n_kv=3, d_head=4, d_ff=20, layers=3, vocab=40, rope_base=1e4,
                           norm_eps=1e-5, attention_block=8)
    B, L = 2, 8
    Q, K, D = m.n_q_per_kv, m.n_kv, m.d_head
    tokens = lambda dtype, *shape: jax.ShapeDtypeStruct((B, L, *shape), dtype)  # noqa: E731

    @typed_shard_map
    def logits(w: train.Model, inputs: u32[b"B/d L/c"], is_seq_start: bool_[b"B/d L/c"]) -> f32[b"B/d L/c V/t"]:
        return train.forward(m, w, inputs, is_seq_start)[0]

    @typed_shard_map
    def attend(q: f32[b"B/d L Q K/t D"], k: f32[b"B/d L K/t D"], v: f32[b"B/d L K/t D"],
               mask: bool_[b"B/d L S"]) -> f32[b"B/d L Q K/t D"]:
        return attention.dense_attention(q, k, v, mask)

    with jax.set_mesh(make_mesh(1, 1)):
        weights = jax.eval_shape(lambda: train.init_weights(m, jax.random.key(0)))
        forward = dot_flops(jax.make_jaxpr(logits)(weights, tokens(jnp.uint32), tokens(jnp.bool_)).jaxpr)
        per_layer_attention = dot_flops(jax.make_jaxpr(attend)(
            tokens(jnp.float32, Q, K, D), *[tokens(jnp.float32, K, D)] * 2, tokens(jnp.bool_, L)).jaxpr)
    assert per_layer_attention == 2 * (2 * B * L * L * Q * K * D)  # QK^T and PV over every query-key pair
    causal_forward = forward - m.layers * per_layer_attention / 2
    assert train.model_flops_per_token(m, seq_len=L) == 3 * causal_forward / (B * L)


@pytest.mark.slow
@pytest.mark.parametrize("d", [1, 8])
def test_formulas_agree_with_xla_cost_analysis(d):
    """XLA's cost_analysis() counts a while loop's body once (startup_report.flops_check); the layers
    run as a Python loop, so with 3 layers it sees all three (a layer scan would count one: it
    gave half here). XLA counts the model's FLOPs, and the Newton-Schulz branch of the optimizer on every
    device (it counts each device's program, whose work is the busiest device's), plus elementwise
    work, the masked half of the attention scores and the recomputed QK^T: the sum must be above
    the formulas' and by less than 10% (L=64 keeps attention small and d_model=256 keeps the
    elementwise work small next to the matmuls). One attention block of L positions: with more,
    the attention's block loop would be counted once. One device runs every layer's Newton-Schulz, so
    a miscount of it shows; on 8, the first device runs one layer of each group of same-shaped weights
    (two weights' 3 layers fill 8 devices: q with o, k with v, gate with up, down alone), and a count of
    one layer of every weight (gave 0.90) shows."""
    cfg = load_config("local_test_synthetic", ["+paths.model_name=flops", "model.layers=3", "model.attention_block=64",
                                               f"mesh.d={d}", "mesh.t=1"])
    mesh = make_mesh(cfg.mesh.d, cfg.mesh.t)
    with jax.set_mesh(mesh):
        compiled = compile_step(train.training_step, cfg, abstract_state(cfg, mesh), mesh)
    cost = compiled.cost_analysis()
    xla = (cost[0] if isinstance(cost, list) else cost)["flops"] * mesh.size
    model = (train.model_flops_per_token(cfg.model, cfg.training.tokens.len) * cfg.training.tokens.batch
             * cfg.training.tokens.len)
    _, busiest = train.newton_schulz_flops(cfg.model, mesh.size)
    assert busiest * mesh.size > 0.1 * model  # so that a wrong count of it shows
    assert 1.0 <= xla / (model + busiest * mesh.size) <= 1.10, (xla, model, busiest)


def report_config():
    return types.SimpleNamespace(mesh=types.SimpleNamespace(d=1, t=1, c=1),
                                 training=types.SimpleNamespace(tokens=types.SimpleNamespace(batch=4, len=8)),
                                 model=config.ModelConfig(d_model=8, n_q_per_kv=1, n_kv=1, d_head=8, d_ff=16, layers=1,
                                                          vocab=16, rope_base=1e4, norm_eps=1e-5, attention_block=8))


def compiled_loop():
    def f(w, x):
        return lax.fori_loop(0, 3, lambda i, x: jnp.tanh(x @ w), x)

    return jax.jit(f).lower(jnp.ones((8, 8)), jnp.ones((4, 8))).compile()


def test_missing_graphviz_is_said_in_the_compile_line_not_warned(tmp_path, monkeypatch, capsys):
    """graphviz is optional: without it the compile line says there is no .svg (was: a warning of two
    lines on every run)."""
    monkeypatch.setattr(startup_report.shutil, "which", lambda name: None)
    report = StartupReport(str(tmp_path), report_config())
    report.compile(compiled_loop, train.model_flops_per_token, train.newton_schulz_flops)
    report.close()
    out, err = capsys.readouterr()
    assert not err and re.search(r"^compiled the training step in [\d.]+ s: .*/training_step.hlo.txt, .dot "
                                 r"\(no .svg: graphviz is not installed\)$", out, re.M), out
    assert (tmp_path / "training_step.dot").exists() and not (tmp_path / "training_step.svg").exists()


@pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz's dot is not installed")
def test_the_graph_is_drawn_at_the_lowest_priority(tmp_path):
    """The background `dot` takes no CPU from the steps: nice 19 (and the run still waits for its svg)."""
    report = StartupReport(str(tmp_path), report_config())
    report.compile(compiled_loop, train.model_flops_per_token, train.newton_schulz_flops)
    # not yet waited for: the process exists, finished or not
    assert os.getpriority(os.PRIO_PROCESS, report.dot_process.pid) == 19
    report.close()
    assert ElementTree.parse(tmp_path / "training_step.svg").getroot().tag.endswith("svg")




def test_on_a_gpu_the_roofline_gives_the_mfu_ceiling(tmp_path, monkeypatch, capsys):
    """On a device that targets.py knows (here an H200, as a GPU names itself), the compile is followed by
    the roofline's step time and MFU ceiling of the compiled program; on a CPU, by nothing."""
    report = StartupReport(str(tmp_path), report_config())
    compiled = compiled_loop()
    report.print_roofline(compiled, lambda h, seq_len: 1e9)
    assert capsys.readouterr().out == ""
    monkeypatch.setattr(jax, "devices", lambda *a: [types.SimpleNamespace(platform="gpu",
                                                                          device_kind="NVIDIA H200 141GB HBM3e")])
    report.print_roofline(compiled, lambda h, seq_len: 1e9)
    line = capsys.readouterr().out
    found = re.fullmatch(r"roofline of the compiled step on h200: ([\d.e-]+) ms a step, MFU ceiling ([\d.]+)% "
                         r"\(docs/roofline.md\)\n", line)
    assert found, line
    tokens = 4 * 8  # report_config's batch
    ceiling = 1e9 * tokens / jax.device_count() / (float(found.group(1)) / 1e3 * 989e12)
    assert float(found.group(2)) == pytest.approx(100 * ceiling, rel=0.02)  # both rounded to 3 digits
