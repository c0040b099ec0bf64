"""roofline.py on hand-built HLO whose answer is known: one matmul, convolutions (against a brute-force
count of their taps and XLA's own count; the matmuls the TPU compiler writes as convolutions), one
elementwise kernel, an in-place update in a loop, a loop of unknown trip count inside a counted one,
a conditional (its costlier branch), a collective the compiler made asynchronous against one it did
not, and a Pallas kernel that states its FLOPs."""

import dataclasses
import random

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from seqax.analysis import roofline
from seqax.analysis.hlo import parse_module

RATES = roofline.Rates(matmul_flops=1e12, vector_flops=1e11, memory_bandwidth=1e10, link_bandwidth=1e9,
                       network_bandwidth=1e8, devices_per_host=4, launch_seconds=1e-6)


def module(*computations: str, entry: str) -> str:
    return "HloModule test, is_scheduled=true\n\n" + "\n\n".join(computations + (entry,)) + "\n"


def step(text: str) -> roofline.Roofline:
    return roofline.roofline(text, RATES)


def test_one_matmul_is_bound_by_its_flops():
    text = module(entry="""ENTRY %main (a: bf16[256,512], b: bf16[512,128]) -> f32[256,128] {
  %a = bf16[256,512]{1,0} parameter(0)
  %b = bf16[512,128]{1,0} parameter(1)
  ROOT %dot.1 = f32[256,128]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}""")
    model = step(text)
    [kernel] = model.kernels
    flops = 2 * 256 * 128 * 512
    nbytes = 256 * 512 * 2 + 512 * 128 * 2 + 256 * 128 * 4
    assert (kernel.kind, kernel.runs, kernel.flops, kernel.bytes) == ("matmul", 1, flops, nbytes)
    assert kernel.seconds == pytest.approx(max(flops / 1e12, nbytes / 1e10) + 1e-6)
    assert model.step_seconds == kernel.seconds


def test_a_float8_matmul_costs_the_float8_rate_and_its_bytes():
    """A dot of two float8 operands (a Triton gemm fusion's, as the GPU compiler writes it for
    model.matmul_dtype=float8) runs at the float8 rate and reads one byte an element; a dot of an
    e4m3 and a bf16 operand is not a float8 matmul (bf16's rate); without a float8 rate (TPUs), bf16's."""
    def fused(lhs: str, rhs: str, rates=None) -> roofline.Roofline:
        text = module(f"""%gemm_fusion (p0: {lhs}[1024,512], p1: {rhs}[512,256]) -> f32[1024,256] {{
  %p0 = {lhs}[1024,512]{{1,0}} parameter(0)
  %p1 = {rhs}[512,256]{{1,0}} parameter(1)
  ROOT %dot.1 = f32[1024,256]{{1,0}} dot(%p0, %p1), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
}}""", entry=f"""ENTRY %main (a: {lhs}[1024,512], b: {rhs}[512,256]) -> f32[1024,256] {{
  %a = {lhs}[1024,512]{{1,0}} parameter(0)
  %b = {rhs}[512,256]{{1,0}} parameter(1)
  ROOT %fusion.1 = f32[1024,256]{{1,0}} fusion(%a, %b), kind=kCustom, calls=%gemm_fusion
}}""")
        return roofline.roofline(text, rates or RATES)

    flops = 2 * 1024 * 256 * 512
    float8_rates = dataclasses.replace(RATES, float8_matmul_flops=2e12, memory_bandwidth=1e12)
    both = fused("f8e4m3fn", "f8e5m2", float8_rates)
    [kernel] = both.kernels
    nbytes = 1024 * 512 + 512 * 256 + 1024 * 256 * 4
    assert (kernel.flops, kernel.float8_flops, kernel.bytes) == (flops, flops, nbytes)
    assert kernel.seconds == pytest.approx(flops / 2e12 + 1e-6) and both.float8_matmul_flops == flops
    [mixed] = fused("f8e4m3fn", "bf16", float8_rates).kernels
    assert (mixed.float8_flops, mixed.seconds) == (0.0, pytest.approx(flops / 1e12 + 1e-6))
    [no_rate] = fused("f8e4m3fn", "f8e4m3fn", dataclasses.replace(float8_rates, float8_matmul_flops=0.0)).kernels
    assert no_rate.seconds == pytest.approx(flops / 1e12 + 1e-6)


