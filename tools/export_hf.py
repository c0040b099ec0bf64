"""A checkpoint as a Hugging Face model directory (config.json, model.safetensors and the
dataset's tokenizer, whether a tokenizer.json or the bytes tokenizer): a Llama, a Qwen3 when the
layers have QK-norm's gains, or with experts a Glm4Moe, which `transformers.LlamaForCausalLM`
(`Qwen3ForCausalLM`, `Glm4MoeForCausalLM`) loads with every weight used. Before the directory
replaces anything, transformers runs it beside train.forward on a few rows (tools/export_check.py)
and the export is refused unless their float32 logits agree to float32 rounding.

    python -m tools.export_hf --run-dir runs/RUN [--step N] --output hf_model/ [--overwrite]

The architectures agree: pre-RMSNorm, grouped-query attention with RoPE in the rotate-half
layout (HF's `rotate_half` pairs dims i and i + D/2 with rate base^(-2i/D), as train.rope), SwiGLU,
final RMSNorm, untied unembedding. The weights map one to one, transposed to torch's
[out, in] layout. Heads: HF's `repeat_kv` gives query head h the kv head h // Q, so seqax's query
head (q, k) is HF head k * Q + q. Weights are written in float32, as trained; seqax runs its
matmuls with bfloat16 operands, so logits agree to bfloat16 rounding, not exactly (in float32, as
the check runs them, to float32 rounding).

QK-norm (Qwen3, OLMo 2, Gemma 3): Layer gains `q_norm` and `k_norm` of shape [layers, D], an RMSNorm
over the head dimension of each query and key head after their projections and before RoPE, are
Qwen3's `self_attn.q_norm` / `k_norm` (Glm4Moe's with use_qk_norm when there are experts).

With experts (model.experts > 0) the class is Glm4Moe, whose router is train.experts_block':
sigmoid scores, a bias per expert (e_score_correction_bias) added to choose the top k and not to
weigh them, the chosen scores divided by their sum (norm_topk_prob, routed_scaling_factor 1), and
groups of experts that one group (n_group 1) makes moot. Its attention is Llama's once RoPE covers
the whole head (partial_rotary_factor 1; its default is half) and every layer has experts
(first_k_dense_replace 0). The dense SwiGLU is its shared expert, moe_intermediate_size x
n_shared_experts wide: d_ff must be a multiple of expert_d_ff (0: none), and its group score (a
group's top 2) needs 2 experts or more; a run that is not so is refused (check_expressible). The
experts are written one module each, as GLM-4.5's checkpoints and save_pretrained have them;
transformers stacks them into gate_up_proj [E, 2H, M] and down_proj [E, M, H] when it loads.

Token ids are seqax's: a tokenizer's id + 1, with 0 the begin-of-document input (bos_token_id 0).
The exported tokenizer.json is the dataset's with every id shifted by one and a `<seqax_bos>`
token at 0, so that it encodes to the ids the model was trained on. Its post-processor is
replaced by one that puts `<seqax_bos>` first and adds nothing else: the dataset's documents
were encoded without the tokenizer's own special tokens, so `tok(text)` gives [0] + the ids
that a document of that text has in the dataset, and `model.generate(**tok(text,
return_tensors="pt"))` continues it as sample.py does. The pad id is never 0 (transformers
would take a 0 in the inputs for padding): the first id above the data's (`<seqax_pad>`, an
embedding row the model has but the data never used), else the end-of-document id, else none.
generation_config.json suppresses 0 and the ids above the data's, which sample.py never
chooses either, so greedy decoding picks the same tokens. A bytes-tokenized dataset gets the
bytes tokenizer as a tokenizer.json (tokenizer.ByteTokenizer.tokenizer_json: byte b is id b + 1,
`<eod>` 257 ends a document), exported the same way.
"""

import argparse
import json
import os
import shutil
import stat
import sys
import uuid

import jax
import numpy as np
import zarr

