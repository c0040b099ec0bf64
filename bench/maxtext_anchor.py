"""MaxText's training step compiled for a TPU slice or GPUs that are not here and priced by our roofline exactly as
bench/compile_for.py prices ours: the anchor that holds our TPU cost model to published measurements, and
the step ours is compared with (docs/roofline.md, "Calibrated on TPUs").

    make compilers maxtext    # once: .venv-compilers (ours) and .venv-maxtext (MaxText's, bench/maxtext/)
    .venv-compilers/bin/python -m bench.maxtext_anchor --recipe llama3.1-8b-v6e-256 [llama2-70b-v5p-512]
    .venv-compilers/bin/python -m bench.maxtext_anchor --config tpu8_1b [--target v6e] [--ours]
    .venv-compilers/bin/python -m bench.maxtext_anchor --config gpu1_1b --target h200 --ours

--recipe compiles one of MaxText's published recipes (RECIPES: its settings and libtpu flags, the
measured MFU and tokens/s it published) and prints the roofline beside the measurement: the roofline's step
must not be longer than the measured one (its MFU ceiling at least the measured MFU). --config compiles
MaxText's step at one of our configs' shapes (model, sequence length, batch per chip, chips), with its default
remat policy, its default optimizer (AdamW) and no compiler flags unless --remat, --optimizer muon (MaxText's
Muon: Newton-Schulz on the layers' matrices, AdamW on the rest, as ours) and --recipe-flags (a TPU recipe's libtpu
flags) say otherwise, and with --ours compiles ours beside it (bench/compile_for.py) and prints the ratio.

MaxText's compile runs in .venv-maxtext (bench/maxtext/compile_maxtext.py: MaxText 0.2.5 needs Python
>= 3.12, jax 0.11.1, libtpu 0.0.46.3) and writes its optimized HLO; this script, in our venv, prices it.
Compiles are kept under --out and reused when their settings and flags are the same (an 8B recipe
compiles for several minutes on 2 cores).

MaxText's attention is Pallas, whose HLO is opaque to the roofline: on a TPU splash attention, on a GPU
(attention=flash) tokamax's Triton kernels. As our kernels state their work (roofline.stated_flops), each
call is priced at the matmul FLOPs of the block pairs it visits under its causal mask (its block sizes are in
its kernel metadata), with the same count of matmuls a pair as our kernels: forward 2, dK and dV 4 (5 when
splash's backward is fused), dQ 3; tokamax's backward is one kernel that does the dK/dV pass and the dQ pass,
each over its own blocks (4 + 3 matmuls a pair).

On a GPU, MaxText compiles for the devices of the machine it runs on; compile_maxtext.py gives it a CUDA
topology of the target instead (the same description bench/compile_for.py compiles ours for). MaxText runs
jax 0.11.1 with its CUDA plugin, ours 0.10.2: two XLA versions, each the one its code is released with.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import types  # noqa: E402

from seqax.analysis import hlo, memory, roofline  # noqa: E402
from seqax.analysis.targets import TARGETS, Target  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAXTEXT_PYTHON = os.path.join(ROOT, ".venv-maxtext", "bin", "python")
COMPILE_MAXTEXT = os.path.join(ROOT, "bench", "maxtext", "compile_maxtext.py")

# MaxText's libtpu flags (its benchmarks/xla_flags_library.py names them; its recipes add them up).
VMEM_LIMIT_DENSE = "--xla_tpu_scoped_vmem_limit_kib=98304"
LAYOUT_FOR_ALL_REDUCE_SCATTER = ("--xla_tpu_use_minor_sharding_for_major_trivial_input=true "
                                 "--xla_tpu_relayout_group_size_threshold_for_reduce_scatter=1 "
                                 "--xla_tpu_assign_all_reduce_scatter_layout=true")
DATA_PARALLEL_OVERLAP = ("--xla_tpu_enable_data_parallel_all_reduce_opt=true "
                         "--xla_tpu_data_parallel_opt_different_sized_ops=true")
# Its "continuation fusion" for all-gathers is three more flags (xla_tpu_enable_async_collective_fusion,
# _fuse_all_gather, _multiple_steps): libtpu 0.0.46.3 refuses them on a v6e ("not supported/recommended on
# platforms other than Viperlite") and on a v5p, so the recipes run here without them.
ASYNC_ALL_GATHER = "--xla_tpu_overlap_compute_collective_tc=true --xla_enable_async_all_gather=true"
SPARSECORE_ALL_REDUCE = ("--xla_tpu_enable_async_collective_fusion_fuse_all_reduce=false "
                         "--xla_tpu_enable_sparse_core_collective_offload_all_reduce=true "
                         "--xla_tpu_enable_all_reduce_offload_tracing=true "
                         "--xla_tpu_use_tc_device_shape_on_sc=true --xla_sc_enable_instruction_fusion=false "
                         "--xla_sc_disjoint_spmem=false --xla_sc_disable_megacore_partitioning=true")
HOST_OFFLOAD = ("--xla_tpu_enable_all_experimental_scheduler_features=true "
                "--xla_tpu_enable_scheduler_memory_pressure_tracking=true --xla_tpu_host_transfer_overlap_limit=24 "
                "--xla_tpu_aggressive_opt_barrier_removal=ENABLED --xla_lhs_prioritize_async_depth_over_stall=ENABLED "
                "--xla_tpu_enable_ag_backward_pipelining=true "
                "--xla_should_allow_loop_variant_parameter_in_chain=ENABLED "
                "--xla_should_add_loop_invariant_op_in_chain=ENABLED --xla_max_concurrent_host_send_recv=100 "
                "--xla_tpu_scheduler_percent_shared_memory_limit=100 --xla_latency_hiding_scheduler_rerun=2")
FLAGS = {  # the flags of each target's recipe below, which --config uses too
    "v6e": " ".join([VMEM_LIMIT_DENSE, LAYOUT_FOR_ALL_REDUCE_SCATTER, DATA_PARALLEL_OVERLAP, ASYNC_ALL_GATHER,
                     SPARSECORE_ALL_REDUCE, HOST_OFFLOAD]),
    "v5p": " ".join([DATA_PARALLEL_OVERLAP, ASYNC_ALL_GATHER]),
}
SYNTHETIC = ["dataset_type=synthetic", "enable_checkpointing=False", "use_iota_embed=True"]
BLOCKS_2048 = [f"sa_block_{name}=2048" for name in ("q", "kv", "kv_compute", "q_dkv", "kv_dkv", "kv_dkv_compute",
                                                    "q_dq", "kv_dq")]


@dataclasses.dataclass(frozen=True)
class Recipe:
    target: str
    chips: int
    settings: tuple[str, ...]  # MaxText's, beyond its base.yml
    tokens_per_chip: int  # a step's: per_device_batch_size x max_target_length
    measured_mfu: float
    measured_tokens_per_chip_second: float
    source: str

    @property
    def measured_step_seconds(self) -> float:
        return self.tokens_per_chip / self.measured_tokens_per_chip_second


TIERING = "MaxText's docs/reference/models/tiering.md (read 2026-12-06)"
RECIPES = {
    # tpu-recipes' Llama3.1-8B-MaxText/v6e-256, as MaxText's benchmarks/maxtext_trillium_model_configs.py
    # (llama3_1_8b_8192) writes it: FSDP over 256 chips, the layer's input and projections offloaded to host.
    "llama3.1-8b-v6e-256": Recipe(
        "v6e", 256, ("model_name=llama3.1-8b", "per_device_batch_size=4", "max_target_length=8192",
                     "ici_fsdp_parallelism=-1", "remat_policy=custom", "decoder_layer_input=offload",
                     "out_proj=offload", "query_proj=offload", "key_proj=offload", "value_proj=offload",
                     "attention=flash", "sa_use_fused_bwd_kernel=True", *BLOCKS_2048, *SYNTHETIC),
        4 * 8192, 0.4546, 7207, TIERING + ": 256 chips, bf16, SL 8192, 45.46% MFU, 7,207 tokens/s/chip"),
    # MaxText's benchmarks/maxtext_v5p_model_configs.py at 92e59fdf (llama2_70b_v5p_128), as tiering.md
    # links it. MaxText names a v5p slice by its TensorCores: v5p-512 is 256 chips (JAX devices).
    "llama2-70b-v5p-512": Recipe(
        "v5p", 256, ("model_name=llama2-70b", "per_device_batch_size=4", "max_target_length=4096",
                     "ici_fsdp_parallelism=-1", "remat_policy=save_dot_except_mlpwi", *SYNTHETIC),
        4 * 4096, 0.654, 692, TIERING + ": v5p-512, bf16, SL 4096, 65.4% MFU, 692 tokens/s/chip"),
}


def topology_name(target: Target, chips: int) -> str:
    """MaxText's compile_topology for `chips` chips: v5p slices are named by TensorCores (2 a chip); GPUs by
    JAX's CUDA topology (hosts x devices)."""
    if target.platform == "cuda":
        return target.topology(chips)[0]
    return f"{target.name}-{chips * 2 if target.name == 'v5p' else chips}"


