"""tools/export_hf.py: transformers loads the exported checkpoint (a Llama, a Qwen3 with QK-norm's
gains, or a Glm4Moe with experts) with every weight used, its logits (torch, CPU, float32) match
seqax's forward pass within bfloat16 rounding, and its tokenizer encodes to the ids the dataset
holds; its files are readable by all. The export checks its own logits (tools/export_check.py) and
refuses, in one line and leaving nothing, a model it does not compute. A weight no class has a
place for, and a mixture of experts that Glm4Moe cannot express, are refused in one line."""

import contextlib
import dataclasses
import io
import json
import os
import re
import stat

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from omegaconf import OmegaConf

import train
from fixtures import float32_config, forward_logits, make_mesh, perturbed_weights, prepared_dataset, tiny_config
from seqax.checkpoint import Checkpointer
from seqax.config import ConfigError
from seqax.data.tokenizer import dataset_tokenizer
from seqax.shardlib.shardtypes import f32, make_shardings, pytree_dataclass
from tools import export_hf

TEXT = ("the quick brown fox jumps over the lazy dog. " * 20
        + "pack my box with five dozen liquor jugs; sphinx of black quartz, judge my vow.")

# seqax multiplies bfloat16 operands (8-bit mantissa, relative rounding 2^-9) with float32 sums;
# transformers runs float32 throughout. Each matmul input is rounded once, so every logit is off
# by about 2^-9 x sqrt(number of roundings on its path) x its scale; with logits of size ~1-5 on
# this tiny model that is a few 1e-2 at most. The bound: 5e-2 + 2e-2 x |logit|.
ATOL, RTOL = 5e-2, 2e-2
# With float32 matmuls in seqax too, only the order of sums differs: ~1e-6 on these logits.
ATOL_F32, RTOL_F32 = 1e-4, 1e-4

# The tiny model with 4 experts of H 32, 2 a token (as tests/test_moe.py); TINY's d_ff 128 is 4 experts wide.
MOE = ("+model.experts=4", "+model.experts_per_token=2", "+model.expert_d_ff=32", "+model.expert_block=8")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """(folder, a dataset prepared with a BPE tokenizer.json trained here)."""
    root = tmp_path_factory.mktemp("export")
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=180, special_tokens=["[UNK]", "</s>"]))
    tokenizer.save(str(root / "tokenizer.json"))
    (root / "text.txt").write_text(TEXT)
    (root / "more.txt").write_text(TEXT[::-1])
    data = prepared_dataset(root / "data.zarr", str(root / "text.txt"), str(root / "more.txt"), "--tokenizer",
                            str(root / "tokenizer.json"), "--eos-token", "</s>", "--validation-documents", "1")
    return root, data


def checkpointed_run(root, name: str, cfg, weights) -> str:
    """A run directory `name` whose checkpoint 3 holds `weights`."""
    run_dir = root / name
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(dataclasses.asdict(cfg)))
    checkpointer = Checkpointer(str(run_dir / "checkpoints"), cfg.checkpoints)
    checkpointer.save(3, train.fresh_state(weights))
    checkpointer.close()
    return str(run_dir)


def exported_run(root, name: str, cfg, weights) -> str:
    """The export (its folder) of a run `name` whose checkpoint 3 holds `weights`, written under umask 022;
    it printed its logits check."""
    run_dir, out, umask = checkpointed_run(root, name, cfg, weights), io.StringIO(), os.umask(0o022)
    try:
        with contextlib.redirect_stdout(out):
            export_hf.main(["--run-dir", run_dir, "--output", str(root / f"{name}_hf")])
    finally:
        os.umask(umask)
    check = out.getvalue().splitlines()[0]
    assert re.fullmatch(r"logits check: largest gap \S+ over 4 x 32 tokens \(float32, bound \S+\)", check), check
    return str(root / f"{name}_hf")


@pytest.fixture(scope="module")
def exported(dataset):
    root, data = dataset
    cfg = tiny_config("model.n_kv=2", f"dataset.path={data}", f"paths.root_working_dir={root}")
    weights = perturbed_weights(cfg)
    return cfg, jax.device_get(weights), exported_run(root, "run", cfg, weights), data