def test_a_kernel_that_states_its_flops_costs_them():
    """A custom call whose inside XLA cannot see (a Pallas kernel) costs the matmul FLOPs stated in a
    name scope around it, wherever autodiff put that scope in the op_name; without one, its bytes only."""
    def call(op_name: str) -> roofline.Kernel:
        [kernel] = step(module(entry=f"""ENTRY %main (a: bf16[256,512]) -> bf16[256,512] {{
  %a = bf16[256,512]{{1,0}} parameter(0)
  ROOT %pallas_call.1 = bf16[256,512]{{1,0}} custom-call(%a), custom_call_target="__gpu$xla.gpu.triton", metadata={{op_name="{op_name}"}}
}}""")).kernels
        return kernel

    scope = roofline.stated_flops(3e9)
    assert scope == "matmul_flops=3000000000"
    kernel = call(f"jit(step)/transpose(jvp({scope}))/flash_dq/pallas_call")
    nbytes = 2 * 256 * 512 * 2
    assert (kernel.kind, kernel.flops, kernel.bytes) == ("matmul", 3e9, nbytes)
    assert kernel.seconds == pytest.approx(max(3e9 / 1e12, nbytes / 1e10) + 1e-6)
    assert (call("jit(step)/some_kernel/pallas_call").kind, call("jit(step)/pallas_call").flops) == ("memory", 0)


FUSED_ADD = """%fused_add (p0: f32[1000], p1: f32[1000]) -> f32[1000] {
  %p0 = f32[1000]{0} parameter(0)
  %p1 = f32[1000]{0} parameter(1)
  %exp.1 = f32[1000]{0} exponential(%p0)
  ROOT %add.1 = f32[1000]{0} add(%exp.1, %p1)
}"""


def test_one_elementwise_kernel_is_bound_by_memory():
    text = module(FUSED_ADD, entry="""ENTRY %main (x: f32[1000], y: f32[1000]) -> f32[1000] {
  %x = f32[1000]{0} parameter(0)
  %y = f32[1000]{0} parameter(1)
  ROOT %fusion.1 = f32[1000]{0} fusion(%x, %y), kind=kLoop, calls=%fused_add
}""")
    [kernel] = step(text).kernels
    assert (kernel.kind, kernel.flops, kernel.other_flops, kernel.bytes) == ("memory", 0, 2000, 3 * 4000)
    assert kernel.seconds == pytest.approx(max(2000 / 1e11, 12000 / 1e10) + 1e-6)


def test_an_asynchronous_fusion_costs_the_fusion_it_runs_once():
    """XLA (jax 0.11) writes an asynchronous fusion as fusion-start (its operands, the fused
    computation it calls), fusion-update and fusion-done: the start costs that fusion, as a
    synchronous one would (above); the update and the done cost nothing."""
    text = module(FUSED_ADD, entry="""ENTRY %main (x: f32[1000], y: f32[1000]) -> f32[1000] {
  %x = f32[1000]{0} parameter(0)
  %y = f32[1000]{0} parameter(1)
  %fusion-start.1 = ((f32[1000]{0}, f32[1000]{0}), f32[1000]{0}, s32[]) fusion-start(%x, %y), kind=kLoop, calls=%fused_add
  %fusion-update.1 = ((f32[1000]{0}, f32[1000]{0}), f32[1000]{0}, s32[]) fusion-update(%fusion-start.1)
  ROOT %fusion-done.1 = f32[1000]{0} fusion-done(%fusion-update.1)
}""")
    [kernel] = step(text).kernels
    assert (kernel.name, kernel.kind, kernel.runs) == ("fusion-start.1", "memory", 1)
    assert (kernel.flops, kernel.other_flops, kernel.bytes) == (0, 2000, 3 * 4000)


IN_PLACE_LOOP = module("""%fused_update (param_0: f32[4,256], param_1: s32[], param_2: f32[256]) -> f32[4,256] {
  %param_0 = f32[4,256]{1,0} parameter(0)
  %param_2 = f32[256]{0} parameter(2)
  %param_1 = s32[] parameter(1)
  %double = f32[256]{0} add(%param_2, %param_2)
  %bitcast.1 = f32[1,256]{1,0} bitcast(%double)
  %zero = s32[] constant(0)
  ROOT %dynamic-update-slice.1 = f32[4,256]{1,0} dynamic-update-slice(%param_0, %bitcast.1, %param_1, %zero)
}""", """%body (arg: (s32[], f32[4,256], f32[256])) -> (s32[], f32[4,256], f32[256]) {
  %arg = (s32[], f32[4,256]{1,0}, f32[256]{0}) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %buffer = f32[4,256]{1,0} get-tuple-element(%arg), index=1
  %x = f32[256]{0} get-tuple-element(%arg), index=2
  %update = f32[4,256]{1,0} fusion(%buffer, %i, %x), kind=kLoop, calls=%fused_update
  ROOT %tuple.1 = (s32[], f32[4,256]{1,0}, f32[256]{0}) tuple(%i, %update, %x)
}""", """%cond (arg: (s32[], f32[4,256], f32[256])) -> pred[] {
  %arg = (s32[], f32[4,256]{1,0}, f32[256]{0}) parameter(0)
  ROOT %true = pred[] constant(true)
}""", entry="""ENTRY %main (state: (s32[], f32[4,256], f32[256])) -> (s32[], f32[4,256], f32[256]) {
  %state = (s32[], f32[4,256]{1,0}, f32[256]{0}) parameter(0)
  ROOT %while.1 = (s32[], f32[4,256]{1,0}, f32[256]{0}) while(%state), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
}""")


