"""FLOPs of the model and of Muon's orthogonalization, read off the weights' shapes and annotations:
MFU's numerator (records.py, bench/) and the start-up report's FLOPs check (startup_report.py)."""

import dataclasses
import math

import jax

from seqax.muon_sharding import matrices_of, matrix_groups
from seqax.shardlib.shardtypes import leaf_dims


def model_flops_per_token(arch, seq_len: int, init_weights) -> float:
    """Training FLOPs per token of model config `arch` (train.init_weights(arch, key) gives the weights'
    shapes): 2 per multiply-add of every matrix a token goes through (the layers' weights of 2 or more
    dimensions, of a stack of experts' matrices (E first) only the experts_per_token of E a token goes to,
    the unembedding; the embedding is a lookup), plus attention's QK^T and PV over the causal half of the
    L x L scores (PaLM, app. B); x 3 for forward + backward. Norms, RoPE, softmax, routing, the optimizer,
    recomputation: left out (MFU, not HFU)."""
    w = jax.eval_shape(lambda: init_weights(arch, jax.random.key(0)))
    matrices = w.unembed.size
    for field, dims in zip(dataclasses.fields(w.layers), leaf_dims(type(w.layers)), strict=True):
        x = getattr(w.layers, field.name)
        if x.ndim > 2:  # layers and at least two more
            experts = dims[0].name == "E"
            matrices += x.size * arch.experts_per_token // max(arch.experts, 1) if experts else x.size
    layers, _, *heads = w.layers.w_q.shape  # heads: Q K D
    attention = layers * 2 * (2 * math.prod(heads) * seq_len) / 2  # QK^T and PV against every key, halved
    return 3.0 * (2 * matrices + attention)


def newton_schulz_flops(arch, devices: int, init_weights, muon: dict, steps: int) -> tuple[float, float]:
    """FLOPs of a step's Newton-Schulz iterations (`steps` a step) on the weights `muon` names
    (train.MUON: name -> muon_sharding.LayerMatrix), in all and on the busiest of `devices` (the first,
    which holds ceil(group's layers / devices) layers of every group: train.muon_update spreads the
    layers of each group of same-shaped weights, muon_sharding.matrix_groups, over the devices): per
    matrix, wide as r x c, each step multiplies X X^T (2 r^2 c), A A (2 r^3) and B X (2 r^2 c)."""
    w = jax.eval_shape(lambda: init_weights(arch, jax.random.key(0))).layers

    def per_layer(name):  # one layer's matrices of the weight (one per expert for the experts')
        matrices, *shape = matrices_of(getattr(w, name).shape[1:], muon[name])
        r, c = sorted(shape)
        return steps * matrices * (4 * r * r * c + 2 * r**3)

    total = busiest = 0
    for names in matrix_groups(muon, arch.layers, devices):
        total += arch.layers * sum(per_layer(name) for name in names)
        busiest += -(-arch.layers * len(names) // devices) * per_layer(names[0])
    return total, busiest