def target_settings(out: str, target: Target, chips: int) -> list[str]:
    """compile_maxtext.py's arguments that name the target: a TPU slice by MaxText's topology name; GPUs by
    a CUDA topology (the description written beside `out`) that MaxText's internal_compile takes for its
    devices (its a3 names an 8-GPU host, whose size would set the batch)."""
    if target.platform == "tpu":
        return [f"compile_topology={topology_name(target, chips)}"]
    description = out + ".gpu_target_config.txtpb"
    with open(description, "w") as f:
        f.write(target.gpu_target_config())
    return ["--gpu", target.name, topology_name(target, chips), description, "compile_topology=a3",
            "internal_compile=True", f"internal_compile_num_devices={chips}", "hardware=gpu"]


def compile_maxtext(out: str, target: Target, chips: int, settings: list[str], flags: str) -> dict:
    """MaxText's step compiled (or the compile kept at `out` with the same settings and flags): its facts."""
    settings = [*target_settings(out, target, chips), "compile_topology_num_slices=1", *settings,
                f"run_name={os.path.basename(out)}", f"base_output_directory={os.path.dirname(out)}/maxtext_out"]
    if os.path.exists(out + ".json") and os.path.exists(out + ".hlo.txt"):
        with open(out + ".json") as f:
            kept = json.load(f)
        if kept["settings"] == settings and kept["libtpu_init_args"] == flags:
            return kept
    if not os.path.exists(MAXTEXT_PYTHON):
        sys.exit("bench.maxtext_anchor: error: MaxText's venv is missing: run `make maxtext` (bench/maxtext/setup.sh)")
    # Nothing of this process's JAX: importing it set TPU_LIBRARY_PATH to our libtpu, which MaxText's jax would load.
    env = {name: value for name, value in os.environ.items() if not name.startswith(("TPU_", "JAX_", "XLA_", "LIBTPU"))}
    env.update(LIBTPU_INIT_ARGS=flags, JAX_PLATFORMS="cpu")
    if target.platform == "tpu":
        env.update(TPU_ACCELERATOR_TYPE=topology_name(target, chips))
    print(f"compiling MaxText's step for {chips} x {target.name} ({topology_name(target, chips)})...", flush=True)
    result = subprocess.run([MAXTEXT_PYTHON, COMPILE_MAXTEXT, out, *settings], env=env, capture_output=True,
                            text=True)
    if result.returncode != 0:
        errors = [line for line in result.stderr.splitlines() if "Error" in line] or result.stderr.splitlines()[-1:]
        sys.exit(f"bench.maxtext_anchor: error: MaxText's compile failed: {errors[-1][:500] if errors else '?'}")
    with open(out + ".json") as f:
        return json.load(f)


