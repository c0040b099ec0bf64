"""hlo.py and hlo_graph.py: the optimized HLO parsed (loop trip counts, element sizes) and drawn; loops the
compiler left uncounted, counted from their start, step and bound."""

import itertools
import re
import shutil
import subprocess
import xml.etree.ElementTree as ElementTree

import jax
import jax.numpy as jnp
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
