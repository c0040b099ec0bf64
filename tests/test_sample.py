"""sample.py: greedy decoding with the KV cache picks exactly the tokens that full forward passes
without a cache pick; seeded sampling is reproducible; the command line prints text from a
trained byte-level run."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from omegaconf import OmegaConf

import sample
import train
from fixtures import (
    ROOT,
    forward_logits,
    make_mesh,
    prepared_dataset,
    run_overrides,
    run_train,
    synthetic_dataset,
    tiny_config,
    tiny_overrides,
    train_args,
)
from seqax import config, runs
from seqax.data.flat_tokens import open_flat_tokens
from seqax.shardlib.shardtypes import make_shardings

PROMPTS = [[], [5, 17, 3], [200, 9, 9, 41, 77, 130, 2, 8, 250, 64, 11]]
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def model():
    cfg = tiny_config("model.n_kv=2")
    return cfg.model, jax.device_get(train.init_weights(cfg.model, jax.random.key(0)))


def greedy_without_cache(h: config.ModelConfig, weights, mesh, prompt: list[int], steps: int) -> list[int]:
    """Greedy decoding by a full forward pass (train.forward, the training model) over the whole
    sequence for every new token. The sequence is padded to whole attention blocks: causal
    attention keeps the padding from changing the logits of the positions before it."""
    d = mesh.shape["d"]
    length = -(-(len(prompt) + 1 + steps) // h.attention_block) * h.attention_block  # whole attention blocks
    starts = np.zeros((d, length), bool)
    starts[:, 0] = True
    logits_of = forward_logits(h)
    sequence = [0, *prompt]
    with jax.set_mesh(mesh):
        w = jax.device_put(weights, make_shardings(train.Model, mesh))
        for _ in range(steps):
            inputs = np.zeros((d, length), np.uint32)
            inputs[:, : len(sequence)] = sequence
            logits = np.array(logits_of(w, inputs, starts)[0, len(sequence) - 1])
            logits[0] = -np.inf  # 0 is never a target; sample.py does not choose it either
            sequence.append(int(np.argmax(logits)))
    return sequence[len(prompt) + 1 :]


@pytest.mark.slow
@pytest.mark.parametrize("d,t", [(1, 1), (4, 2)])
def test_greedy_with_kv_cache_matches_full_forward_passes(model, d, t):
    h, weights = model
    mesh = make_mesh(d, t)
    w = jax.device_put(weights, make_shardings(train.Model, mesh))
    for prompt in PROMPTS:
        expected = greedy_without_cache(h, weights, mesh, prompt, NEW_TOKENS)
        tokens = sample.generate(h, w, mesh, prompt, num_samples=3, max_new_tokens=NEW_TOKENS)
        assert tokens.shape == (3, NEW_TOKENS)
        for row in tokens:
            assert row.tolist() == expected, (prompt, row.tolist(), expected)


@pytest.mark.slow
def test_generation_keeps_at_most_two_steps_in_flight(model, monkeypatch):
    """Each decoding step is dispatched only once the step two before it has finished: on XLA:CPU,
    multi-device steps queued ahead of busy devices deadlocked their collectives (41 steps on a loaded
    2-core machine; XLA aborts the process after its rendezvous timeout)."""
    h, weights = model
    mesh = make_mesh(4, 2)
    waited, dispatched = set(), []
    wait = jax.block_until_ready
    monkeypatch.setattr(jax, "block_until_ready", lambda x: (waited.add(id(x)), wait(x))[1])

    def decode_step(*args, **kwargs):
        assert all(id(tokens) in waited for tokens in dispatched[:-1]), len(dispatched)
        tokens, cache = step(*args, **kwargs)
        dispatched.append(tokens)
        return tokens, cache

    step = sample.decode_step
    monkeypatch.setattr(sample, "decode_step", decode_step)
    sample.generate(h, jax.device_put(weights, make_shardings(train.Model, mesh)), mesh, [5, 17], 2, 40)
    assert len(dispatched) == 40


@pytest.mark.slow
def test_a_mixture_of_experts_generates_as_its_full_forward_passes():
    """sample.py's cached decoding routes each new token as the training model routes it in a full
    forward pass (4 experts, 2 a token, a nonzero selection bias): the same greedy tokens."""
    cfg = tiny_config("model.n_kv=2", "+model.experts=4", "+model.experts_per_token=2", "+model.expert_d_ff=32",
                      "+model.expert_block=8")
    w = train.init_weights(cfg.model, jax.random.key(0))
    bias = jax.random.normal(jax.random.key(1), w.layers.expert_bias.shape)
    weights = jax.device_get(train.Model(w.embed, train.Layer(**{**vars(w.layers), "expert_bias": bias}),
                                         w.final_norm, w.unembed))
    mesh = make_mesh(4, 2)
    placed = jax.device_put(weights, make_shardings(train.Model, mesh))
    for prompt in PROMPTS[1:]:
        expected = greedy_without_cache(cfg.model, weights, mesh, prompt, NEW_TOKENS)
        tokens = sample.generate(cfg.model, placed, mesh, prompt, num_samples=2, max_new_tokens=NEW_TOKENS)
        assert all(row.tolist() == expected for row in tokens), (prompt, tokens, expected)


@pytest.mark.slow
def test_seeded_sample_is_reproducible(model):
    h, weights = model
    mesh = make_mesh(4, 2)
    w = jax.device_put(weights, make_shardings(train.Model, mesh))
    draw = lambda seed, n: sample.generate(h, w, mesh, [7, 8, 9], num_samples=n, max_new_tokens=8,  # noqa: E731
                                           temperature=1.0, top_k=50, seed=seed)
    first = draw(3, 5)
    assert np.array_equal(first, draw(3, 5))
    assert np.array_equal(first[:2], draw(3, 2))  # a sample does not depend on how many are drawn
    assert not np.array_equal(first, draw(4, 5))
    assert len({tuple(row) for row in first}) > 1  # the samples of one call differ


def test_choose_tokens_keeps_to_top_k_and_valid_ids():
    logits = jnp.array([[9.0, 1.0, 5.0, 4.0, 3.0, 8.0]] * 64)
    chosen = np.asarray(sample.choose_tokens(logits, jax.random.key(0), jnp.uint32(0), temperature=1.0, top_k=2,
                                             max_token_id=4))
    assert set(chosen.tolist()) == {2, 3}  # 0 is not a target and 5 is above max_token_id


@pytest.fixture(scope="module")
def text_run(tmp_path_factory):
    """A tiny byte-level model trained for 40 steps on this repository's docs by `python -m train`