# A splash attention kernel's name -> block-size keys of its kernel metadata (queries, keys) and its matmuls
# a visited block pair and query head.
SPLASH = {"fwd": ("block_q", "block_kv", 2), "dkv": ("block_q_dkv", "block_kv_dkv", 4),
          "dq": ("block_q_dq", "block_kv_dq", 3)}


def splash_flops(inst: hlo.Instruction, operand_shapes: list[str]) -> int | None:
    """The matmul FLOPs of one splash attention call (None if `inst` is not one): q [B, Hq, L, D] and
    k [B, Hkv, S, D] are its first two 4-D operands; its blocks come from its kernel metadata."""
    kind = re.search(r"splash_mha_(fwd|dkv|dq)", inst.name + " " + inst.op_name)
    if inst.opcode != "custom-call" or kind is None:
        return None
    metadata = {key: value for key, value in re.findall(r'\\"(\w+)\\": (\w+)', inst.attributes)}
    q_key, k_key, matmuls = SPLASH[kind.group(1)]
    fused = metadata.get("use_fused_bwd_kernel") == "true"
    if kind.group(1) == "dkv" and fused:
        matmuls += 1  # dQ as well
    four_d = [dims for shape in operand_shapes for _, dims in hlo.arrays(shape)[:1] if len(dims) == 4]
    (batch, heads, length, depth), (_, _, keys, _) = four_d[:2]
    block_q, block_k = min(int(metadata[q_key]), length), min(int(metadata[k_key]), keys)
    pairs = causal_block_pairs(length, block_q, block_k)
    return math.ceil(batch * heads * pairs * matmuls * 2 * block_q * block_k * depth)


