"""HF Qwen2/Qwen3/Llama <-> Megatron-core GPTModel: model config, layer spec and weights.

    shards = hf_to_megatron(hf_model.state_dict(), hf_model.config, tp=2)   # one dict per TP rank
    hf_state = megatron_to_hf(shards, hf_model.config)                       # exact inverse

Megatron layouts the conversion follows (local, non-TransformerEngine spec):
* `linear_qkv` fuses q, k and v per query group: for each KV head g the rows are
  [its q heads, k_g, v_g]; tensor parallel gives each rank whole groups (and so the
  q heads that belong to them, matching HF's grouped-query attention).
* `linear_fc1` is [gate; up] per rank: rank r holds rows r of gate then rows r of up.
* `linear_proj` and `linear_fc2` are row-parallel (split along the input dimension).
* Embedding and output layer are vocab-parallel; the vocabulary is padded with zero rows
  to a multiple of the TP size, and the padding is dropped again on the way back.
* Qwen3's per-head q_norm/k_norm are Megatron's `qk_layernorm` (q_layernorm/k_layernorm),
  replicated on every TP rank like the other norms.
RoPE follows HF's rotate-half convention, so q/k rows need no permutation.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.nn.functional as F

ARCHS = ("qwen2", "qwen3", "llama")
# Replicated norm weights whose gradient on a TP rank is a part of the whole (the engine sums
# them over the TP group): q/k norms see only their rank's heads. (With sequence parallelism
# every norm sees only its rank's positions: `sequence_parallel` on the weight marks those.)
QK_NORMS = ("self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight")


def _head_dim(c: Any) -> int:
    return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads


def _rope_theta(c: Any) -> float:
    params = getattr(c, "rope_parameters", None) or {}
    if params.get("rope_type", "default") != "default":
        raise ValueError(f"rope_type '{params['rope_type']}' has no Megatron mapping here; "
                         "use a model with default RoPE or backend.train=torch")
    return float(params.get("rope_theta", getattr(c, "rope_theta", 10000.0)))


def megatron_problems(c: Any, tp: int) -> list[str]:
    """What of HF config `c` the conversion does not map at tensor-parallel size `tp` (empty:
    the model runs on the Megatron engines)."""
    if c.model_type not in ARCHS:
        return [f"model type '{c.model_type}' (the converter maps {list(ARCHS)})"]
    problems = []
    if getattr(c, "hidden_act", "silu") != "silu":
        problems.append(f"hidden_act='{c.hidden_act}' (SwiGLU with silu only)")
    if c.model_type in ("llama", "qwen3") and (getattr(c, "attention_bias", False) or getattr(c, "mlp_bias", False)):
        problems.append(f"{c.model_type} attention_bias/mlp_bias")
    if getattr(c, "use_sliding_window", False):
        problems.append("sliding-window attention")
    if c.num_key_value_heads % tp:
        problems.append(f"num_key_value_heads={c.num_key_value_heads} not divisible by "
                        f"megatron.tensor_parallel_size={tp}")
    if c.intermediate_size % tp:
        problems.append(f"intermediate_size={c.intermediate_size} not divisible by "
                        f"megatron.tensor_parallel_size={tp}")
    return problems


def check_hf_config(c: Any, tp: int) -> None:
    """Refuse what the conversion does not map, naming the setting and the fix."""
    problems = megatron_problems(c, tp)
    if problems:
        raise ValueError("Megatron engine cannot run this model: " + "; ".join(problems)
                         + ". Fix: change megatron.tensor_parallel_size or use backend.train=torch")


def padded_vocab(vocab_size: int, tp: int) -> int:
    """Vocabulary rows in Megatron: the next multiple of the TP size."""
    return -(-vocab_size // tp) * tp


def transformer_config(c: Any, tp: int, cpu: bool, sequence_parallel: bool, params_dtype: torch.dtype = torch.float32):
    """Megatron TransformerConfig equal to HF config `c`; fusions that need CUDA kernels off.
    `sequence_parallel` (TP > 1 only) splits the positions of norms and residuals over the TP ranks."""
    # megatron-core is optional (the megatron engines): imported on use
    from megatron.core.transformer.transformer_config import TransformerConfig

    check_hf_config(c, tp)
    return TransformerConfig(
        num_layers=c.num_hidden_layers, hidden_size=c.hidden_size, ffn_hidden_size=c.intermediate_size,
        num_attention_heads=c.num_attention_heads, num_query_groups=c.num_key_value_heads,
        kv_channels=_head_dim(c), tensor_model_parallel_size=tp, sequence_parallel=sequence_parallel and tp > 1,
        qk_layernorm=c.model_type == "qwen3",
        normalization="RMSNorm", layernorm_epsilon=c.rms_norm_eps,
        gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=c.model_type == "qwen2",
        hidden_dropout=0.0, attention_dropout=0.0, attention_softmax_in_fp32=True,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        use_cpu_initialization=cpu, params_dtype=params_dtype)


class _RMSNorm:
    """Megatron's norm slot filled with torch's RMSNorm, its weight marked `sequence_parallel`
    as the config says (Megatron's own torch norm refuses sequence parallelism)."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, **_):
        norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        norm.weight.sequence_parallel = config.sequence_parallel
        return norm


def build_gpt_model(c: Any, tp: int, cpu: bool, sequence_parallel: bool):
    """An uninitialised-weights GPTModel shaped like HF config `c` (parallel state must exist)."""
    # megatron-core is optional (the megatron engines): imported on use
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    config = transformer_config(c, tp, cpu, sequence_parallel=sequence_parallel)
    layer = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=config.qk_layernorm)
    parts, attention = layer.submodules, layer.submodules.self_attention.submodules
    parts.input_layernorm = parts.pre_mlp_layernorm = _RMSNorm
    if config.qk_layernorm:
        attention.q_layernorm = attention.k_layernorm = _RMSNorm
    return GPTModel(
        config, TransformerBlockSubmodules(layer_specs=[layer] * c.num_hidden_layers, layer_norm=_RMSNorm),
        vocab_size=padded_vocab(c.vocab_size, tp), max_sequence_length=c.max_position_embeddings,
        share_embeddings_and_output_weights=bool(c.tie_word_embeddings), position_embedding_type="rope",
        rotary_base=_rope_theta(c), parallel_output=True)


