"""Teacher role: next-token distributions of a frozen model for distillation (top-k or the
full vocabulary), moved off the device and back (`offload`/`onload`) when it shares one.

    teacher = Teacher("small_qwen2")
    values, indices = teacher.logits(batch, topk=64)            # [B, T, k] logprobs, token ids
    values, indices, tail = teacher.logits(batch, topk=64, tail=True)
    full = teacher.logits(batch, topk=None)                     # [B, T, V] logprobs
    sampled = teacher.token_logprobs(batch, temperature=1.0)     # [B, T] logprob of each token

Outputs are aligned with `batch.input_ids` like every per-token field: position t is the
distribution of token t given tokens < t; position 0 and padding hold 0. Values are
log-softmax of the model's logits (divided by `temperature`) in fp32, on CPU, equal to
what a direct `transformers` forward of the same rows gives. The model runs in the dtype
of its model config, without autocast. With `engine="vllm"` a vLLM engine serves top-k only
(roles.engines.vllm_engine). With `engine="megatron"` the model is a Megatron-core
GPTModel split over `tensor_parallel_size` ranks: TP peers join their slices of the batch,
each takes the top-k of its vocabulary shard and the shards' candidates are merged.
No Ray here.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Union

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from roles.batch import Batch, fitting_rows, token_bytes
from roles.engines import megatron_trainer as mt
from roles.engines.host_copies import host_bytes, module_tensors, to_device, to_host
from roles.engines.options import TEACHER_ENGINES, MegatronOptions, check_engine
from roles.engines.torch_engine import process_memory, token_logprobs as engine_token_logprobs
from roles.engines.torch_trainer import rank_device
from roles.engines.train_kernels import (check_plain_head, chunked_token_logprobs, chunked_vocab_logprobs,
                                        next_token_vocab_logprobs, pack, packed_forward, plain_head, use_packing,
                                        vocab_logprobs)
from roles.engines.vllm_engine import VLLMEngine
from roles.models import DTYPES, ModelSpec, build_model, load_tokenizer, resolve_config
from roles.weight_transfer import WeightReceiver, load_named_weights

# TeacherConfig fields only the torch engine honours.
KERNEL_OPTIONS = ("packing", "compile", "chunked_logprobs", "fused_logprobs")


@dataclass
class TeacherConfig:
    # Compute device: 'auto' (CUDA if torch can use it, else CPU), 'cpu', 'cuda' or 'cuda:N'.
    device: str = "auto"
    # Sequences per forward pass; bounds the [micro-batch, T, V] logits held at once.
    # 0: chosen per call, the whole batch when its estimated activations fit
    # micro_batch_memory_mb, else the most rows that fit.
    micro_batch_per_device: int = 0
    # Activation memory (MiB) one forward may take when micro_batch_per_device is 0.
    micro_batch_memory_mb: float = 2048.0
    # Weight dtype of the forward ("float32", "bfloat16", "float16"); None keeps the model's
    # (a preset's is float32). vLLM's GPU attention kernels need bfloat16 or float16.
    dtype: Optional[str] = None
    # Forward options of the torch engine (KERNEL_OPTIONS; the trainer's options of the same names,
    # docs/gpu.md measures them), all off: pack a micro-batch's real tokens into one sequence
    # (FlashAttention varlen on CUDA; rows right-padded, as the drivers' batches are); without
    # compile or chunks, its top-k and logprobs come from the output head over those tokens only.
    packing: bool = False
    # torch.compile the model's forward (about a minute of compilation per new shape).
    compile: bool = False
    # Log-softmax and top-k from the last hidden states a chunk of positions at a time, without
    # the [micro-batch, T, V] float32 logits (automatic micro-batches are then sized without them).
    chunked_logprobs: bool = False
    # With compile: the output head, the log-softmax, the top-k and the tail mass compiled with the
    # model as one function (no float32 copy of the [micro-batch, T, V] logits beside the output;
    # faster than chunked_logprobs, which holds less).
    fused_logprobs: bool = False


class Teacher(WeightReceiver):
    # No state a fresh rank could not get back (weights: its model path or a sync), so a lost
    # rank may be replaced (orchestration.launch.restartable).
    RESTARTABLE = True
    # Tensor-parallel Megatron peers join their rows here: worker groups call every rank,
    # empty slices too (an empty call returns empty tensors).
    LOCKSTEP_METHODS = ("logits",)

    def __init__(self, model: ModelSpec, config: Union[TeacherConfig, Mapping[str, Any], None] = None,
                 engine: str = "torch", engine_options: Optional[Mapping[str, Any]] = None):
        check_engine("teacher", engine, TEACHER_ENGINES)
        if config is None:
            config = TeacherConfig()
        elif not isinstance(config, TeacherConfig):
            config = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TeacherConfig), config))
        if config.fused_logprobs and (not config.compile or config.chunked_logprobs):
            raise ValueError("teacher fused_logprobs is a compiled function: set teacher.engine.compile=true "
                             "and leave chunked_logprobs off")
        if config.micro_batch_per_device < 0:
            raise ValueError(f"teacher micro_batch_per_device={config.micro_batch_per_device} must be >= 0")
        if not config.micro_batch_memory_mb > 0:
            raise ValueError(f"teacher micro_batch_memory_mb={config.micro_batch_memory_mb} must be > 0")
        if config.dtype is not None and config.dtype not in DTYPES:
            raise ValueError(f"teacher dtype='{config.dtype}'; choose one of {sorted(DTYPES)} or null")
        on = [k for k in KERNEL_OPTIONS if getattr(config, k)]
        if on and engine != "torch":
            raise ValueError(f"teacher {on} need the torch engine, not {engine}")
        self.config = config
        self.model_config = resolve_config(model)
        self.tokenizer = load_tokenizer(self.model_config)
        self.device = rank_device(config.device)
        self.engine = engine
        self._vllm = None
        if engine == "vllm":  # vLLM holds the model and serves top-k through prompt logprobs
            self._vllm = VLLMEngine(self.model_config, self.tokenizer, self.device, config.dtype, engine_options,
                                    "teacher", wake_call="onload()")
            self._vocab_size, self._host, self.weight_version = self._vllm.vocab_size, None, 0
            return
        self.model = build_model(self.model_config)
        if config.dtype is not None:
            self.model = self.model.to(DTYPES[config.dtype])
        self._vocab_size = self.model.config.vocab_size
        if engine == "megatron":  # this TP rank's shard; TP peers join their slices in logits()
            tp = (engine_options or {}).get("tensor_parallel_size", MegatronOptions.tensor_parallel_size)
            # Seed 0: a frozen teacher in eval mode draws no random numbers.
            mt.setup_parallel(int(tp), self.device, seed=0)
            self.model = mt.to_megatron(self.model, mt.tp_info()[1], self.device, next(self.model.parameters()).dtype)
        self.model = self.model.to(self.device).eval()
        self.model.requires_grad_(False)
        if engine == "torch":
            self._set_options()
        self._host: Optional[list] = None
        self.weight_version = 0

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    _run: Optional[torch.nn.Module] = None  # the compiled forward (compile), else None
    # The output head, log-softmax, top-k and tail as one function of the model (fused_logprobs:
    # compiled; packing alone: eager, over the packed real tokens, never the padded [b, T, V]).
    _vocab: Optional[Callable] = None

    def _set_options(self) -> None:
        """Packing and compilation of the torch engine's forward (KERNEL_OPTIONS)."""
        c = self.config
        for option in ("chunked_logprobs", "fused_logprobs"):
            if getattr(c, option):
                check_plain_head(self.model, f"teacher {option}")
        use_packing(self.model, c.packing)
        if c.fused_logprobs:  # the module itself stays what offload and weight loads see
            self._vocab = torch.compile(functools.partial(next_token_vocab_logprobs, self.model))
        elif c.compile:
            self._run = torch.compile(self.model.base_model if c.chunked_logprobs else self.model)
        elif c.packing and not c.chunked_logprobs and plain_head(self.model):
            self._vocab = functools.partial(next_token_vocab_logprobs, self.model)

    def _torch_forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Logits [b, T, V] (HF layout), or with chunked_logprobs the last hidden states [b, T, H];
        packed: zero on padding."""
        base = self.config.chunked_logprobs
        if self.config.packing:
            return packed_forward(self.model, ids, mask, run=self._run, base=base)
        run = self._run if self._run is not None else (self.model.base_model if base else self.model)
        out = run(input_ids=ids, attention_mask=mask, use_cache=False)
        return out.last_hidden_state if base else out.logits

    def _fused_forward(self, ids: torch.Tensor, mask: torch.Tensor, topk: Optional[int], tail: bool,
                       temperature: float) -> tuple[torch.Tensor, ...]:
        """`vocab_logprobs` of the model's logits [b, T, ...] (HF layout) through `_vocab`; packed:
        zero on padding."""
        if not self.config.packing:
            return self._vocab(topk, tail, temperature, input_ids=ids, attention_mask=mask, use_cache=False)
        p = pack(self.model, ids, mask)
        return tuple(p.unpack(got[0]) for got in self._vocab(topk, tail, temperature, **p.inputs))

    @torch.no_grad()
    def _micro_batches(self, batch: Batch):
        """(rows, input ids, attention mask) of each micro-batch of `batch` on the device, sized by
        micro_batch_per_device or else by the memory a row's forward takes."""
        B, T = batch.input_ids.shape
        per_token = token_bytes(self.model, backward=False, logits=not self.config.chunked_logprobs)
        size = self.config.micro_batch_per_device or fitting_rows(B, T, per_token, self.config.micro_batch_memory_mb)
        for start in range(0, B, size):
            rows = slice(start, min(start + size, B))
            yield rows, batch.input_ids[rows].to(self.device), batch.attention_mask[rows].to(self.device)

    def logits(self, batch: Batch, topk: Optional[int] = None, tail: bool = False, temperature: float = 1.0):
        """Top-k `(logprobs [B, T, k], indices [B, T, k])`, plus the tail mass
        `log(1 - sum of the top-k probabilities)` [B, T] as a third tensor when `tail`;
        or, with `topk=None`, the full-vocabulary logprobs [B, T, V]."""
        if self._host is not None:
            raise RuntimeError("teacher is offloaded; call onload() before logits()")
        V = self.vocab_size
        if topk is not None and not 1 <= topk <= V:
            raise ValueError(f"topk={topk} must lie in 1..{V} (the vocabulary size), or be None for full logits")
        if topk is None and tail:
            raise ValueError("tail=True needs topk; the full distribution has no tail")
        if temperature <= 0:
            raise ValueError(f"temperature={temperature} must be > 0")
        if self._vllm and len(batch.input_ids):
            return self._vllm.topk_logprobs(batch.input_ids, batch.attention_mask, topk, tail, temperature)
        own = slice(None)
        if self.engine == "megatron":
            batch, own = mt.join_rows(batch)
        B, T = batch.input_ids.shape
        width = V if topk is None else topk
        values = torch.zeros(B, T, width)
        indices = torch.zeros(B, T, width, dtype=torch.long) if topk is not None else None
        tails = torch.zeros(B, T) if tail else None
        for rows, ids, mask in self._micro_batches(batch):
            keep = mask[:, 1:].bool().unsqueeze(-1)
            if self.engine == "megatron":
                local = mt.local_logits(self.model, ids)
                if topk is not None:  # merged across the vocabulary shards of the TP ranks
                    top = mt.topk_logprobs(local[:, :-1], V, topk, temperature, tail)
                    values[rows, 1:] = torch.where(keep, top[0], 0.0).cpu()
                    indices[rows, 1:] = torch.where(keep, top[1], 0).cpu()
                    if tail:
                        tails[rows, 1:] = torch.where(keep.squeeze(-1), top[2], 0.0).cpu()
                    continue
                outs = vocab_logprobs(mt.gather_vocab(local, V), None, False, temperature)
            elif not bool(mask.any()):
                continue  # padding only: every output stays 0
            elif self.config.chunked_logprobs:  # only the kept positions, a chunk at a time
                hidden = self._torch_forward(ids, mask)[:, :-1][keep[..., 0]]
                flat = chunked_vocab_logprobs(hidden, self.model.get_output_embeddings(), topk, tail, temperature,
                                              values.device)
                kept = keep[..., 0].cpu()
                values[rows, 1:][kept] = flat[0]
                if topk is not None:
                    indices[rows, 1:][kept] = flat[1]
                if tail:
                    tails[rows, 1:][kept] = flat[2]
                continue
            elif self._vocab is not None:
                outs = self._fused_forward(ids, mask, topk, tail, temperature)
            else:
                outs = vocab_logprobs(self._torch_forward(ids, mask), topk, tail, temperature)
            # Row t of the output predicts token t + 1: it becomes aligned position t + 1.
            for out, got in zip((values, indices, tails), outs):
                kept = keep if got.dim() == 3 else keep[..., 0]
                out[rows, 1:] = torch.where(kept, got[:, :-1], 0).cpu()
        if topk is None:
            return values[own]
        return (values[own], indices[own], tails[own]) if tail else (values[own], indices[own])

    @torch.no_grad()
    def token_logprobs(self, batch: Batch, temperature: float) -> torch.Tensor:
        """The logprob of each of the batch's own tokens [B, T] at `temperature`: position t holds
        log p(input_ids[t] | tokens < t), 0 at position 0 and on padding (GRPO's teacher signal:
        the teacher's view of each sampled token). Keeps one value a position, never a [B, T, k]
        or [B, T, V] output. Torch engine only (vLLM serves top-k; Megatron's TP ranks meet in
        `logits`)."""
        if self._host is not None:
            raise RuntimeError("teacher is offloaded; call onload() before token_logprobs()")
        if self.engine != "torch":
            raise ValueError(f"teacher token_logprobs needs the torch engine, not {self.engine}")
        if temperature <= 0:
            raise ValueError(f"temperature={temperature} must be > 0")
        B, T = batch.input_ids.shape
        out = torch.zeros(B, T)
        for rows, ids, mask in self._micro_batches(batch):
            if not bool(mask.any()):
                continue  # padding only: every output stays 0
            if self.config.chunked_logprobs:
                got = chunked_token_logprobs(self._torch_forward(ids, mask), self.model.get_output_embeddings(), ids,
                                             mask, temperature)
            elif self.config.fused_logprobs:  # the compiled log-softmax [b, T, V], picked here
                full = self._fused_forward(ids, mask, None, False, temperature)[0]
                got = F.pad(full[:, :-1].gather(-1, ids[:, 1:, None])[..., 0], (1, 0))
            else:
                got = engine_token_logprobs(self._torch_forward(ids, mask), ids, temperature)
            out[rows] = torch.where(mask.bool(), got.float(), 0.0).cpu()
        return out

    def update_weights(self, buckets: Any, version: int) -> None:
        """Load a trainer's weights (self-distillation: the teacher follows the student);
        (name, tensor) pairs or buckets of them, all weights, names and shapes exact."""
        if self._host is not None:
            raise RuntimeError("teacher is offloaded; call onload() before update_weights()")
        pairs = [p for b in buckets for p in (b if isinstance(b, list) else [b])]
        if self._vllm:
            self._vllm.load_weights(pairs, version)
        else:
            load_named_weights(self.model, pairs, "teacher")
        self.weight_version = int(version)

    def update_weights_from_path(self, path: str, version: int) -> None:
        """Load weights from a folder of safetensors files (or one file)."""
        from safetensors.torch import load_file

        files = sorted(Path(path).glob("*.safetensors")) if Path(path).is_dir() else [Path(path)]
        self.update_weights([p for f in files for p in load_file(str(f)).items()], version)

    def offload(self) -> dict[str, float]:
        """Move the weights into host buffers, releasing device memory; returns bytes moved."""
        if self._vllm:  # vLLM's sleep mode (on CPU only a state change: see roles.engines.vllm_engine)
            return self._vllm.sleep(1)
        if self._host is None:
            self._host = to_host(module_tensors(self.model))
            return {"model_bytes": host_bytes(self._host)}
        return {"model_bytes": 0}

    def onload(self) -> dict[str, float]:
        """Bring the weights back, bit-identical."""
        if self._vllm:
            return self._vllm.wake_up()
        if self._host is None:
            return {"model_bytes": 0}
        moved = to_device(self._host)
        self._host = None
        return {"model_bytes": moved}

    def engine_info(self) -> dict[str, Any]:
        """Engine name, this rank's place in a tensor-parallel engine, weight bytes it holds."""
        if self._vllm:
            return self._vllm.info()
        size, rank = 1, 0
        if self.engine == "megatron":
            rank, size, _ = mt.tp_info()
        return {"engine": self.engine, "tensor_parallel_size": size, "tensor_parallel_rank": rank,
                "weight_bytes": sum(p.numel() * p.element_size() for p in self.model.parameters())}

    def memory(self) -> dict[str, int]:
        """Host RSS (now, peak) and peak device memory of this rank's process."""
        return process_memory(self.device)