import train
from seqax.config import ConfigError, DatasetError, SeqaxError, TokenizerError
from seqax.data.tokenizer import EOD_TOKEN, ByteTokenizer
from seqax.outputs import check_output_apart
from seqax.runs import load_run_config, load_weights, paths_read, run_mesh
from tools.export_check import check_logits

BOS_TOKEN = "<seqax_bos>"
PAD_TOKEN = "<seqax_pad>"


# The weights of train.Model that each transformers class has a place for (hf_tensors maps each): a Llama's;
# a Qwen3's, Llama's and QK-norm's gains; a Glm4Moe's, Llama's (its MLP the shared expert), the router and
# experts, and QK-norm's gains where the model has them (use_qk_norm).
LLAMA_WEIGHTS = {"embed", "final_norm", "unembed", "layers.attn_norm", "layers.w_q", "layers.w_k", "layers.w_v",
                 "layers.w_o", "layers.ffn_norm", "layers.w_gate", "layers.w_up", "layers.w_down"}
QK_NORM_WEIGHTS = {"layers.q_norm", "layers.k_norm"}
EXPERT_WEIGHTS = {"layers.router", "layers.expert_bias", "layers.expert_gate", "layers.expert_up",
                  "layers.expert_down"}


def hf_class(h, qk_norm: bool) -> str:
    """The transformers class of a model with config `h`, with QK-norm's gains or not."""
    return "Glm4MoeForCausalLM" if h.experts else "Qwen3ForCausalLM" if qk_norm else "LlamaForCausalLM"


def check_weights(w, h) -> bool:
    """Whether train.Model numpy weights `w` have QK-norm's gains. A weight that the class has no place for
    (a model edit other than QK-norm) stops the export: it would be dropped; so does one the class computes
    with that the model lacks (an edit that removed it). An empty one (a dense model's experts) holds nothing."""
    every = {jax.tree_util.keystr(path, simple=True, separator="."): x
             for path, x in jax.tree_util.tree_flatten_with_path(w)[0]}
    shapes = {name: x.shape for name, x in every.items() if x.size}
    qk_norm = bool(shapes.keys() & QK_NORM_WEIGHTS)
    known = LLAMA_WEIGHTS | (EXPERT_WEIGHTS if h.experts else set()) | (QK_NORM_WEIGHTS if qk_norm else set())
    model = hf_class(h, qk_norm).removesuffix("ForCausalLM")
    if missing := known - every.keys():  # an edit that removed a weight (a gate-less MLP)
        raise ConfigError(f"the model lacks weights that a Hugging Face {model} computes with: {sorted(missing)}; no "
                          "transformers class the export writes computes this model, so it exports none (extend "
                          "tools/export_hf.py for it)")
    if shapes.keys() - known:
        raise ConfigError(f"the model has weights that a Hugging Face {model} has no place for: "
                          f"{sorted(shapes.keys() - known)}; tools/export_hf.py's hf_tensors would drop them, so it "
                          "exports none (extend it for this model)")
    for name in sorted(shapes.keys() & QK_NORM_WEIGHTS):
        if shapes[name] != (h.layers, h.d_head):
            raise ConfigError(f"{name} has shape {shapes[name]}; {model}'s {name.split('.')[-1]} is one gain per "
                              f"head dimension, [layers, D] = {(h.layers, h.d_head)}, so this run cannot be exported")
    return qk_norm


def check_expressible(h):
    """A ConfigError unless Glm4Moe computes what train.experts_block does for model config `h` (experts > 0)."""
    if h.experts == 1:
        raise ConfigError("model.experts is 1: Glm4Moe, the Hugging Face class with our router, ranks its expert "
                          "group by its top 2 experts, so it needs 2 or more; this run cannot be exported")
    if h.expert_d_ff < 1 or h.d_ff % h.expert_d_ff:
        raise ConfigError(f"model.d_ff {h.d_ff} is not a multiple of model.expert_d_ff {h.expert_d_ff}: Glm4Moe's "
                          "shared expert has n_shared_experts x moe_intermediate_size hidden units, so the dense "
                          "SwiGLU must be a whole number of experts wide (or 0); this run cannot be exported")


