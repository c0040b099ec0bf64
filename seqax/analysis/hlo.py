"""The optimized HLO text of a compiled program (`Compiled.as_text()`), parsed: its computations,
their instructions (name, result shape, opcode, operands, the computations each calls, a while
loop's trip count, the attributes as written), how many times each computation runs per call of
the program, and the byte size of an array shape. The communication report, the HLO graph and
the roofline read the HLO through this module only.

Why text: `as_text()` is public and its format is stable across XLA releases and backends (CPU,
GPU, TPU); JAX has no public API for the HLO module's structure.
"""

import collections
import json
import math
import re
from dataclasses import dataclass, field

import numpy as np

_COMPUTATION = re.compile(r"^(ENTRY )?%(\S+) .*\{$")
_INSTRUCTION = re.compile(r"^\s+(ROOT )?%(\S+) = (.*)$")
_OPCODE = re.compile(r"(?:^|[\s}\])])([a-z][a-z0-9\-]*)\(")
_ARRAY = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+[a-z]*)?)\[([\d,]*)\]")  # f8e4m3fn: a float8 type
# Attributes that name computations an instruction runs: a fusion's or a call's body, a while
# loop's body (its condition is left out: it computes nothing a report counts), the branches of a
# conditional, the computation a reduction or scatter applies to each element pair (to_apply).
_CALLED = re.compile(r"\b(?:calls|body|to_apply|true_computation|false_computation)=%([\w.\-]+)")
_BRANCHES = re.compile(r"\bbranch_computations=\{([^}]*)\}")

# Bytes per element, by HLO element type (and the names jax prints for the same types:
# bool, i8, i16, i32, i64, f8_e4m3fn, f8_e5m2).
ELEMENT_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
                 "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8, "c64": 8, "c128": 16,
                 "bool": 1, "i8": 1, "i16": 2, "i32": 4, "i64": 8, "f8_e4m3fn": 1, "f8_e5m2": 1}


@dataclass
class Instruction:
    name: str
    shape: str  # the result's shape as written: "f32[16,64]{1,0}", or a tuple "(f32[2], u32[])"
    opcode: str
    operands: list[str]
    calls: list[str]  # computations it runs (fusion body, while body, branches, ...)
    trip_count: int | None = None  # a while loop's, when the compiler wrote it down (GPU, CPU)
    attributes: str = ""  # everything after the operands, as written
    arguments: str = ""  # what the parentheses hold, as written (a constant's value)

    @property
    def op_name(self) -> str:
        """JAX's name of the operation the instruction came from ('jit(training_step)/.../dot_general')."""
        match = re.search(r'op_name="([^"]*)"', self.attributes)
        return match.group(1) if match else ""

    @property
    def stack_frame(self) -> int:
        """The id of the instruction's Python stack (Module.stacks), 0 if it has none."""
        match = re.search(r"stack_frame_id=(\d+)", self.attributes)
        return int(match.group(1)) if match else 0

    @property
    def backend_config(self) -> dict:
        """The instruction's backend_config (JSON), {} if it has none."""
        start = self.attributes.find("backend_config={")
        if start < 0:
            return {}
        start += len("backend_config=")
        return json.loads(self.attributes[start : _matching(self.attributes, start, "{", "}") + 1])

    def attribute(self, name: str) -> str | None:
        """The value of `name=...` as written, up to the next comma outside brackets (a quoted value
        without its quotes), or None."""
        match = re.search(rf"(?:^|[\s,]){name}=", self.attributes)
        if not match:
            return None
        value, depth = "", 0
        for char in self.attributes[match.end() :]:
            if char == "," and depth == 0:
                break
            depth += 1 if char in "([{" else -1 if char in ")]}" else 0
            value += char
        return value.strip().strip('"')


@dataclass(frozen=True)
class WindowDimension:
    """One spatial dimension of a convolution's window, as XLA defines it: `size` taps, `rhs_dilation`
    apart, slide `stride` apart over the input with `lhs_dilation - 1` holes between its elements and
    `pad_low`, `pad_high` positions added at its ends (negative: cut off)."""

    size: int
    stride: int = 1
    pad_low: int = 0
    pad_high: int = 0
    lhs_dilation: int = 1
    rhs_dilation: int = 1


