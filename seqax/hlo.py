"""The optimized HLO text of a compiled program (`Compiled.as_text()`), parsed: its computations,
their instructions (name, result shape, opcode, operands, the computations each calls, a while
loop's trip count, the attributes as written), how many times each computation runs per call of
the program, and the byte size of an array shape. The communication report, the HLO graph and
the roofline read the HLO through this module only.

Why text: `as_text()` is public and its format is stable across XLA releases and backends (CPU,
GPU, TPU); JAX has no public API for the HLO module's structure.
"""

import collections
import math
import re
from dataclasses import dataclass, field

_COMPUTATION = re.compile(r"^(ENTRY )?%(\S+) .*\{$")
_INSTRUCTION = re.compile(r"^\s+(ROOT )?%(\S+) = (.*)$")
_OPCODE = re.compile(r"(?:^|[\s}\])])([a-z][a-z0-9\-]*)\(")
_ARRAY = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
# Attributes that name computations an instruction runs: a fusion's or a call's body, a while
# loop's body (its condition is left out: it computes nothing a report counts), the branches of a
# conditional, the computation a reduction or scatter applies to each element pair (to_apply).
_CALLED = re.compile(r"\b(?:calls|body|to_apply|true_computation|false_computation)=%([\w.\-]+)")
_BRANCHES = re.compile(r"\bbranch_computations=\{([^}]*)\}")

# Bytes per element, by HLO element type (and the names jax prints for the same types:
# bool, i8, i16, i32, i64).
ELEMENT_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
                 "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8, "c64": 8, "c128": 16,
                 "bool": 1, "i8": 1, "i16": 2, "i32": 4, "i64": 8}


@dataclass
class Instruction:
    name: str
    shape: str  # the result's shape as written: "f32[16,64]{1,0}", or a tuple "(f32[2], u32[])"
    opcode: str
    operands: list[str]
    calls: list[str]  # computations it runs (fusion body, while body, branches, ...)
    trip_count: int | None = None  # a while loop's, when XLA knows it
    attributes: str = ""  # everything after the operands, as written


@dataclass
class Computation:
    name: str
    is_entry: bool
    instructions: list[Instruction] = field(default_factory=list)


def _matching_paren(text: str, start: int) -> int:
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i
    return len(text)


def parse_instruction(name: str, rest: str) -> Instruction:
    """One instruction from its line after `%name = `."""
    match = _OPCODE.search(rest)
    opcode = match.group(1)
    close = _matching_paren(rest, match.end() - 1)
    operands = re.findall(r"%([\w.\-]+)", rest[match.end() : close])
    attributes = rest[close + 1 :]
    calls = _CALLED.findall(attributes)
    for branches in _BRANCHES.findall(attributes):
        calls += re.findall(r"%([\w.\-]+)", branches)
    trip = re.search(r'"known_trip_count":\{"n":"(\d+)"', attributes)
    shape = rest[: match.start(1)].strip()
    return Instruction(name, shape, opcode, operands, calls, int(trip.group(1)) if trip else None, attributes)


def parse_hlo(text: str) -> dict[str, Computation]:
    """The computations of an HLO module's text, by name."""
    computations: dict[str, Computation] = {}
    current = None
    for line in text.splitlines():
        if current is None:
            header = _COMPUTATION.match(line)
            if header:
                current = computations[header.group(2)] = Computation(header.group(2), bool(header.group(1)))
        elif line.startswith("}"):
            current = None
        else:
            instruction = _INSTRUCTION.match(line)
            if instruction:
                current.instructions.append(parse_instruction(instruction.group(2), instruction.group(3)))
    return computations


def entry(computations: dict[str, Computation]) -> Computation:
    return next(c for c in computations.values() if c.is_entry)


def runs_per_call(computations: dict[str, Computation]) -> tuple[dict[str, int], set[str]]:
    """How many times each computation reached from the entry runs when the program runs once: a
    while body its trip count times per run of the computation holding the loop, everything else
    (fusion bodies, both branches of a conditional) once per run of its caller. Also the names of
    the computations inside a loop of unknown trip count (counted as if it ran once)."""
    runs: collections.Counter = collections.Counter()
    uncounted: set[str] = set()

    def visit(name: str, times: int, path: tuple, unknown: bool):
        if name in path or name not in computations:
            return
        runs[name] += times
        if unknown:
            uncounted.add(name)
        for inst in computations[name].instructions:
            loop = inst.opcode == "while"
            for called in inst.calls:
                visit(called, times * (inst.trip_count or 1) if loop else times, path + (name,),
                      unknown or (loop and inst.trip_count is None))

    visit(entry(computations).name, 1, (), False)
    return dict(runs), uncounted


def element_bytes(dtype: str) -> int:
    """Bytes of one element of an HLO (or jax) element type name such as 'bf16' or 'pred'."""
    if dtype not in ELEMENT_BYTES:
        raise ValueError(f"unknown element type {dtype!r}")
    return ELEMENT_BYTES[dtype]


def arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    """(element type, dimensions) of every array in a shape as written: 'f32[16,64]{1,0}' or a tuple."""
    return [(dtype, tuple(int(d) for d in dims.split(",") if d)) for dtype, dims in _ARRAY.findall(shape)
            if dtype in ELEMENT_BYTES]


def shape_bytes(shape: str) -> int:
    """Bytes of all the arrays of a shape as written ('f32[16,64]{1,0}', '(bf16[2], u32[])')."""
    return sum(math.prod(dims) * element_bytes(dtype) for dtype, dims in arrays(shape))