def causal_block_pairs(length: int, block_q: int, block_k: int) -> int:
    """Block pairs of `block_q` queries and `block_k` keys over the same `length` positions that hold a
    position on or below the diagonal: all a causal kernel visits (flash_blocks.causal_pairs when the blocks are
    square; with blocks of 1024 queries and 512 keys over 4096 positions 20 pairs, where that formula gives 18)."""
    keys = math.ceil(length / block_k)
    return sum(min(keys, math.ceil((i + 1) * block_q / block_k)) for i in range(math.ceil(length / block_q)))


# tokamax's Pallas Triton attention (MaxText's attention=flash on a GPU), by its op's class: each pass over
# block pairs as (its query block's key, its key block's key, matmuls a visited pair and query head).
TOKAMAX = {"PallasTritonFlashAttention": (("block_q", "block_k", 2),),
           "PallasTritonFlashAttentionVjp": (("block_m1", "block_n1", 4), ("block_m2", "block_n2", 3))}
_TOKAMAX_PAYLOAD = re.compile(r'metadata_payload="tokamax:((?:[^"\\]|\\.)*)"')


def tokamax_flops(inst: hlo.Instruction) -> int | None:
    """The matmul FLOPs of one tokamax Triton attention call (None if `inst` is not one), from the op and
    arguments it records: q [B, L, Hq, D], k [B, S, Hkv, D], causal over the same positions."""
    payload = _TOKAMAX_PAYLOAD.search(inst.attributes)
    if inst.opcode != "custom-call" or payload is None:
        return None
    op = json.loads(payload.group(1).replace('\\"', '"'))
    passes = TOKAMAX.get(op["op"]["__type"].rsplit(".", 1)[-1])
    if passes is None:
        return None
    config, arguments = op["op"]["config"], op["arguments"]
    (batch, length, heads, depth), (_, keys, _, _) = (hlo.arrays(arguments[x])[0][1] for x in ("q", "k"))
    mask = arguments.get("mask") or {}
    if length != keys or not mask.get("causal_mask") or mask["causal_mask"].get("offset", 0) != 0:
        raise ValueError(f"{inst.name}: tokamax attention priced here only causal over its own positions")
    return sum(batch * heads * causal_block_pairs(length, config[q], config[k]) * matmuls * 2 * config[q]
               * config[k] * depth for q, k, matmuls in passes)


def state_attention_flops(hlo_text: str) -> tuple[str, int]:
    """The HLO with each attention call's FLOPs (splash's, tokamax's) stated in its op_name, as our kernels
    state theirs; how many."""
    module = hlo.parse_module(hlo_text)
    stated = {}
    for computation in module.computations.values():
        shapes = {i.name: i.shape for i in computation.instructions}
        for inst in computation.instructions:
            flops = splash_flops(inst, [shapes.get(o, "") for o in inst.operands])
            if flops is None:
                flops = tokamax_flops(inst)
            if flops is not None:
                stated[inst.name] = flops
    pieces, done = [], 0
    for name, flops in stated.items():  # each call's op_name, which may be lines after its name
        start = hlo_text.index(f"%{name} = ", done)
        at = hlo_text.index('op_name="', start) + len('op_name="')
        pieces += [hlo_text[done:at], roofline.stated_flops(flops) + "/"]
        done = at
    return "".join(pieces + [hlo_text[done:]]), len(stated)


def category(kernel: roofline.Kernel) -> str:
    if kernel.kind == "collective":
        return "communication (exposed)"
    if not kernel.computes:
        return "transfers (exposed)"
    if "splash" in kernel.op_name or "splash" in kernel.name or "pallas_flash_attention" in kernel.op_name:
        return "attention"
    return "matmuls" if kernel.kind == "matmul" else "elementwise, norms, converts"


KINDS = ("matmuls", "attention", "elementwise, norms, converts", "communication (exposed)", "transfers (exposed)")


