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
    x = x.astype(f32)
    return x / jnp.sqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps) * w


def rotate(x, pos, base):
    """RoPE on [L, D] with positions [L]: pairs (i, i + D/2) rotated by pos / base^(2i/D)."""
    half = x.shape[-1] // 2
    freq = 1.0 / base ** (np.arange(half) * 2.0 / x.shape[-1])
    ang = pos[:, None].astype(f32) * freq[None, :]
    a, b = x[:, :half], x[:, half:]
    return jnp.concatenate([a * jnp.cos(ang) - b * jnp.sin(ang), a * jnp.sin(ang) + b * jnp.cos(ang)], axis=-1)


def sequence_losses(w, cfg, tokens, starts):
    """Next-token loss at every position of one row, and each layer's routing (expert_weights'
    picked and scores). tokens: [L] int, starts: [L] bool."""
    L = tokens.shape[0]
    prev = jnp.concatenate([jnp.zeros((1,), tokens.dtype), tokens[:-1]])
    inputs = jnp.where(starts, 0, prev)
    doc = jnp.cumsum(starts.astype(jnp.int32))
    first = jax.lax.associative_scan(jnp.maximum, jnp.where(starts, jnp.arange(L), 0))
    pos = jnp.arange(L) - first
    allowed = (doc[:, None] == doc[None, :]) & (jnp.arange(L)[:, None] >= jnp.arange(L)[None, :])

    x = w["embed"][inputs]
    K, Q, D = cfg["n_kv"], cfg["n_q_per_kv"], cfg["d_head"]
    routing = []
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
        normed = norm(x, layer["ffn_norm"], cfg["norm_eps"])
        h = normed.astype(bf16)
        g = mm(h, layer["w_gate"]).astype(bf16)
        u = mm(h, layer["w_up"]).astype(bf16)
        # in float32, rounded once, as train.py
        x = x + mm((jax.nn.silu(g.astype(f32)) * u).astype(bf16), layer["w_down"]) + experts(layer, cfg, normed)
        routing.append(expert_weights(layer, cfg, normed)[1:])
    h = norm(x, w["final_norm"], cfg["norm_eps"])
    logp = jax.nn.log_softmax(mm(h, w["unembed"]), axis=-1)
    return -jnp.take_along_axis(logp, tokens[:, None].astype(jnp.int32), axis=-1)[:, 0], routing


def expert_weights(layer, cfg, h):
    """[L, E] weight of each expert at each position of a row: 0 unless it is one of the
    experts_per_token of highest sigmoid(h @ router) + expert_bias; the chosen weigh their sigmoids
    divided by the chosen's sum. h: the normed input [L, M] in float32."""
    scores = jax.nn.sigmoid(h @ layer["router"])
    _, chosen = jax.lax.top_k(scores + layer["expert_bias"], cfg["experts_per_token"])
    picked = jnp.sum(jax.nn.one_hot(chosen, scores.shape[-1], dtype=f32), axis=1)  # [L, E]: 1 where chosen
    return picked * scores / jnp.sum(picked * scores, axis=-1, keepdims=True), picked, scores


def experts(layer, cfg, normed):
    """The mixture of experts' output [L, M]: every expert on every position, weighed (mostly by 0)."""
    weights, _, _ = expert_weights(layer, cfg, normed)
    h = normed.astype(bf16)
    out = jnp.zeros(h.shape, f32)
    for e in range(layer["router"].shape[-1]):
        g = mm(h, layer["expert_gate"][e]).astype(bf16)
        u = mm(h, layer["expert_up"][e]).astype(bf16)
        out = out + weights[:, e : e + 1] * mm((jax.nn.silu(g.astype(f32)) * u).astype(bf16), layer["expert_down"][e])
    return out


def loss(w, cfg, targets, is_seq_start, loss_mask):
    """Mean next-token cross-entropy over the tokens where loss_mask is True."""
    per_token = jax.vmap(lambda tokens, starts: sequence_losses(w, cfg, tokens, starts)[0])(targets, is_seq_start)
    return jnp.sum(per_token * loss_mask) / np.sum(loss_mask)


def loads_and_balance(w, cfg, targets, is_seq_start):
    """Per layer: how many positions of the batch chose each expert [E] (padding too), and the
    sequence-wise balance loss (DeepSeek-V3, eq. 17-20): over rows, the mean of sum_i f_i P_i with
    f_i = E / (k L) x the row's positions that chose expert i, P_i = the row's mean of expert i's
    score divided by the sum of all experts' scores at that position."""
    routing = jax.vmap(lambda tokens, starts: sequence_losses(w, cfg, tokens, starts)[1])(targets, is_seq_start)
    result = []
    for picked, scores in routing:  # [B, L, E] each
        E, L, k = picked.shape[-1], picked.shape[1], cfg["experts_per_token"]
        f = E / (k * L) * jnp.sum(picked, axis=1)
        P = jnp.mean(scores / jnp.sum(scores, axis=-1, keepdims=True), axis=1)
        result.append((jnp.sum(picked, axis=(0, 1)), jnp.mean(jnp.sum(f * P, axis=-1))))
    return result


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
