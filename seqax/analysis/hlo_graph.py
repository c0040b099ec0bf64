"""The optimized HLO of a compiled step as a Graphviz graph: one node per instruction of the
entry computation and of every while-loop body (a cluster each, with its trip count), fusions
drawn as one node named after their main operation, matmuls and collectives coloured.

Why our own converter: JAX has no public call that renders HLO as a graph. XLA's dump flags
(`--xla_dump_to --xla_dump_hlo_as_dot`) are process-wide and must be set before JAX starts,
and jaxlib's private renderer has moved between releases. The text of `Compiled.as_text()` is
public; hlo.py parses it.
"""

from seqax.analysis.hlo import Computation, Instruction, entry, loop_trips, parse_hlo

COLLECTIVES = {"all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute",
               "all-gather-start", "all-reduce-start", "collective-permute-start"}
MATMULS = {"dot", "convolution"}
# Plumbing left out of the picture: an edge through one of these goes to its producer.
PASS_THROUGH = {"get-tuple-element", "tuple", "bitcast", "constant", "copy", "parameter"}


def _label_and_colour(inst: Instruction, computation: Computation,
                      computations: dict[str, Computation]) -> tuple[str, str]:
    """The node's text (the instruction's name, as in the profiler trace, its operation and its
    shape) and fill colour."""
    ops = {inst.opcode}
    operation = inst.opcode
    if inst.opcode == "fusion" and inst.calls and inst.calls[0] in computations:
        ops = {i.opcode for i in computations[inst.calls[0]].instructions}
        main = (sorted(ops & (MATMULS | COLLECTIVES))
                or sorted(ops & {"reduce", "scatter", "gather", "dynamic-update-slice"}) or ["elementwise"])
        operation = f"fusion: {'+'.join(main)}"
    elif inst.opcode == "while":
        operation = f"while x{loop_trips(inst, computation, computations) or '?'}"
    colour = ("lightgrey" if inst.opcode == "while" else "lightblue" if ops & MATMULS
              else "orange" if ops & COLLECTIVES else "white")
    shape = "tuple" if inst.shape.startswith("(") else inst.shape.split("{")[0]
    return f"{inst.name}\\n{operation}\\n{shape}", colour


def _is_shown(computation: Computation, inst: Instruction) -> bool:
    return inst.opcode not in PASS_THROUGH or (computation.is_entry and inst.opcode == "parameter")


def _computation_lines(computation: Computation, index: int, computations: dict[str, Computation]) -> list[str]:
    """Nodes and edges of one computation; an edge through plumbing (PASS_THROUGH) is drawn from
    the instruction that produced the value."""
    by_name = {i.name: i for i in computation.instructions}

    def producers(name: str, seen: tuple = ()) -> list[str]:
        inst = by_name.get(name)
        if inst is None or name in seen:
            return []
        if _is_shown(computation, inst):
            return [name]
        return [p for operand in inst.operands for p in producers(operand, seen + (name,))]

    lines = []
    for inst in computation.instructions:
        if not _is_shown(computation, inst):
            continue
        label, colour = _label_and_colour(inst, computation, computations)
        lines.append(f'"{index}:{inst.name}" [label="{label}", fillcolor="{colour}"];')
        for source in dict.fromkeys(p for operand in inst.operands for p in producers(operand)):
            lines.append(f'"{index}:{source}" -> "{index}:{inst.name}";')
    return lines


def to_dot(text: str, title: str = "training step") -> str:
    """Graphviz source for the optimized HLO `text` (Compiled.as_text())."""
    computations = parse_hlo(text)
    shown = [(entry(computations), None)]
    for computation, _ in shown:  # while bodies, found breadth-first (the list grows)
        for inst in computation.instructions:
            if inst.opcode == "while" and inst.calls and inst.calls[0] in computations:
                shown.append((computations[inst.calls[0]], loop_trips(inst, computation, computations)))
    # Layout effort capped (crossing minimization and network simplex passes): with the layers unrolled
    # the step's graph has thousands of nodes, and dot's default effort took 83 s on local_test_synthetic
    # where these limits take 4 s, with more crossed edges.
    lines = [f'digraph "{title}" {{', "  rankdir=TB; mclimit=0.1; nslimit=1; nslimit1=1;",
             '  node [shape=box, style=filled, fontname="Helvetica", fontsize=10];',
             f'  label="{title}: optimized HLO (blue: matmuls, orange: collectives, dashed boxes: loop bodies)"; '
             'labelloc=t;']
    for index, (computation, trip_count) in enumerate(shown):
        body = _computation_lines(computation, index, computations)
        if computation.is_entry:
            lines += ["  " + line for line in body]
        else:
            lines += [f"  subgraph cluster_{index} {{",
                      f'    label="while body {computation.name} (x{trip_count or "?"})"; style=dashed;']
            lines += ["    " + line for line in body] + ["  }"]
    lines.append("}")
    return "\n".join(lines) + "\n"
