"""bench/maxtext_anchor.py's pricing of MaxText's program, on hand-built HLO (MaxText's own compile needs
.venv-maxtext, `make maxtext`, and minutes: not in the suite): a splash attention call (TPU) and a tokamax Triton
call (GPU) cost the matmul FLOPs of the block pairs their causal masks visit, as our kernels state theirs; our
configs' shapes become MaxText's settings; v5p slices are named by their TensorCores, GPUs by our CUDA topology."""

import json

import pytest

from bench import maxtext_anchor
from seqax.analysis import roofline
from seqax.analysis.targets import TARGETS
from seqax.config import load_config
from seqax.kernels.flash_blocks import causal_pairs

# A forward and a backward splash call as MaxText's compile writes them (abridged): q [B, Hq, L, D], k and v
# [B, Hkv, S, D], the block sizes in kernel metadata on lines of their own.
METADATA = ('"xprof_metadata":"{\\"block_q\\": 1024, \\"block_kv\\": 512, \\"block_q_dkv\\": 2048, '
            '\\"block_kv_dkv\\": 2048, \\"use_fused_bwd_kernel\\": FUSED}"')


def splash_call(name: str, operands: str, kernel: str) -> str:
    return (f"  %{name} = bf16[2,16,4096,128]{{3,2,1,0}} custom-call({operands}), "
            'custom_call_target="tpu_custom_call", '
            f"frontend_attributes={{kernel_metadata={{\n{METADATA}\n}}}}, "
            f'metadata={{op_name="jit(train_step)/{kernel}/pallas_call" stack_frame_id=1}}\n')


SPLASH = ("HloModule m\n\nENTRY %main (q: bf16[2,16,4096,128], k: bf16[2,4,4096,128], v: bf16[2,4,4096,128]) "
          "-> bf16[2,16,4096,128] {\n"
          "  %q = bf16[2,16,4096,128]{3,2,1,0} parameter(0)\n"
          "  %k = bf16[2,4,4096,128]{3,2,1,0} parameter(1)\n"
          "  %v = bf16[2,4,4096,128]{3,2,1,0} parameter(2)\n"
          + splash_call("splash_mha_fwd_segmented_residuals.1", "%q, %k, %v", "splash_mha_fwd_segmented_residuals")
          + "  ROOT" + splash_call("splash_mha_dkv_segmented_no_residuals.2", "%q, %k, %v",
                                   "splash_mha_dkv_segmented_no_residuals")[1:]
          + "}\n")


@pytest.mark.parametrize("fused", ["true", "false"])
def test_a_splash_call_costs_the_block_pairs_its_causal_mask_visits(fused):
    """Forward: 2 matmuls a visited pair and query head (QK^T, PV) over blocks of 1024 x 512 queries and keys;
    the backward's dK and dV kernel 4 (5 with dQ fused in) over blocks of 2048: what our kernels state."""
    text, calls = maxtext_anchor.state_attention_flops(SPLASH.replace("FUSED", fused))
    model = roofline.roofline(text, TARGETS["v6e"].rates())
    by_name = {k.name: k for k in model.kernels}
    forward = by_name["splash_mha_fwd_segmented_residuals.1"]
    backward = by_name["splash_mha_dkv_segmented_no_residuals.2"]
    per_pair = 2 * 16 * 2 * 128  # batch x query heads x 2 FLOPs a multiply-add x D
    assert calls == 2 and forward.kind == backward.kind == "matmul"
    assert forward.flops == per_pair * 20 * 2 * 1024 * 512  # 4 query blocks reach 2, 4, 6, 8 key blocks
    assert backward.flops == per_pair * 3 * (5 if fused == "true" else 4) * 2048 * 2048
    assert forward.seconds == pytest.approx(max(forward.flops / TARGETS["v6e"].peak_flops,
                                                forward.bytes / TARGETS["v6e"].memory_bandwidth))


def test_our_configs_shape_becomes_maxtexts_settings():
    cfg = load_config("tpu8_1b", ["+paths.model_name=check"])
    settings = dict(s.split("=", 1) for s in maxtext_anchor.config_settings(cfg, 8))
    m = cfg.model
    assert (settings["base_emb_dim"], settings["base_num_query_heads"], settings["base_num_kv_heads"]) == \
        (str(m.d_model), str(m.n_kv * m.n_q_per_kv), str(m.n_kv))
    assert (settings["base_mlp_dim"], settings["base_num_decoder_layers"], settings["vocab_size"]) == \
        (str(m.d_ff), str(m.layers), str(m.vocab))
    assert int(settings["per_device_batch_size"]) * 8 == cfg.training.tokens.batch
    assert settings["max_target_length"] == str(cfg.training.tokens.len) and settings["decoder_block"] == "llama2"


