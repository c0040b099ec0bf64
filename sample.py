"""Text from a checkpoint, generated with an explicit KV cache.

    python -m sample --run-dir runs/RUN (--prompt "def " | --prompt-ids 5 17 3) [--step N]
        [--max-new-tokens 200] [--temperature 0.8] [--top-k 40] [--seed 0] [--num-samples 4]
        [--mesh-d D --mesh-t T]

The run's config.yaml gives the model and the dataset, whose tokenizer encodes the prompt and
decodes the samples. --prompt-ids gives the prompt as token ids instead (1 to the dataset's
largest id; 0 is the begin of document), for any run: on a dataset without a text tokenizer
(the synthetic one) the samples are printed as ids, the prompt's first.
A sample is a new document: its inputs are token 0 (begin of document),
then the prompt's tokens, then each generated token. Prefill runs the prompt through the model
once and fills the cache; then every step feeds one token per sample and appends its keys and
values. The model's math is train.py's own (embed_tokens, transformer_layer, output_logits);
only the attention differs: over the KV cache, with attention.dense_attention.

Sharding: samples over `d` (padded up to a multiple of it), heads, d_ff and vocabulary over
`t`, as in training; the cache is typed like the weights, so its size per device is visible
and printed. Temperature 0 is greedy decoding. Sampling draws every sample's token from a key
of (seed, generated position, sample index), so a seeded sample is the same on any mesh and
for any --num-samples.
"""

import argparse
import math
import sys
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import train
from seqax.analysis import memory
from seqax.config import ConfigError, ModelConfig, SeqaxError, TokenizerError
from seqax.data.flat_tokens import open_flat_tokens
from seqax.data.tokenizer import dataset_tokenizer
from seqax.kernels.attention import causal_document_mask, dense_attention
from seqax.runs import load_run_config, load_weights, run_mesh
from seqax.shardlib.shardtypes import (
    Array,
    bf16,
    f32,
    make_shardings,
    pytree_dataclass,
    typechecked,
    typed_shard_map,
    u32,
)


@pytree_dataclass
class KVCache:
    """Keys (after RoPE) and values of every layer at cache positions S (one per input token)."""

    k: Array[b"layers", bf16[b"B/d S K/t D"]]
    v: Array[b"layers", bf16[b"B/d S K/t D"]]


def init_cache(arch: ModelConfig, batch: int, length: int, mesh) -> KVCache:
    @partial(jax.jit, out_shardings=make_shardings(KVCache, mesh))
    def zeros():
        shape = (arch.layers, batch, length, arch.n_kv, arch.d_head)
        return KVCache(jnp.zeros(shape, jnp.bfloat16), jnp.zeros(shape, jnp.bfloat16))

    return zeros()


@typechecked
def forward_cached(arch: ModelConfig, w: train.Model, cache: KVCache, inputs: u32[b"B/d L"],
                   start: u32[b""]) -> tuple[f32[b"B/d V/t"], KVCache]:
    """Runs inputs at cache positions [start, start + L): writes their keys and values into the
    cache and attends over the cache up to each position. Returns the logits of the last input."""
    B, L = inputs.shape
    S = cache.k.shape[2]
    position = start + jnp.arange(L, dtype=jnp.uint32)  # one document per row: RoPE position = cache position
    # Causal over the cache (positions after the last written one are in the future); one document.
    one_document = jnp.zeros((B, L), jnp.uint32), jnp.zeros((B, S), jnp.uint32)
    mask = causal_document_mask(position, jnp.arange(S, dtype=jnp.uint32), *one_document)
    rotation = train.rope_rotation(jnp.broadcast_to(position, (B, L)), arch.d_head, arch.rope_base)
    x = train.embed_tokens(w, inputs)

    def layer(x, weights_and_cache):
        w_layer, k_cache, v_cache = weights_and_cache

        def attend_over_cache(q, k, v):
            # The cache holds bfloat16 whatever model.matmul_dtype is (a float32 run's keys are rounded there).
            k_all = lax.dynamic_update_slice_in_dim(k_cache, k.astype(k_cache.dtype), start, axis=1)  # B S K D
            v_all = lax.dynamic_update_slice_in_dim(v_cache, v.astype(v_cache.dtype), start, axis=1)
            return dense_attention(q, k_all, v_all, mask), (k_all, v_all)

        x, cache, _ = train.transformer_layer(arch, x, w_layer, rotation, attend_over_cache)  # routing: training's
        return x, cache

    x, (k, v) = lax.scan(layer, x, (w.layers, cache.k, cache.v))
    unembed = train.gathered_unembedding(arch, w)
    return train.output_logits(arch, w.final_norm, unembed, x[:, -1:])[:, 0], KVCache(k, v)


