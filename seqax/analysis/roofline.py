"""A roofline model of a compiled step: how long the target's own compiled program takes on the
target, kernel by kernel, read from its optimized HLO (hlo.py). docs/roofline.md explains it.

Every kernel the program launches (a fusion, a library call, a copy, a collective) runs as often as
the loops around it say (a while loop's trip count; a conditional's costlier branch: the busiest
device's). A compute kernel takes max(FLOPs / rate, bytes / memory bandwidth) plus a fixed launch
cost: matmul FLOPs (dots, from their shapes) at the device's matmul rate, every other arithmetic
operation one FLOP per element at its vector rate; bytes are what the kernel must read and write
(a dynamic slice reads its slice, an in-place update or scatter writes its update, not the whole buffer).
A kernel whose inside XLA cannot see (a Pallas call) costs the matmul FLOPs it states
(stated_flops) and its operands' and results' bytes. A collective moves what communication.py
says one device sends, at the bandwidth of the link its group spans (within a host, or across
hosts). The compiler runs asynchronous collectives (`*-start` ... `*-done`) beside the kernels:
they are exposed only for the time by which they exceed the step's compute; synchronous ones are
exposed whole. The step's time is its kernels' in sequence (one stream), plus exposed
communication.

It is a model, not a measurement: no caches, no kernel overlap, no autotuning (a deviceless
compile does not tune its kernels' tiles). It says where the time must go at best, which is
what the MFU ceiling is: model FLOPs / (the step's time x the device's peak).
"""

import dataclasses
import math
import re

from seqax.analysis import hlo
from seqax.analysis.communication import collective_shape, sent_bytes

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "ragged-all-to-all", "collective-permute")
# Data movement the compiler starts and waits for later (a DMA beside the kernels): a copy or slice between
# memories (a TPU prefetches into its VMEM so), a dynamic slice or update of a buffer in the host's memory
# (activations offloaded to the host and back).
TRANSFERS = ("copy-start", "slice-start", "dynamic-slice-start", "dynamic-update-slice-start")
TRANSFER_KINDS = ("host transfer", "device transfer")
HOST_MEMORY_SPACE = 5  # an array layout's S(5): the host's memory, reached over PCIe
# Instructions that move no data of their own: views, tuples, control (and an async op's update and done).
PLUMBING = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all", "partition-id",
            "replica-id", "opt-barrier", "add-dependency", "iota"}
# Operations that only move or view data inside a fusion: no FLOP.
DATA_MOVEMENT = {"parameter", "bitcast", "reshape", "broadcast", "transpose", "copy", "slice", "dynamic-slice",
                 "dynamic-update-slice", "concatenate", "pad", "tuple", "get-tuple-element", "constant", "iota",
                 "gather", "scatter", "reverse", "bitcast-convert"}
# A library call's name -> what it computes (GPU: cuBLAS matmuls, cuDNN fused attention).
MATMUL_CALLS = ("__cublas$gemm", "__cublas$lt$matmul")
ATTENTION_CALLS = ("__cudnn$fmha",)
# A kernel of our own (a Pallas call) states the matmul FLOPs it does in a name scope around it,
# since its HLO is opaque: `with jax.named_scope(stated_flops(n))`. Its op_name then holds the scope.
_STATED_FLOPS = re.compile(r"\bmatmul_flops=(\d+)")


def stated_flops(flops: int) -> str:
    """The name scope by which a kernel that XLA cannot look into states its matmul FLOPs per run."""
    return f"matmul_flops={int(flops)}"


@dataclasses.dataclass(frozen=True)
class Rates:
    """What one device can do, per second: the roofline's ceilings."""

    matmul_flops: float  # dense bf16 matmul FLOP/s
    vector_flops: float  # other arithmetic, FLOP/s (f32 on the vector units)
    memory_bandwidth: float  # bytes/s between the device's memory and its cores
    link_bandwidth: float  # bytes/s one device sends to the others of its host (NVLink, ICI)
    network_bandwidth: float  # bytes/s one device sends to devices of other hosts (InfiniBand, DCN)
    devices_per_host: int  # devices 0..n-1 share a host, n..2n-1 the next, ...
    launch_seconds: float = 0.0  # fixed cost of launching one kernel
    float8_matmul_flops: float = 0.0  # dense float8 matmul FLOP/s (0: no float8 units, priced as bf16)
    # Memory spaces (an array layout's S(n)) that are on the chip, not its HBM: a value there costs no memory
    # bandwidth (a TPU's VMEM, where XLA keeps small and soon reused values; its flags and scalar memory).
    on_chip_memory_spaces: frozenset[int] = frozenset()
    host_bandwidth: float = 0.0  # bytes/s between one device and its host's memory, one direction (PCIe)


