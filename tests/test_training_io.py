"""What a run reports: the FLOPs formula by hand and against XLA, the peak table, the memory
estimate, metrics.jsonl and TensorBoard (also on resume), the HLO graph, and one short real run
whose run directory holds all of it."""

import gzip
import json
import math
import os
import re
import shutil
import subprocess
import types
import xml.etree.ElementTree as ElementTree
from functools import partial

import jax
import jax.extend.core as jax_core
import jax.numpy as jnp
import pytest
from jax import lax
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import train
from fixtures import abstract_state, make_mesh, run_train, tiny_config, train_args
from seqax import attention, config, hlo_graph, memory, training_io
from seqax.config import load_config
from seqax.jax_extra import save_for_backward
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
        return train.forward(m, w, inputs, is_seq_start)

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
def test_formulas_agree_with_xla_cost_analysis_for_one_layer():
    """XLA's cost_analysis() counts a while loop's body once (training_io.flops_check), so the
    comparison is exact only with one layer (and one matrix per device for Muon's map over its
    matrices). XLA counts the model's FLOPs, and the Newton-Schulz branch of the optimizer on every
    device (it counts each device's program, whose work is the busiest device's), plus elementwise
    work, the masked half of the attention scores and the recomputed QK^T: the sum must be above
    the formulas' and by less than 10% (+1.8% here, 69.6 against 68.3 GFLOP: L=64 keeps attention
    small and d_model=256 keeps the elementwise work small next to the matmuls). One attention
    block of L positions: with more, the attention's block loop would be counted once too."""
    cfg = load_config("local_test_synthetic", ["+paths.model_name=flops", "model.layers=1", "model.attention_block=64"])
    mesh = make_mesh(cfg.mesh.d, cfg.mesh.t)
    with jax.set_mesh(mesh):
        compiled = training_io.compile_step(train.training_step, cfg, abstract_state(cfg, mesh), mesh)
    cost = compiled.cost_analysis()
    xla = (cost[0] if isinstance(cost, list) else cost)["flops"] * jax.device_count()
    model = (train.model_flops_per_token(cfg.model, cfg.training.tokens.len) * cfg.training.tokens.batch
             * cfg.training.tokens.len)
    _, busiest = train.newton_schulz_flops(cfg.model, jax.device_count())
    assert busiest > 0.1 * model  # so that a wrong count of it shows
    assert 1.0 <= xla / (model + busiest * jax.device_count()) <= 1.10, (xla, model, busiest)


@pytest.mark.parametrize(
    "kind,peak",
    [("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12),
     ("NVIDIA H200", 989e12), ("NVIDIA B200", 2250e12), ("TPU v4", 275e12), ("TPU v5 lite", 197e12),
     ("TPU v5", 459e12), ("TPU v5p", 459e12), ("TPU v6 lite", 918e12), ("TPU v4 lite", None), ("Imaginary X1", None)],
)
def test_peak_table(kind, peak):
    assert training_io.peak_bf16_flops_per_device(kind) == peak


def fake_config(steps: int):
    return types.SimpleNamespace(
        training=types.SimpleNamespace(steps=steps, tokens=types.SimpleNamespace(batch=4, len=8)),
        model=config.ModelConfig(d_model=8, n_q_per_kv=1, n_kv=1, d_head=8, d_ff=16, layers=1, vocab=16,
                                 rope_base=1e4, norm_eps=1e-5, attention_block=8),
        mesh=types.SimpleNamespace(d=1, t=1),
        logging=config.LoggingConfig(wandb_project="", wandb_entity=""),
    )


def log_steps(run_dir, start: int, losses: dict[int, float], steps: int = 6):
    log = training_io.RunLog(str(run_dir), "x: 1\n", fake_config(steps), start, train.model_flops_per_token,
                             train.newton_schulz_flops, profiled_steps=0)
    for step, loss in losses.items():
        log.before_step(step, None)
        log.after_step(step, train.Metrics(jnp.float32(loss), jnp.float32(1e-3), jnp.float32(0.5)))
    log.close()


def scalars(run_dir, tag: str) -> list[tuple[int, float]]:
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


def test_tensorboard_on_resume_shows_each_step_once(tmp_path, monkeypatch):
    monkeypatch.setattr(training_io, "peak_flops", lambda: (1e12, "test"))
    log_steps(tmp_path, 0, {s: float(s) for s in range(5)})  # crashed after step 4, checkpoint 3
    log_steps(tmp_path, 3, {s: 10.0 + s for s in range(3, 6)})
    assert scalars(tmp_path, "loss") == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 13.0), (4, 14.0), (5, 15.0)]
    lines = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
    assert [l["step"] for l in lines] == [0, 1, 2, 3, 4, 3, 4, 5]  # appended: the re-run steps twice