def choose_tokens(logits, key, index, temperature: float, top_k: int, max_token_id: int):
    """Next tokens [B] from logits [B, V]: argmax at temperature 0, else a draw from
    softmax(logits / temperature) over the top_k largest (top_k 0: all). Only ids the data can
    hold are chosen (1..max_token_id: 0 is the begin-of-document input, never a target)."""
    ids = jnp.arange(logits.shape[-1])
    logits = jnp.where((ids >= 1) & (ids <= max_token_id), logits, -jnp.inf)
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.uint32)
    logits = logits / temperature
    if top_k:
        kth = lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits >= kth, logits, -jnp.inf)
    step_key = jax.random.fold_in(key, index)
    keys = jax.vmap(partial(jax.random.fold_in, step_key))(jnp.arange(logits.shape[0], dtype=jnp.uint32))
    return jax.vmap(jax.random.categorical)(keys, logits).astype(jnp.uint32)


@partial(jax.jit, static_argnames=("arch", "temperature", "top_k", "max_token_id"), donate_argnames=("cache",))
def decode_step(weights, cache, inputs, start, key, index, arch: ModelConfig, temperature: float, top_k: int,
                max_token_id: int):
    """Prefill (L = prompt length + 1) or one decoding step (L = 1): (next tokens [B, 1], cache)."""

    @typed_shard_map
    def on_device(w: train.Model, cache: KVCache, inputs: u32[b"B/d L"],
                  start: u32[b""]) -> tuple[f32[b"B/d V/t"], KVCache]:
        # Sampling runs with c = 1, but the weights' annotations split M over d and c, so every
        # value is typed as varying over c: a sum over c's one device types it as the same.
        return jax.tree.map(lambda x: lax.psum(x, "c"), forward_cached(arch, w, cache, inputs, start))

    logits, cache = on_device(weights, cache, inputs, start)
    return choose_tokens(logits, key, index, temperature, top_k, max_token_id)[:, None], cache


def cache_size(mesh, prompt_length: int, num_samples: int, max_new_tokens: int) -> tuple[int, int]:
    """(B, S) of the KV cache: samples padded to a multiple of `d`; token 0, the prompt and every
    generated token but the last (which is never an input)."""
    d = mesh.shape["d"]
    return math.ceil(num_samples / d) * d, 1 + prompt_length + max_new_tokens - 1


def generate(arch: ModelConfig, weights: train.Model, mesh, prompt: list[int], num_samples: int, max_new_tokens: int,
             temperature: float = 0.0, top_k: int = 0, seed: int = 0, max_token_id: int | None = None,
             verbose: bool = False) -> np.ndarray:
    """max_new_tokens tokens [num_samples, max_new_tokens] after the prompt's ids."""
    batch, length = cache_size(mesh, len(prompt), num_samples, max_new_tokens)
    inputs = np.tile(np.array([0, *prompt], np.uint32), (batch, 1))
    with jax.set_mesh(mesh):
        cache = init_cache(arch, batch, length, mesh)
        if verbose:
            shard = cache.k.sharding.shard_shape(cache.k.shape)
            print(f"KV cache: 2 x bf16{list(cache.k.shape)} (layers B S K D), per device 2 x bf16{list(shard)} = "
                  f"{2 * math.prod(shard) * 2 / 2**20:.2f} MiB", file=sys.stderr)
        settings = dict(arch=arch, temperature=float(temperature), top_k=int(top_k),
                        max_token_id=int(arch.vocab - 1 if max_token_id is None else max_token_id))
        key = jax.random.key(seed)
        tokens = jax.device_put(inputs, NamedSharding(mesh, P("d", None)))
        start, out = 0, []
        for i in range(max_new_tokens):
            step_inputs = tokens
            tokens, cache = decode_step(weights, cache, step_inputs, jnp.uint32(start), key, jnp.uint32(i), **settings)
            start += step_inputs.shape[1]
            out.append(tokens)
            if len(out) > 1:  # at most two steps in flight: XLA:CPU deadlocks when more queue up (docs/reliability.md)
                jax.block_until_ready(out[-2])
        return np.concatenate(jax.device_get(out), axis=1)[:num_samples]