@dataclasses.dataclass
class Kernel:
    name: str  # the instruction's name in the optimized HLO
    opcode: str  # its HLO opcode (the name can be JAX's: "psum_invariant.2" is an all-reduce)
    # "matmul", "attention", "memory" (everything else that computes), "collective", or a DMA: "host transfer"
    # (to or from the host's memory), "device transfer" (within the device)
    kind: str
    runs: float  # per step
    flops: float  # per run: matmul FLOPs (attention's for a fused attention call)
    other_flops: float  # per run: the rest of its arithmetic
    bytes: float  # per run: memory read and written, or for a collective the bytes one device sends
    seconds: float  # per run
    asynchronous: bool  # a collective or transfer the compiler overlaps with computation
    stack: list  # the Python stack it came from, innermost first: (file, function, line)
    op_name: str
    float8_flops: float = 0.0  # per run: the part of `flops` whose operands are float8

    @property
    def total_seconds(self) -> float:
        return self.seconds * self.runs

    @property
    def computes(self) -> bool:
        """Whether it runs on the cores (in the step's one stream), not on a link or a DMA engine beside them."""
        return self.kind not in ("collective", *TRANSFER_KINDS)


def dot_flops(inst: hlo.Instruction, operand_shapes: list[str]) -> float:
    """2 per multiply-add of a dot: 2 x its output's elements x the product of the contracted
    dimensions of its left operand (dimension numbers from its attributes or its backend_config). A
    convolution (the TPU compiler writes matmuls as convolutions): convolution_flops."""
    if inst.opcode == "convolution":
        return convolution_flops(inst, operand_shapes)
    out = hlo.arrays(hlo.tuple_elements(inst.shape)[0])[0][1]
    contracting = inst.attribute("lhs_contracting_dims")
    if contracting is not None:
        dims = [int(d) for d in contracting.strip("{}").split(",") if d]
    else:
        numbers = inst.backend_config.get("gemm_backend_config", {}).get("dot_dimension_numbers", {})
        dims = [int(d) for d in numbers.get("lhs_contracting_dimensions", [])]
    lhs = hlo.arrays(operand_shapes[0])[0][1]
    return 2.0 * math.prod(out) * math.prod(lhs[d] for d in dims)


def matmul_cost(inst: hlo.Instruction, operand_shapes: list[str]) -> tuple[float, float]:
    """(dot_flops, the part of them in float8): all of them where both operands are float8 (e4m3 or
    e5m2), priced at the float8 rate; none where either is wider."""
    flops = dot_flops(inst, operand_shapes)
    types = [arrays[0][0] if (arrays := hlo.arrays(s)) else "" for s in operand_shapes[:2]]
    return flops, flops if len(types) == 2 and all(t.startswith("f8") for t in types) else 0.0


def convolution_flops(inst: hlo.Instruction, operand_shapes: list[str]) -> float:
    """2 per multiply-add that reads the input, not its padding: for each of the output's batch rows
    and features, the input features of its group (the input's / feature_group_count) x the window
    taps that land on an input element, summed over the output's positions. Spatial dimensions are
    independent, so that sum is the product over them of taps_inside. The TPU compiler writes a
    matmul's free dimensions as windows padded on both sides (an output dimension of n from an input
    of 1: n taps, n - 1 of padding each side, one real tap per position) and its batch dimensions as
    windows over a dilated input (one real tap per position): counting every tap of the kernel gave
    such a matmul up to 16x its FLOPs. For a 1-tap window, or one that covers exactly the input, this
    is the matching dot's count."""
    lhs = hlo.arrays(operand_shapes[0])[0][1]
    out = hlo.arrays(hlo.tuple_elements(inst.shape)[0])[0][1]
    lhs_labels, _, out_labels = hlo.dim_labels(inst)
    window = hlo.window(inst)
    spatial = sum(label.isdigit() for label in lhs_labels)
    if len(window) != spatial or len(lhs_labels) != len(lhs) or len(out_labels) != len(out):
        raise ValueError(f"convolution {inst.name}: its window ({inst.attribute('window')}) and dim_labels "
                         f"({inst.attribute('dim_labels')}) do not fit its shapes {lhs} -> {out}")
    taps = math.prod(taps_inside(lhs[lhs_labels.index(str(d))], out[out_labels.index(str(d))], dimension)
                     for d, dimension in enumerate(window))
    features = lhs[lhs_labels.index("f")] // int(inst.attribute("feature_group_count") or 1)
    return 2.0 * out[out_labels.index("b")] * out[out_labels.index("f")] * features * taps