(a child process: a training run's profiler, threads and signal handler stay out of this one)."""
    root = tmp_path_factory.mktemp("text")
    data = prepared_dataset(root / "docs.zarr", os.path.join(ROOT, "docs"), os.path.join(ROOT, "README.md"),
                            "--suffixes", ".md", "--txt-documents", "paragraph", "--validation-documents", "8")
    result = run_train(["--config-name=local_test_text", *run_overrides(root, data, "text"),
        "model.d_model=64", "model.d_head=16", "model.d_ff=128", "model.vocab=264", "training.tokens.batch=8",
        "training.tokens.len=64", "training.steps=40", "training.warmup_steps=4", "training.learning_rate=1e-2",
        "eval_batches=0", "mesh.d=4", "mesh.t=2", "dataset.streams=1"],
        graph=False)  # sampling reads the checkpoint and config.yaml, not training_step.svg (fixtures.child_env)
    assert result.returncode == 0, result.stderr[-3000:]
    return str(root / "text")


@pytest.mark.slow
def test_command_line_prints_text(text_run, capsys):
    sample.main(["--run-dir", text_run, "--prompt", "The ", "--max-new-tokens", "40", "--num-samples", "2",
                 "--temperature", "0.7", "--top-k", "10", "--seed", "1"])
    out = capsys.readouterr().out
    texts = out.split("--- sample ")[1:]
    assert len(texts) == 2, out
    for text in texts:
        body = text.split("\n", 1)[1]
        assert body.startswith("The ") and len(body) > len("The \n"), body
        # \ufffd: a byte that is not UTF-8
        text_like = sum(c.isprintable() and c != "\ufffd" or c in "\n\t" for c in body)
        assert text_like >= 0.9 * len(body), body
    print(out, file=sys.stderr)


@pytest.mark.slow
def test_a_run_trained_before_attention_blocks_still_loads(text_run, tmp_path):
    """A config.yaml written before model.attention_block existed loads (the key is training's
    alone; one block of the training length stands in) and samples."""
    old = tmp_path / "old_run"
    old.mkdir()
    os.symlink(os.path.join(text_run, "checkpoints"), old / "checkpoints", target_is_directory=True)
    config = OmegaConf.load(os.path.join(text_run, "config.yaml"))
    del config.model["attention_block"]
    OmegaConf.save(config, old / "config.yaml")
    h = runs.load_run_config(str(old))
    assert h.model.attention_block == h.seq_len
    sample.main(["--run-dir", str(old), "--prompt", "a", "--max-new-tokens", "3", "--seed", "0"])


@pytest.fixture(scope="module")
def synthetic_run(tmp_path_factory):
    """A tiny model trained for 10 steps on the synthetic dataset (no text tokenizer), as `make
    train` trains one, by `python -m train` in a child process."""
    root = tmp_path_factory.mktemp("synthetic")
    data = synthetic_dataset(root / "synthetic.zarr", "--train-tokens", "20000", "--validation-tokens", "2000")
    result = run_train(train_args(root, data, "synthetic",
                                  *tiny_overrides("training.steps=10", "eval_batches=0", "checkpoint_interval=10")),
                       graph=False)
    assert result.returncode == 0, result.stderr[-3000:]
    return str(root / "synthetic")


@pytest.mark.slow
def test_prompt_ids_on_a_run_without_a_text_tokenizer_print_ids(synthetic_run, capsys):
    prompt = [2, 10, 11, 12, 1]  # the copy task, three symbols, the separator
    sample.main(["--run-dir", synthetic_run, "--prompt-ids", *map(str, prompt), "--max-new-tokens", "5",
                 "--temperature", "0", "--num-samples", "2"])
    run = runs.load_run_config(synthetic_run)
    mesh = runs.run_mesh(run.model, train.Model, None, None)
    _, weights = runs.load_weights(synthetic_run, run, mesh, train.init_weights, train.Model)
    largest = open_flat_tokens(run.dataset_path).max_token_id
    expected = sample.generate(run.model, weights, mesh, prompt, num_samples=1, max_new_tokens=5,
                               max_token_id=largest)[0].tolist()
    assert all(1 <= t <= largest for t in expected)
    out = capsys.readouterr().out
    assert out == "".join(f"--- sample {i}\n{' '.join(map(str, prompt + expected))}\n" for i in range(2)), out


@pytest.mark.slow
@pytest.mark.parametrize("args,message", [
    (["--prompt-ids", "5", "70"], "--prompt-ids 70 is outside 1..69"),
    (["--prompt-ids", "0"], "--prompt-ids 0 is outside 1..69"),
    (["--prompt", "hello"],
     "has no text tokenizer to encode --prompt; give the prompt as token ids with --prompt-ids"),
], ids=["above", "zero", "text"])
def test_a_prompt_the_data_cannot_hold_is_refused_in_one_line(synthetic_run, capsys, args, message):
    with pytest.raises(SystemExit) as exit:
        sample.main(["--run-dir", synthetic_run, *args])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("seqax: error: ") and message in err and err.count("\n") == 1, err


def test_prompt_and_prompt_ids_exclude_each_other(capsys):
    with pytest.raises(SystemExit) as exit:
        sample.main(["--run-dir", "nowhere", "--prompt", "a", "--prompt-ids", "3"])
    assert exit.value.code == 2 and "not allowed with argument" in capsys.readouterr().err
