"""The export used the ordinary transformers way, end to end, on a run trained here on a dataset
prepared with a tokenizer.json (trained in this process; no hub access): `tok(text)` gives the
begin-of-document id 0 and the dataset's ids (not the tokenizer's own special tokens), the
model's logits on them match train.forward's in float32 to float32 rounding, and greedy
`model.generate(**tok(text, return_tensors="pt"))` picks sample.py's greedy tokens."""

import dataclasses
import json
import os

import jax
import numpy as np
import pytest

import sample
import train
from fixtures import forward_logits, make_mesh, prepared_dataset, run_overrides, run_train
from seqax import runs
from seqax.data.tokenizer import dataset_tokenizer
from tools import export_hf
from tools.export_check import logits_bound

SENTENCES = ["the quick brown fox jumps over the lazy dog.", "pack my box with five dozen liquor jugs.",
             "sphinx of black quartz, judge my vow.", "how vexingly quick daft zebras jump!"]
PARAGRAPHS = [" ".join(SENTENCES[(i + j) % 4] for j in range(3)) for i in range(40)]
PROMPTS = ["the quick brown", "pack my box with five", "sphinx"]
NEW_TOKENS = 8

pytestmark = pytest.mark.slow  # a tokenizer, a dataset, 40 training steps, an export and torch


def llama3_like_tokenizer():
    """Byte-level BPE whose post-processor adds its own <s> (as Llama 3's adds <|begin_of_text|>):
    the dataset was encoded without it, so the export must not add it either."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(PARAGRAPHS, trainers.BpeTrainer(vocab_size=170, special_tokens=["[UNK]", "<s>", "</s>"],
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])])
    return tok


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("usage")
    tok = llama3_like_tokenizer()
    tok.save(str(root / "tokenizer.json"))
    (root / "text.txt").write_text("\n\n".join(PARAGRAPHS))
    data = prepared_dataset(root / "data.zarr", str(root / "text.txt"), "--tokenizer", str(root / "tokenizer.json"),
                            "--eos-token", "</s>", "--txt-documents", "paragraph", "--validation-documents", "2")
    vocab = dataset_tokenizer(data).vocab_size
    assert vocab < 512, vocab  # the model has spare rows above the data's ids: one becomes <seqax_pad>
    result = run_train(["--config-name=local_test_text", *run_overrides(root, data, "run"),
        "model.d_model=64", "model.d_head=16", "model.d_ff=128", "model.vocab=512", "model.attention_block=32",
        "training.tokens.batch=8", "training.tokens.len=64", "training.steps=40", "training.warmup_steps=4",
        "training.learning_rate=1e-2", "eval_batches=0", "mesh.d=4", "mesh.t=2", "dataset.streams=1"],
        graph=False)  # the export reads the checkpoint, not training_step.svg (fixtures.child_env)
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = str(root / "run")
    export_hf.main(["--run-dir", run_dir, "--output", str(root / "hf")])
    return run_dir, data, str(root / "hf")


def seqax_ids(data: str, text: str) -> list[int]:
    """The ids a document of `text` has in the dataset, without its end-of-document id."""
    ours = dataset_tokenizer(data)
    return [int(i) for i in ours.encode([text])[0] if int(i) != ours.eos_id]


def test_tokenizer_call_gives_begin_of_document_and_the_dataset_ids(exported):
    import transformers

    _, data, hf_dir = exported
    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    config = json.load(open(os.path.join(hf_dir, "config.json")))
    assert config["bos_token_id"] == tok.bos_token_id == 0
    assert (tok.pad_token == export_hf.PAD_TOKEN
            and config["pad_token_id"] == tok.pad_token_id == dataset_tokenizer(data).vocab_size)
    for text in PROMPTS:
        encoded = tok(text)
        assert encoded["input_ids"] == [0, *seqax_ids(data, text)]
        assert encoded["attention_mask"] == [1] * len(encoded["input_ids"])
        assert tok.decode(encoded["input_ids"], skip_special_tokens=True) == text
    batch = tok(PROMPTS, padding=True)  # padding uses <seqax_pad>, never 0, and the mask hides it
    for text, ids, mask in zip(PROMPTS, batch["input_ids"], batch["attention_mask"]):
        n = len(seqax_ids(data, text)) + 1
        assert [i for i, m in zip(ids, mask) if m] == [0, *seqax_ids(data, text)] and sum(mask) == n
        assert all(i == tok.pad_token_id for i, m in zip(ids, mask) if not m)


def test_logits_and_greedy_generate_match_seqax(exported):
    import torch
    import transformers

    run_dir, data, hf_dir = exported
    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)  # Llama, or Qwen3 (hf_class)
    run = runs.load_run_config(run_dir)
    mesh = make_mesh(4, 2)
    _, weights = runs.load_weights(run_dir, run, mesh, train.init_weights, train.Model)
    logits_of = forward_logits(dataclasses.replace(run.model, matmul_dtype="float32"))  # as the export's check
    largest = dataset_tokenizer(data).vocab_size - 1
    worst = 0.0
    for text in PROMPTS:
        inputs = tok(text, return_tensors="pt")
        ids = inputs["input_ids"][0].tolist()
        with torch.no_grad():
            theirs = model(**inputs).logits[0].numpy()
        # 4 rows for d=4, whole attention blocks; padding after the text leaves its logits alone
        rows = np.zeros((4, 64), np.uint32)
        rows[:, : len(ids)] = ids
        starts = np.zeros(rows.shape, bool)
        starts[:, 0] = True
        with jax.set_mesh(mesh):
            ours = np.asarray(logits_of(weights, rows, starts))[0, : len(ids)]
        gap, bound = np.abs(theirs - ours).max(), logits_bound(run.model, rows.shape[1], np.abs(ours).max())
        worst = max(worst, gap / bound)
        print(f"{text!r}: max |logit difference| {gap:.3g}, max |logit| {np.abs(ours).max():.3g}")
        assert gap <= bound, (gap, bound)

        generated = model.generate(**inputs, do_sample=False, max_new_tokens=NEW_TOKENS)[0, len(ids) :].tolist()
        expected = sample.generate(run.model, weights, mesh, ids[1:], num_samples=1, max_new_tokens=NEW_TOKENS,
                                   max_token_id=largest)[0].tolist()
        eos = dataset_tokenizer(data).eos_id
        if eos in expected:  # generate stops at the end of the document; sample.py runs on
            expected = expected[: expected.index(eos) + 1]
        print(f"{text!r}: generate {generated}, sample.py {expected}")
        assert generated == expected
    print(f"worst difference / bound {worst:.3f}")

