"""Megatron-core training engine behind the Trainer role (`backend.train=megatron`), and
the tensor-parallel pieces the Teacher's Megatron engine shares.

The engine has TorchTrainEngine's methods, so the Trainer's micro-batching, losses and
checkpoint layout stay as they are. The model is a Megatron GPTModel converted from the
HF model the Trainer builds (same initial weights); outside the engine everything is HF:
`forward` returns full-vocabulary HF-layout logits and `named_weights` yields HF tensors.

Ranks: WORLD_SIZE = data-parallel size x `megatron.tensor_parallel_size`; Megatron puts
tensor-parallel (TP) peers on consecutive ranks. Gradients are summed across the
data-parallel group (and a replicated weight's parts across its TP group: q/k norms, and
with sequence parallelism what sees only its rank's positions). Data: drivers hand every rank its own slice of a batch
(dispatch='slice'); TP peers must compute on the same rows, so `join_rows` concatenates
the slices of a TP group (in rank order) and tells each rank which rows are its own. A
TP group thus forms one data-parallel rank whose share is its members' slices together.

Full HF weights of a TP>1 model live on its TP ranks in pieces; a weight sync asks rank 0
alone (execute='first'), so each TP group's first rank keeps a host copy of all its TP
shards, refreshed after every update (one gather per step of what trains; it costs one fp32
model of host memory). On CPU, Megatron's CUDA-only pieces are swapped for host ones
(megatron_host) and its RNG tracker for an inference tracker.

`megatron.sequence_parallel` (TP > 1; ignored at TP 1, as Megatron-SWIFT does) splits the
positions between the tensor-parallel linears (norms, residuals, dropout) over the TP ranks;
a forward pads its rows to a multiple of the TP size (right padding: causal positions never
see it). With LoRA (the Trainer puts peft's adapters into the HF model first) the base is
frozen and the adapters are megatron_lora's, initialised with peft's values; `named_weights`
then yields the peft-adapted model's names (`X.base_layer.weight`, `X.lora_A.default.weight`,
...) in its order, which roles.lora merges and exports as it does for the torch engine.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import types
from typing import Any, Iterator, Mapping, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from roles.engines.collectives import DIST_TIMEOUT, all_reduce_gradients, init_data_parallel
from roles.engines.megatron_convert import QK_NORMS, build_gpt_model, hf_to_megatron, megatron_to_hf
from roles.engines.megatron_host import ScratchBuffer, host_rope_emb, host_sequence_parallel
from roles.engines.megatron_lora import MegatronLora, hf_adapters
from roles.engines.options import MegatronOptions
from roles.engines.torch_trainer import AUTOCAST_DTYPES, TorchTrainEngine, adamw, lr_schedule
from roles.lora import base_name


# ---------------------------------------------------------------------- process groups
def setup_parallel(tp: int, device: torch.device, seed: int) -> tuple[int, int]:
    """Join the process group (a 1-rank one without a worker group) and Megatron's TP/DP
    groups, with RNG and scratch memory for `device`; returns (rank, world size). Roles in
    one process share the groups, so they need one TP size."""
    # megatron-core is optional (the megatron engines): imported on use
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mrandom

    rank, world = init_data_parallel(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world == 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(),
                                rank=0, world_size=1, timeout=DIST_TIMEOUT)
    if tp < 1 or world % tp:
        raise ValueError(f"megatron.tensor_parallel_size={tp} must divide the role's {world} ranks; "
                         f"set it to a divisor of {world} or change the role's device count")
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, create_gloo_process_groups=False)
    elif ps.get_tensor_model_parallel_world_size() != tp:
        raise ValueError(f"this process already runs Megatron with tensor_parallel_size="
                         f"{ps.get_tensor_model_parallel_world_size()}, not {tp}; roles sharing a "
                         "process need one megatron.tensor_parallel_size")
    if device.type == "cuda":
        mrandom.model_parallel_cuda_manual_seed(seed)
    else:  # CUDA RNG states do not exist on a CPU host
        mrandom.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
        host_sequence_parallel()
    ps._GLOBAL_MEMORY_BUFFER = ScratchBuffer(device)
    return rank, world


def tp_info() -> tuple[int, int, Any]:
    """(TP rank, TP size, TP group) of this process."""
    # megatron-core is optional (the megatron engines): imported on use
    from megatron.core import parallel_state as ps

    return (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(),
            ps.get_tensor_model_parallel_group())


# ---------------------------------------------------------------------- model
def to_megatron(hf_model: torch.nn.Module, tp: int, device: torch.device, dtype: torch.dtype = torch.float32,
                sequence_parallel: bool = False) -> torch.nn.Module:
    """This TP rank's GPTModel holding `hf_model`'s weights (parallel state must exist); of a
    peft-adapted model, its base weights."""
    tp_rank = tp_info()[0]
    cfg = hf_model.config
    model = build_gpt_model(cfg, tp, cpu=device.type == "cpu", sequence_parallel=sequence_parallel)
    if device.type == "cpu":
        model.rotary_pos_emb.get_emb = types.MethodType(host_rope_emb, model.rotary_pos_emb)
    base = {hf: t for hf, t in ((base_name(n), t) for n, t in hf_model.state_dict().items()) if hf is not None}
    load_shard(dict(model.named_parameters()), hf_to_megatron(base, cfg, tp)[tp_rank])
    return model.to(device=device, dtype=dtype)


def load_shard(params: Mapping[str, torch.Tensor], shard: Mapping[str, torch.Tensor]) -> None:
    """Copy a converted shard into `params` (a model's base parameters by name): the same names."""
    if set(params) != set(shard):
        raise RuntimeError(f"Megatron weights do not match the model: missing {sorted(set(params) - set(shard))}, "
                           f"unexpected {sorted(set(shard) - set(params))}")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(shard[name])


def local_logits(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """This TP rank's vocabulary shard of the logits [B, T, V_padded / TP] (HF layout).
    Right padding needs no mask: a causal model's real positions never see it."""
    T = input_ids.shape[1]
    if model.config.sequence_parallel:  # positions split evenly over the TP ranks
        input_ids = F.pad(input_ids, (0, -T % model.config.tensor_model_parallel_size))
    width = input_ids.shape[1]
    device = input_ids.device
    positions = torch.arange(width, device=device).unsqueeze(0).expand_as(input_ids)
    causal = torch.ones(width, width, dtype=torch.bool, device=device).triu(1)[None, None]  # True = masked
    return model(input_ids, positions, causal)[:, :T]


def gather_vocab(local: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Full logits [..., V] from the TP ranks' shards; differentiable (backward keeps this
    rank's columns of the gradient, which every TP rank computes identically)."""
    tp_rank, tp, group = tp_info()
    if tp > 1:  # Megatron's own gather allocates on CUDA; this one runs on any device
        local = _GatherVocab.apply(local, tp_rank, group)
    return local[..., :vocab_size]


class _GatherVocab(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local, tp_rank, group):
        ctx.columns = slice(tp_rank * local.shape[-1], (tp_rank + 1) * local.shape[-1])
        return _all_gather_cat(local, group)

    @staticmethod
    def backward(ctx, grad):
        return grad[..., ctx.columns].contiguous(), None, None


def join_rows(batch: Any) -> tuple[Any, slice]:
    """The rows of every TP peer's slice of `batch`, concatenated in rank order, and the
    slice of them that is this rank's own."""
    tp_rank, tp, group = tp_info()
    if tp == 1:
        return batch, slice(None)
    parts = [None] * tp
    dist.all_gather_object(parts, batch, group=group)
    starts = [0]
    for p in parts:
        starts.append(starts[-1] + len(p))
    fields = {}
    for f in dataclasses.fields(batch):
        values = [getattr(p, f.name) for p in parts]
        first = values[0]
        if isinstance(first, torch.Tensor) and first.ndim >= 1:
            shapes = {tuple(v.shape[1:]) for v in values}
            if len(shapes) > 1:
                raise ValueError(f"tensor-parallel peers got '{f.name}' of shapes {sorted(shapes)}; "
                                 "slices of one batch (dispatch='slice') must share their padded length")
            fields[f.name] = torch.cat(values)
        elif isinstance(first, list):
            fields[f.name] = [x for v in values for x in v]
        else:  # None and whole-batch values: rank order's first
            fields[f.name] = first
    return dataclasses.replace(batch, **fields), slice(starts[tp_rank], starts[tp_rank + 1])


def topk_logprobs(local: torch.Tensor, vocab_size: int, k: int, temperature: float, tail: bool):
    """Top-k logprobs/indices of the full vocabulary from per-TP-rank logit shards
    [..., V_padded / TP]: each rank's local top-k, merged; the log-normaliser and the tail
    mass `log(1 - sum p_topk)` are log-sum-exps combined across ranks (exact, no 1 - p)."""
    tp_rank, tp, group = tp_info()
    width = local.shape[-1]
    logits = local.float() / temperature
    column = torch.arange(width, device=logits.device) + tp_rank * width
    logits = logits.masked_fill(column >= vocab_size, float("-inf"))  # vocabulary padding
    values, indices = torch.topk(logits, min(k, width), dim=-1)
    indices = indices + tp_rank * width
    lse = logits.logsumexp(-1)
    if tp > 1:
        values, indices = _all_gather_cat(values, group), _all_gather_cat(indices, group)
        lse = _all_gather_cat(lse.unsqueeze(-1), group).logsumexp(-1)
        values, picked = torch.topk(values, k, dim=-1)
        indices = indices.gather(-1, picked)
    out = (values - lse.unsqueeze(-1), indices)
    if not tail:
        return out
    # Drop the merged top-k columns that fall in this shard; the rest of the shard is the tail.
    offset = tp_rank * width
    mine = (indices >= offset) & (indices < offset + width)
    hits = torch.zeros_like(logits).scatter_add_(-1, (indices - offset).clamp(0, width - 1), mine.float())
    rest = logits.masked_fill(hits > 0, float("-inf"))
    rest = rest.logsumexp(-1)
    if tp > 1:
        rest = _all_gather_cat(rest.unsqueeze(-1), group).logsumexp(-1)
    return out + (rest - lse,)


def _all_gather_cat(t: torch.Tensor, group) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


# ---------------------------------------------------------------------- engine
class MegatronTrainEngine(TorchTrainEngine):
    """Own model, groups, gradient reduction, clipping, weights and state; autocast, backward,
    lr, barrier and offload/onload are the torch engine's (they use the same attributes)."""

    def __init__(self, hf_model: torch.nn.Module, *, options: Mapping[str, Any], device: torch.device, dtype: str,
                 lr: float, weight_decay: float, betas: tuple[float, float], eps: float, optimizer: str,
                 warmup_steps: int, total_steps: int, schedule: str, min_lr: float, seed: int):
        # megatron-core is optional (the megatron engines): imported on use
        from megatron.core import parallel_state as ps

        self.tp = int(options.get("tensor_parallel_size", MegatronOptions.tensor_parallel_size))
        sequence_parallel = bool(options.get("sequence_parallel", MegatronOptions.sequence_parallel)) and self.tp > 1
        self.rank, self.world_size = setup_parallel(self.tp, device, seed)
        self.tp_rank, _, self.tp_group = tp_info()
        self.dp_group = ps.get_data_parallel_group()
        self.dp_size = dist.get_world_size(self.dp_group)
        self.device = device
        self.hf_config = hf_model.config
        torch.manual_seed(seed + ps.get_data_parallel_rank())
        # The HF names `named_weights` yields (with LoRA, the adapted model's): its state_dict order,
        # a tied weight once.
        first = {}
        for name, t in hf_model.state_dict(keep_vars=True).items():
            first.setdefault(id(t), name)
        self._hf_names = list(first.values())
        # Master weights stay fp32; a lower `dtype` is the autocast compute precision.
        self.model = to_megatron(hf_model, self.tp, device, sequence_parallel=sequence_parallel).eval()
        self._base = dict(self.model.named_parameters())
        self.lora: Optional[MegatronLora] = None
        if hf_adapters(hf_model):  # LoRA: the base frozen, peft's adapters on the parallel linears
            self.model.requires_grad_(False)
            self.lora = MegatronLora(self.model, hf_model, self.tp_rank, self.tp, sequence_parallel)
            self.model.to(device)
        hf_model.to("meta")  # its weights live on in the Megatron model; its modules stay (peft's config)
        self.autocast_dtype = AUTOCAST_DTYPES[dtype]
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        # Trained replicated weights whose gradient on a TP rank is a part: q/k norms (their
        # rank's heads) and, with sequence parallelism, those marked (their rank's positions).
        self._tp_partial = [p for n, p in self.model.named_parameters() if p.requires_grad and self.tp > 1
                            and (n.endswith(QK_NORMS) or getattr(p, "sequence_parallel", False))]
        self.optimizer = adamw(self.params, lr, betas, weight_decay, eps, optimizer)
        self.scheduler = lr_schedule(self.optimizer, warmup_steps, total_steps, schedule, min_lr / lr)
        self.step = 0
        self._host_model: Optional[list] = None
        self._host_optimizer: Optional[list] = None
        self._shards: Optional[list[dict]] = None
        self._refresh_shards(everything=True)

    # ------------------------------------------------------------------ compute
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits [B, T, V] (HF layout: row t predicts token t + 1)."""
        with self.autocast():
            return gather_vocab(local_logits(self.model, input_ids.to(self.device)), self.hf_config.vocab_size)

    def join_rows(self, batch: Any) -> tuple[Any, slice]:
        return join_rows(batch)

    def reduce_gradients(self) -> None:
        """Sum gradients over the data-parallel group (TP peers hold different shards), and
        the parts of replicated weights' gradients over the TP group."""
        if self._tp_partial:
            all_reduce_gradients(self._tp_partial, self.tp_group)
        if self.dp_size > 1:
            all_reduce_gradients(self.params, self.dp_group)

    def adapter_off(self):
        """A context in which the model computes as its base (the LoRA adapters add nothing)."""
        return self.lora.off() if self.lora is not None else contextlib.nullcontext()

    def grad_norm(self) -> float:
        """Global L2 norm: TP-sharded parameters count on every rank, replicated ones
        (norm weights) on TP rank 0 only, so nothing is counted twice."""
        # megatron-core is optional (the megatron engines): imported on use
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        grads = [p.grad for p in self.params if p.grad is not None and param_is_not_tensor_parallel_duplicate(p)]
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for g in grads:
            total += g.detach().double().pow(2).sum()
        if self.tp > 1:
            dist.all_reduce(total, group=self.tp_group)
        return float(total.sqrt())

    def optimizer_step(self, grad_clip: float) -> tuple[float, bool]:
        """Clip, step AdamW and the schedule, clear gradients. Returns (grad norm before
        clipping, whether the update was applied: a non-finite norm skips it)."""
        norm = self.grad_norm()
        applied = math.isfinite(norm)
        if applied:
            if grad_clip > 0 and norm > grad_clip:  # torch's clip_grad_norm_ rule
                scale = grad_clip / (norm + 1e-6)
                for p in self.params:
                    if p.grad is not None:
                        p.grad.mul_(scale)
            self.optimizer.step()
            self.scheduler.step()
            self.step += 1
        self.optimizer.zero_grad(set_to_none=True)
        if applied:
            self._refresh_shards(everything=False)
        return norm, applied

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        """Sums over the data-parallel group: TP peers computed on the same rows."""
        if self.dp_size == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, group=self.dp_group)
        return t.tolist()

    def all_gather_object(self, obj: object) -> list:
        """`obj` of every data-parallel rank (TP peers share theirs), in rank order."""
        if self.dp_size == 1:
            return [obj]
        out: list = [None] * self.dp_size
        dist.all_gather_object(out, obj, group=self.dp_group)
        return out

    # ------------------------------------------------------------------ weights
    def _local_shard(self) -> dict[str, torch.Tensor]:
        host = {id(t): h for t, h, _ in self._host_model or []}
        return {n: host.get(id(p), p.detach()) for n, p in self.model.named_parameters()}

    def _refresh_shards(self, everything: bool) -> None:
        """With TP > 1, copy every TP rank's shard of the weights (`everything`) or of the
        trained ones (after an update: a LoRA base never changes) to the host of the TP group's
        first rank."""
        if self.tp == 1:
            return
        first = dist.get_global_rank(self.tp_group, 0)
        if self.tp_rank == 0 and self._shards is None:
            self._shards = [{} for _ in range(self.tp)]
        trained = {n for n, p in self.model.named_parameters() if p.requires_grad}
        for name, t in self._local_shard().items():
            if not (everything or name in trained):
                continue
            parts = [torch.empty_like(t) for _ in range(self.tp)] if self.tp_rank == 0 else None
            dist.gather(t.contiguous(), parts, dst=first, group=self.tp_group)
            if parts is not None:
                for shard, part in zip(self._shards, parts):
                    shard[name] = part.to("cpu")

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full HF-named weights in HF state_dict order (no tied lm_head); with LoRA, the
        peft-adapted model's names and tensors (base and adapters apart). With TP > 1 only a
        TP group's first rank holds them (rank 0 serves weight syncs)."""
        if self.tp == 1:
            shards = [self._local_shard()]
        elif self._shards is None:
            raise RuntimeError(f"rank {self.rank} is tensor-parallel rank {self.tp_rank}: full weights live on "
                               "the first rank of each tensor-parallel group; ask rank 0 (execute='first')")
        else:
            shards = self._shards
        base = megatron_to_hf(shards, self.hf_config)
        if self.lora is None:
            yield from base.items()
            return
        adapters = self.lora.hf_tensors(shards)
        for name in self._hf_names:
            hf = base_name(name)
            yield name, adapters[name] if hf is None else base[hf]

    def hf_model(self) -> torch.nn.Module:
        """The current weights as an HF model on the host (what Trainer.save writes)."""
        from transformers import AutoModelForCausalLM

        with torch.random.fork_rng(devices=[]):
            model = AutoModelForCausalLM.from_config(self.hf_config)
        state = dict(self.named_weights())
        if self.hf_config.tie_word_embeddings:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        model.load_state_dict(state)
        return model.eval()

    def load_hf_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        """Set the (base) weights from an HF state dict (every rank takes its shard; collective)."""
        shard = hf_to_megatron(state, self.hf_config, self.tp)[self.tp_rank]
        load_shard(self._base, shard)
        self._refresh_shards(everything=True)

    def load_params(self, state: Mapping[str, torch.Tensor]) -> None:
        """Set the LoRA adapters from peft-adapted HF tensors (a saved adapter, on resume; every
        rank takes its piece; collective)."""
        if self.lora is None:
            raise ValueError("load_params: this Megatron model has no LoRA adapters; load_hf_weights sets its weights")
        self.lora.load(state)
        self._refresh_shards(everything=False)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """Step, schedule and optimizer state; with TP > 1 the optimizer state of every TP
        rank, gathered on the TP group's first rank (collective: call it on every rank)."""
        optimizer = self.optimizer.state_dict()
        if self.tp > 1:
            parts = [None] * self.tp if self.tp_rank == 0 else None
            dist.gather_object(optimizer, parts, dst=dist.get_global_rank(self.tp_group, 0), group=self.tp_group)
            optimizer = parts
        return {"step": self.step, "optimizer": optimizer, "scheduler": self.scheduler.state_dict()}

    def _own_optimizer_state(self, optimizer_state: Any) -> dict:
        """This TP rank's part of a saved optimizer state (a list of TP ranks' states when TP > 1)."""
        saved_tp = len(optimizer_state) if isinstance(optimizer_state, list) else 1
        if saved_tp != self.tp:
            raise ValueError(f"the checkpoint's optimizer state has tensor_parallel_size={saved_tp}, this run "
                             f"{self.tp}; set megatron.tensor_parallel_size={saved_tp} to continue from it")
        return optimizer_state[self.tp_rank] if self.tp > 1 else optimizer_state

    def load_moments(self, optimizer_state: Any) -> None:
        """Per-parameter optimizer state from a saved one; lr and other group settings stay."""
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        self.optimizer.load_state_dict(self._own_optimizer_state(optimizer_state))
        for group, kept in zip(self.optimizer.param_groups, groups):
            group.update(kept)

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(self._own_optimizer_state(state["optimizer"]))
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])