@pytest.fixture(scope="module", params=[128, 0], ids=["shared_expert", "no_shared_expert"])
def exported_moe(dataset, request):
    """The tiny MoE model with the dense SwiGLU as 4 shared experts, or none (d_ff 0), and a selection
    bias that differs by expert and layer (training moves it off 0)."""
    root, data = dataset
    cfg = tiny_config("model.n_kv=2", *MOE, f"model.d_ff={request.param}", f"dataset.path={data}",
                      f"paths.root_working_dir={root}")
    w = perturbed_weights(cfg)
    bias = jnp.asarray(np.random.default_rng(1).normal(0, 0.1, (cfg.model.layers, cfg.model.experts)), jnp.float32)
    weights = train.Model(w.embed, train.Layer(**{**vars(w.layers), "expert_bias": bias}), w.final_norm, w.unembed)
    return cfg, jax.device_get(weights), exported_run(root, f"moe_{request.param}", cfg, weights)


def seqax_logits(cfg, weights, inputs: np.ndarray) -> np.ndarray:
    """train.forward on one document per row, on a 4x2 mesh."""
    mesh = make_mesh(4, 2)
    starts = np.zeros(inputs.shape, bool)
    starts[:, 0] = True
    with jax.set_mesh(mesh):
        return np.asarray(forward_logits(cfg.model)(jax.device_put(weights, make_shardings(train.Model, mesh)),
                                                    inputs, starts))


def random_documents(vocab: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    inputs = rng.integers(1, vocab, size=(4, 16)).astype(np.uint32)
    inputs[:, 0] = 0  # begin of document
    return inputs


def hf_logits(model, inputs: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.from_numpy(inputs.astype(np.int64))).logits.numpy()


def assert_logits_agree(theirs: np.ndarray, ours: np.ndarray, atol: float = ATOL, rtol: float = RTOL):
    diff, bound = np.abs(theirs - ours), atol + rtol * np.abs(ours)
    print(f"max |logit difference| {diff.max():.3g}, max |logit| {np.abs(ours).max():.3g}, "
          f"worst difference / bound {(diff / bound).max():.3g}")
    assert np.all(diff <= bound), diff.max()
    assert np.mean(theirs.argmax(-1) == ours.argmax(-1)) > 0.9


@pytest.mark.slow  # a dataset, a checkpoint, an export and torch
def test_transformers_loads_every_weight_and_matches_seqax_logits(exported):
    import torch  # required (requirements-dev.txt); imported here so that collecting the fast tier does not pay for it
    import transformers

    cfg, weights, hf_dir, _ = exported
    # A Llama, or the class that the layer's weights call for (hf_class: QK-norm's gains make it a Qwen3).
    model, info = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, output_loading_info=True,
                                                                    dtype=torch.float32)
    assert not any(info.values()), info  # missing, unexpected and mismatched keys, errors
    assert type(model).__name__ == ("Qwen3ForCausalLM" if hasattr(weights.layers, "q_norm") else "LlamaForCausalLM")
    inputs = random_documents(cfg.model.vocab)
    assert_logits_agree(hf_logits(model, inputs), seqax_logits(cfg, weights, inputs))


@pytest.mark.slow  # a dataset, a checkpoint, an export and torch
def test_glm4_moe_loads_every_weight_and_matches_seqax_logits(exported_moe):
    """With float32 matmuls in seqax: bfloat16's rounding of the router's input moves a score by ~1e-3,
    which can flip a near tie of the top-k (then that token's logits differ by far more than rounding)."""
    import torch
    import transformers

    cfg, weights, hf_dir = exported_moe
    model, info = transformers.Glm4MoeForCausalLM.from_pretrained(hf_dir, output_loading_info=True,
                                                                  dtype=torch.float32)
    assert not any(info.values()), info
    inputs = random_documents(cfg.model.vocab)
    ours = seqax_logits(float32_config(cfg), weights, inputs)
    assert_logits_agree(hf_logits(model, inputs), ours, ATOL_F32, RTOL_F32)
    for layer in model.model.layers:  # the bias matters here: without it other experts are picked
        layer.mlp.gate.e_score_correction_bias.zero_()
    assert not np.allclose(hf_logits(model, inputs), ours, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("overrides,line", [
    ((*MOE, "model.d_ff=48"), "model.d_ff 48 is not a multiple of model.expert_d_ff 32: "),
    (("+model.experts=1", "+model.experts_per_token=1", "+model.expert_d_ff=32"), "model.experts is 1: "),
], ids=["shared_expert_width", "one_expert"])
def test_a_mixture_of_experts_glm4_moe_cannot_express_is_refused_in_one_line(tmp_path, capsys, overrides, line):
    cfg = tiny_config(*overrides)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text(OmegaConf.to_yaml(dataclasses.asdict(cfg)))
    with pytest.raises(SystemExit) as exit:
        export_hf.main(["--run-dir", str(tmp_path / "run"), "--output", str(tmp_path / "hf")])
    assert exit.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"seqax: error: {line}"), lines
    assert not (tmp_path / "hf").exists()


