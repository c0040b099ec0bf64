"""An independent, unsharded implementation of the seqax model and loss, for checking.

Written from the math, not from train.py: per-head loops of plain matmuls, a dense mask built
from document ids, log_softmax for the loss. It follows the same precision policy (bf16 matmul
operands, f32 accumulation) so that sharded and unsharded results differ only by the order of
float32 sums.
"""

import jax
import jax.numpy as jnp
import numpy as np

bf16, f32 = jnp.bfloat16, jnp.float32


def mm(a, b):
    """bf16 x bf16 -> f32 matrix product on the last/first dimensions."""
    return jnp.matmul(a.astype(bf16), b.astype(bf16), preferred_element_type=f32)


def norm(x, w, eps):
    return x / jnp.sqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps) * w


def rotate(x, pos, base):
    """RoPE on [L, D] with positions [L]: pairs (i, i + D/2) rotated by pos / base^(2i/D)."""
    half = x.shape[-1] // 2
    freq = 1.0 / base ** (np.arange(half) * 2.0 / x.shape[-1])
    ang = pos[:, None].astype(f32) * freq[None, :]
    a, b = x[:, :half], x[:, half:]
    return jnp.concatenate([a * jnp.cos(ang) - b * jnp.sin(ang), a * jnp.sin(ang) + b * jnp.cos(ang)], axis=-1)


def sequence_losses(w, cfg, tokens, starts):
    """Next-token loss at every position of one row. tokens: [L] int, starts: [L] bool."""
    L = tokens.shape[0]
    prev = jnp.concatenate([jnp.zeros((1,), tokens.dtype), tokens[:-1]])
    inputs = jnp.where(starts, 0, prev)
    doc = jnp.cumsum(starts.astype(jnp.int32))
    first = jax.lax.associative_scan(jnp.maximum, jnp.where(starts, jnp.arange(L), 0))
    pos = jnp.arange(L) - first
    allowed = (doc[:, None] == doc[None, :]) & (jnp.arange(L)[:, None] >= jnp.arange(L)[None, :])

    x = w["embed"][inputs]
    K, Q, D = cfg["n_kv"], cfg["n_q_per_kv"], cfg["d_head"]
    for layer in w["layers"]:
        h = norm(x, layer["attn_norm"], cfg["norm_eps"]).astype(bf16)
        M = h.shape[-1]
        # One projection for all heads, then split: query head (q, kv) uses kv head kv.
        qs = mm(h, layer["w_q"].reshape(M, Q * K * D)).reshape(L, Q, K, D)
        ks = mm(h, layer["w_k"].reshape(M, K * D)).reshape(L, K, D)
        vs = mm(h, layer["w_v"].reshape(M, K * D)).reshape(L, K, D).astype(bf16)
        outputs = []
        for qh in range(Q):
            for kv in range(K):
                q = rotate(qs[:, qh, kv], pos, cfg["rope_base"]).astype(bf16)
                k = rotate(ks[:, kv], pos, cfg["rope_base"]).astype(bf16)
                scores = jnp.where(allowed, mm(q, k.T) / np.sqrt(D), -jnp.inf)
                outputs.append(mm(jax.nn.softmax(scores, axis=-1), vs[:, kv]).astype(bf16))
        attn = mm(jnp.stack(outputs, axis=1).reshape(L, Q * K * D), layer["w_o"].reshape(Q * K * D, M))
        x = x + attn
        h = norm(x, layer["ffn_norm"], cfg["norm_eps"]).astype(bf16)
        g = mm(h, layer["w_gate"]).astype(bf16)
        u = mm(h, layer["w_up"]).astype(bf16)
        # in float32, rounded once, as train.py
        x = x + mm((jax.nn.silu(g.astype(f32)) * u).astype(bf16), layer["w_down"])
    h = norm(x, w["final_norm"], cfg["norm_eps"])
    logp = jax.nn.log_softmax(mm(h, w["unembed"]), axis=-1)
    return -jnp.take_along_axis(logp, tokens[:, None].astype(jnp.int32), axis=-1)[:, 0]


def loss(w, cfg, targets, is_seq_start, loss_mask):
    """Mean next-token cross-entropy over the tokens where loss_mask is True."""
    per_token = jax.vmap(lambda tokens, starts: sequence_losses(w, cfg, tokens, starts))(targets, is_seq_start)
    return jnp.sum(per_token * loss_mask) / np.sum(loss_mask)


def weights_to_dicts(model, n_layers):
    """train.Model (stacked layers) -> nested dicts with a list of per-layer dicts."""
    fields = lambda obj: {k: np.asarray(v) for k, v in vars(obj).items()}  # noqa: E731
    layers = fields(model.layers)
    return {
        "embed": np.asarray(model.embed),
        "final_norm": np.asarray(model.final_norm),
        "unembed": np.asarray(model.unembed),
        "layers": [{k: v[i] for k, v in layers.items()} for i in range(n_layers)],
    }
