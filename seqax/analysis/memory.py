"""Memory per device of the training step: an estimate from the code's own annotations (the
shardings in the types, the values marked save_for_backward) next to XLA's memory_analysis() of
the compiled step. startup_report.py prints and writes it as memory_report.txt; bench/memory.py sizes
configs with it ahead of time.
"""

import contextlib
import dataclasses
import inspect
import io
import math
import re
import typing

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import print_saved_residuals
from jax.extend.core import Literal
from jax.sharding import NamedSharding, PartitionSpec

from seqax.analysis import hlo
from seqax.config import MODEL_DIMENSIONS, ConfigError
from seqax.jax_extra import SAVED_NAME, explicit_activation_checkpointing
from seqax.muon_sharding import matrices_of, matrix_groups
from seqax.shardlib.shardops import FLOAT8_OPERAND_NAME
from seqax.shardlib.shardtypes import ArrayType, Stacked, make_partition_specs

MiB = 2**20


def per_device_bytes(tree) -> int:
    """Bytes of one device's shards of the arrays (or ShapeDtypeStructs with shardings) in `tree`."""
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _without_axes(entry, axes: tuple[str, ...]):
    """One entry of a PartitionSpec with the mesh axes `axes` taken out."""
    if isinstance(entry, tuple):
        return tuple(a for a in entry if a not in axes) or None
    return None if entry in axes else entry


def gathered_bytes(tree, axes: tuple[str, ...] = ("d", "c")) -> int:
    """Bytes per device of the leaves of `tree` that are split over the mesh axes `axes`, once
    all-gathered over them (FSDP gathers weights over `d` and `c` one layer at a time)."""
    total = 0
    for x in jax.tree.leaves(tree):
        spec = x.sharding.spec
        if set(axes) & set(jax.tree.leaves(tuple(spec))):
            gathered = jax.sharding.NamedSharding(
                x.sharding.mesh, jax.sharding.PartitionSpec(*(_without_axes(e, axes) for e in spec)))
            total += math.prod(gathered.shard_shape(x.shape)) * x.dtype.itemsize
    return total


def saved_residuals(f, *args) -> list[str]:
    """jax.ad_checkpoint.print_saved_residuals(f, *args) as lines: what `f` keeps for its
    backward pass. Call it where `args` have per-device shapes (inside shard_map)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_saved_residuals(f, *args)
    return out.getvalue().strip().splitlines()


_RESIDUAL = re.compile(r"^(\w+)\[([\d,]*)\]")


def dimension_sizes(cfg) -> dict[str, int]:
    """The global size of each dimension name that the annotations use: the model's (the keys of
    config.MODEL_DIMENSIONS), the batch's B and L (S for keys), and R, RoPE's D / 2 frequencies."""
    sizes = {name: getattr(cfg.model, key) for name, key in MODEL_DIMENSIONS.items()}
    return {**sizes, "B": cfg.training.tokens.batch, "L": cfg.training.tokens.len, "S": cfg.training.tokens.len,
            "R": cfg.model.d_head // 2}


def annotated(annotation: ArrayType, sizes: dict[str, int], mesh) -> jax.ShapeDtypeStruct:
    """An abstract global array of the annotation's dtype, dimension sizes and sharding on `mesh`."""
    shape = tuple(int(d.name) if d.name.isdecimal() else sizes[d.name] for d in annotation.dims)
    return jax.ShapeDtypeStruct(shape, annotation.dtype, sharding=NamedSharding(mesh, make_partition_specs(annotation)))


def stacked_layers(weights) -> tuple[str, typing.Any]:
    """(field name, stacked weights) of the weights' field annotated Array[b'layers', ...]: the
    layers that the step runs one at a time."""
    for f in dataclasses.fields(weights):
        if isinstance(f.type, Stacked) and [d.name for d in f.type.dims] == ["layers"]:
            return f.name, getattr(weights, f.name)
    raise ValueError(f"{type(weights).__name__} has no field annotated Array[b'layers', ...]")