def test_resume_drops_a_torn_last_metrics_line(tmp_path, monkeypatch):
    monkeypatch.setattr(training_io, "peak_flops", lambda: (1e12, "test"))
    log_steps(tmp_path, 0, {0: 1.0, 1: 2.0})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 2, "lo')  # killed while writing step 2's line
    log_steps(tmp_path, 2, {2: 3.0})
    lines = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
    assert [(l["step"], l["loss"]) for l in lines] == [(0, 1.0), (1, 2.0), (2, 3.0)]


def test_unknown_accelerator_gives_null_mfu_and_one_warning(tmp_path, monkeypatch, capsys):
    device = types.SimpleNamespace(platform="gpu", device_kind="Imaginary X1")
    monkeypatch.setattr(jax, "devices", lambda *a: [device])
    log_steps(tmp_path, 0, {s: 1.0 for s in range(3)})
    lines = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
    assert [l["mfu"] for l in lines] == [None] * 3 and all(l["tokens_per_second"] > 0 for l in lines)
    warnings = [l for l in capsys.readouterr().err.splitlines() if "warning" in l]
    assert len(warnings) == 1 and "Imaginary X1" in warnings[0], warnings


def test_memory_report_follows_save_for_backward(monkeypatch):
    """A value marked with save_for_backward shows up in the estimate by itself. Here the
    sigmoid of the SwiGLU gate (float32 [B/d, L, F/t], which the backward pass needs and
    otherwise recomputes) is marked too."""
    cfg = tiny_config()
    mesh = make_mesh(4, 2)
    state = abstract_state(cfg, mesh)
    with jax.set_mesh(mesh):
        # A new function object each time: JAX caches the trace of a checkpointed function by its identity.
        before = memory.memory_estimate(state, cfg.model.layers, *memory.memory_annotations(
            cfg, mesh, state, partial(train.training_layer, cfg.model)), train.MUON)
        sigmoid = jax.nn.sigmoid
        monkeypatch.setattr(jax.nn, "sigmoid", lambda x: save_for_backward(sigmoid(x)))
        after = memory.memory_estimate(state, cfg.model.layers, *memory.memory_annotations(
            cfg, mesh, state, partial(train.training_layer, cfg.model)), train.MUON)
    saved = lambda terms: next(size for name, size in terms[0] if name.startswith("saved for backward"))  # noqa: E731
    B, L, F = cfg.training.tokens.batch // 4, cfg.training.tokens.len, cfg.model.d_ff // 2
    assert saved(after) - saved(before) == B * L * F * 4 * cfg.model.layers
    assert len(after[1]) == len(before[1]) + 1


def compiled_loop():
    def f(w, x):
        return lax.fori_loop(0, 3, lambda i, x: jnp.tanh(x @ w), x)

    return jax.jit(f).lower(jnp.ones((8, 8)), jnp.ones((4, 8))).compile()


def loop_hlo() -> str:
    return compiled_loop().as_text()


def test_hlo_graph_has_the_loop_body_and_its_matmul():
    dot = hlo_graph.to_dot(loop_hlo(), "f")
    assert "subgraph cluster_" in dot and "(x3)" in dot
    assert re.search(r'label="[^"]*(dot|fusion: dot)[^"]*", fillcolor="lightblue"', dot), dot
    if shutil.which("dot"):
        svg = subprocess.run(["dot", "-Tsvg"], input=dot, capture_output=True, text=True, check=True).stdout
        assert ElementTree.fromstring(svg).tag.endswith("svg")


