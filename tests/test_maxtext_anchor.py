"""bench/maxtext_anchor.py's pricing of MaxText's program, on hand-built HLO (MaxText's own compile needs
.venv-maxtext, `make maxtext`, and minutes: not in the suite): a splash attention call costs the matmul FLOPs
of the block pairs its causal mask visits, as our kernels state theirs; our configs' shapes become MaxText's
settings; v5p slices are named by their TensorCores."""

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
    text, calls = maxtext_anchor.state_splash_flops(SPLASH.replace("FUSED", fused))
    model = roofline.roofline(text, TARGETS["v6e"].rates())
    by_name = {k.name: k for k in model.kernels}
    forward = by_name["splash_mha_fwd_segmented_residuals.1"]
    backward = by_name["splash_mha_dkv_segmented_no_residuals.2"]
    per_pair = 2 * 16 * 2 * 128  # batch x query heads x 2 FLOPs a multiply-add x D
    assert calls == 2 and forward.kind == backward.kind == "matmul"
    assert forward.flops == per_pair * causal_pairs(4, 8) * 2 * 1024 * 512
    assert backward.flops == per_pair * causal_pairs(2, 2) * (5 if fused == "true" else 4) * 2048 * 2048
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