@pytest.mark.slow  # a dataset, a checkpoint, an export and torch
def test_exported_tokenizer_encodes_to_the_dataset_ids(exported):
    import transformers

    _, _, hf_dir, data = exported
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    ours = dataset_tokenizer(data)
    text = "the lazy fox judges my box"
    expected = [int(i) for i in ours.encode([text])[0] if int(i) != ours.eos_id]
    assert tokenizer(text, add_special_tokens=False)["input_ids"] == expected
    assert tokenizer.decode(expected) == ours.decode(expected)
    assert tokenizer.convert_ids_to_tokens(0) == export_hf.BOS_TOKEN


@pytest.mark.slow  # a dataset, a checkpoint and an export
def test_exported_files_are_readable_by_all(exported):
    """Under umask 022 every file is 0644, as any file written with open() (safetensors alone writes 0600)."""
    hf_dir = exported[2]
    modes = {name: stat.S_IMODE(os.stat(os.path.join(hf_dir, name)).st_mode) for name in os.listdir(hf_dir)}
    assert "model.safetensors" in modes and set(modes.values()) == {0o644}, modes


@pytest.mark.slow  # a dataset, a checkpoint, an export and torch
@pytest.mark.parametrize("edit", ["squared_relu", "gate_and_up_swapped"])
def test_a_model_the_export_does_not_compute_is_refused_in_one_line(dataset, tmp_path, capsys, monkeypatch, edit):
    """train's SwiGLU made squared ReLU (x sigmoid(x) -> x relu(x) = relu(x)^2: the same weights, another
    function), or the export's mapping wrong (layer 0's gate and up swapped: the same names and shapes): the
    logits check refuses the export in one line, and the old output that --overwrite would replace stays."""
    root, data = dataset
    cfg = tiny_config("model.n_kv=2", f"dataset.path={data}")
    run_dir = checkpointed_run(tmp_path, "run", cfg, perturbed_weights(cfg))
    if edit == "squared_relu":
        monkeypatch.setattr(jax.nn, "sigmoid", jax.nn.relu)
    else:
        tensors = export_hf.hf_tensors

        def swapped(w, h):
            out = tensors(w, h)
            gate, up = "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"
            return out | {gate: out[up], up: out[gate]}

        monkeypatch.setattr(export_hf, "hf_tensors", swapped)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    with pytest.raises(SystemExit) as exit:
        export_hf.main(["--run-dir", run_dir, "--output", str(tmp_path / "hf"), "--overwrite"])
    assert exit.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and re.match(r"seqax: error: the exported \w+ForCausalLM computes other logits than "
                                        "train.forward: largest gap ", lines[0]), lines
    assert sorted(os.listdir(tmp_path)) == ["hf", "run"] and os.listdir(tmp_path / "hf") == ["config.json"]


def with_layer_weights(h, **extra) -> train.Model:
    """Initial weights (numpy) of model config `h` with the Layer weights `extra` (name: array [layers, ...]), as a
    researcher's edit of train.Layer adds them (or replaces them, where train.Layer already has that name)."""
    new = {name: f32[b"D"] for name in extra if name not in vars(train.Layer)["__dataclass_fields__"]}
    extended = pytree_dataclass(type("Layer", (train.Layer,), {"__annotations__": new}))
    w = jax.device_get(train.init_weights(h, jax.random.key(0)))
    return train.Model(w.embed, extended(**{**vars(w.layers), **extra}), w.final_norm, w.unembed)