def test_missing_graphviz_is_a_warning(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(training_io, "peak_flops", lambda: (1e12, "test"))
    monkeypatch.setattr(training_io.shutil, "which", lambda name: None)
    log = training_io.RunLog(str(tmp_path), "x: 1\n", fake_config(1), 0, train.model_flops_per_token,
                             train.newton_schulz_flops)
    log.compile(compiled_loop)
    log.close()
    assert "graphviz" in capsys.readouterr().err
    assert (tmp_path / "training_step.dot").exists() and not (tmp_path / "training_step.svg").exists()


@pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz's dot is not installed")
def test_the_graph_is_drawn_at_the_lowest_priority(tmp_path, monkeypatch):
    """The background `dot` takes no CPU from the steps: nice 19 (and the run still waits for its svg)."""
    monkeypatch.setattr(training_io, "peak_flops", lambda: (1e12, "test"))
    log = training_io.RunLog(str(tmp_path), "x: 1\n", fake_config(1), 0, train.model_flops_per_token,
                             train.newton_schulz_flops)
    log.compile(compiled_loop)
    assert os.getpriority(os.PRIO_PROCESS, log.dot_process.pid) == 19  # not yet waited for: it exists, finished or not
    log.close()
    assert ElementTree.parse(tmp_path / "training_step.svg").getroot().tag.endswith("svg")


@pytest.fixture(scope="module")
def short_run(tmp_path_factory, default_dataset):
    """Four steps of local_test_synthetic, as `make train` runs it (on its dataset)."""
    root = tmp_path_factory.mktemp("runs")
    result = run_train(train_args(root, default_dataset, "obs", "training.steps=4"))
    assert result.returncode == 0, result.stderr[-3000:]
    return root / "obs", result


@pytest.mark.slow
def test_short_run_writes_profile_graph_memory_metrics_and_tensorboard(short_run):
    run_dir, result = short_run
    traces = list((run_dir / "profile").glob("plugins/profile/*/perfetto_trace.json.gz"))
    assert len(traces) == 1
    events = json.load(gzip.open(traces[0]))["traceEvents"]
    assert sum("training_step" in str(e.get("name", "")) for e in events) >= 2
    if shutil.which("dot"):
        assert ElementTree.parse(run_dir / "training_step.svg").getroot().tag.endswith("svg")
    else:
        assert (run_dir / "training_step.dot").exists() and "graphviz" in result.stderr
    assert "compiled the training step in" in result.stdout

    # training lines, not eval lines
    lines = [l for l in map(json.loads, open(run_dir / "metrics.jsonl")) if "loss" in l]
    assert [l["step"] for l in lines] == [0, 1, 2, 3]
    for l in lines:
        assert l["tokens_per_second"] > 0 and 0 < l["mfu"] < 1.5 and l["step_time"] > 0
    assert [s for s, _ in scalars(run_dir, "loss")] == [0, 1, 2, 3]
    assert [v for _, v in scalars(run_dir, "loss")] == pytest.approx([l["loss"] for l in lines], rel=1e-6)
    assert len(re.findall(r"^step .* MFU .* ETA ", result.stdout, re.M)) == 4


@pytest.mark.slow
def test_memory_estimate_is_within_30_percent_of_xla(short_run):
    run_dir, result = short_run
    report = (run_dir / "memory_report.txt").read_text()
    assert report in result.stdout
    ratio = float(re.search(r"estimate / XLA peak = ([\d.]+)", report).group(1))
    assert 0.7 <= ratio <= 1.3, report


@pytest.mark.slow
def test_plot_metrics_draws_two_runs(short_run, tmp_path):
    from tools import plot_metrics

    run_dir, _ = short_run
    other = tmp_path / "other"
    other.mkdir()
    lines = [l for l in map(json.loads, open(run_dir / "metrics.jsonl")) if "loss" in l]
    with open(other / "metrics.jsonl", "w") as f:
        for l in lines:
            f.write(json.dumps({**l, "loss": l["loss"] + 0.5}) + "\n")
        f.write(json.dumps({"step": 3, "eval_loss": 6.0}) + "\n")
    output = tmp_path / "plot.png"
    plot_metrics.main([str(run_dir), str(other), "--output", str(output)])
    data = output.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
