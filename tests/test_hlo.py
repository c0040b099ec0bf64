"""hlo.py and hlo_graph.py: the optimized HLO parsed (loop trip counts, element sizes) and drawn; loops the
compiler left uncounted, counted from their start, step and bound."""

import itertools
import re
import shutil
import subprocess
import xml.etree.ElementTree as ElementTree

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from seqax.analysis import hlo, hlo_graph, roofline

RATES = roofline.Rates(matmul_flops=1e12, vector_flops=1e11, memory_bandwidth=1e10, link_bandwidth=1e9,
                       network_bandwidth=1e8, devices_per_host=4)


def compiled_loop():
    def f(w, x):
        return lax.fori_loop(0, 3, lambda i, x: jnp.tanh(x @ w), x)

    return jax.jit(f).lower(jnp.ones((8, 8)), jnp.ones((4, 8))).compile()


def loop_hlo() -> str:
    return compiled_loop().as_text()


def test_every_element_type_is_read_with_its_size():
    """Each element type as XLA writes it, float8's included (a tuple's elements one by one): a type the
    reading missed counted no bytes and no FLOPs, as every float8 matmul once did."""
    shape = "(f8e4m3fn[1024,512]{1,0}, f8e5m2[4]{0}, bf16[2,3]{1,0}, f32[], pred[8]{0}, s32[2]{0})"
    assert [t for t, _ in hlo.arrays(shape)] == ["f8e4m3fn", "f8e5m2", "bf16", "f32", "pred", "s32"]
    assert hlo.shape_bytes(shape) == 1024 * 512 + 4 + 2 * 6 + 4 + 8 + 8


def test_hlo_graph_has_the_loop_body_and_its_matmul():
    dot = hlo_graph.to_dot(loop_hlo(), "f")
    assert "subgraph cluster_" in dot and "(x3)" in dot
    assert re.search(r'label="[^"]*(dot|fusion: dot)[^"]*", fillcolor="lightblue"', dot), dot
    if shutil.which("dot"):
        svg = subprocess.run(["dot", "-Tsvg"], input=dot, capture_output=True, text=True, check=True).stdout
        assert ElementTree.fromstring(svg).tag.endswith("svg")




def loop_module(start: int, step: int, bound: int, direction: str, fused: bool = False, swapped: bool = False,
                backend_config: str = "") -> str:
    """A loop over (x, i), its counter at index 1: i from `start`, `i += step` each trip while
    `i <direction> bound` (`bound <direction> i` when swapped). Fused: the step and the comparison
    inside fusions, their constants inside the fused computations, as the TPU compiler writes them."""
    test = f"%bound, %i), direction={direction}" if swapped else f"%i, %bound), direction={direction}"
    fusions = f"""%fused_step (p0: s32[]) -> s32[] {{
  %p0 = s32[] parameter(0)
  %step = s32[] constant({step})
  ROOT %add.1 = s32[] add(%step, %p0)
}}

%fused_test (p0: s32[]) -> pred[] {{
  %i = s32[] parameter(0)
  %bound = s32[] constant({bound})
  ROOT %compare.1 = pred[] compare({test}
}}

""" if fused else ""
    update = ("%next = s32[] fusion(%i), kind=kLoop, calls=%fused_step" if fused
              else f"%step = s32[] constant({step})\n  %next = s32[] add(%i, %step)")
    condition = ("ROOT %test = pred[] fusion(%i), kind=kLoop, calls=%fused_test" if fused
                 else f"%bound = s32[] constant({bound})\n  ROOT %test = pred[] compare({test}")
    return f"""HloModule loop, is_scheduled=true

{fusions}%body (arg: (f32[8], s32[])) -> (f32[8], s32[]) {{
  %arg = (f32[8]{{0}}, s32[]) parameter(0)
  %x = f32[8]{{0}} get-tuple-element(%arg), index=0
  %i = s32[] get-tuple-element(%arg), index=1
  {update}
  %y = f32[8]{{0}} negate(%x)
  ROOT %tuple.1 = (f32[8]{{0}}, s32[]) tuple(%y, %next)
}}

%cond (arg: (f32[8], s32[])) -> pred[] {{
  %arg = (f32[8]{{0}}, s32[]) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=1
  {condition}
}}

ENTRY %main (x: f32[8]) -> (f32[8], s32[]) {{
  %x = f32[8]{{0}} parameter(0)
  %start = s32[] constant({start})
  %init = (f32[8]{{0}}, s32[]) tuple(%x, %start)
  ROOT %while.1 = (f32[8]{{0}}, s32[]) while(%init), condition=%cond, body=%body{backend_config}
}}
"""


def trips_of(text: str) -> int | None:
    computations = hlo.parse_hlo(text)
    main = hlo.entry(computations)
    return hlo.loop_trips(main.instructions[-1], main, computations)


def simulated_trips(start: int, step: int, bound: int, direction: str, swapped: bool) -> int | None:
    """The loop run: its trips, None if it has not ended after 1000."""
    holds = {"LT": lambda a, b: a < b, "LE": lambda a, b: a <= b, "GT": lambda a, b: a > b,
             "GE": lambda a, b: a >= b, "NE": lambda a, b: a != b, "EQ": lambda a, b: a == b}[direction]
    i, trips = start, 0
    while (holds(bound, i) if swapped else holds(i, bound)) and trips <= 1000:
        i, trips = i + step, trips + 1
    return trips if trips <= 1000 else None


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("step", [2, 3, -2, -3, 1, 0])
def test_a_loop_is_counted_from_its_start_step_and_bound(step, fused):
    """An unrolled loop steps its counter by 2 to 4: its trips are the counter's range over the
    step, whichever way it compares (the counter on either side); as the loop runs, None where it
    would not end."""
    for direction, swapped in itertools.product(["LT", "LE", "GT", "GE", "NE", "EQ"], [False, True]):
        for start, bound in [(0, 12), (1, 12), (3, 20), (12, 0), (13, 1), (5, 5)]:
            text = loop_module(start, step, bound, direction, fused, swapped)
            expected = simulated_trips(start, step, bound, direction, swapped)
            assert trips_of(text) == expected, (direction, swapped, start, bound)