def window(inst: Instruction) -> list[WindowDimension]:
    """A convolution's window, one entry per spatial dimension, from its text:
    `window={size=3x4 stride=2x1 pad=3_1x2_-1 lhs_dilate=2x1 rhs_dilate=1x3 rhs_reversal=0x1}`, where a
    field at its default for every dimension is left out (a reversal reorders the taps: nothing counts it).
    [] when it has none (no spatial dimension)."""
    fields = dict(item.split("=", 1) for item in (inst.attribute("window") or "").strip("{}").split())
    if "size" not in fields:
        return []

    def each(key: str, default: str) -> list[str]:
        return fields[key].split("x") if key in fields else [default] * len(fields["size"].split("x"))

    return [WindowDimension(int(size), int(stride), int(pad.split("_")[0]), int(pad.split("_")[1]), int(lhs), int(rhs))
            for size, stride, pad, lhs, rhs in zip(each("size", "1"), each("stride", "1"), each("pad", "0_0"),
                                                   each("lhs_dilate", "1"), each("rhs_dilate", "1"))]


def dim_labels(inst: Instruction) -> tuple[str, str, str]:
    """A convolution's dimension labels, `dim_labels=b01f_01io->b01f`: (input, kernel, output), a letter
    per dimension in order: b batch, f feature (i, o the kernel's input and output features), a digit the
    spatial dimension of that number (the window's dimension of that index)."""
    text = inst.attribute("dim_labels")
    match = re.fullmatch(r"([a-z0-9]+)_([a-z0-9]+)->([a-z0-9]+)", text or "")
    if not match:
        raise ValueError(f"convolution {inst.name} has no dim_labels=INPUT_KERNEL->OUTPUT (it has {text!r})")
    return match.group(1), match.group(2), match.group(3)


@dataclass
class Computation:
    name: str
    is_entry: bool
    instructions: list[Instruction] = field(default_factory=list)


def _matching(text: str, start: int, opening: str = "(", closing: str = ")") -> int:
    """The index of the bracket that closes the one at `start`."""
    depth = 0
    for i in range(start, len(text)):
        depth += 1 if text[i] == opening else -1 if text[i] == closing else 0
        if depth == 0:
            return i
    return len(text)


def parse_instruction(name: str, rest: str) -> Instruction:
    """One instruction from its line after `%name = `."""
    match = _OPCODE.search(rest)
    opcode = match.group(1)
    close = _matching(rest, match.end() - 1)
    operands = re.findall(r"%([\w.\-]+)", rest[match.end() : close])
    attributes = rest[close + 1 :]
    calls = _CALLED.findall(attributes)
    for branches in _BRANCHES.findall(attributes):
        calls += re.findall(r"%([\w.\-]+)", branches)
    trip = re.search(r'"known_trip_count":\{"n":"(\d+)"', attributes)
    shape = rest[: match.start(1)].strip()
    return Instruction(name, shape, opcode, operands, calls, int(trip.group(1)) if trip else None, attributes,
                       rest[match.end() : close])


@dataclass
class Module:
    computations: dict[str, Computation]
    stacks: dict[int, list[tuple[str, str, int]]]  # stack frame id -> (file, function, line), innermost first

    def stack(self, frame: int) -> list[tuple[str, str, int]]:
        return self.stacks.get(frame, [])


def parse_module(text: str) -> Module:
    """The computations of an HLO module's text and the Python stacks its instructions came from."""
    return Module(parse_hlo(text), _stacks(text))


def _table(text: str, name: str) -> dict[int, str]:
    """A numbered table of the module's text ('FileNames', 'StackFrames', ...): id -> its line's rest."""
    match = re.search(rf"^{name}\n(.*?)(?:\n\n|\Z)", text, re.M | re.S)
    rows = (line.split(" ", 1) for line in match.group(1).splitlines()) if match else ()
    return {int(number): rest for number, rest in rows}


def _stacks(text: str) -> dict[int, list[tuple[str, str, int]]]:
    """The stack of every frame of the module's StackFrames table. A frame is a file location and a
    parent: the frame that called it, whose id is parent_frame_id - 1 (0: none)."""
    files = {k: v.strip('"') for k, v in _table(text, "FileNames").items()}
    functions = {k: v.strip('"') for k, v in _table(text, "FunctionNames").items()}
    locations = {}
    for k, v in _table(text, "FileLocations").items():
        fields = dict(re.findall(r"(\w+)=(\d+)", v))
        locations[k] = (files.get(int(fields["file_name_id"]), "?"),
                        functions.get(int(fields["function_name_id"]), "?"), int(fields["line"]))
    frames = {k: {key: int(value) for key, value in re.findall(r"(\w+)=(\d+)", v)}
              for k, v in _table(text, "StackFrames").items()}
    stacks: dict[int, list[tuple[str, str, int]]] = {}
    for frame in frames:
        stack, seen, current = [], set(), frame
        while current in frames and current not in seen:
            seen.add(current)
            stack.append(locations.get(frames[current]["file_location_id"], ("?", "?", 0)))
            current = frames[current]["parent_frame_id"] - 1
        stacks[frame] = stack
    return stacks