def test_an_in_place_update_in_a_loop_moves_its_update_not_the_buffer():
    """Each of the 4 iterations reads x (1 KiB) and its index, and writes one row (1 KiB): not the
    4 KiB buffer."""
    [kernel] = step(IN_PLACE_LOOP).kernels
    assert (kernel.runs, kernel.bytes, kernel.other_flops) == (4, 1024 + 4 + 1024, 256)


def test_a_loop_of_unknown_trip_count_inside_a_counted_one_runs_the_causal_triangle():
    """A loop of unknown trip count inside one of n = 4 iterations runs (n + 1) / 2 = 2.5 times per
    outer iteration (the key blocks a query block of one document sees, on average)."""
    inner = IN_PLACE_LOOP.split("ENTRY")[0].replace("%body (", "%inner (").replace("%cond (", "%inner_cond (")
    outer = inner + """%outer (arg: (s32[], f32[4,256], f32[256])) -> (s32[], f32[4,256], f32[256]) {
  %arg = (s32[], f32[4,256]{1,0}, f32[256]{0}) parameter(0)
  ROOT %while.2 = (s32[], f32[4,256]{1,0}, f32[256]{0}) while(%arg), condition=%inner_cond, body=%inner
}

%outer_cond (arg: (s32[], f32[4,256], f32[256])) -> pred[] {
  %arg = (s32[], f32[4,256]{1,0}, f32[256]{0}) parameter(0)
  ROOT %true = pred[] constant(true)
}

ENTRY %main (state: (s32[], f32[4,256], f32[256])) -> (s32[], f32[4,256], f32[256]) {
  %state = (s32[], f32[4,256]{1,0}, f32[256]{0}) parameter(0)
  ROOT %while.1 = (s32[], f32[4,256]{1,0}, f32[256]{0}) while(%state), condition=%outer_cond, body=%outer, backend_config={"known_trip_count":{"n":"4"}}
}
"""
    [kernel] = step("HloModule test\n\n" + outer).kernels
    assert kernel.runs == 4 * 2.5


def test_a_conditional_costs_its_costlier_branch():
    text = module("""%small (p: f32[16]) -> f32[16] {
  %p = f32[16]{0} parameter(0)
  ROOT %neg.1 = f32[16]{0} negate(%p)
}""", """%large (p: f32[16]) -> f32[16] {
  %p = f32[16]{0} parameter(0)
  %big = f32[1000000]{0} broadcast(%p), dimensions={}
  %e = f32[1000000]{0} exponential(%big)
  ROOT %s = f32[16]{0} slice(%e), slice={[0:16]}
}""", entry="""ENTRY %main (pred: pred[], x: f32[16]) -> f32[16] {
  %pred = pred[] parameter(0)
  %x = f32[16]{0} parameter(1)
  ROOT %conditional.1 = f32[16]{0} conditional(%pred, %x, %x), true_computation=%large, false_computation=%small
}""")
    names = {k.name for k in step(text).kernels}
    assert "e" in names and "neg.1" not in names


COLLECTIVES = """ENTRY %main (x: f32[1000]) -> (f32[4000], f32[8000]) {
  %x = f32[1000]{0} parameter(0)
  %all-gather-start.1 = (f32[1000]{0}, f32[4000]{0}) all-gather-start(%x), channel_id=1, replica_groups={{0,1,2,3}}, dimensions={0}
  %all-gather-done.1 = f32[4000]{0} all-gather-done(%all-gather-start.1)
  %all-gather.2 = f32[8000]{0} all-gather(%x), channel_id=2, replica_groups=[1,8]<=[8], dimensions={0}
  ROOT %t = (f32[4000]{0}, f32[8000]{0}) tuple(%all-gather-done.1, %all-gather.2)
}"""