def test_a_loop_stepping_by_two_or_three_runs_its_body_that_many_times():
    """What the reports count (communication's runs_per_call, the roofline's kernels): i from 0 by 2
    below 12 is 6 trips, by 3 below 12 is 4."""
    for step, trips in [(2, 6), (3, 4)]:
        text = loop_module(0, step, 12, "LT", fused=True)
        runs, uncounted = hlo.runs_per_call(hlo.parse_hlo(text))
        assert (runs["body"], uncounted) == (trips, set())
        assert {k.name: k.runs for k in roofline.roofline(text, RATES).kernels} == {"next": trips, "y": trips}


def test_the_trip_count_the_compiler_wrote_comes_first():
    text = loop_module(0, 2, 12, "LT", backend_config=', backend_config={"known_trip_count":{"n":"5"}}')
    assert trips_of(text) == 5


def test_the_graph_draws_a_loop_with_the_trips_read_from_it():
    """The TPU compiler writes no trip count: the graph's loop says the 6 trips of i from 0 by 2 below 12."""
    dot = hlo_graph.to_dot(loop_module(0, 2, 12, "LT"), "f")
    assert "while x6" in dot and "(x6)" in dot


def test_an_instruction_written_over_several_lines_is_read_whole():
    """A Pallas call's kernel metadata is JSON on lines of its own, the last starting with '}': read line
    by line, the call lost its op_name and backend config and that '}' ended its computation, so the
    instructions after it (here the loop body's matmul) were never priced; MaxText's programs lost 90%."""
    text = """HloModule m

%body (p: f32[8,8]) -> f32[8,8] {
  %p = f32[8,8]{1,0} parameter(0)
  %kernel.1 = f32[8,8]{1,0} custom-call(%p), custom_call_target="tpu", frontend_attributes={kernel_metadata={
"xprof_metadata":"{\\"block_q\\": 512, \\"note\\": \\"} {\\"}"
}}, metadata={op_name="jit(f)/pallas_call" stack_frame_id=3}, backend_config={"custom_call_config":{"body":"x"}}
  ROOT %dot.2 = f32[8,8]{1,0} dot(%kernel.1, %p), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (a: f32[8,8]) -> f32[8,8] {
  %a = f32[8,8]{1,0} parameter(0)
  ROOT %call.3 = f32[8,8]{1,0} call(%a), to_apply=%body
}
"""
    body = hlo.parse_module(text).computations["body"]
    kernel = body.instructions[1]
    assert [i.name for i in body.instructions] == ["p", "kernel.1", "dot.2"]
    assert kernel.op_name == "jit(f)/pallas_call" and kernel.stack_frame == 3
    assert kernel.backend_config == {"custom_call_config": {"body": "x"}} and '\\"block_q\\": 512' in kernel.attributes


@pytest.mark.parametrize("text, groups", [
    ("mesh['x'=4] {'x'}", [[0, 1, 2, 3]]),
    ("mesh['a'=2,'b'=4] {'b'}", [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ("mesh['a'=2,'b'=4] {'a'}", [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ("mesh['a'=2,'b'=4] {'b','a'}", [[0, 4, 1, 5, 2, 6, 3, 7]]),  # in the order named
    ("mesh['a'=8] {'a':(1)2}", [[0, 4], [1, 5], [2, 6], [3, 7]]),  # a as [2, 4]: its major 2
    ("mesh['a'=8] {'a':(2)2}", [[0, 2], [1, 3], [4, 6], [5, 7]]),  # a as [2, 2, 2]: the middle 2
    # a by b's 8 as [4, 2]: for each of b's major 4, a and b's minor 2 in that order
    ("mesh['a'=2,'b'=8] {'a','b':(4)2}", np.arange(16).reshape(2, 4, 2).transpose(1, 0, 2).reshape(4, 4).tolist()),
])
def test_replica_groups_written_over_a_mesh_are_the_devices_along_its_named_axes(text, groups):
    """jax 0.11's XLA writes a collective's groups as mesh axes ("mesh['axis_0'=256] {'axis_0'}", as in
    MaxText's program): read as no groups, its collectives sent nothing. Each form against the devices laid
    out row-major over the mesh."""
    assert hlo.mesh_groups(text) == groups
    instruction = hlo.parse_instruction("ag.1", f"f32[8]{{0}} all-gather(%x), replica_groups={text}, dimensions={{0}}")
    assert hlo.replica_groups(instruction) == groups


def test_replica_groups_in_a_form_not_read_here_are_refused():
    instruction = hlo.parse_instruction("ag.1", "f32[8]{0} all-gather(%x), replica_groups=<unknown>, dimensions={0}")
    with pytest.raises(ValueError, match="a form not read here"):
        hlo.replica_groups(instruction)


def test_an_arrays_memory_space_is_read_from_its_layout():
    shape = "(bf16[2,128]{1,0:T(8,128)(2,1)S(1)}, f32[4]{0}, u32[]{:S(2)}, bf16[8]{0:T(8)S(5)}, s32[3])"
    assert [space for _, _, space in hlo.spaced_arrays(shape)] == [1, 0, 2, 5, 0]
    assert hlo.shape_bytes_outside(shape, frozenset({1, 2})) == 16 + 16 + 12
    assert hlo.shape_bytes_outside(shape, frozenset()) == hlo.shape_bytes(shape)