def parse_hlo(text: str) -> dict[str, Computation]:
    """The computations of an HLO module's text, by name."""
    computations: dict[str, Computation] = {}
    current = None
    lines = iter(text.splitlines())
    for line in lines:
        if current is None:
            header = _COMPUTATION.match(line)
            if header:
                current = computations[header.group(2)] = Computation(header.group(2), bool(header.group(1)))
        elif line.startswith("}"):
            current = None
        else:
            instruction = _INSTRUCTION.match(line)
            if instruction:
                written = instruction.group(3)
                # An attribute may hold line breaks (a Pallas kernel's frontend_attributes: its metadata as
                # JSON on lines of its own): the instruction goes on until its brackets close. Read line by
                # line, its rest was lost, and a continuation starting with '}' ended the computation.
                while _open_brackets(written) > 0 and (more := next(lines, None)) is not None:
                    written += "\n" + more
                current.instructions.append(parse_instruction(instruction.group(2), written))
    return computations


def _open_brackets(text: str) -> int:
    """How many of text's brackets ({[( ) ]}) are open at its end, outside quoted strings."""
    bare = _QUOTED.sub("", text)
    return sum(bare.count(c) for c in "{[(") - sum(bare.count(c) for c in ")]}")


_QUOTED = re.compile(r'"(?:[^"\\]|\\.)*"')


def entry(computations: dict[str, Computation]) -> Computation:
    return next(c for c in computations.values() if c.is_entry)


def loop_trips(loop: Instruction, computation: Computation, computations: dict[str, Computation]) -> int | None:
    """How many times a while loop runs: the trip count the compiler wrote down (GPU and CPU do),
    else read from the loop (the TPU compiler writes none): its condition compares a counter of its
    state (plus a constant) with a constant bound, its body adds a constant step to that counter (1,
    or 2 to 4 in an unrolled loop), and the counter starts at the constant the loop's initial tuple
    holds there, each directly or inside fusions. None when the bound or step is not a constant (a
    loop whose length depends on data) or the loop would not end."""
    if loop.trip_count is not None:
        return loop.trip_count
    condition = computations.get((loop.attribute("condition") or "").lstrip("%"))
    body = computations.get(loop.calls[0]) if loop.calls else None
    if condition is None or body is None or not condition.instructions or not body.instructions:
        return None
    test = _value(condition.instructions[-1].name, condition, computations, _loop_state)
    if test is None or test[0] != "compare" or None in test[2:]:
        return None
    _, direction, counter, bound = test
    if counter[0] == "constant":  # `N > counter`: the counter on the left, `counter < N`
        counter, bound, direction = bound, counter, _FLIPPED.get(direction)
    if counter[0] != "counter" or bound[0] != "constant":
        return None
    _, index, offset = counter
    update = _element(body.instructions[-1].name, index, body, computations, _loop_state)
    if update is None or update[:2] != ("counter", index):
        return None
    init = _element(loop.operands[0], index, computation, computations, lambda _: None) if loop.operands else None
    start = init[1] if init is not None and init[0] == "constant" else 0  # scan's and fori_loop's start at 0
    return _trips(start + offset, update[2], bound[1], direction)


def _loop_state(number: int) -> tuple | None:
    """The parameters of a loop's condition and body: the loop's state."""
    return ("state",) if number == 0 else None


# A comparison with its operands swapped.
_FLIPPED = {"LT": "GT", "GT": "LT", "LE": "GE", "GE": "LE", "EQ": "EQ", "NE": "NE"}
# Operations that pass a loop counter on unchanged.
_SAME_VALUE = {"copy", "convert", "bitcast", "reshape"}
_SCALAR = re.compile(r"[a-z]+\d*\[\]")


