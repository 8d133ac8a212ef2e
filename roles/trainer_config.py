"""The Trainer's settings (the `trainer:` section of a run) and their checks."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Optional, Tuple, Union

from omegaconf import OmegaConf

from roles.engines.torch_trainer import OPTIMIZERS
from roles.lora import LoraConfig, lora_problems

SCHEDULES = ("cosine", "linear", "constant")
COMPUTE_DTYPES = ("auto", "float32", "bfloat16", "float16")
# TrainerConfig fields only the torch engine honours.
KERNEL_OPTIONS = ("packing", "compile", "cuda_graphs", "activation_checkpointing", "chunked_logprobs",
                  "fused_logprobs")


@dataclass
class TrainerConfig:
    # Peak learning rate of AdamW, reached at the end of warmup.
    lr: float = 1e-5
    # Decoupled AdamW weight decay, applied to matrices only (not to norm weights or biases).
    weight_decay: float = 0.0
    # AdamW moment decay rates (beta1, beta2).
    betas: Tuple[float, float] = (0.9, 0.999)
    # AdamW's epsilon, added to the root of the second moment.
    adam_eps: float = 1e-8
    # AdamW kernel: 'adamw' (torch's choice), 'adamw_fused' (one fused kernel), 'adamw_foreach'
    # (per tensor list) or 'adamw_for_loop' (per tensor); the same update on every engine.
    optimizer: str = "adamw"
    # Optimizer updates of linear warmup from lr / warmup_steps up to lr; 0 starts at lr.
    warmup_steps: int = 0
    # Update at which the cosine or linear decay reaches min_lr (it stays there after it).
    total_steps: int = 1000
    # Learning rate after warmup: 'cosine' or 'linear' (decay to min_lr at total_steps) or 'constant'.
    schedule: str = "cosine"
    # Learning rate at the end of a cosine or linear decay.
    min_lr: float = 0.0
    # Warmup as a fraction of the run's updates (sets warmup_steps when given); null: warmup_steps.
    warmup_ratio: Optional[float] = None
    # Clip the global gradient norm to this value; 0 disables clipping (the norm is still reported).
    grad_clip: float = 1.0
    # Sequences per forward/backward on one device; a rank's share of a step is split into
    # micro-batches of this size and their gradients accumulated (exactly: the loss is
    # normalised by the step's totals). 0: chosen per call, the whole share when its estimated
    # activations fit micro_batch_memory_mb, else the most rows that fit.
    micro_batch_per_device: int = 0
    # Activation memory (MiB) one forward/backward may take when micro_batch_per_device is 0.
    micro_batch_memory_mb: float = 2048.0
    # Seed of torch's global RNG (dropout), offset by the data-parallel rank.
    seed: int = 0
    # Compute device: 'auto' (CUDA if torch can use it, else CPU), 'cpu', 'cuda' or 'cuda:N'.
    device: str = "auto"
    # Compute precision over fp32 master weights: 'float32', 'bfloat16', 'float16' (autocast),
    # or 'auto' (bfloat16 on CUDA, float32 on CPU).
    dtype: str = "auto"
    # Forward options of the torch engine (KERNEL_OPTIONS; docs/gpu.md measures them), all off:
    # pack a micro-batch's real tokens into one sequence (FlashAttention varlen on CUDA); without
    # compile the output head and log-softmax then run on those tokens only, unless the loss reads
    # the logits (with compile, fused_logprobs does that).
    packing: bool = False
    # torch.compile the model's forward (about a minute of compilation per new shape).
    compile: bool = False
    # With compile, on CUDA: replay the compiled forward and backward as CUDA graphs (the host stops
    # launching each kernel; docs/gpu.md). A graph per input shape: pair it with packing, whose
    # lengths are rounded to 8 sizes per power of two. Its graphs' memory stays through offload,
    # and each onload records them again: for a trainer that keeps its weights on the device.
    cuda_graphs: bool = False
    # Recompute each layer's activations in the backward pass: less memory, more compute.
    activation_checkpointing: bool = False
    # Token logprobs from the last hidden states chunk by chunk, without the [B, T, V] float32
    # logits (a loss that reads logits or entropy still gets the full logits).
    chunked_logprobs: bool = False
    # With compile: token logprobs from one compiled function of the model, its output head and
    # the log-softmax (one pass over the 16-bit logits, no float32 copy; faster than
    # chunked_logprobs, which holds less: the [tokens, V] 16-bit logits stay for the backward).
    # Entropies (GRPO logs them) come from the same pass; a loss that reads logits gets the full logits.
    fused_logprobs: bool = False
    # LoRA: a low-rank adapter trained on the frozen base (peft; rank 0: full-parameter training).
    # The optimizer, gradients and clipping cover the adapter (and modules_to_save) only.
    lora: LoraConfig = field(default_factory=LoraConfig)


def every_weight(config: TrainerConfig) -> TrainerConfig:
    """`config` training every parameter (no LoRA adapter): a warm start that stands for the
    pretrained model a LoRA run adapts."""
    return replace(config, lora=replace(config.lora, rank=0))


def resolve_trainer_config(config: Union[TrainerConfig, Mapping[str, Any], None]) -> TrainerConfig:
    """A validated TrainerConfig from a TrainerConfig, a mapping/DictConfig of its fields, or None."""
    if config is None:
        cfg = TrainerConfig()
    elif isinstance(config, TrainerConfig):
        cfg = config
    else:  # unknown keys and wrong types fail here, naming the key
        cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainerConfig), config))
    problems = []
    if cfg.schedule not in SCHEDULES:
        problems.append(f"schedule='{cfg.schedule}' (choose one of {SCHEDULES})")
    if cfg.optimizer not in OPTIMIZERS:
        problems.append(f"optimizer='{cfg.optimizer}' (choose one of {tuple(OPTIMIZERS)})")
    if not cfg.adam_eps > 0:
        problems.append(f"adam_eps={cfg.adam_eps} must be > 0")
    if cfg.dtype not in COMPUTE_DTYPES:
        problems.append(f"dtype='{cfg.dtype}' (choose one of {COMPUTE_DTYPES})")
    if cfg.micro_batch_per_device < 0 or cfg.warmup_steps < 0 or cfg.grad_clip < 0:
        problems.append("micro_batch_per_device, warmup_steps and grad_clip must be >= 0")
    if not cfg.micro_batch_memory_mb > 0:
        problems.append(f"micro_batch_memory_mb={cfg.micro_batch_memory_mb} must be > 0")
    if cfg.schedule != "constant" and cfg.total_steps <= cfg.warmup_steps:
        problems.append(f"total_steps={cfg.total_steps} must exceed warmup_steps={cfg.warmup_steps} "
                        f"for the {cfg.schedule} schedule")
    if not 0.0 <= cfg.min_lr <= cfg.lr:
        problems.append(f"min_lr={cfg.min_lr} must be in [0, lr={cfg.lr}]")
    if cfg.cuda_graphs and not cfg.compile:
        problems.append("cuda_graphs=true replays compiled graphs: set compile=true too")
    if cfg.fused_logprobs and not cfg.compile:
        problems.append("fused_logprobs=true is a compiled function: set compile=true too")
    if cfg.fused_logprobs and cfg.chunked_logprobs:
        problems.append("fused_logprobs and chunked_logprobs are two ways to the same logprobs: set one")
    problems.extend(lora_problems(cfg.lora))
    if len(cfg.betas) != 2:
        problems.append(f"betas={cfg.betas} must hold two values")
    if problems:
        raise ValueError("trainer config: " + "; ".join(problems))
    cfg.betas = tuple(float(b) for b in cfg.betas)
    return cfg
