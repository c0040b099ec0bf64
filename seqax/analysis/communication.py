"""What a training step sends between devices: the collectives of the compiled step's HLO, each
counted as often as it runs (a while loop's body `trip count` times), as bytes that one device
sends, and the time those bytes take over a given link. It reads what the code does, so a change
to the model or the optimizer needs no change here (docs/observability.md derives the same bytes
by hand, as a cross-check).

Bytes one device sends per collective over a group of g devices (ring algorithms, which NCCL,
ICI and gloo use for large messages): all-gather and reduce-scatter (g-1)/g of the gathered
(or scattered) full array, all-reduce twice that, all-to-all (g-1)/g of its operand (it keeps
one block of g), a permute its whole operand. A ragged all-to-all (a mixture of experts' rows) sends
only the rows its sizes say, which the program does not show: it is counted as (g-1)/g of the
smaller of its operand and its output buffer, what it sends when the rows spread evenly over the
group (the buffers are sized for the worst load). A collective over a group of one device sends
nothing. The figures are per step and per device.
"""

import collections
import dataclasses
import re

from seqax.analysis import hardware, hlo

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "ragged-all-to-all", "collective-permute")
# How the dtype of the bytes on the wire is shown. On a CPU all_gather_cast sends bfloat16 values as their
# uint16 bits (XLA:CPU would widen a bfloat16 collective to float32; shardlib/bits.py).
SHOWN_DTYPE = {"u16": "bf16 (as u16 bits)"}

@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str  # one of KINDS
    dtype: str  # HLO element type of what is sent
    group: int  # devices in each group
    bytes_sent: float  # by one device, each time it runs
    runs: int  # times per step (loop trip counts applied)


def array_bytes(shape: str) -> tuple[str, int]:
    """(dtype of its first array, bytes of all) of an HLO shape such as 'f32[16,64]{1,0}', or of a tuple."""
    found = hlo.arrays(shape)
    return (found[0][0] if found else "?"), hlo.shape_bytes(shape)


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


def collective_shape(inst: hlo.Instruction, operand_shapes: list[str]) -> str:
    """The shape whose bytes a collective moves: a permute's operands (an asynchronous one's result
    tuple also holds its context scalars), an all-reduce's result, and for the others their result,
    which an asynchronous start writes as ((operands...), (results...))."""
    kind = inst.opcode.removesuffix("-start")
    if kind == "collective-permute":
        return "(" + ", ".join(operand_shapes) + ")"
    if kind == "ragged-all-to-all":  # the rows (operand) and the buffer they land in (output): a balanced load's
        return min(operand_shapes[:2], key=hlo.shape_bytes)
    elements = hlo.tuple_elements(inst.shape)
    if inst.opcode.endswith("-start") and kind != "all-reduce" and len(elements) > 1:
        elements = elements[len(elements) // 2 :]
    return "(" + ", ".join(elements) + ")"


def step_collectives(hlo_text: str) -> list[Collective]:
    """Every collective of a compiled step (Compiled.as_text()) with how often it runs per step (a
    while body's count multiplied by its trip count: hlo.runs_per_call). A collective inside a loop of
    unknown trip count (a fori_loop with a traced bound) is an error naming the loop's body, since
    its bytes would be a guess."""
    computations = hlo.parse_hlo(hlo_text)
    runs, uncounted = hlo.runs_per_call(computations)
    found = []
    for name, times in runs.items():
        shapes = {i.name: i.shape for i in computations[name].instructions}
        for inst in computations[name].instructions:
            kind = inst.opcode.removesuffix("-start")
            if kind not in KINDS:
                continue
            if name in uncounted:
                raise ValueError(f"{inst.name} in {name} runs inside a while loop of unknown trip count")
            shape = collective_shape(inst, [shapes.get(o, "") for o in inst.operands])
            group = group_size(inst.attributes)
            dtype, size = array_bytes(shape)
            if kind == "reduce-scatter":
                size *= group  # the result is one device's slice; the ring moves the whole array
            if kind == "collective-permute":
                group = 2
            found.append(Collective(kind, dtype, group, sent_bytes(kind, size, group) if group > 1 else 0.0, times))
    return found


def totals(collectives: list[Collective]) -> dict[tuple[str, str], float]:
    """Bytes sent per device per step by (kind, dtype)."""
    out: collections.Counter = collections.Counter()
    for c in collectives:
        out[(c.kind, c.dtype)] += c.bytes_sent * c.runs
    return dict(out)


def report(title: str, collectives: list[Collective]) -> str:
    """The communication report: bytes per device per step by collective and dtype, read from the
    compiled step's HLO (step_collectives), and the time their total takes at each link bandwidth."""
    MiB = 2**20
    sent, runs = totals(collectives), collections.Counter()
    for c in collectives:
        runs[(c.kind, c.dtype)] += c.runs
    lines = [f"Communication per device per step of the training step: {title}", "",
             f"  {'collective':<18} {'dtype':<20} {'runs per step':>14} {'sent (HLO, loops counted)':>30}"]
    for key in sorted(sent):
        shown = SHOWN_DTYPE.get(key[1], key[1])
        lines.append(f"  {key[0]:<18} {shown:<20} {runs[key]:14d} {sent[key] / MiB:26.3f} MiB")
    total = sum(sent.values())
    lines.append(f"  {'total':<54} {total / MiB:26.3f} MiB")
    lines += ["", "Time to send the total at a link's bandwidth per device (no overlap with compute assumed):"]
    lines += [f"  {name:<52} {bandwidth / 1e9:6.0f} GB/s  {total / bandwidth * 1e3:9.3f} ms"
              for name, bandwidth in hardware.LINK_BANDWIDTH]
    return "\n".join(lines) + "\n"