def _trips(start: int, step: int, bound: int, direction: str | None) -> int | None:
    """How many times `for (i = start; i <direction> bound; i += step)` runs; None if it does not end
    (or ends only when i overflows)."""
    if direction in ("LE", "GE"):  # i <= N is i < N + 1, i >= N is i > N - 1
        bound, direction = bound + (1 if direction == "LE" else -1), direction[0] + "T"
    if direction == "LT":
        return 0 if start >= bound else None if step <= 0 else -((start - bound) // step)
    if direction == "GT":
        return 0 if start <= bound else None if step >= 0 else -((bound - start) // -step)
    if direction == "NE":
        distance = bound - start
        return 0 if distance == 0 else distance // step if step and distance % step == 0 and distance * step > 0 \
            else None
    if direction == "EQ":
        return 0 if start != bound else 1 if step else None
    return None


def _value(name: str, computation: Computation, computations: dict[str, Computation], parameters) -> tuple | None:
    """What a scalar of a loop's condition or body is, in terms of the loop's state: ("constant", c),
    ("counter", i, c) (the state's element i plus c), ("compare", direction, a, b), ("state",) (the
    state itself); None when it is anything else. `parameters(number)`: what the computation's
    parameter of that number is (a fusion body's: its operand's value, found when asked: a fusion
    that increments the counter may have large operands of its own)."""
    inst = next((i for i in computation.instructions if i.name == name), None)
    if inst is None or inst.opcode not in ("parameter", "get-tuple-element") and not _SCALAR.match(inst.shape):
        return None  # a counter is a scalar: what computes arrays is not followed
    if inst.opcode == "parameter":
        return parameters(int(inst.arguments))
    if inst.opcode == "constant":
        return ("constant", int(inst.arguments)) if re.fullmatch(r"-?\d+", inst.arguments) else None
    if inst.opcode == "get-tuple-element":
        return _element(inst.operands[0], int(inst.attribute("index")), computation, computations, parameters)
    if inst.opcode == "fusion" and inst.calls and inst.calls[0] in computations:
        body = computations[inst.calls[0]]
        return _value(body.instructions[-1].name, body, computations, _operands(inst, computation, computations,
                                                                                parameters))
    if inst.opcode not in _SAME_VALUE | {"compare", "add", "subtract"}:
        return None
    operands = [_value(o, computation, computations, parameters) for o in inst.operands]
    if inst.opcode in _SAME_VALUE and operands:
        return operands[0]
    if inst.opcode == "compare" and len(operands) == 2:
        return ("compare", inst.attribute("direction"), *operands)
    if inst.opcode in ("add", "subtract") and len(operands) == 2 and None not in operands:
        (a, *x), (b, *y) = operands
        sign = 1 if inst.opcode == "add" else -1
        if a == "counter" and b == "constant":
            return ("counter", x[0], x[1] + sign * y[0])
        if a == "constant" and b == "counter" and sign == 1:
            return ("counter", y[0], y[1] + x[0])
        if a == b == "constant":
            return ("constant", x[0] + sign * y[0])
    return None


def _element(name: str, index: int, computation: Computation, computations: dict[str, Computation],
             parameters) -> tuple | None:
    """_value of element `index` of the tuple `name`: the loop's state, a tuple, or a fusion's tuple."""
    inst = next((i for i in computation.instructions if i.name == name), None)
    if inst is None:
        return None
    if inst.opcode == "tuple" and index < len(inst.operands):
        return _value(inst.operands[index], computation, computations, parameters)
    if inst.opcode == "fusion" and inst.calls and inst.calls[0] in computations:
        body = computations[inst.calls[0]]
        return _element(body.instructions[-1].name, index, body, computations,
                        _operands(inst, computation, computations, parameters))
    return ("counter", index, 0) if _value(name, computation, computations, parameters) == ("state",) else None


def _operands(fusion: Instruction, computation: Computation, computations: dict[str, Computation], parameters):
    """The parameters of a fusion's body: its operands' values, each found when asked."""
    return lambda number: (_value(fusion.operands[number], computation, computations, parameters)
                           if number < len(fusion.operands) else None)


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
            trips = loop_trips(inst, computations[name], computations) if loop else None
            for called in inst.calls:
                visit(called, times * (trips or 1) if loop else times, path + (name,),
                      unknown or (loop and trips is None))

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


def tuple_elements(shape: str) -> list[str]:
    """The top-level elements of a tuple shape as written ('(a, (b, c))' gives ['a', '(b, c)']); a
    shape that is not a tuple is its own one element."""
    shape = re.sub(r"/\*index=\d+\*/", "", shape.strip())
    if not shape.startswith("("):
        return [shape]
    inner, elements, depth, start = shape[1 : _matching(shape, 0)], [], 0, 0
    for i, char in enumerate(inner):
        depth += 1 if char in "([{" else -1 if char in ")]}" else 0
        if char == "," and depth == 0:
            elements.append(inner[start:i].strip())
            start = i + 1
    return elements + [inner[start:].strip()] if inner.strip() else elements


def shape_bytes(shape: str) -> int:
    """Bytes of all the arrays of a shape as written ('f32[16,64]{1,0}', '(bf16[2], u32[])')."""
    return sum(math.prod(dims) * element_bytes(dtype) for dtype, dims in arrays(shape))


def spaced_arrays(shape: str) -> list[tuple[str, tuple[int, ...], int]]:
    """(element type, dimensions, memory space) of every array in a shape as written: the space is the
    S(n) of its layout ('bf16[8,128]{1,0:T(8,128)S(1)}'), 0 (the device's main memory) when it names none."""
    return [(dtype, tuple(int(d) for d in dims.split(",") if d), int(space or 0))
            for dtype, dims, space in _SPACED_ARRAY.findall(shape) if dtype in ELEMENT_BYTES]


_SPACED_ARRAY = re.compile(_ARRAY.pattern + r"(?:\{[^{}]*?S\((\d+)\)[^{}]*\})?")


def shape_bytes_outside(shape: str, spaces: frozenset[int]) -> int:
    """Bytes of the arrays of a shape whose memory space is not one of `spaces` (shape_bytes if empty)."""
    if not spaces:
        return shape_bytes(shape)
    return sum(math.prod(dims) * element_bytes(dtype) for dtype, dims, space in spaced_arrays(shape)
               if space not in spaces)


def replica_groups(inst: Instruction) -> list[list[int]]:
    """The device groups of a collective: '{{0,1},{2,3}}', the iota form '[2,2]<=[4]' (arange(4)
    reshaped to [2, 2], its rows the groups) with an optional transpose '[4,2]<=[2,4]T(1,0)', or the
    mesh form (newer XLA) "mesh['a'=2,'b'=4] {'b'}" (mesh_groups). A collective without groups (or
    '{}') is one group of every device: [] here."""
    text = inst.attribute("replica_groups") or inst.attribute("source_target_pairs") or ""
    if text.startswith("{"):
        return [[int(d) for d in group.split(",") if d] for group in re.findall(r"\{([\d,]*)\}", text[1:-1])]
    if text.startswith("mesh["):
        return mesh_groups(text)
    match = re.fullmatch(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
    if not match:
        if text:
            raise ValueError(f"{inst.name}: replica groups written as {text!r}, a form not read here")
        return []
    shape, dims = [int(d) for d in match.group(1).split(",")], [int(d) for d in match.group(2).split(",")]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if match.group(3):
        ids = ids.transpose([int(p) for p in match.group(3).split(",")])
    return ids.reshape(-1, shape[-1]).tolist()


def mesh_groups(text: str) -> list[list[int]]:
    """The groups of "mesh['a'=2,'b'=4] {'b'}": devices 0..7 laid out row-major over the mesh's axes,
    one group for each position on the axes not named, its devices along the named axes in their order.
    A named sub-axis "'b':(2)2" is part of b: b viewed as [2, 2, rest] (its major 2 first), the middle."""
    match = re.fullmatch(r"mesh\[([^\]]*)\]\s*\{([^}]*)\}", text.strip())
    if not match:
        raise ValueError(f"replica groups written as {text!r}, a mesh form not read here")
    axes = [(name, int(size)) for name, size in re.findall(r"'([^']+)'=(\d+)", match.group(1))]
    named = [(name, int(pre) if pre else None, int(size) if size else None)
             for name, pre, size in re.findall(r"'([^']+)'(?::\((\d+)\)(\d+))?", match.group(2))]
    sizes, part_at = [], {}  # each axis split at its named sub-axes' edges, its major part first
    for name, size in axes:
        cuts = {1, size} | {p for n, pre, sub in named if n == name and pre for p in (pre, pre * sub)}
        ordered = sorted(cuts)
        for low, high in zip(ordered, ordered[1:]):
            part_at[(name, low)] = len(sizes)
            sizes.append(high // low)
    grouped = []
    for name, pre, _ in named:
        if pre is None:  # the whole axis
            grouped += [i for (n, _), i in sorted(part_at.items()) if n == name]
        else:
            grouped.append(part_at[(name, pre)])
    rest = [a for a in range(len(sizes)) if a not in grouped]
    ids = np.arange(math.prod(sizes)).reshape(sizes).transpose(rest + grouped)
    return ids.reshape(-1, math.prod(sizes[a] for a in grouped)).tolist()
