"""Torch training engine behind the Trainer role: one process per data-parallel rank.

The engine owns the model, AdamW, the learning-rate schedule, the process group (joined
and used through `collectives`) and the host copies of offloaded tensors; the role above
it owns micro-batching, the loss and the checkpoint layout. A DeepSpeed or Megatron
engine replaces this class behind the same methods.

Data parallel is plain torch.distributed (gloo on CPU, NCCL on CUDA) without DDP hooks:
the loss of each micro-batch is already normalised by the step's global token count, so
gradients are summed across ranks once per step, and ranks may run different numbers of
micro-batches.
"""
from __future__ import annotations

import contextlib
import functools
import math
import os
import random
import time
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist

from roles.batch import tensor_to
from roles.engines.collectives import DataParallelCollectives, all_reduce_gradients, init_data_parallel
from roles.engines.host_copies import host_bytes, module_tensors, optimizer_tensors, to_device, to_host
from roles.engines.torch_engine import pick_device
from roles.engines.train_kernels import (TrainKernelOptions, check_plain_head, chunked_token_logprobs, plain_head,
                                        fused_token_logprobs, next_token_logprobs, packed_forward, use_packing)

AUTOCAST_DTYPES = {"float32": None, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Re-recordings of a CUDA graph (cuda_graphs) torch allows before it drops the graph: one per onload.
RERECORD_LIMIT = 2**31 - 1


def rank_device(preference: str) -> torch.device:
    """The compute device of this rank: `pick_device`, with CUDA pinned to LOCAL_RANK
    among the visible GPUs (Ray shows an actor only its own; torchrun shows all)."""
    device = pick_device(preference)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return device


def lr_multiplier(step: int, warmup_steps: int, total_steps: int, schedule: str, floor: float = 0.0) -> float:
    """Factor on the peak lr for update number `step` (0-based): linear warmup reaching 1.0
    at step warmup_steps - 1, then constant, or a cosine or linear decay reaching `floor`
    (min_lr / lr) at total_steps."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    decay = 1.0 - progress if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return floor + (1.0 - floor) * decay


# trainer.optimizer -> torch.optim.AdamW's kernel switches ("adamw": torch's own choice).
OPTIMIZERS = {"adamw": {}, "adamw_fused": {"fused": True}, "adamw_foreach": {"foreach": True},
              "adamw_for_loop": {"foreach": False, "fused": False}}


def adamw(params: list[torch.nn.Parameter], lr: float, betas, weight_decay: float, eps: float,
          optimizer: str) -> torch.optim.AdamW:
    """The engines' AdamW (torch, DeepSpeed, Megatron): norm weights and biases (1-d) are not decayed;
    `optimizer` picks torch's kernel (OPTIMIZERS): the same update, computed fused, per list, or per tensor."""
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=tuple(betas), eps=eps,
                             **OPTIMIZERS[optimizer])