def test_a_v5p_slice_is_named_by_its_tensorcores():
    assert maxtext_anchor.topology_name(TARGETS["v5p"], 256) == "v5p-512"
    assert maxtext_anchor.topology_name(TARGETS["v6e"], 256) == "v6e-256"
    recipe = maxtext_anchor.RECIPES["llama3.1-8b-v6e-256"]
    assert recipe.measured_step_seconds == pytest.approx(4 * 8192 / 7207)


def tokamax_call(name: str, kind: str, config: dict, causal: bool = True) -> str:
    """A tokamax Triton attention call as MaxText's GPU compile writes it (abridged): q [B, L, Hq, D], k and v
    [B, S, Hkv, D]; the op, its blocks and its arguments' shapes in the call's metadata_payload."""
    op = {"op": {"__type": f"tokamax._src.ops.attention.pallas_triton.{kind}", "config": config},
          "arguments": {"q": "bf16[2,4096,16,128]", "k": "bf16[2,4096,4,128]", "v": "bf16[2,4096,4,128]",
                        "mask": {"bool_mask": "bool[2,1,4096,4096]",
                                 "causal_mask": {"offset": 0, "window_size": None} if causal else None}}}
    payload = json.dumps(op).replace('"', '\\"')
    return (f"  %{name} = bf16[2,4096,16,128]{{3,2,1,0}} custom-call(%q, %k, %v), "
            'custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(train_step)/jvp()/'
            f'vmap(pallas_flash_attention)/pallas_call" metadata_payload="tokamax:{payload}"}}\n')


def tokamax_module(causal: bool = True) -> str:
    return ("HloModule m\n\nENTRY %main (q: bf16[2,4096,16,128], k: bf16[2,4096,4,128], v: bf16[2,4096,4,128]) "
            "-> bf16[2,4096,16,128] {\n"
            "  %q = bf16[2,4096,16,128]{3,2,1,0} parameter(0)\n"
            "  %k = bf16[2,4096,4,128]{3,2,1,0} parameter(1)\n"
            "  %v = bf16[2,4096,4,128]{3,2,1,0} parameter(2)\n"
            + tokamax_call("forward.1", "PallasTritonFlashAttention", {"block_q": 64, "block_k": 64}, causal)
            + "  ROOT" + tokamax_call("backward.2", "PallasTritonFlashAttentionVjp",
                                      {"block_m1": 32, "block_n1": 64, "block_m2": 64, "block_n2": 32}, causal)[1:]
            + "}\n")


def test_a_tokamax_call_costs_the_block_pairs_its_causal_mask_visits():
    """MaxText's attention on a GPU: the forward 2 matmuls a visited pair and query head over its 64 x 64 blocks
    (64 x 65 / 2 pairs on and below the diagonal of 4096 positions); the backward, one kernel, a dK/dV pass of
    4 matmuls over 32 x 64 blocks and a dQ pass of 3 over 64 x 32 (each visits 4160 pairs: a block row of 32
    queries reaches ceil((i + 1) / 2) blocks of 64 keys)."""
    text, calls = maxtext_anchor.state_attention_flops(tokamax_module())
    model = roofline.roofline(text, TARGETS["h200"].rates())
    by_name = {k.name: k for k in model.kernels}
    forward, backward = by_name["forward.1"], by_name["backward.2"]
    per_pair = 2 * 16 * 2 * 128  # batch x query heads x 2 FLOPs a multiply-add x D
    assert calls == 2 and forward.kind == backward.kind == "matmul"
    assert maxtext_anchor.category(forward) == maxtext_anchor.category(backward) == "attention"
    assert forward.flops == per_pair * 2080 * 2 * 64 * 64
    assert backward.flops == per_pair * 4160 * (4 * 32 * 64 + 3 * 64 * 32)
    assert maxtext_anchor.causal_block_pairs(4096, 64, 64) == causal_pairs(64, 64) == 2080


def test_a_tokamax_call_without_a_causal_mask_is_refused():
    with pytest.raises(ValueError, match="only causal"):
        maxtext_anchor.state_attention_flops(tokamax_module(causal=False))


def test_maxtexts_gpu_compile_takes_the_targets_cuda_topology(tmp_path):
    """On a GPU MaxText compiles for the CUDA topology of our target (its description written beside the
    compile), as many devices as our config's mesh, not its a3 host of 8 (which would set the batch)."""
    settings = maxtext_anchor.target_settings(str(tmp_path / "gpu1_1b-h200"), TARGETS["h200"], 1)
    assert settings[:4] == ["--gpu", "h200", "1x1x1", str(tmp_path / "gpu1_1b-h200.gpu_target_config.txtpb")]
    assert "internal_compile_num_devices=1" in settings and "hardware=gpu" in settings
    assert (tmp_path / "gpu1_1b-h200.gpu_target_config.txtpb").read_text() == TARGETS["h200"].gpu_target_config()
    assert maxtext_anchor.target_settings(str(tmp_path / "x"), TARGETS["v5p"], 256) == ["compile_topology=v5p-512"]
