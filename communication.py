"""What a training step sends between devices: the collectives of the compiled step's HLO, each
counted as often as it runs (a while loop's body `trip count` times), as bytes that one device
sends, next to what a formula predicts and the time those bytes take over a given link.

Bytes one device sends per collective over a group of g devices (ring algorithms, which NCCL,
ICI and gloo use for large messages): all-gather and reduce-scatter (g-1)/g of the gathered
(or scattered) full array, all-reduce twice that, a permute its whole operand. A collective over
a group of one device sends nothing. The figures are per step and per device.
"""

import collections
import dataclasses
import math
import re

import hlo_graph
from config import Config

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute")
_ARRAY = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4,
            "f64": 8, "s64": 8, "u64": 8}
# How the dtype of the bytes on the wire is shown. all_gather_cast sends bfloat16 values as their
# uint16 bits (XLA:CPU would widen a bfloat16 collective to float32).
SHOWN_DTYPE = {"u16": "bf16 (as u16 bits)"}

# Per-device link bandwidth, one direction, bytes/s: what a device can send while all send.
LINK_BANDWIDTH = [
    # NVIDIA H100/H200 SXM: NVLink 4, 18 links x 25 GB/s per direction = 450 GB/s (900 GB/s both ways).
    ("NVLink 4 (H100/H200 SXM, within a node)", 450e9),
    # NVIDIA A100 SXM: NVLink 3, 12 links x 25 GB/s per direction = 300 GB/s.
    ("NVLink 3 (A100 SXM, within a node)", 300e9),
    # One 400 Gb/s InfiniBand NDR adapter per GPU (DGX H100): 50 GB/s per direction.
    ("InfiniBand NDR 400 Gb/s per GPU (between nodes)", 50e9),
    # Google Cloud TPU v5p: ICI 4,800 Gbps per chip (both ways, all links) = 300 GB/s per direction.
    ("TPU v5p ICI", 300e9),
]


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str  # one of KINDS
    dtype: str  # HLO element type of what is sent
    group: int  # devices in each group
    bytes_sent: float  # by one device, each time it runs
    runs: int  # times per step (loop trip counts applied)


def array_bytes(shape: str) -> tuple[str, int]:
    """(dtype, bytes) of an HLO shape such as 'f32[16,64]{1,0}', or of a tuple of them."""
    arrays = _ARRAY.findall(shape)
    return (arrays[0][0] if arrays else "?"), sum(
        math.prod(int(d) for d in dims.split(",") if d) * ITEMSIZE.get(t, 4) for t, dims in arrays)


def group_size(attributes: str) -> int:
    """Devices per group of a collective's replica_groups: '{{0,1},{2,3}}' or the iota form '[2,2]<=[4]'."""
    match = re.search(r"replica_groups=\{\{([\d,]*)\}", attributes)
    if match:
        return len(match.group(1).split(","))
    match = re.search(r"replica_groups=\[([\d,]+)\]<=", attributes)
    if match:
        return int(match.group(1).split(",")[-1])
    return 1


def sent_bytes(kind: str, full_bytes: int, group: int) -> float:
    """Bytes one device sends for a collective whose full (gathered, or pre-scatter) array has
    `full_bytes`, over `group` devices; for a permute, full_bytes is its operand."""
    if kind == "collective-permute":
        return float(full_bytes)
    share = (group - 1) / group
    return (2 if kind == "all-reduce" else 1) * share * full_bytes


def step_collectives(hlo_text: str) -> list[Collective]:
    """Every collective of a compiled step (Compiled.as_text()) with how often it runs: the
    computations reached from the entry, a while body's count multiplied by its trip count. A
    loop of unknown trip count (a fori_loop with a traced bound) holding a collective counts its
    body once and is named in the error raised, since the bytes would be a guess."""
    computations = hlo_graph.parse_hlo(hlo_text)
    lines = {}
    for line in hlo_text.splitlines():
        match = re.match(r"^\s+(?:ROOT )?%(\S+) = (.*)$", line)
        if match:
            lines[match.group(1)] = match.group(2)
    runs: collections.Counter = collections.Counter()

    def visit(name: str, times: int, path: tuple):
        if name in path or name not in computations:
            return
        runs[name] += times
        for inst in computations[name].instructions:
            for called in inst.calls:
                if (inst.opcode == "while" and inst.trip_count is None
                        and any(_holds_collective(computations, called, ()))):
                    raise ValueError(f"while loop {inst.name} runs collectives an unknown number of times")
                visit(called, times * (inst.trip_count or 1) if inst.opcode == "while" else times, path + (name,))

    entry = next(c.name for c in computations.values() if c.is_entry)
    visit(entry, 1, ())
    found = []
    for name, times in runs.items():
        for inst in computations[name].instructions:
            kind = inst.opcode.removesuffix("-start")
            if kind not in KINDS:
                continue
            text = lines[inst.name]
            shape = text.split(f" {inst.opcode}(")[0]
            if inst.opcode.endswith("-start") and shape.startswith("("):  # (operand, result): the result
                shape = shape[shape.rindex(", ") + 2 : -1] if kind != "collective-permute" else shape
            group = group_size(text)
            dtype, size = array_bytes(shape)
            if kind == "reduce-scatter":
                size *= group  # the result is one device's slice; the ring moves the whole array
            if kind == "collective-permute":
                group = 2
            found.append(Collective(kind, dtype, group, sent_bytes(kind, size, group) if group > 1 else 0.0, times))
    return found