def encode_prompt(tokenizer, text: str) -> list[int]:
    """The prompt's ids, refused unless they decode back to the prompt: a character the
    tokenizer drops or replaces would silently change what the samples continue."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # argv bytes that are not UTF-8 arrive as lone surrogates
        raise ConfigError(f"--prompt is not valid UTF-8 (byte {ord(text[e.start]) - 0xDC00:#04x} "
                          f"at character {e.start}); pass UTF-8 text") from None
    encode = lambda t: [int(i) for i in tokenizer.encode([t])[0] if int(i) != tokenizer.eos_id]  # noqa: E731
    if tokenizer.decode(encode(text)) != text:
        bad = next(i for i in range(1, len(text) + 1) if tokenizer.decode(encode(text[:i])) != text[:i]) - 1
        raise ConfigError(f"--prompt character {text[bad]!r} (U+{ord(text[bad]):04X}, at {bad}) cannot be encoded "
                          "by the run's tokenizer; leave it out")
    return encode(text)


def prompt_and_tokenizer(args, run) -> tuple[list[int], object, int]:
    """(prompt ids, the dataset's text tokenizer or None, the largest id a sample may hold)."""
    path = args.dataset or run.dataset_path
    if args.prompt_ids is None:
        try:
            tokenizer = dataset_tokenizer(path)
        except TokenizerError:
            raise TokenizerError(f"dataset {path!r} has no text tokenizer to encode --prompt; "
                                 "give the prompt as token ids with --prompt-ids") from None
        return encode_prompt(tokenizer, args.prompt), tokenizer, tokenizer.vocab_size - 1
    try:
        tokenizer = dataset_tokenizer(path)
        largest, where = tokenizer.vocab_size - 1, "the dataset's tokenizer"
    except TokenizerError:  # no text tokenizer: the ids the dataset holds
        tokenizer = None
        largest, where = (min(open_flat_tokens(path, check_seq_starts=False).max_token_id, run.model.vocab - 1),
                          f"dataset {path!r}")
    bad = [i for i in args.prompt_ids if not 1 <= i <= largest]
    if bad:
        raise ConfigError(f"--prompt-ids {bad[0]} is outside 1..{largest}, the ids of {where} "
                          "(0 is the begin of document, added before the prompt)")
    return list(args.prompt_ids), tokenizer, largest


def check_cache_fits(arch: ModelConfig, batch: int, length: int, mesh):
    """Refuses, before allocating it, a KV cache larger than the memory its devices have free."""
    shape = (arch.layers, batch, length, arch.n_kv, arch.d_head)
    shard = make_shardings(KVCache, mesh).k.shard_shape(shape)
    device = mesh.devices.flat[0]
    # CPU devices share the host's memory: the whole cache must fit; else each device its shard.
    need = 2 * 2 * math.prod(shape if device.platform == "cpu" else shard)  # k and v, bf16
    free = memory.free_memory(device)
    if need > free:
        raise ConfigError(f"the KV cache of {batch} samples x {length} positions needs {need / 2**30:.2f} GiB, "
                          f"more than the {free / 2**30:.2f} GiB free "
                          f"on {device.platform}; lower --max-new-tokens (or --num-samples, or the prompt)")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-dir", required=True, help="a run directory: config.yaml and checkpoints/")
    parser.add_argument("--step", type=int, help="checkpoint step (default: the newest)")
    prompt = parser.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", default="",
                        help="text the samples continue (default: none, a document from its start)")
    prompt.add_argument("--prompt-ids", type=int, nargs="+", metavar="ID",
                        help="the prompt as token ids (any dataset; without a text tokenizer samples print as ids)")
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-samples", type=int, default=1)
    parser.add_argument("--dataset",
                        help="the flat-tokens dataset whose tokenizer to use (default: the run's dataset.path)")
    parser.add_argument("--mesh-d", type=int,
                        help="devices over samples (with --mesh-t; default: the most t that fits)")
    parser.add_argument("--mesh-t", type=int, help="devices over heads, d_ff and vocabulary")
    args = parser.parse_args(argv)
    try:
        if args.max_new_tokens < 1 or args.num_samples < 1 or not 0 <= args.temperature < math.inf or args.top_k < 0:
            raise ConfigError("--max-new-tokens and --num-samples must be positive, "
                              "--temperature a finite number and not negative, --top-k not negative")
        run = load_run_config(args.run_dir)
        prompt, tokenizer, max_token_id = prompt_and_tokenizer(args, run)
        mesh = run_mesh(run.model, train.Model, args.mesh_d, args.mesh_t)
        check_cache_fits(run.model, *cache_size(mesh, len(prompt), args.num_samples, args.max_new_tokens), mesh)
        step, weights = load_weights(args.run_dir, run, mesh, train.init_weights, train.Model, args.step)
        trained_c = (f" (the run trained with mesh.c={run.trained_context_devices}; its weights do not depend on c)"
                     if run.trained_context_devices > 1 else "")
        mesh_shown = f"mesh d={mesh.shape['d']} t={mesh.shape['t']} c=1{trained_c}"
        print(f"checkpoint {step} of {args.run_dir}, {mesh_shown}, prompt of {len(prompt)} tokens", file=sys.stderr)
        top_k = min(args.top_k, run.model.vocab)
        tokens = generate(run.model, weights, mesh, prompt, args.num_samples, args.max_new_tokens, args.temperature,
                          top_k, args.seed, max_token_id=max_token_id, verbose=True)
    except SeqaxError as e:
        print(f"seqax: error: {e}", file=sys.stderr)
        sys.exit(2)
    for i, row in enumerate(tokens):
        print(f"--- sample {i}")
        if tokenizer is None:
            print(" ".join(str(int(t)) for t in [*prompt, *row]), flush=True)
            continue
        if tokenizer.eos_id is not None and tokenizer.eos_id in row:
            row = row[: list(row).index(tokenizer.eos_id)]  # the document ended there
        print((args.prompt if args.prompt_ids is None else tokenizer.decode(prompt)) + tokenizer.decode(row),
              flush=True)


if __name__ == "__main__":
    main()