def hf_tensors(w, h) -> dict[str, np.ndarray]:
    """HF parameter names -> float32 arrays, from train.Model numpy weights `w`, for the class
    hf_class names (check_weights stops the export at a weight it has no place for)."""
    qk_norm = check_weights(w, h)
    M, Q, K, D = h.d_model, h.n_q_per_kv, h.n_kv, h.d_head
    out = {"model.embed_tokens.weight": w.embed, "model.norm.weight": w.final_norm, "lm_head.weight": w.unembed.T}
    layers = w.layers
    for i in range(h.layers):
        p = f"model.layers.{i}."
        mlp = p + ("mlp.shared_experts." if h.experts else "mlp.")  # Glm4Moe: the dense SwiGLU is the shared expert
        out |= {
            p + "input_layernorm.weight": layers.attn_norm[i],
            # [M, Q, K, D] -> [K, Q, D, M] -> [(k q d), M]: HF head k * Q + q.
            p + "self_attn.q_proj.weight": layers.w_q[i].transpose(2, 1, 3, 0).reshape(K * Q * D, M),
            p + "self_attn.k_proj.weight": layers.w_k[i].reshape(M, K * D).T,
            p + "self_attn.v_proj.weight": layers.w_v[i].reshape(M, K * D).T,
            # [Q, K, D, M] -> [M, K, Q, D] -> [M, (k q d)].
            p + "self_attn.o_proj.weight": layers.w_o[i].transpose(3, 1, 0, 2).reshape(M, K * Q * D),
            p + "post_attention_layernorm.weight": layers.ffn_norm[i],
            mlp + "gate_proj.weight": layers.w_gate[i].T,
            mlp + "up_proj.weight": layers.w_up[i].T,
            mlp + "down_proj.weight": layers.w_down[i].T,
        }
        if qk_norm:  # one gain [D] shared by every head (Qwen3's and Glm4Moe's RMSNorm over head_dim)
            out |= {p + "self_attn.q_norm.weight": layers.q_norm[i], p + "self_attn.k_norm.weight": layers.k_norm[i]}
        if h.experts:  # the router [E, M] and the bias that picks, not weighs (Glm4MoeTopkRouter)
            out[p + "mlp.gate.weight"] = layers.router[i].T
            out[p + "mlp.gate.e_score_correction_bias"] = layers.expert_bias[i]
        for e in range(h.experts):  # one module an expert, as GLM-4.5's checkpoints (transformers stacks them)
            out |= {
                p + f"mlp.experts.{e}.gate_proj.weight": layers.expert_gate[i, e].T,
                p + f"mlp.experts.{e}.up_proj.weight": layers.expert_up[i, e].T,
                p + f"mlp.experts.{e}.down_proj.weight": layers.expert_down[i, e].T,
            }
    return {name: np.ascontiguousarray(x, dtype=np.float32) for name, x in out.items()}


def pad_id(data_vocab: int, model_vocab: int, eos_id: int | None) -> int | None:
    """The exported pad id: the first id above the data's if the model has one (PAD_TOKEN), else
    the end-of-document id (padding is masked out, so it is never read), else None."""
    return data_vocab if data_vocab < model_vocab else eos_id