def lr_schedule(optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int,
                schedule: str, floor: float = 0.0) -> torch.optim.lr_scheduler.LambdaLR:
    """The learning-rate schedule of every engine: `lr_multiplier` of the optimizer step."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_multiplier(s, warmup_steps, total_steps, schedule, floor))


def named_params(model: torch.nn.Module, names) -> dict[str, torch.nn.Parameter]:
    """The model's parameters by name; ValueError naming any of `names` it does not have."""
    params = dict(model.named_parameters())
    unknown = sorted(set(names) - set(params))
    if unknown:
        raise ValueError(f"load_params: the model has no parameters {unknown[:5]}")
    return params


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class TorchTrainEngine(DataParallelCollectives):
    def __init__(self, model: torch.nn.Module, *, device: torch.device, dtype: str, lr: float,
                 weight_decay: float, betas: tuple[float, float], eps: float, optimizer: str, warmup_steps: int,
                 total_steps: int, schedule: str, min_lr: float, seed: int):
        self.rank, self.world_size = init_data_parallel(device)
        self.device = device
        torch.manual_seed(seed + self.rank)
        # Master weights stay fp32; a lower `dtype` is the autocast compute precision. Frozen
        # weights (a LoRA adapter's base) never update: they are kept in that precision.
        self.model = model.to(device=device, dtype=torch.float32)
        self.autocast_dtype = AUTOCAST_DTYPES[dtype]
        if self.autocast_dtype is not None:
            for p in self.model.parameters():
                if not p.requires_grad:
                    p.data = p.data.to(self.autocast_dtype)
        if self.world_size > 1:
            for t in module_tensors(self.model):
                dist.broadcast(t.data, src=0)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = adamw(self.params, lr, betas, weight_decay, eps, optimizer)
        self.scheduler = lr_schedule(self.optimizer, warmup_steps, total_steps, schedule, min_lr / lr)
        self.step = 0
        self._host_model: Optional[list] = None
        self._host_optimizer: Optional[list] = None

    # ------------------------------------------------------------------ compute
    def autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    # Packing, compilation and activation checkpointing of the forward (set_options; all off).
    kernels = TrainKernelOptions()
    _compiled: Optional[torch.nn.Module] = None
    _compiled_base: Optional[torch.nn.Module] = None
    _compiled_logprobs: Optional[Callable] = None
    # Packing without compilation: the same function as fused_logprobs run eagerly, so that the
    # output head and log-softmax see only the packed real tokens, never the padded [B, T, V].
    _packed_logprobs: Optional[Callable] = None
    # cuda_graphs: the gradients are the backward graph's outputs (a step's first micro-batch),
    # which the next replay overwrites.
    _grads_in_graph_pool = False

    def set_options(self, options: TrainKernelOptions) -> None:
        """Turn the forward's options (train_kernels) on or off."""
        self.kernels = options
        use_packing(self.model, options.packing)
        if options.activation_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        elif self.model.is_gradient_checkpointing:
            self.model.gradient_checkpointing_disable()
        mode = "reduce-overhead" if options.cuda_graphs else None
        self._compiled = torch.compile(self.model, mode=mode) if options.compile else None
        # The chunked logprobs' forward (compiled on its first call, if ever).
        self._compiled_base = torch.compile(self.model.base_model, mode=mode) if options.compile else None
        self._compiled_logprobs = None
        if options.fused_logprobs:
            check_plain_head(self.model, "fused_logprobs")
            self._compiled_logprobs = torch.compile(functools.partial(next_token_logprobs, self.model), mode=mode)
        eager = options.packing and not options.compile and plain_head(self.model)
        self._packed_logprobs = functools.partial(next_token_logprobs, self.model) if eager else None

    @property
    def packed_logprobs(self) -> bool:
        """Whether token_logprobs runs packed without compilation (packing on, compile off, a
        plain output head): the trainer then takes its logprobs and entropies from it."""
        return self._packed_logprobs is not None

    def _graphs(self):
        """Around a CUDA-graphed forward or backward: the graphs re-record whenever the weights
        come back at new addresses (onload after offload), so torch's cap on re-recordings (128
        per graph, then the graph is dropped for good) is lifted."""
        if not self.kernels.cuda_graphs:
            return contextlib.nullcontext()
        return torch._inductor.config.patch({"triton.cudagraph_unexpected_rerecord_limit": RERECORD_LIMIT})

    def _next_replay(self) -> None:
        """Before a CUDA-graphed forward: the previous replay's outputs are no longer read, so
        the graphs may overwrite them; gradients still held there (a step's first micro-batch
        took the backward's outputs as they came, saving a zero and an add per parameter) are
        copied out first, and later micro-batches accumulate into the copies."""
        if not self.kernels.cuda_graphs:
            return
        if self._grads_in_graph_pool:
            for p in self.params:
                if p.grad is not None:
                    p.grad = p.grad.clone()
            self._grads_in_graph_pool = False
        torch.compiler.cudagraph_mark_step_begin()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, V] of the model (HF layout: row t predicts token t + 1)."""
        self._next_replay()
        with self.autocast(), self._graphs():  # packing indexes the mask where it is: from the host
            if self.kernels.packing and bool(attention_mask.any()):
                return packed_forward(self.model, input_ids, attention_mask, run=self._compiled,
                                      bucket=self.kernels.cuda_graphs)
            input_ids, attention_mask = tensor_to(input_ids, self.device), tensor_to(attention_mask, self.device)
            run = self.model if self._compiled is None else self._compiled
            out = run(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        return out.logits

    def token_logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float,
                       entropy: bool = False, topk_indices: Optional[torch.Tensor] = None,
                       chunked: bool = False) -> tuple:
        """`torch_engine.token_logprobs` of the model's logits (0 on padding) without the
        [B, T, V] float32 logits, the entropies (`token_entropy`) where asked (else None), and
        at `topk_indices` the log-softmax and the mass outside them (`fused_token_logprobs`;
        else None, None): with fused_logprobs in one compiled function of the model, its output
        head and the log-softmax; with packing (no compile) the same function run eagerly over
        the packed tokens, unless `chunked` asks for the chunked head and it can serve; else last
        hidden states, then the output head chunk by chunk (logprobs only)."""
        self._next_replay()
        run = self._compiled_logprobs
        if run is None and not (chunked and not entropy and topk_indices is None):
            run = self._packed_logprobs
        if run is not None:
            with self.autocast(), self._graphs():
                packing = self.kernels.packing and bool(attention_mask.any())
                return fused_token_logprobs(self.model, run, input_ids, attention_mask, temperature, packing,
                                            bucket=self.kernels.cuda_graphs, entropy=entropy,
                                            topk_indices=topk_indices)
        if entropy or topk_indices is not None:
            raise ValueError("chunked logprobs give no entropy or top-k: the loss needs the full logits")
        with self.autocast(), self._graphs():
            if self.kernels.packing and bool(attention_mask.any()):
                hidden = packed_forward(self.model, input_ids, attention_mask, run=self._compiled_base, base=True,
                                        bucket=self.kernels.cuda_graphs)
            else:
                input_ids, attention_mask = tensor_to(input_ids, self.device), tensor_to(attention_mask, self.device)
                hidden = (self._compiled_base or self.model.base_model)(
                    input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        # (a plain copy here would wait for the forward queued above)
        return chunked_token_logprobs(hidden, self.model.get_output_embeddings(), tensor_to(input_ids, self.device),
                                      tensor_to(attention_mask, self.device), temperature), None, None, None

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate this micro-batch's gradients (engines with their own hooks override it)."""
        if self.kernels.cuda_graphs and any(p.grad is None for p in self.params):
            self._grads_in_graph_pool = True  # (before: a backward that fails midway leaves some there too)
        with self._graphs():
            loss.backward()

    def current_lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def reduce_gradients(self) -> None:
        """Sum gradients over the data-parallel ranks (in flat buckets)."""
        if self.world_size > 1:
            all_reduce_gradients(self.params)

    def optimizer_step(self, grad_clip: float) -> tuple[float, bool]:
        """Clip, step AdamW and the schedule, clear gradients. Returns (grad norm before
        clipping, whether the update was applied: a non-finite norm skips it)."""
        max_norm = grad_clip if grad_clip > 0 else float("inf")
        fused = bool(self.optimizer.defaults.get("fused"))
        if fused:
            # The fused kernel divides the gradients by grad_scale as it reads them (clipping without
            # a pass that rewrites them) and skips the update where found_inf is 1, as under a
            # GradScaler; so the device runs the update before the host reads the norm.
            norm = torch.nn.utils.get_total_norm([p.grad for p in self.params if p.grad is not None])
            # clip_grad_norm_'s factor, max_norm / (norm + 1e-6) when below 1, as a divisor.
            self.optimizer.grad_scale = ((norm + 1e-6) / max_norm).clamp(min=1.0).float()
            self.optimizer.found_inf = (~torch.isfinite(norm)).float()
            self.optimizer.step()
            del self.optimizer.grad_scale, self.optimizer.found_inf
        else:
            norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm)
        norm = float(norm)
        applied = math.isfinite(norm)
        if applied and not fused:
            self.optimizer.step()
        if applied:
            self.scheduler.step()
            self.step += 1
        self.optimizer.zero_grad(set_to_none=True)
        self._grads_in_graph_pool = False
        return norm, applied

    # ------------------------------------------------------------------ memory
    @property
    def model_offloaded(self) -> bool:
        return self._host_model is not None

    def offload(self, model: bool, optimizer: bool) -> dict:
        start, moved = time.perf_counter(), {"model_bytes": 0, "optimizer_bytes": 0}
        if model and self._host_model is None:
            self.optimizer.zero_grad(set_to_none=True)
            self._grads_in_graph_pool = False
            self._host_model = to_host(module_tensors(self.model))
            moved["model_bytes"] = host_bytes(self._host_model)
        if optimizer and self._host_optimizer is None:
            self._host_optimizer = to_host(optimizer_tensors(self.optimizer))
            moved["optimizer_bytes"] = host_bytes(self._host_optimizer)
        return {**moved, "seconds": time.perf_counter() - start}

    def onload(self) -> dict:
        start, moved = time.perf_counter(), {"model_bytes": 0, "optimizer_bytes": 0}
        if self._host_model is not None:
            moved["model_bytes"] = to_device(self._host_model)
            self._host_model = None
        if self._host_optimizer is not None:
            moved["optimizer_bytes"] = to_device(self._host_optimizer)
            self._host_optimizer = None
        return {**moved, "seconds": time.perf_counter() - start}

    def check_live(self, what: str, optimizer: bool = True) -> None:
        if self._host_model is not None or (optimizer and self._host_optimizer is not None):
            part = "model" if self._host_model is not None else "optimizer"
            raise RuntimeError(f"trainer {part} is offloaded; call onload() before {what}()")

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named weights in state_dict order, each tensor once (tied copies skipped),
        read from the host buffers while the model is offloaded."""
        host = {id(t): h for t, h, _ in self._host_model or []}
        seen = set()
        for name, t in self.model.state_dict(keep_vars=True).items():
            if id(t) in seen:
                continue
            seen.add(id(t))
            yield name, host.get(id(t), t.detach())

    def load_params(self, state: dict) -> None:
        """Copy tensors into the parameters of those names (a LoRA adapter's, on resume)."""
        params = named_params(self.model, state)
        with torch.no_grad():
            for name, t in state.items():
                params[name].copy_(t)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        return {"step": self.step, "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict()}

    def load_moments(self, optimizer_state: dict) -> None:
        """Per-parameter optimizer state from `optimizer_state`; lr and other group settings stay."""
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        self.optimizer.load_state_dict(optimizer_state)
        for group, kept in zip(self.optimizer.param_groups, groups):
            group.update(kept)

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])