def test_collectives_take_their_links_and_only_what_is_not_overlapped_is_exposed():
    """Within a host of 4 devices, an asynchronous all-gather into 16000 bytes sends 3/4 of them at
    the link's 1 GB/s and hides behind no compute here, so all of it is exposed; a synchronous one
    over all 8 devices (into 32000 bytes) spans two hosts and goes at the network's 0.1 GB/s."""
    model = step(module(entry=COLLECTIVES))
    by_name = {k.name: k for k in model.kernels}
    inside, across = by_name["all-gather-start.1"], by_name["all-gather.2"]
    assert inside.asynchronous and not across.asynchronous
    assert inside.bytes == 0.75 * 16000 and inside.seconds == pytest.approx(0.75 * 16000 / 1e9)
    assert across.bytes == 7 / 8 * 32000 and across.seconds == pytest.approx(7 / 8 * 32000 / 1e8)
    assert model.exposed_communication_seconds == pytest.approx(inside.seconds + across.seconds)


def test_a_kernel_carries_its_opcode_whatever_its_name():
    """JAX names some instructions itself (psum_invariant.2 is an all-reduce): what reads kernels by kind of
    collective (compile_for's synchronous collectives by op) takes the opcode, not the name."""
    text = module("""%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}""", entry="""ENTRY %main (x: f32[1000]) -> f32[1000] {
  %x = f32[1000]{0} parameter(0)
  ROOT %psum_invariant.2 = f32[1000]{0} all-reduce(%x), channel_id=1, replica_groups={{0,1,2,3}}, to_apply=%add
}""")
    [kernel] = step(text).kernels
    assert (kernel.name, kernel.opcode, kernel.kind) == ("psum_invariant.2", "all-reduce", "collective")
    by_name = {k.name: k.opcode for k in step(module(entry=COLLECTIVES)).kernels}
    assert by_name["all-gather-start.1"] == "all-gather-start" and by_name["all-gather.2"] == "all-gather"


def test_the_python_stack_of_a_kernel_is_read_from_the_module():
    text = """HloModule m

FileNames
1 "/repo/train.py"

FunctionNames
1 "forward"
2 "training_step"

FileLocations
1 {file_name_id=1 function_name_id=1 line=10 end_line=10 column=1 end_column=2}
2 {file_name_id=1 function_name_id=2 line=20 end_line=20 column=1 end_column=2}

StackFrames
1 {file_location_id=2 parent_frame_id=0}
2 {file_location_id=1 parent_frame_id=2}

ENTRY %main (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  ROOT %neg = f32[8]{0} negate(%x), metadata={op_name="jit(f)/neg" stack_frame_id=2}
}
"""
    [kernel] = roofline.kernels(parse_module(text), RATES)
    assert kernel.stack == [("/repo/train.py", "forward", 10), ("/repo/train.py", "training_step", 20)]
    assert kernel.op_name == "jit(f)/neg"


def test_a_loop_the_compiler_left_uncounted_is_counted_from_its_condition():
    """The TPU compiler writes no trip count: `counter < 6`, the counter starting at 0 and stepping by
    1, runs 6 times."""
    text = IN_PLACE_LOOP.replace(', backend_config={"known_trip_count":{"n":"4"}}', "").replace(
        "tuple(%i, %update, %x)", "tuple(%next, %update, %x)").replace(
        "  %update =", "  %one = s32[] constant(1)\n  %next = s32[] add(%i, %one)\n  %update =").replace(
        """  ROOT %true = pred[] constant(true)""", """  %counter = s32[] get-tuple-element(%arg), index=0
  %six = s32[] constant(6)
  ROOT %lt = pred[] compare(%counter, %six), direction=LT""").replace(
        """  %state = (s32[], f32[4,256]{1,0}, f32[256]{0}) parameter(0)
  ROOT %while.1""", """  %state = (s32[], f32[4,256]{1,0}, f32[256]{0}) parameter(0)
  %zero = s32[] constant(0)
  %buffer = f32[4,256]{1,0} get-tuple-element(%state), index=1
  %x = f32[256]{0} get-tuple-element(%state), index=2
  %start = (s32[], f32[4,256]{1,0}, f32[256]{0}) tuple(%zero, %buffer, %x)
  ROOT %while.1""").replace("while(%state)", "while(%start)")
    assert {k.name: k.runs for k in step(text).kernels} == {"next": 6, "update": 6}