def taps_inside(size_in: int, size_out: int, dim: hlo.WindowDimension) -> int:
    """How many (output position, window tap) pairs of one spatial dimension read an input element:
    output o's tap k reads position u = o stride + k rhs_dilation - pad_low of the dilated input, an
    element when u is a multiple of lhs_dilation below size_in x lhs_dilation. Per tap, the outputs
    that qualify are a range (u inside the input) intersected with a residue class (u a multiple of
    lhs_dilation: o stride = -offset mod lhs_dilation, solvable when gcd(stride, lhs_dilation)
    divides the offset, then every lhs_dilation / gcd outputs)."""
    last = (size_in - 1) * dim.lhs_dilation  # the last element's position in the dilated input
    common = math.gcd(dim.stride, dim.lhs_dilation)
    period = dim.lhs_dilation // common
    inverse = pow(dim.stride // common, -1, period)  # 0 when period is 1: every output in range qualifies
    count = 0
    for k in range(dim.size):
        offset = k * dim.rhs_dilation - dim.pad_low  # tap k's position for output 0
        if offset % common:
            continue
        first, final = max(0, -(offset // dim.stride)), min(size_out - 1, (last - offset) // dim.stride)
        residue = (-offset // common) * inverse % period
        if final >= first:
            count += (final - residue) // period - (first - 1 - residue) // period
    return count


def _element_count(shape: str) -> int:
    return sum(math.prod(dims) for _, dims in hlo.arrays(shape))


class _Program:
    """The module, with each instruction's result shape by name (operands are written as names)."""

    def __init__(self, module: hlo.Module, on_chip: frozenset[int]):
        self.module = module
        self.on_chip = on_chip
        self.shapes = {c.name: {i.name: i.shape for i in c.instructions} for c in module.computations.values()}

    def operand_shapes(self, computation: str, inst: hlo.Instruction) -> list[str]:
        return [self.shapes[computation].get(o, "") for o in inst.operands]

    def memory_bytes(self, shape: str) -> int:
        """Bytes of a shape's arrays in the device's memory (HBM), not on the chip."""
        return hlo.shape_bytes_outside(shape, self.on_chip)

    def fusion_cost(self, computation: str, inst: hlo.Instruction) -> tuple[float, float, float, float]:
        """(matmul FLOPs, those of them in float8, other FLOPs, bytes) of a fusion: its body's dots and
        arithmetic; what it reads of each operand (a parameter that only dynamic-slices or slices read
        costs its slices, one that is only updated in place costs nothing) and what it writes (an
        in-place update or scatter its update: XLA scatters into the operand's buffer, copying it
        first in a kernel of its own if it must). An operand or a result on the chip costs nothing."""
        body = self.module.computations[inst.calls[0]]
        by_name = {i.name: i for i in body.instructions}
        users: dict[str, list[hlo.Instruction]] = {}
        for i in body.instructions:
            for o in i.operands:
                users.setdefault(o, []).append(i)

        def read_of(name: str, whole: int) -> int:  # bytes a value costs, through views of it
            total = 0
            for user in users.get(name, []):
                if user.opcode in ("bitcast", "reshape"):
                    total += read_of(user.name, whole)
                elif user.opcode in ("dynamic-slice", "slice", "gather") and user.operands[0] == name:
                    total += hlo.shape_bytes(user.shape)  # a slice of it: the part read
                elif user.opcode in ("dynamic-update-slice", "scatter") and user.operands[0] == name:
                    continue  # updated in place: the buffer is the output's
                else:
                    return whole
            return min(total, whole)

        params = [i for i in body.instructions if i.opcode == "parameter"]
        read = sum(read_of(p.name, whole) for p in params if (whole := self.memory_bytes(p.shape)))
        root = body.instructions[-1] if body.instructions else None
        roots = [by_name[o] for o in root.operands if o in by_name] if root is not None and root.opcode == "tuple" \
            else [root] if root is not None else []
        written = 0
        for out in roots:
            while out.opcode in ("bitcast", "reshape") and out.operands and out.operands[0] in by_name:
                out = by_name[out.operands[0]]
            if out.opcode in ("dynamic-update-slice", "scatter"):  # its update (a scatter's: its last operand)
                update = out.operands[1] if out.opcode == "dynamic-update-slice" else out.operands[-1]
                on_chip = not self.memory_bytes(out.shape)
                written += hlo.shape_bytes(by_name[update].shape) if update in by_name and not on_chip else 0
            else:
                written += self.memory_bytes(out.shape)
        matmul = float8 = other = 0.0
        for i in body.instructions:
            if i.opcode in ("dot", "convolution"):
                flops, in_float8 = matmul_cost(i, [by_name[o].shape for o in i.operands if o in by_name])
                matmul, float8 = matmul + flops, float8 + in_float8
            elif i.opcode == "fusion" and i.calls:  # a nested fusion (Triton's): its own arithmetic
                nested_matmul, nested_float8, nested_other, _ = self.fusion_cost(body.name, i)
                matmul, float8, other = matmul + nested_matmul, float8 + nested_float8, other + nested_other
            elif i.opcode == "reduce":
                other += _element_count(by_name[i.operands[0]].shape) if i.operands[0] in by_name else 0
            elif i.opcode not in DATA_MOVEMENT:
                other += _element_count(i.shape)
        return matmul, float8, other, read + written


def _collective(inst: hlo.Instruction, operand_shapes: list[str]) -> tuple[float, list[list[int]]]:
    """(bytes one device sends, device groups) of a collective instruction (communication.py's count)."""
    kind = inst.opcode.removesuffix("-start")
    groups = hlo.replica_groups(inst)
    size = hlo.shape_bytes(collective_shape(inst, operand_shapes))
    group = 2 if kind == "collective-permute" else len(groups[0]) if groups else 1
    if kind == "reduce-scatter":
        size *= group  # the result is one device's slice; the ring moves the whole array
    return (sent_bytes(kind, size, group) if group > 1 else 0.0), groups


def kernels(module: hlo.Module, rates: Rates) -> list[Kernel]:
    """Every kernel of the module's program with how often it runs and its time per run.

    A while loop of unknown trip count runs the trips its op_name expects when it names them
    (`expected_trips=N`: grouped_swiglu's loop over an expert's blocks, N blocks at a balanced load);
    else (blockwise attention's loop over key blocks, whose length depends on the documents)
    (n + 1) / 2 times per run of an enclosing loop of n iterations: the causal triangle of one
    document a row, which is also what the MFU's FLOPs count; outside any counted loop, once."""
    program = _Program(module, rates.on_chip_memory_spaces)
    found: list[Kernel] = []

    def cost(kernel: Kernel) -> float:
        if kernel.kind in ("collective", *TRANSFER_KINDS):
            return 0.0 if not kernel.bytes else kernel.bytes / kernel_link(kernel)
        float8_rate = rates.float8_matmul_flops or rates.matmul_flops
        compute = ((kernel.flops - kernel.float8_flops) / rates.matmul_flops + kernel.float8_flops / float8_rate
                   + kernel.other_flops / rates.vector_flops)
        return max(compute, kernel.bytes / rates.memory_bandwidth) + rates.launch_seconds

    link_of: dict[str, float] = {}

    def kernel_link(kernel: Kernel) -> float:
        return link_of[kernel.name]

    def add(computation: str, inst: hlo.Instruction, runs: float, out: list, kind: str, flops=0.0, other=0.0,
            nbytes=0.0, asynchronous=False, float8=0.0):
        kernel = Kernel(inst.name, inst.opcode, kind, runs, flops, other, nbytes, 0.0, asynchronous,
                        module.stack(inst.stack_frame), inst.op_name, float8)
        kernel.seconds = cost(kernel)
        out.append(kernel)

    def visit(name: str, runs: float, outer_trips: float, out: list):
        computation = module.computations[name]
        for inst in computation.instructions:
            op, operands = inst.opcode, program.operand_shapes(name, inst)
            if op in PLUMBING or op.endswith(("-done", "-update")):  # an async op's later halves: its start costs it
                continue
            if op == "while":
                known = hlo.loop_trips(inst, computation, module.computations)
                if known is None:  # a loop of data-dependent length may name the trips expected of it
                    hint = re.search(r"expected_trips=(\d+)", inst.op_name)
                    known = int(hint.group(1)) if hint else None
                trips = known if known is not None else (outer_trips + 1) / 2
                visit(inst.calls[0], runs * trips, known or 1, out)
            elif op == "conditional":
                branches = []
                for branch in inst.calls:
                    branch_kernels: list[Kernel] = []
                    visit(branch, runs, outer_trips, branch_kernels)
                    branches.append(branch_kernels)
                out.extend(max(branches, key=lambda ks: sum(k.total_seconds for k in ks)))
            elif op in ("call", "async-start", "call-start") and inst.calls:
                called = module.computations[inst.calls[0]]
                wrapped = [i for i in called.instructions if i.opcode in COLLECTIVES]
                # an asynchronous collective wrapped in a computation (call-start: a TPU's, on its SparseCore)
                if op != "call" and wrapped:
                    collective(inst.calls[0], wrapped[0], runs, out, asynchronous=True)
                else:
                    visit(inst.calls[0], runs, outer_trips, out)
            elif op.removesuffix("-start") in COLLECTIVES:
                collective(name, inst, runs, out, asynchronous=op.endswith("-start"))
            elif op in TRANSFERS:
                transfer(name, inst, runs, out)
            elif op in ("fusion", "fusion-start"):  # fusion-start: an asynchronous fusion, calling its fused body
                matmul, float8, other, nbytes = program.fusion_cost(name, inst)
                add(name, inst, runs, out, "matmul" if matmul else "memory", matmul, other, nbytes, float8=float8)
            elif op == "custom-call":
                target = inst.attribute("custom_call_target") or ""
                result = hlo.tuple_elements(inst.shape)[0]
                nbytes = sum(map(program.memory_bytes, operands)) + program.memory_bytes(result)
                if target.startswith(MATMUL_CALLS):
                    flops, float8 = matmul_cost(inst, operands)
                    add(name, inst, runs, out, "matmul", flops, 0.0, nbytes, float8=float8)
                elif target.startswith(ATTENTION_CALLS):
                    add(name, inst, runs, out, "attention", fused_attention_flops(inst, operands), 0.0, nbytes)
                elif stated := _STATED_FLOPS.search(inst.op_name):
                    add(name, inst, runs, out, "matmul", float(stated.group(1)), 0.0, nbytes)
                else:
                    add(name, inst, runs, out, "memory", 0.0, 0.0, nbytes)
            elif op in ("dot", "convolution"):
                nbytes = sum(map(program.memory_bytes, operands)) + program.memory_bytes(inst.shape)
                flops, float8 = matmul_cost(inst, operands)
                add(name, inst, runs, out, "matmul", flops, 0.0, nbytes, float8=float8)
            else:  # an unfused operation: a copy, a bare add, a sort, ...
                nbytes = sum(map(program.memory_bytes, operands)) + program.memory_bytes(inst.shape)
                other = 0.0 if op in DATA_MOVEMENT else _element_count(inst.shape)
                add(name, inst, runs, out, "memory", 0.0, other, nbytes)

    def collective(computation: str, inst: hlo.Instruction, runs: float, out: list, asynchronous: bool):
        nbytes, groups = _collective(inst, program.operand_shapes(computation, inst))
        spans_hosts = any(len({d // rates.devices_per_host for d in g}) > 1 for g in groups)
        link_of[inst.name] = rates.network_bandwidth if spans_hosts else rates.link_bandwidth
        add(computation, inst, runs, out, "collective", 0.0, 0.0, nbytes, asynchronous)

    def transfer(computation: str, inst: hlo.Instruction, runs: float, out: list):
        """A DMA: what it moves (a copy's or a slice's result, an update's update), over PCIe when either
        end is the host's memory, else within the device at its memory bandwidth."""
        parts = hlo.tuple_elements(inst.shape)  # (operands, result, context); a copy's: (source, result, context)
        moved = program.operand_shapes(computation, inst)[1] if inst.opcode == "dynamic-update-slice-start" \
            else parts[1]
        host = any(space == HOST_MEMORY_SPACE for _, _, space in hlo.spaced_arrays(inst.shape))
        if host and not rates.host_bandwidth:
            raise ValueError(f"{inst.name} moves data to or from the host's memory, and the target has no "
                             "host_bandwidth to price it")
        link_of[inst.name] = rates.host_bandwidth if host else rates.memory_bandwidth
        add(computation, inst, runs, out, TRANSFER_KINDS[0] if host else TRANSFER_KINDS[1], 0.0, 0.0,
            hlo.shape_bytes(moved), asynchronous=True)

    visit(hlo.entry(module.computations).name, 1.0, 1.0, found)
    return found


def fused_attention_flops(inst: hlo.Instruction, operand_shapes: list[str]) -> float:
    """FLOPs of a fused attention library call (cuDNN's): q [B, N, L, D] against k [B, N, S, D]: QK^T
    and PV, 2 x 2 B N L S D forward, twice that for the backward call (dQ, dK, dV and the recomputed
    scores: 2.5x the forward, rounded to the usual 2x plus the recomputation), halved when causal."""
    q, k = (hlo.arrays(s)[0][1] for s in operand_shapes[:2])
    forward = 4.0 * math.prod(q) * k[-2]
    target = inst.attribute("custom_call_target") or ""
    causal = "causal" in inst.attributes.lower() or '"mask_type":"CAUSAL"' in inst.attributes
    return (forward * (2.5 if "Backward" in target else 1.0)) * (0.5 if causal else 1.0)


@dataclasses.dataclass
class Roofline:
    """The step's time on the target, and where it goes."""

    kernels: list[Kernel]
    compute_seconds: float  # every compute kernel, one after another
    synchronous_seconds: float  # collectives the compiler did not overlap
    asynchronous_seconds: float  # collectives it overlaps with compute
    launches: float  # kernels launched per step
    host_transfer_seconds: float = 0.0  # DMAs to and from the host's memory, beside compute (PCIe)
    device_transfer_seconds: float = 0.0  # DMAs within the device (a TPU's prefetches into VMEM), beside compute

    @property
    def exposed_communication_seconds(self) -> float:
        return self.synchronous_seconds + max(0.0, self.asynchronous_seconds - self.compute_seconds)

    @property
    def exposed_transfer_seconds(self) -> float:
        """The DMAs' time beyond the compute they overlap, each link (PCIe, the device's DMA) on its own."""
        return sum(max(0.0, seconds - self.compute_seconds)
                   for seconds in (self.host_transfer_seconds, self.device_transfer_seconds))

    @property
    def step_seconds(self) -> float:
        return self.compute_seconds + self.exposed_communication_seconds + self.exposed_transfer_seconds

    def seconds_by(self, category) -> dict[str, float]:
        """The step's time by kind: each compute kernel's under category(kernel), then the exposed
        communication and transfers under "communication (exposed)" and "transfers (exposed)"."""
        seconds: dict[str, float] = {}
        for kernel in self.kernels:
            if kernel.computes:
                seconds[category(kernel)] = seconds.get(category(kernel), 0.0) + kernel.total_seconds
        seconds["communication (exposed)"] = self.exposed_communication_seconds
        seconds["transfers (exposed)"] = self.exposed_transfer_seconds
        return seconds

    @property
    def matmul_flops(self) -> float:
        return sum(k.flops * k.runs for k in self.kernels)

    @property
    def float8_matmul_flops(self) -> float:
        """The part of matmul_flops whose operands are float8 (priced at Rates.float8_matmul_flops)."""
        return sum(k.float8_flops * k.runs for k in self.kernels)

    @property
    def recomputed_matmul_flops(self) -> float:
        """The part of matmul_flops that the backward pass computes again: what jax.checkpoint recomputes
        (a value its policy did not save: for train.py, one not marked save_for_backward) carries JAX's name
        RECOMPUTED in its op_name."""
        return sum(k.flops * k.runs for k in self.kernels if RECOMPUTED in k.op_name.split("/"))


RECOMPUTED = "rematted_computation"  # the name scope JAX's remat gives the forward pass it computes again


def roofline(hlo_text: str, rates: Rates) -> Roofline:
    """The roofline of a compiled program (Compiled.as_text() of the target's compiler)."""
    found = kernels(hlo.parse_module(hlo_text), rates)
    computing = [k for k in found if k.computes]
    synchronous = sum(k.total_seconds for k in found if k.kind == "collective" and not k.asynchronous)
    asynchronous = sum(k.total_seconds for k in found if k.kind == "collective" and k.asynchronous)
    host, device = (sum(k.total_seconds for k in found if k.kind == kind) for kind in TRANSFER_KINDS)
    return Roofline(found, sum(k.total_seconds for k in computing), synchronous, asynchronous,
                    sum(k.runs for k in computing), host, device)


def source(kernel: Kernel, roots: tuple[str, ...]) -> tuple[str, str, int] | None:
    """The innermost frame of the kernel's stack in a file whose path ends with one of `roots`."""
    return next((frame for frame in kernel.stack if frame[0].endswith(roots)), None)

