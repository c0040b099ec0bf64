"""tools/export_hf.py: transformers loads the exported checkpoint with every weight used, its
logits (torch, CPU, float32) match seqax's forward pass within bfloat16 rounding, and its
tokenizer encodes to the ids the dataset holds."""

import dataclasses

import jax
import numpy as np
import pytest
from omegaconf import OmegaConf

import train
from fixtures import forward_logits, make_mesh, perturbed_weights, prepared_dataset, tiny_config
from seqax.checkpoint import Checkpointer
from seqax.shardlib.shardtypes import make_shardings
from seqax.tokenizer import dataset_tokenizer
from tools import export_hf

TEXT = ("the quick brown fox jumps over the lazy dog. " * 20
        + "pack my box with five dozen liquor jugs; sphinx of black quartz, judge my vow.")

# seqax multiplies bfloat16 operands (8-bit mantissa, relative rounding 2^-9) with float32 sums;
# transformers runs float32 throughout. Each matmul input is rounded once, so every logit is off
# by about 2^-9 x sqrt(number of roundings on its path) x its scale; with logits of size ~1-5 on
# this tiny model that is a few 1e-2 at most. The bound: 5e-2 + 2e-2 x |logit|.
ATOL, RTOL = 5e-2, 2e-2

pytestmark = pytest.mark.slow  # a dataset, a checkpoint, an export and torch


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
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

    cfg = tiny_config("model.n_kv=2", f"dataset.path={data}", f"paths.root_working_dir={root}")
    run_dir = root / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(dataclasses.asdict(cfg)))
    weights = perturbed_weights(cfg)
    checkpointer = Checkpointer(str(run_dir / "checkpoints"), cfg.checkpoints)
    checkpointer.save(3, train.fresh_state(weights))
    checkpointer.close()
    export_hf.main(["--run-dir", str(run_dir), "--output", str(root / "hf")])
    return cfg, jax.device_get(weights), str(root / "hf"), data


def seqax_logits(cfg, weights, inputs: np.ndarray) -> np.ndarray:
    """train.forward on one document per row, on a 4x2 mesh."""
    mesh = make_mesh(4, 2)
    starts = np.zeros(inputs.shape, bool)
    starts[:, 0] = True
    with jax.set_mesh(mesh):
        return np.asarray(forward_logits(cfg.model)(jax.device_put(weights, make_shardings(train.Model, mesh)),
                                                    inputs, starts))


def test_transformers_loads_every_weight_and_matches_seqax_logits(exported):
    import torch  # required (requirements-dev.txt); imported here so that collecting the fast tier does not pay for it
    import transformers

    cfg, weights, hf_dir, _ = exported
    model, info = transformers.LlamaForCausalLM.from_pretrained(hf_dir, output_loading_info=True, dtype=torch.float32)
    assert not any(info.values()), info  # missing, unexpected and mismatched keys, errors
    rng = np.random.default_rng(0)
    inputs = rng.integers(1, cfg.model.vocab, size=(4, 16)).astype(np.uint32)
    inputs[:, 0] = 0  # begin of document
    with torch.no_grad():
        theirs = model(torch.from_numpy(inputs.astype(np.int64))).logits.numpy()
    ours = seqax_logits(cfg, weights, inputs)
    diff = np.abs(theirs - ours)
    print(f"max |logit difference| {diff.max():.3g}, max |logit| {np.abs(ours).max():.3g}")
    assert np.all(diff <= ATOL + RTOL * np.abs(ours)), diff.max()
    assert np.mean(theirs.argmax(-1) == ours.argmax(-1)) > 0.9


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