def convolution(window: str, labels: str, lhs: str, rhs: str, out: str, extra: str = "") -> str:
    """A module of one convolution, its operands parameters."""
    return module(entry=f"""ENTRY %main (a: {lhs}, b: {rhs}) -> {out} {{
  %a = {lhs} parameter(0)
  %b = {rhs} parameter(1)
  ROOT %convolution.1 = {out} convolution(%a, %b), window={{{window}}}, dim_labels={labels}{extra}, metadata={{op_name="jit(f)/dot_general"}}
}}""")


def taps_reading_the_input(size_in, size, stride, low, high, lhs_dilation, rhs_dilation) -> tuple[int, int]:
    """(output positions, (position, tap) pairs that read an input element) of one spatial dimension,
    by laying out the dilated, padded input and sliding the dilated window over it."""
    is_element = [False] * max(low, 0) + [i % lhs_dilation == 0 for i in range((size_in - 1) * lhs_dilation + 1)]
    is_element = is_element[max(-low, 0):] + [False] * max(high, 0)
    is_element = is_element[: len(is_element) + min(high, 0)]
    span = (size - 1) * rhs_dilation + 1
    starts = range(0, len(is_element) - span + 1, stride)
    return len(starts), sum(is_element[start + k * rhs_dilation] for start in starts for k in range(size))


def test_a_convolution_counts_the_taps_that_read_its_input_not_its_padding():
    """Two spatial dimensions with random sizes, strides, paddings (some negative) and dilations, 2
    feature groups: 2 x batch x output features x 3 input features a group x the (position, tap) pairs
    that land on an input element, counted by brute force."""
    rng, checked = random.Random(0), 0
    while checked < 200:
        dims = [(rng.randint(1, 6), rng.randint(1, 4), rng.randint(1, 3), rng.randint(-2, 5), rng.randint(-2, 5),
                 rng.randint(1, 3), rng.randint(1, 3)) for _ in range(2)]
        counted = [taps_reading_the_input(*dim) for dim in dims]
        if any(positions < 1 for positions, _ in counted):
            continue
        window = (f"size={'x'.join(str(d[1]) for d in dims)} stride={'x'.join(str(d[2]) for d in dims)} "
                  f"pad={'x'.join(f'{d[3]}_{d[4]}' for d in dims)} lhs_dilate={'x'.join(str(d[5]) for d in dims)} "
                  f"rhs_dilate={'x'.join(str(d[6]) for d in dims)}")
        (h, kh, *_), (w, kw, *_) = dims
        (oh, taps_h), (ow, taps_w) = counted
        text = convolution(window, "b01f_01io->b01f", f"f32[2,{h},{w},6]{{3,2,1,0}}", f"f32[{kh},{kw},3,8]{{3,2,1,0}}",
                           f"f32[2,{oh},{ow},8]{{3,2,1,0}}", ", feature_group_count=2")
        [kernel] = step(text).kernels
        assert kernel.flops == 2 * 2 * 8 * 3 * taps_h * taps_w, dims
        checked += 1


def test_a_convolution_costs_what_xla_counts_for_it():
    """XLA's own count (its cost analysis, which also skips the padding) of a convolution this CPU
    compiled, with every window field written as XLA writes it: strides, a negative padding, both
    dilations, feature groups."""
    def f(x, w):
        return lax.conv_general_dilated(x, w, window_strides=(2, 1), padding=((3, 1), (2, -1)), lhs_dilation=(2, 1),
                                        rhs_dilation=(1, 3), dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                        feature_group_count=2)

    compiled = jax.jit(f).lower(jax.ShapeDtypeStruct((2, 7, 9, 6), jnp.float32),
                                jax.ShapeDtypeStruct((3, 4, 3, 8), jnp.float32)).compile()
    [kernel] = [k for k in step(compiled.as_text()).kernels if k.kind == "matmul"]
    assert kernel.flops == compiled.cost_analysis()["flops"] == 2016


# A matmul as the TPU compiler writes it, [window, dim_labels, lhs, rhs, out], and its dot's FLOPs: a
# dimension kept whole under a 1-tap window; the query projection (v6e, shapes cut down), its heads
# (4 x 4) windows over an input of 1 padded by 3 each side; a batch of 6 matrices (Newton-Schulz),
# windows over an input dilated by 6, one tap in 6 on an element.
MATMULS_AS_CONVOLUTIONS = [
    (["size=1", "0bf_0io->0bf", "bf16[8,64,128]{2,1,0}", "bf16[1,128,32]{2,1,0}", "f32[8,64,32]{2,1,0}"],
     2 * 8 * 64 * 32 * 128),
    (["size=1x4x4 pad=0_0x3_3x3_3 rhs_reversal=0x1x1", "0bf21_i21o0->0b21f", "bf16[2,16,64,1,1]{4,3,2,1,0}",
      "bf16[64,4,4,8,1]{4,3,2,1,0}", "f32[2,16,4,4,8]{4,3,2,1,0}"], 2 * 2 * 16 * 4 * 4 * 8 * 64),
    (["size=6 stride=5 lhs_dilate=6", "0bf_0io->0bf", "bf16[6,64,128]{2,1,0}", "bf16[6,128,32]{2,1,0}",
      "f32[6,64,32]{2,1,0}"], 2 * 6 * 64 * 32 * 128),
]