def hf_config(h, max_positions: int, eos_id: int | None, pad: int | None = None, qk_norm: bool = False) -> dict:
    """config.json of the class hf_class names."""
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": h.vocab, "hidden_size": h.d_model,
        "intermediate_size": h.d_ff, "num_hidden_layers": h.layers, "num_attention_heads": h.n_q_per_kv * h.n_kv,
        "num_key_value_heads": h.n_kv, "head_dim": h.d_head, "hidden_act": "silu", "rms_norm_eps": h.norm_eps,
        "rope_theta": h.rope_base, "rope_parameters": {"rope_type": "default", "rope_theta": h.rope_base},
        "max_position_embeddings": max_positions, "attention_bias": False, "mlp_bias": False,
        "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": eos_id, "pad_token_id": pad,
        "torch_dtype": "float32", "dtype": "float32",
    }
    if hf_class(h, qk_norm) == "LlamaForCausalLM":
        return config
    del config["mlp_bias"]
    if not h.experts:  # Qwen3: Llama's attention with q_norm and k_norm, every layer attending to all before it
        return config | {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "use_sliding_window": False}
    # Glm4Moe's defaults that differ from our model, set back: RoPE on half of each head, no MoE in the first
    # layer, a multi-token prediction layer. Its router's groups do nothing with one group (n_group 1).
    return config | {
        "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "partial_rotary_factor": 1.0,
        "rope_parameters": {"rope_type": "default", "rope_theta": h.rope_base, "partial_rotary_factor": 1.0},
        "use_qk_norm": qk_norm, "first_k_dense_replace": 0, "num_nextn_predict_layers": 0,
        "n_routed_experts": h.experts, "num_experts_per_tok": h.experts_per_token,
        "moe_intermediate_size": h.expert_d_ff, "n_shared_experts": h.d_ff // h.expert_d_ff,
        "norm_topk_prob": True, "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1,
    }


def generation_config(data_vocab: int, model_vocab: int, eos_id: int | None, pad: int | None) -> dict:
    """Greedy `generate` picks what sample.py picks: never 0 (the begin-of-document input) nor an
    id above the data's (sample.py chooses among 1..data_vocab - 1)."""
    return {"bos_token_id": 0, "eos_token_id": eos_id, "pad_token_id": pad, "decoder_start_token_id": 0,
            "suppress_tokens": [0, *range(data_vocab, model_vocab)]}


def offset_steps(processor: dict | None) -> list[dict]:
    """What `processor` does to offsets without adding tokens, as ByteLevel steps: ByteLevel's own,
    and RobertaProcessing's trimming (which it applies even without special tokens)."""
    kind = (processor or {}).get("type")
    if kind == "Sequence":
        return [step for p in processor.get("processors") or [] for step in offset_steps(p)]
    if kind == "ByteLevel":
        return [processor]
    if kind == "RobertaProcessing" and processor.get("trim_offsets", True):
        return [{"type": "ByteLevel", "add_prefix_space": processor.get("add_prefix_space", True), "trim_offsets": True,
                 "use_regex": True}]
    return []