def price(hlo_text: str, target: Target, tokens_per_chip: int) -> dict:
    """The roofline of MaxText's compiled step, in compile_for's terms."""
    hlo_text, attention_calls = state_attention_flops(hlo_text)
    model = roofline.roofline(hlo_text, target.rates())
    collectives = [k for k in model.kernels if k.kind == "collective"]
    seconds = model.seconds_by(category)
    return {"step_seconds": model.step_seconds, "seconds_per_token": model.step_seconds / tokens_per_chip,
            "hlo_matmul_tflop_per_device": model.matmul_flops / 1e12, "attention_calls": attention_calls,
            "collectives_per_step": sum(c.runs for c in collectives),
            "asynchronous_collectives": sum(c.runs for c in collectives if c.asynchronous),
            "exposed_communication_seconds": model.exposed_communication_seconds,
            "seconds_by_kind": {kind: seconds.get(kind, 0.0) for kind in KINDS}}


def describe(title: str, row: dict) -> str:
    lines = [title, f"  roofline: step {row['step_seconds'] * 1e3:,.1f} ms ({row['hlo_matmul_tflop_per_device']:.1f} "
             f"TFLOP of matmuls a chip, {row['attention_calls']} attention kernel calls priced at their blocks' "
             "FLOPs); "
             f"collectives {row['collectives_per_step']:,.0f} a step, {row['asynchronous_collectives']:,.0f} "
             "asynchronous"]
    lines += [f"    {kind:<30} {seconds * 1e3:10.1f} ms {seconds / row['step_seconds']:6.1%}"
              for kind, seconds in row["seconds_by_kind"].items()]
    return "\n".join(lines)


def run_recipe(name: str, out_dir: str) -> dict:
    recipe = RECIPES[name]
    target = TARGETS[recipe.target]
    facts = compile_maxtext(os.path.join(out_dir, name), target, recipe.chips, list(recipe.settings),
                            FLAGS[recipe.target])
    with open(os.path.join(out_dir, name) + ".hlo.txt") as f:
        row = price(f.read(), target, recipe.tokens_per_chip)
    row.update(recipe=name, compile_s=facts["compile_s"], measured_step_seconds=recipe.measured_step_seconds,
               measured_mfu=recipe.measured_mfu, source=recipe.source)
    # The ceiling by the measurement's own FLOPs count: MFU scales as 1 / step time.
    row["ratio"] = recipe.measured_step_seconds / row["step_seconds"]
    row["mfu_ceiling"] = recipe.measured_mfu * row["ratio"]
    print(describe(f"{name} on {recipe.chips} x {target.name}: MaxText's compile {facts['compile_s']:.0f} s", row))
    print(f"  measured: step {recipe.measured_step_seconds * 1e3:,.0f} ms, MFU {recipe.measured_mfu:.2%} "
          f"({recipe.source})")
    print(f"  measured / roofline {row['ratio']:.2f}x: MFU ceiling {row['mfu_ceiling']:.1%} "
          f"{'>=' if row['ratio'] >= 1 else '< (the roofline overprices this step)'} the measured "
          f"{recipe.measured_mfu:.2%}\n", flush=True)
    return row


def config_settings(cfg, chips: int) -> list[str]:
    """MaxText's settings for the model and batch of one of our configs (its Llama 2 decoder block is our
    layer: RMSNorm, RoPE, grouped-query attention, SwiGLU, an untied unembedding)."""
    m, tokens = cfg.model, cfg.training.tokens
    if tokens.batch % chips:
        raise ValueError(f"a batch of {tokens.batch} does not split over {chips} chips")
    return [f"base_emb_dim={m.d_model}", f"base_num_query_heads={m.n_kv * m.n_q_per_kv}", f"base_num_kv_heads={m.n_kv}",
            f"head_dim={m.d_head}", f"base_mlp_dim={m.d_ff}", f"base_num_decoder_layers={m.layers}",
            f"vocab_size={m.vocab}", "decoder_block=llama2", f"rope_max_timescale={int(m.rope_base)}",
            f"normalization_layer_epsilon={m.norm_eps}", f"max_target_length={tokens.len}",
            f"per_device_batch_size={tokens.batch // chips}", f"ici_fsdp_parallelism={cfg.mesh.d}",
            f"ici_tensor_parallelism={cfg.mesh.t}", "attention=flash", *SYNTHETIC]