@pytest.mark.parametrize("convolution_text, dot", MATMULS_AS_CONVOLUTIONS, ids=["one_tap", "padded_heads", "dilated_batch"])
def test_a_matmul_the_tpu_compiler_wrote_as_a_convolution_costs_the_dot(convolution_text, dot):
    """Whatever its op_name: counting every tap of the kernel, padding included, gave the query
    projection 16x its FLOPs and the batch 6x."""
    [kernel] = step(convolution(*convolution_text)).kernels
    assert kernel.kind == "matmul" and kernel.flops == dot


def test_a_convolution_whose_window_does_not_fit_its_labels_is_refused():
    text = convolution("size=1x4 pad=0_0x3_3", "0bf_0io->0bf", "bf16[8,64,128]{2,1,0}", "bf16[1,128,32]{2,1,0}",
                       "f32[8,64,32]{2,1,0}")
    with pytest.raises(ValueError, match="do not fit its shapes"):
        step(text)


def test_a_scatter_in_a_loop_moves_its_rows_not_the_buffer():
    """A scatter of 2 rows into a 64-row buffer (grouped_swiglu's output, a block's rows at a time)
    reads its rows and their indices and writes the rows: XLA scatters into the buffer in place."""
    text = IN_PLACE_LOOP.replace("""  %double = f32[256]{0} add(%param_2, %param_2)
  %bitcast.1 = f32[1,256]{1,0} bitcast(%double)
  %zero = s32[] constant(0)
  ROOT %dynamic-update-slice.1 = f32[4,256]{1,0} dynamic-update-slice(%param_0, %bitcast.1, %param_1, %zero)""",
                                 """  %rows = f32[2,128]{1,0} bitcast(%param_2)
  %at = s32[2,1]{1,0} broadcast(%param_1), dimensions={}
  %bits = f32[4,256]{1,0} bitcast(%param_0)
  %buffer = f32[8,128]{1,0} bitcast(%bits)
  %scatter.1 = f32[8,128]{1,0} scatter(%buffer, %at, %rows), update_window_dims={1}, inserted_window_dims={0}, scatter_dims_to_operand_dims={0}, index_vector_dim=1, to_apply=%take_update
  ROOT %bitcast.2 = f32[4,256]{1,0} bitcast(%scatter.1)""")
    text = text.replace("%fused_update (", """%take_update (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  ROOT %b = f32[] parameter(1)
}

%fused_update (""", 1)
    [kernel] = [k for k in step(text).kernels if k.kind != "collective"]
    assert (kernel.runs, kernel.bytes) == (4, 1024 + 4 + 1024)


def test_a_loop_of_data_dependent_length_runs_the_trips_its_name_expects():
    """A loop the compiler cannot count (its bound is data) runs the trips named in its op_name
    (grouped_swiglu's `expected_trips=N`), not once."""
    text = IN_PLACE_LOOP.replace(', backend_config={"known_trip_count":{"n":"4"}}',
                                 ', metadata={op_name="jit(step)/jvp(expected_trips=7)/while"}')
    [kernel] = step(text).kernels
    assert kernel.runs == 7
    assert step(text.replace("expected_trips=7", "no_hint")).kernels[0].runs == 1