@pytest.mark.slow  # torch
@pytest.mark.parametrize("moe", [False, True], ids=["qwen3", "glm4_moe"])
def test_qk_norm_gains_export_as_qwen3_or_glm4_moe_with_every_weight_used(tmp_path, moe):
    """Layer gains q_norm and k_norm [layers, D] (QK-norm; train.py has none, so they are added here) make the
    export write a Qwen3ForCausalLM (with experts a Glm4MoeForCausalLM with use_qk_norm), whose
    self_attn.q_norm and k_norm hold them and which loads every weight. (The scratch QK-norm edit of train.py
    ran this export end to end, the logits check included: docs/export.md.)"""
    import torch
    import transformers
    from safetensors.numpy import save_file

    h = tiny_config("model.n_kv=2", *(MOE if moe else ())).model
    rng = np.random.default_rng(0)
    gains = {name: (1 + 0.1 * rng.standard_normal((h.layers, h.d_head))).astype(np.float32)
             for name in ("q_norm", "k_norm")}
    w = with_layer_weights(h, **gains)
    qk_norm = export_hf.check_weights(w, h)
    config = export_hf.hf_config(h, 64, None, None, qk_norm)
    architecture = "Glm4MoeForCausalLM" if moe else "Qwen3ForCausalLM"
    assert qk_norm and config["architectures"] == [architecture] and config.get("use_qk_norm", moe) == moe
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file(export_hf.hf_tensors(w, h), str(tmp_path / "model.safetensors"))
    model, info = getattr(transformers, architecture).from_pretrained(tmp_path, output_loading_info=True,
                                                                     dtype=torch.float32)
    assert not any(info.values()), info
    for name, gain in gains.items():
        assert np.array_equal(getattr(model.model.layers[1].self_attn, name).weight.detach().numpy(), gain[1])


@pytest.mark.parametrize("extra,line", [
    ({"q_norm": np.ones((2, 2, 8, 8), np.float32), "k_norm": np.ones((2, 2, 8, 8), np.float32)},
     "layers.k_norm has shape (2, 2, 8, 8); Qwen3's k_norm is one gain per head dimension, [layers, D] = (2, 8)"),
    ({"attn_gain": np.ones((2, 8), np.float32)}, "has no place for: ['layers.attn_gain']"),
    ({"q_norm": np.ones((2, 8), np.float32), "k_norm": np.ones((2, 8), np.float32),
      "attn_gain": np.ones((2, 8), np.float32)}, "Qwen3 has no place for: ['layers.attn_gain']"),
], ids=["per_head_gains", "another_weight", "another_weight_beside_qk_norm"])
def test_a_weight_no_class_has_a_place_for_is_refused_in_one_line(extra, line):
    """A model edit that adds a weight the class does not have stops the export with one line naming it,
    instead of a checkpoint that silently lacks it."""
    h = tiny_config("model.n_kv=2").model
    with pytest.raises(ConfigError) as error:
        export_hf.hf_tensors(with_layer_weights(h, **extra), h)
    assert line in str(error.value) and "\n" not in str(error.value), str(error.value)


@pytest.mark.parametrize("moe", [False, True], ids=["llama", "glm4_moe"])
def test_a_model_without_a_weight_the_class_computes_with_is_refused_in_one_line(moe):
    """An edit that removes a weight (a squared-ReLU MLP without SwiGLU's w_gate, README's third edit) stops
    the export with one line naming it: no class the export writes computes that model. (A KeyError-like
    traceback from hf_tensors is what it was.)"""
    h = tiny_config("model.n_kv=2", *(MOE if moe else ())).model
    w = jax.device_get(train.init_weights(h, jax.random.key(0)))
    without_gate = {"embed": w.embed, "final_norm": w.final_norm, "unembed": w.unembed,
                    "layers": {name: x for name, x in vars(w.layers).items() if name != "w_gate"}}
    with pytest.raises(ConfigError) as error:
        export_hf.hf_tensors(without_gate, h)
    model = export_hf.hf_class(h, qk_norm="q_norm" in without_gate["layers"]).removesuffix("ForCausalLM")
    assert f"lacks weights that a Hugging Face {model} computes with: ['layers.w_gate']" in str(error.value)
    assert "\n" not in str(error.value)