def run_config(config: str, target: Target, out_dir: str, ours: bool, recipe_flags: bool, remat: str,
               optimizer: str, overrides: list[str]) -> dict:
    from seqax.config import load_config  # our config, for its shapes only

    cfg = load_config(config, overrides + ["+paths.model_name=maxtext_anchor"])
    chips = cfg.mesh.d * cfg.mesh.t * cfg.mesh.c
    if cfg.mesh.c != 1:
        sys.exit("bench.maxtext_anchor: error: MaxText's shape of a context-parallel mesh is not written here (c=1)")
    tokens_per_chip = cfg.training.tokens.batch * cfg.training.tokens.len // chips
    if recipe_flags and target.name not in FLAGS:
        sys.exit(f"bench.maxtext_anchor: error: no recipe's flags for {target.name} here (recipes: {sorted(FLAGS)})")
    out = os.path.join(out_dir, f"{config}-{target.name}-{remat}{'-recipe-flags' if recipe_flags else ''}"
                       f"{'' if optimizer == OPTIMIZER else '-' + optimizer}")
    flags = FLAGS[target.name] if recipe_flags else ""
    settings = config_settings(cfg, chips) + [f"remat_policy={remat}", f"opt_type={optimizer}"]
    facts = compile_maxtext(out, target, chips, settings, flags)
    with open(out + ".hlo.txt") as f:
        row = price(f.read(), target, tokens_per_chip)
    row.update(config=config, target=target.name, compile_s=facts["compile_s"], memory=facts["memory"])
    title = (f"MaxText at {config}'s shape on {chips} x {target.name}, remat_policy={remat}, opt_type={optimizer}, "
             f"{'libtpu' if target.platform == 'tpu' else 'XLA'} flags: "
             f"{'its recipe' if recipe_flags else 'none'}; compiled in {facts['compile_s']:.0f} s")
    row["memory_gib"] = memory.compiled_peak_bytes(types.SimpleNamespace(**facts["memory"])) / 2**30
    print(describe(title, row), flush=True)
    print(f"  memory per device (its compiler's plan): {row['memory_gib']:.1f} GiB of "
          f"{target.memory_bytes / 2**30:.1f}", flush=True)
    if ours:
        from bench.compile_for import compile_for, report  # our step, in this venv's compilers

        mine = compile_for(config, target, overrides, 10)
        print(report(mine))
        row["ours_step_seconds"] = mine["step_seconds"]
        row["ours_seconds_per_token"] = mine["step_seconds"] / tokens_per_chip
        row["speedup"] = row["seconds_per_token"] / row["ours_seconds_per_token"]
        print(f"ours against MaxText at {config}'s shape on {target.name}: {row['speedup']:.2f}x "
              f"(step {mine['step_seconds'] * 1e3:,.1f} ms against {row['step_seconds'] * 1e3:,.1f} ms a chip's "
              f"{tokens_per_chip:,} tokens)\n", flush=True)
    return row


# --config's default remat_policy: MaxText's own default (recompute each layer's forward in its backward).
# Others of its policies (--remat): minimal, save_qkv_proj, save_dot_except_mlp, ... (its base.yml lists them).
REMAT = "full"
OPTIMIZER = "adamw"  # MaxText's default opt_type; "muon" is ours (train.MUON's matrices, AdamW for the rest)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", nargs="+", choices=sorted(RECIPES), default=[], help="published recipes")
    parser.add_argument("--config", nargs="+", default=[], help="our configs: MaxText's step at their shapes")
    parser.add_argument("--target", default="v6e", choices=sorted(TARGETS), help="--config's target (default v6e)")
    parser.add_argument("--remat", default=REMAT, help=f"--config's MaxText remat_policy (default {REMAT})")
    parser.add_argument("--optimizer", default=OPTIMIZER, choices=("adamw", "muon"),
                        help=f"--config's MaxText opt_type (default {OPTIMIZER})")
    parser.add_argument("--ours", action="store_true", help="compile our step beside each --config's")
    parser.add_argument("--recipe-flags", action="store_true",
                        help="compile --config's MaxText step with its target's recipe's libtpu flags (default: none)")
    parser.add_argument("--out", default=os.path.join(ROOT, "runs", "maxtext_anchor"),
                        help="where compiles are kept and reused (default runs/maxtext_anchor)")
    parser.add_argument("--json", help="also write the rows there, as a JSON list")
    parser.add_argument("overrides", nargs="*", help="hydra overrides for every --config, after --")
    args = parser.parse_args(argv)
    if not args.recipe and not args.config:
        parser.error("name at least one --recipe or --config")
    os.makedirs(args.out, exist_ok=True)
    rows = [run_recipe(name, args.out) for name in args.recipe]
    rows += [run_config(config, TARGETS[args.target], args.out, args.ours, args.recipe_flags, args.remat,
                        args.optimizer, args.overrides)
             for config in args.config]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