def test_a_ragged_all_to_all_sends_a_balanced_share_of_its_smaller_buffer():
    """Rows sent to 4 devices (operand 1000 rows, landing in a buffer of 4000: sized for the worst
    load) cost 3/4 of the operand; the way back (4000 rows into 1000) 3/4 of the 1000 rows too."""
    offsets = "s64[4]{0} parameter(1)"
    text = module(entry=f"""ENTRY %main (x: f32[1000,4], o: s64[4]) -> f32[1000,4] {{
  %x = f32[1000,4]{{1,0}} parameter(0)
  %o = {offsets}
  %buffer = f32[4000,4]{{1,0}} broadcast(f32[] constant(0)), dimensions={{}}
  %ragged-all-to-all-start.1 = ((f32[1000,4]{{1,0}}, f32[4000,4]{{1,0}}, s64[4]{{0}}, s64[4]{{0}}, s64[4]{{0}}, s64[4]{{0}}), f32[4000,4]{{1,0}}) ragged-all-to-all-start(%x, %buffer, %o, %o, %o, %o), channel_id=1, replica_groups={{{{0,1,2,3}}}}
  %ragged-all-to-all-done.1 = f32[4000,4]{{1,0}} ragged-all-to-all-done(%ragged-all-to-all-start.1)
  %ragged-all-to-all.2 = f32[1000,4]{{1,0}} ragged-all-to-all(%ragged-all-to-all-done.1, %x, %o, %o, %o, %o), channel_id=2, replica_groups={{{{0,1,2,3}}}}
  ROOT %r = f32[1000,4]{{1,0}} add(%ragged-all-to-all.2, %x)
}}""")
    by_name = {k.name: k for k in step(text).kernels}
    there, back = by_name["ragged-all-to-all-start.1"], by_name["ragged-all-to-all.2"]
    assert there.asynchronous and not back.asynchronous
    assert there.bytes == back.bytes == 0.75 * 16000


@pytest.mark.parametrize("saved", [(), ("a",), ("a", "b")])
def test_the_matmuls_the_backward_pass_computes_again_are_counted_apart(saved):
    """jax.checkpoint's backward pass computes again the values its policy does not keep. Here 3 layers (a
    scan, as train.py's) of tanh(sin(x w1) w2), x [8, 16], w1 and w2 [16, 16]: the sine's derivative needs
    a = x w1 and the tanh's b = sin(a) w2, so each of the two matmuls not saved runs again in every layer's
    backward: recomputed_matmul_flops counts those, out of matmul_flops (each matmul forward, its two
    gradients, and what is recomputed). Unlooped, XLA may merge a recomputation into the forward pass's."""
    def layer(x, w):
        a = checkpoint_name(x @ w[0], "a")
        return jnp.tanh(checkpoint_name(jnp.sin(a) @ w[1], "b")), None

    def loss(x, w):
        policy = jax.checkpoint_policies.save_only_these_names(*saved)
        return jnp.sum(lax.scan(jax.checkpoint(layer, policy=policy), x, w)[0])

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    shapes = jax.ShapeDtypeStruct((8, 16), jnp.float32), jax.ShapeDtypeStruct((3, 2, 16, 16), jnp.float32)
    model = step(grad.lower(*shapes).compile().as_text())
    matmul = 2 * 8 * 16 * 16
    recomputed = 3 * matmul * (2 - len(saved))
    assert model.recomputed_matmul_flops == recomputed
    assert model.matmul_flops == 3 * 3 * 2 * matmul + recomputed


def test_a_value_on_the_chip_costs_no_memory_bandwidth():
    """A TPU keeps small, soon reused values in its VMEM (a layout's S(1)): an elementwise kernel whose
    input and output are there moves nothing through HBM; with the same value in HBM it moves both. Without
    on-chip spaces in its rates (a GPU's), every array is in HBM."""
    def kernel(space: str, rates: roofline.Rates) -> roofline.Kernel:
        text = module(f"""%fused (p: f32[1000]) -> f32[1000] {{
  %p = f32[1000]{{0{space}}} parameter(0)
  ROOT %e = f32[1000]{{0{space}}} exponential(%p)
}}""", entry=f"""ENTRY %main (a: f32[1000]) -> f32[1000] {{
  %a = f32[1000]{{0{space}}} parameter(0)
  ROOT %fusion.1 = f32[1000]{{0{space}}} fusion(%a), kind=kLoop, calls=%fused
}}""")
        [found] = roofline.roofline(text, rates).kernels
        return found

    tpu = dataclasses.replace(RATES, on_chip_memory_spaces=frozenset({1}))
    assert kernel(":S(1)", tpu).bytes == 0 and kernel("", tpu).bytes == 8000
    assert kernel(":S(1)", RATES).bytes == 8000