# ---------------------------------------------------------------------- weights
def _vocab_split(w: torch.Tensor, c: Any, tp: int) -> list[torch.Tensor]:
    pad = padded_vocab(c.vocab_size, tp) - w.shape[0]
    return list(F.pad(w, (0, 0, 0, pad)).chunk(tp)) if pad else list(w.chunk(tp))


def _qkv_split(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, c: Any, tp: int) -> list[torch.Tensor]:
    """Fuse q/k/v (weights [rows, H] or biases [rows]) per query group, then split groups."""
    groups, d = c.num_key_value_heads, _head_dim(c)
    tail = q.shape[1:]
    fused = torch.cat([q.reshape(groups, -1, *tail), k.reshape(groups, d, *tail), v.reshape(groups, d, *tail)], 1)
    return [part.reshape(-1, *tail) for part in fused.chunk(tp)]


def _qkv_merge(parts: list[torch.Tensor], c: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups, d = c.num_key_value_heads, _head_dim(c)
    per_group = c.num_attention_heads // groups * d
    tail = parts[0].shape[1:]
    fused = torch.cat(parts).reshape(groups, per_group + 2 * d, *tail)
    q, k, v = fused.split([per_group, d, d], dim=1)
    return q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)


def hf_to_megatron(hf: Mapping[str, torch.Tensor], c: Any, tp: int = 1) -> list[dict[str, torch.Tensor]]:
    """Per-TP-rank Megatron state dicts (parameters only) from an HF state dict."""
    check_hf_config(c, tp)
    out: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]

    def put(name: str, parts: list[torch.Tensor]) -> None:
        for rank, part in enumerate(parts):
            out[rank][name] = part.clone()

    put("embedding.word_embeddings.weight", _vocab_split(hf["model.embed_tokens.weight"], c, tp))
    for i in range(c.num_hidden_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        put(m + "input_layernorm.weight", [hf[h + "input_layernorm.weight"]] * tp)
        a = h + "self_attn."
        put(m + "self_attention.linear_qkv.weight",
            _qkv_split(hf[a + "q_proj.weight"], hf[a + "k_proj.weight"], hf[a + "v_proj.weight"], c, tp))
        if a + "q_proj.bias" in hf:
            put(m + "self_attention.linear_qkv.bias",
                _qkv_split(hf[a + "q_proj.bias"], hf[a + "k_proj.bias"], hf[a + "v_proj.bias"], c, tp))
        put(m + "self_attention.linear_proj.weight", list(hf[a + "o_proj.weight"].chunk(tp, dim=1)))
        if a + "q_norm.weight" in hf:
            put(m + "self_attention.q_layernorm.weight", [hf[a + "q_norm.weight"]] * tp)
            put(m + "self_attention.k_layernorm.weight", [hf[a + "k_norm.weight"]] * tp)
        put(m + "pre_mlp_layernorm.weight", [hf[h + "post_attention_layernorm.weight"]] * tp)
        gate, up = hf[h + "mlp.gate_proj.weight"].chunk(tp), hf[h + "mlp.up_proj.weight"].chunk(tp)
        put(m + "mlp.linear_fc1.weight", [torch.cat([g, u]) for g, u in zip(gate, up)])
        put(m + "mlp.linear_fc2.weight", list(hf[h + "mlp.down_proj.weight"].chunk(tp, dim=1)))
    put("decoder.final_layernorm.weight", [hf["model.norm.weight"]] * tp)
    if not c.tie_word_embeddings:
        put("output_layer.weight", _vocab_split(hf["lm_head.weight"], c, tp))
    return out


def megatron_to_hf(shards: list[Mapping[str, torch.Tensor]], c: Any) -> dict[str, torch.Tensor]:
    """HF state dict (HF's key order; no lm_head when tied) from all TP ranks' Megatron dicts."""
    def cat(name: str, dim: int = 0) -> torch.Tensor:
        return torch.cat([s[name] for s in shards], dim=dim)

    hf: dict[str, torch.Tensor] = {"model.embed_tokens.weight": cat("embedding.word_embeddings.weight")[:c.vocab_size].clone()}
    for i in range(c.num_hidden_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        q, k, v = _qkv_merge([s[m + "self_attention.linear_qkv.weight"] for s in shards], c)
        bias = m + "self_attention.linear_qkv.bias"
        qb, kb, vb = _qkv_merge([s[bias] for s in shards], c) if bias in shards[0] else (None, None, None)
        for proj, w, b in (("q", q, qb), ("k", k, kb), ("v", v, vb)):
            hf[f"{h}self_attn.{proj}_proj.weight"] = w
            if b is not None:
                hf[f"{h}self_attn.{proj}_proj.bias"] = b
        hf[h + "self_attn.o_proj.weight"] = cat(m + "self_attention.linear_proj.weight", dim=1)
        if m + "self_attention.q_layernorm.weight" in shards[0]:
            hf[h + "self_attn.q_norm.weight"] = shards[0][m + "self_attention.q_layernorm.weight"].clone()
            hf[h + "self_attn.k_norm.weight"] = shards[0][m + "self_attention.k_layernorm.weight"].clone()
        fc1 = [s[m + "mlp.linear_fc1.weight"].chunk(2) for s in shards]
        hf[h + "mlp.gate_proj.weight"] = torch.cat([g for g, _ in fc1])
        hf[h + "mlp.up_proj.weight"] = torch.cat([u for _, u in fc1])
        hf[h + "mlp.down_proj.weight"] = cat(m + "mlp.linear_fc2.weight", dim=1)
        # Norm weights are replicated on every TP rank; the first rank's copy is the value.
        hf[h + "input_layernorm.weight"] = shards[0][m + "input_layernorm.weight"].clone()
        hf[h + "post_attention_layernorm.weight"] = shards[0][m + "pre_mlp_layernorm.weight"].clone()
    hf["model.norm.weight"] = shards[0]["decoder.final_layernorm.weight"].clone()
    if not c.tie_word_embeddings:
        hf["lm_head.weight"] = cat("output_layer.weight")[:c.vocab_size].clone()
    return hf