def _holds_collective(computations: dict, name: str, path: tuple):
    if name in path or name not in computations:
        return
    for inst in computations[name].instructions:
        if inst.opcode.removesuffix("-start") in KINDS:
            yield True
        for called in inst.calls:
            yield from _holds_collective(computations, called, path + (name,))


def predicted_per_step(cfg: Config) -> dict[tuple[str, str], float]:
    """Bytes one device sends per step, by (collective, dtype), as train.py's code should send
    them (step_collectives reads what the compiled step does, for comparison). A ring collective
    over g devices sends (g-1)/g of the full array, an all-reduce twice that. FSDP over d and c:
    each layer weight is gathered twice (forward, and again by the backward pass's
    rematerialization) as bf16 (sent as u16 bits) and its gradient reduce-scattered once in f32;
    the embedding table goes in f32. TP over t: per layer the forward gathers the residual twice
    and scatters it twice, the backward regathers it twice and transposes all four; embedding and
    logits add one of each each way. The ring over c, per layer: the forward passes k, v (bf16,
    sent as u16 bits), doc_start and row_position c times (the rematerialization does not rerun
    attention: what its backward needs is saved), the backward c times more, and the f32 gradients of k and
    v c + 1 times (attention.ring_attention_backward); XLA hoists the forward's passes of
    doc_start and row_position out of the layers' loop (they are the same for every layer).
    Norm gradients and the scalars are all-reduced. Collectives that send nothing are left out."""
    h, (B, L), d, t, c = (cfg.model, (cfg.training.tokens.batch, cfg.training.tokens.len),
                          cfg.mesh.d, cfg.mesh.t, cfg.mesh.c)
    M, Q, K, D, F, V = h.d_model, h.n_q_per_kv, h.n_kv, h.d_head, h.d_ff, h.vocab
    over_dc, over_t, over_c, over_all = (d * c - 1) / (d * c), (t - 1) / t, (c - 1) / c, (d * t * c - 1) / (d * t * c)
    # elements per device once gathered over d and c
    layer_weights = (2 * M * Q * K * D + 2 * M * K * D + 3 * M * F) / t
    tokens = B // d * L // c  # of one device
    residual, kv = tokens * M * 4, tokens * K // t * D  # f32 bytes of x gathered over t; elements of k (or v)
    ring = (c > 1) * h.layers  # ring_pass does nothing over one device
    predicted = {
        ("all-gather", "u16"): (2 * h.layers * layer_weights + M * V / t) * 2 * over_dc,
        ("all-gather", "f32"): V / t * M * 4 * over_dc + (6 * h.layers + 2) * residual * over_t,
        ("all-gather", "u32"): B // d * L * 4 * over_c,  # whole_rows of the targets
        ("all-gather", "pred"): B // d * L * over_c,  # whole_rows of is_seq_start
        ("reduce-scatter", "f32"): (h.layers * layer_weights + 2 * V / t * M) * 4 * over_dc
                                   + (4 * h.layers + 2) * residual * over_t,
        ("all-reduce", "f32"): 2 * ((2 * h.layers + 1) * M * 4 * over_all + 3 * tokens * 4 * over_t
                                    + 4 * over_dc + 4 * over_all),
        ("collective-permute", "u16"): ring * 2 * c * 2 * kv * 2,
        ("collective-permute", "u32"): (ring + (c > 1)) * c * (tokens + L // c) * 4,
        ("collective-permute", "f32"): ring * (c + 1) * 2 * kv * 4,
    }
    return {key: value for key, value in predicted.items() if value}


def totals(collectives: list[Collective]) -> dict[tuple[str, str], float]:
    """Bytes sent per device per step by (kind, dtype)."""
    out: collections.Counter = collections.Counter()
    for c in collectives:
        out[(c.kind, c.dtype)] += c.bytes_sent * c.runs
    return dict(out)


def report(title: str, measured: dict[tuple[str, str], float], predicted: dict[tuple[str, str], float]) -> str:
    """The communication report: bytes per device per step by collective and dtype, from the HLO
    and from the formula, and the time the HLO's total takes at each link bandwidth."""
    MiB = 2**20
    lines = [f"Communication per device per step of the training step: {title}", "",
             f"  {'collective':<18} {'dtype':<20} {'HLO (loops counted)':>20} {'formula':>12} {'HLO / formula':>14}"]
    for key in sorted(set(measured) | set(predicted)):
        m, p = measured.get(key, 0.0), predicted.get(key, 0.0)
        ratio = f"{m / p:.3f}" if p else "-"
        lines.append(f"  {key[0]:<18} {SHOWN_DTYPE.get(key[1], key[1]):<20} {m / MiB:16.3f} MiB "
                     f"{p / MiB:8.3f} MiB {ratio:>14}")
    total_m, total_p = sum(measured.values()), sum(predicted.values())
    lines.append(f"  {'total':<39} {total_m / MiB:16.3f} MiB {total_p / MiB:8.3f} MiB "
                 f"{total_m / total_p if total_p else 0:14.3f}")
    lines += ["", "Time to send the HLO's total at a link's bandwidth per device (no overlap with compute assumed):"]
    lines += [f"  {name:<52} {bandwidth / 1e9:6.0f} GB/s  {total_m / bandwidth * 1e3:9.3f} ms"
              for name, bandwidth in LINK_BANDWIDTH]
    return "\n".join(lines) + "\n"
