"""The export checks itself: transformers runs the written directory, seqax runs train.forward, both
in float32 on a few rows, and their logits must agree to float32 rounding (logits_bound), or the
export is refused. tools/export_hf.py calls check_logits before the directory replaces anything, so
a model that the written class does not compute (a changed activation, say, under the same weight
names) is never exported: the check compares the math, where hf_tensors only compares names."""

import dataclasses
import math
import warnings

import jax
import numpy as np

import train
from seqax.config import ConfigError, DatasetError, ModelConfig
from seqax.data.flat_tokens import open_flat_tokens
from seqax.optional import require
from seqax.shardlib.shardtypes import bool_, f32, typed_shard_map, u32

ROWS, LENGTH = 4, 32  # tokens the check runs: a few seconds of both models on a CPU
UNIT_ROUNDOFF = 2.0**-24  # float32's


def check_rows(dataset: str, data_vocab: int, vocab: int, rows: int) -> np.ndarray:
    """Inputs [rows, LENGTH]: each a document's begin (token 0) then LENGTH - 1 tokens, the first of
    the dataset's training split (any dataset's, even a short one: repeated), or ids drawn below
    `data_vocab` where the dataset cannot be read or holds an id the model has no row for."""
    count = rows * (LENGTH - 1)
    try:
        split = open_flat_tokens(dataset).splits["train"]
        tokens = split.read("encoded_tokens", 0, min(count, split.num_tokens)) >> 1  # the id, without is_start
    except DatasetError:
        tokens = np.zeros(0, np.uint32)
    if not tokens.size or tokens.max() >= vocab:
        tokens = np.random.default_rng(0).integers(1, max(data_vocab, 2), count)
    inputs = np.zeros((rows, LENGTH), np.uint32)
    inputs[:, 1:] = np.resize(tokens, (rows, LENGTH - 1))
    return inputs


def seqax_logits(arch: ModelConfig, weights: train.Model, mesh, inputs: np.ndarray) -> np.ndarray:
    """train.forward's logits [rows, LENGTH, V] of one document a row, in float32 (matmuls too), on
    `mesh`, which holds `weights`. Attention by the readable kernel, the specification that the fast ones are
    tested against (a GPU's Pallas kernel would multiply float32 in TF32; on a CPU it runs only interpreted),
    in one block a row: kernels and blocks change speed, not the math."""
    arch = dataclasses.replace(arch, matmul_dtype="float32", attention_kernel="reference",
                               attention_block=inputs.shape[1])

    @jax.jit
    @typed_shard_map
    def logits(w: train.Model, inputs: u32[b"B/d L/c"], is_seq_start: bool_[b"B/d L/c"]) -> f32[b"B/d L/c V/t"]:
        return train.forward(arch, w, inputs, is_seq_start)[0]

    starts = np.zeros(inputs.shape, bool)
    starts[:, 0] = True
    with jax.set_mesh(mesh), jax.default_matmul_precision("highest"):  # GPUs would use TF32 for float32 operands
        return np.asarray(logits(weights, inputs, starts))


def transformers_logits(directory: str, class_name: str, inputs: np.ndarray) -> np.ndarray:
    """The logits [rows, LENGTH, V] of the exported model in `directory`, loaded by transformers in float32.
    A weight the class did not read or did not find stops the export (it would be dropped, or left at init)."""
    torch = require("torch", "the export's logits check")
    transformers = require("transformers", "the export's logits check")
    # Its notes, warnings (torch's for d_ff 0's empty shared expert) and progress bar, all on stderr, would
    # bury the export's line; they are set back after.
    verbosity, bar = transformers.logging.get_verbosity(), transformers.logging.is_progress_bar_enabled()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, info = getattr(transformers, class_name).from_pretrained(directory, dtype=torch.float32,
                                                                             output_loading_info=True)
    finally:
        transformers.logging.set_verbosity(verbosity)
        if bar:
            transformers.logging.enable_progress_bar()
    unread = {kind: keys for kind, keys in info.items() if keys}
    if unread:
        raise ConfigError(f"transformers' {class_name} does not load the exported weights as written: {unread}; "
                          "tools/export_hf.py's hf_tensors and hf_config disagree with the class (fix them)")
    with torch.no_grad():
        return model(torch.from_numpy(inputs.astype(np.int64))).logits.numpy()


def longest_sum(arch: ModelConfig, length: int) -> int:
    """The most terms any single sum of the forward pass adds: a matmul's contraction or attention's keys."""
    return max(arch.d_model, arch.d_ff, arch.n_q_per_kv * arch.n_kv * arch.d_head, arch.expert_d_ff, length)


def logits_bound(arch: ModelConfig, length: int, largest_logit: float) -> float:
    """How far apart two float32 computations of the same logits may be. Both sides differ only in the
    order of their sums and in their exp, rsqrt and sigmoid (each within a few units of float32 rounding
    u = 2^-24). A sum of n terms added in another order moves by about sqrt(n) u of its size (rounding
    errors add up as a random walk: Higham & Mary 2019), n at most longest_sum. A logit ends a chain of
    such sums: in each block about 8 one after another (norm, the q/k/v projections, attention's scores
    and weighted sum, the output projection, the MLP's gate/up and down), and the final norm and the
    unembedding; each block's error stays in the residual stream. So they differ by at most about
    8 (layers + 1) sqrt(n) u |logit|, and we allow twice that: for the local models (2 layers, n <= 1024)
    1e-4 of the largest logit, where another function (an activation, a norm) moves logits by a good part
    of their size."""
    return 16 * (arch.layers + 1) * math.sqrt(longest_sum(arch, length)) * UNIT_ROUNDOFF * largest_logit


def check_logits(directory: str, class_name: str, arch: ModelConfig, weights: train.Model, mesh, dataset: str,
                 data_vocab: int) -> str:
    """One line saying how far the logits of the export in `directory` (transformers' `class_name`) are
    from train.forward's with `weights` (on `mesh`), or a ConfigError naming where they disagree."""
    inputs = check_rows(dataset, data_vocab, arch.vocab, -(-ROWS // mesh.shape["d"]) * mesh.shape["d"])
    theirs, ours = transformers_logits(directory, class_name, inputs), seqax_logits(arch, weights, mesh, inputs)
    gap = np.abs(theirs.astype(np.float64) - ours)
    bound = logits_bound(arch, LENGTH, float(np.abs(ours).max()))
    row, position, token = np.unravel_index(np.argmax(gap), gap.shape)
    shape = f"{inputs.shape[0]} x {inputs.shape[1]} tokens (float32, bound {bound:.1e})"
    if not gap.max() <= bound:  # (a NaN on either side fails too)
        raise ConfigError(f"the exported {class_name} computes other logits than train.forward: largest gap "
                          f"{gap.max():.3g} (row {row}, position {position}, logit of id {token}) over {shape}; "
                          "train.py's model is not the one tools/export_hf.py writes (a changed activation, norm "
                          "or attention?): change train.py or the export; nothing was written")
    return f"logits check: largest gap {gap.max():.1e} over {shape}"