def begin_of_document_post_processor(processor: dict | None) -> dict:
    """A post-processor that puts BOS_TOKEN (id 0) before the text and adds no other token (the
    dataset's documents were encoded without special tokens); offsets are the original's."""
    kept = offset_steps(processor)
    template = {"type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": BOS_TOKEN, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"SpecialToken": {"id": BOS_TOKEN, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                         {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {BOS_TOKEN: {"id": BOS_TOKEN, "ids": [0], "tokens": [BOS_TOKEN]}}}
    return {"type": "Sequence", "processors": [*kept, template]} if kept else template


def exported_tokenizer_json(text: str, pad: int | None, data_vocab: int) -> dict:
    """shifted_tokenizer_json with begin_of_document_post_processor and, when `pad` is the first
    id above the data's, PAD_TOKEN at that id."""
    tok = shifted_tokenizer_json(text)
    tok["post_processor"] = begin_of_document_post_processor(tok["post_processor"])
    if pad == data_vocab:
        tok["added_tokens"].append({"id": pad, "content": PAD_TOKEN, "single_word": False, "lstrip": False,
                                    "rstrip": False, "normalized": False, "special": True})
    return tok


def shifted_post_processor(processor: dict | None) -> dict | None:
    """A tokenizer.json post_processor with the ids of the special tokens it adds shifted by
    one, for every kind the tokenizers library has; any other kind is a TokenizerError."""
    if processor is None:
        return None
    kind = processor.get("type")
    if kind == "TemplateProcessing":  # special_tokens: {name: {"id", "ids": [...], "tokens"}}
        for special in (processor.get("special_tokens") or {}).values():
            special["ids"] = [i + 1 for i in special.get("ids", [])]
    elif kind in ("BertProcessing", "RobertaProcessing"):  # sep and cls: [token, id]
        for field in ("sep", "cls"):
            token, token_id = processor[field]
            processor[field] = [token, token_id + 1]
    elif kind == "Sequence":
        processor["processors"] = [shifted_post_processor(p) for p in processor.get("processors") or []]
    elif kind != "ByteLevel":  # ByteLevel only trims offsets: no ids
        raise TokenizerError(f"tokenizer post_processor type {kind!r} is not one the export can shift ids of "
                             "(TemplateProcessing, BertProcessing, RobertaProcessing, ByteLevel, Sequence)")
    return processor


def shifted_tokenizer_json(text: str) -> dict:
    """The tokenizer.json with every id + 1 and BOS_TOKEN at id 0 (seqax's ids): the model's
    vocabulary, the added tokens, the special tokens of the post-processor and the padding id."""
    tok = json.loads(text)
    model = tok["model"]
    if isinstance(model.get("vocab"), dict):  # BPE, WordPiece, WordLevel
        model["vocab"] = {BOS_TOKEN: 0, **{t: i + 1 for t, i in model["vocab"].items()}}
    elif isinstance(model.get("vocab"), list):  # Unigram: [token, score] by id
        model["vocab"] = [[BOS_TOKEN, 0.0], *model["vocab"]]
        if model.get("unk_id") is not None:
            model["unk_id"] += 1
    else:
        raise TokenizerError(f"tokenizer model type {model.get('type')!r} has no vocabulary to shift")
    added = [{**t, "id": t["id"] + 1} for t in tok.get("added_tokens") or []]
    tok["added_tokens"] = [{"id": 0, "content": BOS_TOKEN, "single_word": False, "lstrip": False, "rstrip": False,
                            "normalized": False, "special": True}, *added]
    tok["post_processor"] = shifted_post_processor(tok.get("post_processor"))
    if (tok.get("padding") or {}).get("pad_id") is not None:
        tok["padding"]["pad_id"] += 1
    return tok


def export(run_dir: str, output: str, step: int | None = None, dataset: str | None = None,
           overwrite: bool = False) -> int:
    """Writes the HF model directory; returns the checkpoint step exported. Everything goes to
    `<output>.tmp-<random>`, checked (export_check.check_logits) and renamed into place when complete:
    an interrupted or refused export leaves no half-written output, and --overwrite replaces the old
    one whole (no stale files)."""
    check_output_apart(output, paths_read(run_dir, dataset))
    if os.path.lexists(output) and not overwrite:
        raise ConfigError(f"--output {output!r} exists; pass --overwrite to replace it, or choose another --output")
    try:
        from safetensors import SafetensorError
        from safetensors.numpy import save_file
    except ImportError:
        raise ConfigError("the export writes safetensors, which is not installed: it is in requirements.txt, "
                          "which `make` installs") from None
    run = load_run_config(run_dir)
    if run.model.experts:
        check_expressible(run.model)
    mesh = run_mesh(run.model, train.Model, None, None)
    step, on_mesh = load_weights(run_dir, run, mesh, train.init_weights, train.Model, step)
    weights = jax.device_get(on_mesh)
    qk_norm = check_weights(weights, run.model)
    dataset = dataset or run.dataset_path
    if not os.path.isdir(dataset):
        raise DatasetError(f"dataset {dataset!r} (for its tokenizer) does not exist; pass --dataset PATH")
    group_attrs = dict(zarr.open_group(dataset, mode="r").attrs)
    attrs = group_attrs.get("tokenizer", {})
    # ids the data can hold: 0..data_vocab - 1
    data_vocab = attrs.get("vocab_size") or group_attrs.get("max_token_id", run.model.vocab - 1) + 1
    eos, pad = attrs.get("eos_id"), pad_id(data_vocab, run.model.vocab, attrs.get("eos_id"))
    tmp = f"{output.rstrip(os.sep)}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        os.makedirs(tmp)
    except OSError as e:
        raise ConfigError(f"cannot write --output {output!r}: {e.strerror or e} ({e.filename or tmp}); "
                          "choose a writable place for --output") from None
    try:
        config = hf_config(run.model, max(run.seq_len, 2048), eos, pad, qk_norm)
        write_json(os.path.join(tmp, "config.json"), config)
        weights_file = os.path.join(tmp, "model.safetensors")
        save_file(hf_tensors(weights, run.model), weights_file, metadata={"format": "pt"})
        # safetensors writes its file 0600 (private); it gets the mode that open() gave config.json
        # (0644 under the usual umask 022), so that whoever may read the export may read its weights.
        os.chmod(weights_file, stat.S_IMODE(os.stat(os.path.join(tmp, "config.json")).st_mode))
        write_json(os.path.join(tmp, "generation_config.json"),
                   generation_config(data_vocab, run.model.vocab, eos, pad))
        if attrs.get("kind") in ("tokenizers", "bytes"):
            if attrs["kind"] == "bytes":  # the same ids as a tokenizer.json, for transformers and lm-eval
                text = ByteTokenizer(eos is not None).tokenizer_json()
                attrs = {**attrs, "eos_token": EOD_TOKEN if eos is not None else None}
            else:
                text = zarr.open_group(dataset, mode="r")[attrs["stored_as"]][:].tobytes().decode("utf-8")
            with open(os.path.join(tmp, "tokenizer.json"), "w") as f:
                json.dump(exported_tokenizer_json(text, pad, data_vocab), f, ensure_ascii=False)
            # The post-processor adds <seqax_bos>; add_bos_token False keeps transformers from adding another.
            tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS_TOKEN,
                                "add_bos_token": False, "add_eos_token": False, "model_max_length": run.seq_len}
            if attrs.get("eos_token"):
                tokenizer_config["eos_token"] = attrs["eos_token"]
            if pad is not None:
                tokenizer_config["pad_token"] = PAD_TOKEN if pad == data_vocab else attrs.get("eos_token")
            write_json(os.path.join(tmp, "tokenizer_config.json"), tokenizer_config)
        print(check_logits(tmp, config["architectures"][0], run.model, on_mesh, mesh, dataset, data_vocab),
              flush=True)
        replace(tmp, output)
    except (OSError, SafetensorError) as e:  # a full disk, a quota (safetensors' I/O errors are its own kind)
        shutil.rmtree(tmp, ignore_errors=True)
        cause = e.strerror or e if isinstance(e, OSError) else str(e).removeprefix("Error while serializing: ")
        raise ConfigError(f"writing --output {output!r} failed: {cause} (in {tmp}); free space or choose another "
                          "--output; nothing of this export was kept") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return step


def write_json(path: str, value: dict):
    with open(path, "w") as f:
        json.dump(value, f, indent=2)


def replace(tmp: str, output: str):
    """Renames `tmp` to `output`; an existing output (directory or file) is renamed away first
    and deleted after, so `output` is always the old export or the new one, whole."""
    old = f"{output.rstrip(os.sep)}.old-{uuid.uuid4().hex[:8]}"
    if os.path.lexists(output):
        os.rename(output, old)
    os.rename(tmp, output)
    if os.path.isdir(old) and not os.path.islink(old):
        shutil.rmtree(old)
    elif os.path.lexists(old):
        os.remove(old)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--step", type=int, help="checkpoint step (default: the newest)")
    parser.add_argument("--output", required=True, help="the HF model directory to write")
    parser.add_argument("--dataset", help="the run's dataset, for its tokenizer (default: the run's dataset.path)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing --output (whole: no file of the old export stays)")
    args = parser.parse_args(argv)
    try:
        step = export(args.run_dir, args.output, args.step, args.dataset, args.overwrite)
    except SeqaxError as e:
        print(f"seqax: error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"wrote checkpoint {step} of {args.run_dir} to {args.output}")


if __name__ == "__main__":
    main()