@dataclasses.dataclass
class LayerMemory:
    """What the estimate needs besides the state, per device."""

    saved: list[str]  # print_saved_residuals lines of one layer (see layer_saved_values)
    logits: jax.ShapeDtypeStruct  # one device's logits of one of the loss's parts (model.loss_parts)
    ring_bytes: int  # the largest set of blocks one ring step sends and receives (0 without mesh.c > 1)
    weight_bytes: int  # one layer's weights as its matmuls read them, and their f32 gradient (used_weight_bytes)
    stream_bytes: int  # one device's residual stream [B/d, L/c, M/t] in float32


def memory_annotations(cfg, mesh, state, layer, forward) -> LayerMemory:
    """For the memory report, per device: what one transformer layer keeps for its backward pass
    (print_saved_residuals lines: its input x, its weights and every value marked with
    save_for_backward, or save_in_forward_rule inside attention's custom VJP), what its ring
    attention has in flight, the logits of one of the loss's parts and the residual stream. `layer` is
    the layer as the step runs it (train.training_layer with the model config bound): every argument's
    shape and sharding come from its annotation, the weights' from `state` (arrays or ShapeDtypeStructs);
    the logits' from the first of `forward`'s return annotations (train.forward: logits, routing). The
    weights as the layer uses them are read from its program (used_weight_bytes: the experts stay split
    over d)."""
    sizes = dimension_sizes(cfg)
    _, stacked = stacked_layers(state.weights)

    def one_layer(w):  # the stacked weights without their leading `layers` axis
        return jax.ShapeDtypeStruct(w.shape[1:], w.dtype,
                                    sharding=NamedSharding(mesh, PartitionSpec(*w.sharding.spec[1:])))

    parameters = inspect.signature(layer).parameters.values()
    is_weights = [not isinstance(p.annotation, ArrayType) for p in parameters]
    args = tuple(jax.tree.map(one_layer, stacked) if weights else annotated(p.annotation, sizes, mesh)
                 for p, weights in zip(parameters, is_weights))
    weight_leaves = jax.tree.leaves(tuple(jax.tree.map(lambda _, w=w: w, a) for a, w in zip(args, is_weights)))
    lines, ring, weight_bytes = [], [], []

    def probe(*args):  # inside shard_map, so that the shapes are per device
        checkpointed = explicit_activation_checkpointing(layer)
        lines.extend(saved_residuals(checkpointed, *args))
        weight_bytes.append(used_weight_bytes(jax.make_jaxpr(checkpointed)(*args).jaxpr, weight_leaves))
        out, pullback = jax.vjp(checkpointed, *args)
        ring.append(2 * largest_ring_step(jax.make_jaxpr(pullback)(out).jaxpr))  # sent and received
        return jnp.zeros(())

    specs = jax.tree.map(lambda a: a.sharding.spec, args)
    jax.eval_shape(jax.shard_map(probe, mesh=mesh, in_specs=specs, out_specs=PartitionSpec(), check_vma=False), *args)
    logits = annotated(typing.get_args(inspect.signature(forward).return_annotation)[0], sizes, mesh)
    b, length, v = logits.sharding.shard_shape(logits.shape)
    return LayerMemory(lines, jax.ShapeDtypeStruct((b, length // cfg.model.loss_parts, v), logits.dtype), ring[0],
                       weight_bytes[0], b * length * cfg.model.d_model // mesh.shape["t"] * 4)


def _subjaxprs(eqn):
    for value in eqn.params.values():
        for item in value if isinstance(value, list | tuple) else (value,):
            inner = getattr(item, "jaxpr", item)  # a ClosedJaxpr holds its Jaxpr
            if hasattr(inner, "eqns"):
                yield inner


def largest_ring_step(jaxpr) -> int:
    """Bytes that the busiest loop iteration of `jaxpr` passes to a ring neighbour (the operands of
    its ppermutes, shardops.ring_pass, also inside the calls it makes): what one ring step holds in
    flight, read from the code (ring attention's backward passes k, v and their gradients)."""

    def passed(jaxpr) -> tuple[int, int]:  # (bytes passed outside loops, the most one loop iteration passes)
        here = sum(math.prod(v.aval.shape) * v.aval.dtype.itemsize
                   for eqn in jaxpr.eqns if eqn.primitive.name == "ppermute" for v in eqn.invars)
        busiest = 0
        for eqn in jaxpr.eqns:
            for inner in _subjaxprs(eqn):
                inner_here, inner_busiest = passed(inner)
                if eqn.primitive.name in ("scan", "while"):  # one iteration of this loop
                    busiest = max(busiest, inner_here, inner_busiest)
                else:
                    here, busiest = here + inner_here, max(busiest, inner_busiest)
        return here, busiest

    return max(passed(jaxpr))


def used_weight_bytes(jaxpr, is_weight: list[bool]) -> int:
    """Bytes of the weights as `jaxpr` computes with them (its inputs that `is_weight` marks, made into
    what its matmuls read: gathered over the axes the code gathers, cast to bf16; a weight used as it is
    counts as it is), plus 4 bytes an element for each one's float32 gradient, which the backward pass
    builds whole before reduce-scattering it. Read from the code: the values made from the weights alone
    where a computation that also takes activations reads them, also inside the calls it makes."""
    marked = {v for v, weight in zip(jaxpr.invars, is_weight) if weight}
    used, in_calls = {}, 0  # a weight value used here -> its bytes and its gradient's; those the calls use

    def use(values):
        used.update((v, math.prod(v.aval.shape) * (v.aval.dtype.itemsize + 4)) for v in values
                    if not isinstance(v, Literal) and v in marked)

    for eqn in jaxpr.eqns:
        inputs = [v for v in eqn.invars if not isinstance(v, Literal)]
        if inputs and all(v in marked for v in inputs):  # from the weights alone: not yet used
            marked.update(eqn.outvars)
            continue
        calls = [inner for inner in _subjaxprs(eqn) if len(inner.invars) == len(eqn.invars)]
        if calls:  # a call (the layer's remat, an einsum's custom VJP): where its body uses them
            flags = [not isinstance(v, Literal) and v in marked for v in eqn.invars]
            in_calls += max(used_weight_bytes(inner, flags) for inner in calls)
        else:
            use(inputs)
    use(jaxpr.outvars)
    return in_calls + sum(used.values())


def residual_size(line: str) -> tuple[str, int]:
    """('bf16[16,64,256]', bytes) of a print_saved_residuals line, whose types are JAX's short names (bf16, u8, and
    f8_e4m3fn: what a float8 einsum keeps on a GPU or a TPU, where it is not kept as its bits). A type of no known
    size is an error (hlo.element_bytes), not an array of no bytes."""
    dtype, dims = _RESIDUAL.match(line).groups()
    return f"{dtype}[{dims}]", math.prod(int(d) for d in dims.split(",") if d) * hlo.element_bytes(dtype)


def layer_saved_values(residual_lines: list[str], input_name: str = "x") -> list[tuple[str, int, str]]:
    """(shape, bytes, why) of what one layer keeps for its backward pass: every value marked with
    save_for_backward (or save_in_forward_rule), a float8 einsum's kept cast and the layer's input (kept per layer
    for its recomputation).
    Its weights are left out: they are slices of the stacked weights, counted once; so are empty
    values (the experts of a dense model)."""
    kept = []
    for line in residual_lines:
        if f"named '{SAVED_NAME}'" in line:
            shape, size = residual_size(line)
            kept.append((shape, size,
                         "save_for_backward" + (" (a bf16 value's bits)" if shape.startswith("u16") else "")))
        elif f"named '{FLOAT8_OPERAND_NAME}'" in line:
            # A float8 einsum's first operand, kept as its cast. Einsums of the same operand (q, k and v's nx)
            # each keep its cast, the same value, which XLA keeps once: counted each time (an upper bound).
            kept.append((*residual_size(line), "float8 einsum operand"))
        elif line.split(" from ")[-1] == f"the argument {input_name}":
            kept.append((*residual_size(line), "layer input"))
    return [value for value in kept if value[1]]


def muon_bytes(layer_weights, muon: dict) -> int:
    """Bytes per device of Muon's largest orthogonalization (train.muon_update, one group of same-shaped
    weights at a time, muon_sharding.matrix_groups): ceil(the group's layers / devices) layers' whole
    matrices (one per expert for the experts'), r x c wide, on each device, sent and received in bf16
    (2 + 2 bytes an element) with Newton-Schulz's temporaries (X in f32 and bf16, X^T, B X and the next X:
    16 bytes an element; A = X X^T, A A and B in f32 and bf16: 16 bytes an element of the r x r Gram
    matrix). `muon` is train.MUON: weight -> LayerMatrix."""
    largest = 0
    any_weight = jax.tree.leaves(layer_weights)[0]
    for names in matrix_groups(muon, any_weight.shape[0], any_weight.sharding.mesh.size):
        w = getattr(layer_weights, names[0])
        per_layer, *shape = matrices_of(w.shape[1:], muon[names[0]])
        r, c = sorted(shape)
        matrices = -(-w.shape[0] * len(names) // w.sharding.mesh.size) * per_layer
        largest = max(largest, matrices * (20 * r * c + 16 * r * r))
    return largest


def memory_estimate(state, layer: LayerMemory, muon: dict) -> tuple[list[tuple[str, int]], list[tuple[str, int, str]]]:
    """The terms of the memory estimate per device, (name, bytes), and what one layer saves.

    `state` has the weights and the optimizers' state (train.State) as arrays or
    ShapeDtypeStructs with shardings; `layer` is memory_annotations' account of one layer; `muon`
    is train.MUON (see muon_bytes). The same on every platform: bf16 values are saved as their bits
    (jax_extra.save_for_backward), so XLA:CPU keeps no f32 copies of them. Every term is added,
    although Muon's buffers exist only once the backward pass has freed the saved activations: an
    estimate from above."""
    weights = per_device_bytes(state.weights)
    name, stacked = stacked_layers(state.weights)
    layers = jax.tree.leaves(stacked)[0].shape[0]
    saved = layer_saved_values(layer.saved)
    saved_per_layer = sum(size for _, size, _ in saved)
    outside_layers = [getattr(state.weights, f.name) for f in dataclasses.fields(state.weights) if f.name != name]
    # Outside the layers, the unembedding, gathered over d and c (bf16), and its gradient summed over the loss's parts
    # (f32): 1.5x its float32 bytes. (The embedding is not gathered: train.embed_tokens.)
    gathered = max(layer.weight_bytes, *(round(1.5 * gathered_bytes(w)) for w in outside_layers))
    logits_bytes = math.prod(layer.logits.shape) * jnp.dtype(layer.logits.dtype).itemsize
    terms = [
        ("weights (f32, sharded as annotated)", weights),
        ("optimizer state (f32: Muon's momentum, AdamW's mu and nu)",
         per_device_bytes([getattr(state, f.name) for f in dataclasses.fields(state) if f.name != "weights"])),
        ("gradients (f32, reduce-scattered like the weights)", weights),
        # The forward gathers a layer's weights as bf16 (all_gather_cast); the backward gathers
        # them again (they are not saved) and builds their whole f32 gradient before
        # reduce-scattering it: 2 + 4 bytes per gathered parameter.
        ("largest gathered weights: one layer's (bf16, f32 gradient) or the unembedding's", gathered),
        (f"saved for backward: {saved_per_layer / MiB:.2f} MiB per layer x {layers} layers", saved_per_layer * layers),
        ("logits of one of the loss's parts (f32) and their gradient", 2 * logits_bytes),
        # train.cross_entropy_sum keeps it from the loss to the backward pass, beside every layer's saved values.
        ("the loss's gradient of the residual stream (f32)", layer.stream_bytes),
        ("Muon: the largest weight's whole matrices here, Newton-Schulz's temporaries",
         muon_bytes(stacked, muon)),
    ]
    if layer.ring_bytes:  # ring attention (mesh.c > 1): a step's blocks in flight, one layer at a time
        terms.append(("ring attention: the blocks one ring step sends and receives", layer.ring_bytes))
    return terms, saved


def compiled_peak_bytes(analysis) -> int:
    """Peak bytes per device of a compiled executable from its memory_analysis(). On CPU
    peak_memory_in_bytes leaves the temporaries out; what the executable allocates is the larger
    of it and arguments + outputs - aliased + temporaries."""
    allocated = (analysis.argument_size_in_bytes + analysis.output_size_in_bytes - analysis.alias_size_in_bytes
                 + analysis.temp_size_in_bytes)
    return max(allocated, getattr(analysis, "peak_memory_in_bytes", 0))


def memory_report(compiled, state, layer: LayerMemory, muon: dict, title: str) -> tuple[str, float, float]:
    """The memory report (text), the estimate and XLA's peak, in bytes per device: the terms of
    memory_estimate() next to compiled.memory_analysis()."""
    terms, saved = memory_estimate(state, layer, muon)
    estimate = sum(size for _, size in terms)
    lines = [f"Memory per device of the training step: {title}", "",
             "Estimate from the code's annotations (shardings of the types, save_for_backward):"]
    for name, size in terms:
        lines.append(f"  {name:<76} {size / MiB:10.2f} MiB")
        if name.startswith("saved for backward"):
            lines += [f"      {shape:<24} {size / MiB:8.3f} MiB  {why}" for shape, size, why in saved]
    lines.append(f"  {'total':<76} {estimate / MiB:10.2f} MiB")
    lines += ["", "XLA memory_analysis() of the compiled step:"]
    analysis = compiled.memory_analysis()
    if analysis is None:
        lines.append("  not available on this backend")
        return "\n".join(lines) + "\n", estimate, float("nan")
    fields = [("arguments", analysis.argument_size_in_bytes), ("outputs", analysis.output_size_in_bytes),
              ("aliased (outputs written into donated arguments)", analysis.alias_size_in_bytes),
              ("temporaries", analysis.temp_size_in_bytes),
              ("peak_memory_in_bytes", getattr(analysis, "peak_memory_in_bytes", 0))]
    lines += [f"  {name:<76} {size / MiB:10.2f} MiB" for name, size in fields]
    xla = compiled_peak_bytes(analysis)
    lines.append(f"  {'peak: max(peak_memory_in_bytes, arguments + outputs - aliased + temporaries)':<76} "
                 f"{xla / MiB:10.2f} MiB")
    lines += ["", f"estimate / XLA peak = {estimate / xla:.2f}"]
    return "\n".join(lines) + "\n", estimate, xla


def free_memory(device) -> int:
    """Bytes a new buffer on `device` can take: the allocator's limit less what is in use, or,
    for the host's CPU devices (which share it), the memory the kernel reports available."""
    stats = device.memory_stats() if device.platform != "cpu" else None
    if stats and "bytes_limit" in stats:
        return stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["MemAvailable"].split()[0]) * 1024


def check_step_fits(compiled, mesh):
    """Stops the run with one line when the compiled step needs more memory than its devices
    have free: what XLA's memory_analysis() says it allocates beyond its arguments (the state,
    already in memory), on every device of this process (CPU devices share the host's memory)."""
    analysis = compiled.memory_analysis()
    if analysis is None:
        return
    need = compiled_peak_bytes(analysis) - analysis.argument_size_in_bytes
    device = next(d for d in mesh.devices.flat if d.process_index == jax.process_index())
    sharing = len(jax.local_devices()) if device.platform == "cpu" else 1
    free = free_memory(device)
    if need * sharing > free:
        raise ConfigError(f"the training step needs {need / 2**30:.2f} GiB per device beyond its state "
                          "(XLA's memory_analysis(), memory_report.txt) "
                          f"x {sharing} device(s) sharing memory, more than the {free / 2**30:.2f} GiB free on "
                          f"{device.platform}; "
                          "lower training.tokens.batch or training.tokens.len, or use more devices")