OFFLOAD = """%fused (p: bf16[4096,1024]) -> bf16[4096,1024] {
  %p = bf16[4096,1024]{1,0:S(1)} parameter(0)
  ROOT %e = bf16[4096,1024]{1,0} exponential(%p)
}

ENTRY %main (saved: bf16[8,4096,1024], x: bf16[1,4096,1024], i: s32[]) -> (bf16[8,4096,1024], bf16[4096,1024]) {
  %saved = bf16[8,4096,1024]{2,1,0:S(5)} parameter(0)
  %x = bf16[1,4096,1024]{2,1,0} parameter(1)
  %i = s32[] parameter(2)
  %z = s32[] constant(0)
  %dynamic-update-slice-start.1 = ((bf16[8,4096,1024]{2,1,0:S(5)}, bf16[1,4096,1024]{2,1,0}, s32[], s32[], s32[]), bf16[8,4096,1024]{2,1,0:S(5)}, u32[]{:S(2)}) dynamic-update-slice-start(%saved, %x, %i, %z, %z)
  %copy-start.2 = (bf16[1,4096,1024]{2,1,0}, bf16[1,4096,1024]{2,1,0:S(1)}, u32[]{:S(2)}) copy-start(%x)
  %copy-done.2 = bf16[1,4096,1024]{2,1,0:S(1)} copy-done(%copy-start.2)
  %b = bf16[4096,1024]{1,0:S(1)} bitcast(%copy-done.2)
  %fusion.3 = bf16[4096,1024]{1,0} fusion(%b), kind=kLoop, calls=%fused
  %dynamic-update-slice-done.1 = bf16[8,4096,1024]{2,1,0:S(5)} dynamic-update-slice-done(%dynamic-update-slice-start.1)
  ROOT %t = (bf16[8,4096,1024]{2,1,0:S(5)}, bf16[4096,1024]{1,0}) tuple(%dynamic-update-slice-done.1, %fusion.3)
}"""


@pytest.mark.parametrize("host_bandwidth", [1e9, 1e6])
def test_a_dma_runs_beside_compute_and_an_offload_goes_over_pcie(host_bandwidth):
    """Activations offloaded to the host (a dynamic-update-slice-start into an S(5) buffer, as MaxText's
    8B recipe writes five a layer) move their update, not the buffer, over the host's link; a prefetch into
    VMEM (copy-start) moves its array at the device's memory bandwidth. Both are DMAs beside the kernels:
    exposed only for what exceeds the compute (here one elementwise kernel of 16 MB); priced as kernels
    that read and wrote the whole 64 MB buffer, the 8B recipe's step was 5.8 s against 4.5 s measured."""
    rates = dataclasses.replace(RATES, on_chip_memory_spaces=frozenset({1, 2}), host_bandwidth=host_bandwidth)
    model = roofline.roofline(module(entry=OFFLOAD), rates)
    by_name = {k.name: k for k in model.kernels}
    offload, prefetch, compute = by_name["dynamic-update-slice-start.1"], by_name["copy-start.2"], by_name["fusion.3"]
    update = 4096 * 1024 * 2
    assert (offload.kind, offload.bytes, offload.seconds) == ("host transfer", update, update / host_bandwidth)
    assert (prefetch.kind, prefetch.bytes, prefetch.seconds) == ("device transfer", update, update / 1e10)
    assert compute.bytes == update and model.compute_seconds == compute.seconds  # reads VMEM, writes HBM
    assert model.exposed_transfer_seconds == pytest.approx(max(0, offload.seconds - compute.seconds))
    assert model.step_seconds == pytest.approx(compute.seconds + model.exposed_transfer_seconds)
    with pytest.raises(ValueError, match="host_bandwidth"):
        roofline.roofline(module(entry=OFFLOAD), dataclasses.replace(rates, host_bandwidth=0.0))


def test_a_collective_a_tpu_runs_on_its_sparsecore_is_asynchronous():
    """A TPU's all-reduce offloaded to its SparseCore is a call-start of a computation holding it, beside
    the TensorCore's kernels: priced as the all-reduce, asynchronous (it was an unknown op costing nothing)."""
    text = module("""%reduce (a: f32[1000]) -> f32[1000] {
  %a = f32[1000]{0} parameter(0)
  ROOT %all-reduce.1 = f32[1000]{0} all-reduce(%a), channel_id=1, replica_groups=mesh['x'=4] {'x'}, to_apply=%add
}""", """%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}""", entry="""ENTRY %main (g: f32[1000]) -> f32[1000] {
  %g = f32[1000]{0} parameter(0)
  %call-start.1 = ((f32[1000]{0}), f32[1000]{0}, s32[]{:S(2)}) call-start(%g), async_execution_thread="sparsecore", to_apply=%reduce
  ROOT %call-done.1 = f32[1000]{0} call-done(%call-start.1)
}""")
    [reduce] = step(text).kernels
    assert (reduce.kind, reduce.asynchronous, reduce.bytes) == ("collective", True, 2 * 3 / 4 * 4000)
