"""DeepSpeed ZeRO training engine behind the Trainer role (`backend.train=deepspeed`).

The engine has TorchTrainEngine's methods, so the Trainer's micro-batching, losses and
checkpoint layout stay as they are. ZeRO stage 2 shards gradients and optimizer state
across the data-parallel ranks, stage 3 the parameters too; `deepspeed.offload_optimizer`
/ `offload_param` keep them in host memory (ZeRO-Offload).

How the Trainer's step maps onto DeepSpeed:
- The Trainer accumulates micro-batches itself and calls `optimizer_step` once per step, so
  DeepSpeed runs with `managed_gradient_accumulation=false` (every `step()` is the boundary)
  and gradient_accumulation_steps=1 (no 1/GAS loss scaling).
- Each micro-batch loss is already normalised by the step's global token count, so gradients
  must be summed over ranks; ZeRO averages them, so `backward` multiplies by the world size.
- ZeRO's backward (stage 2 and 3) and forward (stage 3) are collectives: every rank must run
  as many passes as the busiest one. The Trainer asks `micro_batch_rounds` and runs
  `idle_pass` for the missing ones (a 1-token forward with a zero loss).
- The optimizer is torch's AdamW over DeepSpeed's flat partitions (same groups and math as
  the torch engine; no compiled FusedAdam/DeepSpeedCPUAdam op, which would need a JIT build
  that a CPU host or a GPU host without nvcc cannot do quickly). With offload_optimizer it
  runs on the host partitions (`zero_force_ds_cpu_optimizer=false`).
- Checkpoints use the torch engine's format: HF weights plus a full, per-parameter AdamW
  state gathered from the shards. They load into either engine at any world size.
- With ZeRO-3 a weight sync asks rank 0 alone (execute='first') while gathering weights is a
  collective, so rank 0 keeps a host copy of the full weights, refreshed after each update.
- Frozen parameters (a LoRA adapter's base) are partitioned like the rest under ZeRO-3 but
  have no gradients, fp32 masters or AdamW state; the engine moves them itself on offload,
  and an update refreshes only the trained ones' host copy.

On CPU the process group is gloo (DeepSpeed wraps the one `init_data_parallel` made); on
CUDA it is NCCL.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import sys
import time
from typing import Any, Iterator, Mapping, Optional

import torch
import torch.distributed as dist

from roles.engines.collectives import DIST_TIMEOUT, DataParallelCollectives, init_data_parallel, size_buckets
from roles.engines.host_copies import to_device, to_host
from roles.engines.options import DeepSpeedOptions
from roles.engines.torch_trainer import adamw, lr_schedule, named_params

# Parameters are gathered (ZeRO-3) in groups of about this size.
GATHER_BUCKET_BYTES = 64 * 2**20
ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")


def resolve_options(options: Mapping[str, Any]) -> DeepSpeedOptions:
    known = {f.name for f in dataclasses.fields(DeepSpeedOptions)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"unknown DeepSpeed option(s) {unknown} (config keys deepspeed.*); known: {sorted(known)}")
    opts = DeepSpeedOptions(**options)
    if opts.zero_stage not in (2, 3):
        raise ValueError(f"deepspeed.zero_stage={opts.zero_stage} is not supported; set it to 2 or 3")
    if opts.offload_param and opts.zero_stage != 3:
        raise ValueError("deepspeed.offload_param needs deepspeed.zero_stage=3 (ZeRO-2 keeps full parameters "
                         "on every rank); set zero_stage=3 or offload_param=false")
    return opts


def import_deepspeed(device: torch.device):
    """deepspeed, with its accelerator matching `device` (its own pick follows CUDA availability)."""
    if device.type == "cpu" and "deepspeed" not in sys.modules:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # deepspeed is optional, and its accelerator is picked at its first import: imported here
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)  # its INFO prints the whole config per rank
    if get_accelerator().device_name() != device.type:
        raise RuntimeError(f"DeepSpeed runs on '{get_accelerator().device_name()}' in this process but the trainer "
                           f"device is '{device}'; set trainer.device to match (or DS_ACCELERATOR before start)")
    return deepspeed


@contextlib.contextmanager
def _without_shm_op():
    """DeepSpeed's CPU comm backend JIT-compiles a shared-memory all-reduce on first init
    (minutes on a busy 2-core host); only DeepSpeed-inference tensor parallel uses it."""
    import importlib

    ds_torch = importlib.import_module("deepspeed.comm.torch")  # `deepspeed.comm.torch` the attribute is torch
    build = ds_torch.build_shm_op
    ds_torch.build_shm_op = lambda: None
    try:
        yield
    finally:
        ds_torch.build_shm_op = build


def _forget_stale_groups() -> None:
    """DeepSpeed keeps its communication backend and the groups it made from the default process
    group in module state (deepspeed.utils.groups). When that group has been destroyed since (a
    vLLM engine's shutdown destroys its process's default group; another library may have made a
    new one after), they name groups torch no longer knows ("Group ... is not registered"):
    forgotten here, so that init_distributed makes them again from the group there is."""
    from deepspeed import comm
    from deepspeed.utils import groups

    if comm.comm.cdb is None:  # nothing made in this process yet
        return
    caches = {name: value for name, value in vars(groups).items()
              if name.startswith("_") and name.endswith(("_GROUP", "_GROUP_RANKS"))}
    held = [g for value in caches.values() for g in (value.values() if isinstance(value, dict) else [value])
            if isinstance(g, dist.ProcessGroup)]
    known = dist.distributed_c10d._world.pg_map
    if dist.is_initialized() and all(g in known for g in held):
        return
    comm.comm.cdb = None
    for name, value in caches.items():
        setattr(groups, name, {} if isinstance(value, dict) else None)
    groups.mesh_device = None


class DeepSpeedTrainEngine(DataParallelCollectives):
    def __init__(self, model: torch.nn.Module, *, options: Mapping[str, Any], device: torch.device, dtype: str,
                 lr: float, weight_decay: float, betas: tuple[float, float], eps: float, optimizer: str,
                 warmup_steps: int, total_steps: int, schedule: str, min_lr: float, seed: int):
        self.options = resolve_options(options)
        self.stage = self.options.zero_stage
        self.rank, self.world_size = init_data_parallel(device)
        self.device = device
        if device.type == "cuda":
            torch.cuda.set_device(device)
        deepspeed = import_deepspeed(device)
        _forget_stale_groups()
        if not dist.is_initialized():  # one rank: DeepSpeed still needs a process group
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(),
                                    rank=0, world_size=1, timeout=DIST_TIMEOUT)
        os.environ.setdefault("LOCAL_RANK", "0")  # DeepSpeed insists on it; a worker group sets it
        with _without_shm_op():
            deepspeed.init_distributed("nccl" if device.type == "cuda" else "gloo", auto_mpi_discovery=False,
                                       timeout=DIST_TIMEOUT)
        torch.manual_seed(seed + self.rank)
        model = model.to(device=device, dtype=torch.float32)
        if self.world_size > 1:  # ZeRO-3 partitions each rank's own copy: start from rank 0's
            for t in list(model.parameters()) + list(model.buffers()):
                dist.broadcast(t.data, src=0)
        optimizer = adamw([p for p in model.parameters() if p.requires_grad], lr, betas, weight_decay, eps, optimizer)
        self.groups = [list(g["params"]) for g in optimizer.param_groups]
        # Taken once: peft's adapter_off clears the adapter's requires_grad while it is off.
        self._trained = {id(p) for g in self.groups for p in g}
        self.frozen = [p for p in model.parameters() if id(p) not in self._trained]
        self.group_settings = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        torch_linear = torch.nn.functional.linear
        self.ds, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=self._config(dtype),
                                                dist_init_required=False)
        # ZeRO-3 swaps torch.nn.functional.linear for its own (which keeps no gathered weight for
        # the backward) in the whole process, for good: every other model there then ran it, and
        # a compiled one trained wrong gradients on CUDA. It is put back; this engine's forwards
        # alone run DeepSpeed's (`_zero_linear`).
        self._linear = torch.nn.functional.linear
        torch.nn.functional.linear = torch_linear
        self.model = self.ds.module
        self.zero = self.ds.optimizer          # ZeRO optimizer (partitions, gradient reduction)
        self.optimizer = self.zero.optimizer   # torch AdamW over this rank's flat partitions
        self.scheduler = lr_schedule(self.optimizer, warmup_steps, total_steps, schedule, min_lr / lr)
        self.step = 0
        self._offloaded: set[str] = set()
        self._host_optimizer: Optional[list] = None  # ZeRO-3's offloaded masters and moments
        self._host_frozen: Optional[list] = None     # offloaded frozen parameters (ZeRO-3: their shards)
        self._moved = {"model_bytes": 0, "optimizer_bytes": 0}  # what onload brings back
        self._full: Optional[dict[int, torch.Tensor]] = None   # ZeRO-3: rank 0's host copy
        # fp32 weights of the trained parameters gathered by state_dict() (rank 0), until they change
        self._masters: Optional[dict[int, torch.Tensor]] = None
        self._refresh_full()

    def _config(self, dtype: str) -> dict:
        o, cuda = self.options, self.device.type == "cuda"
        zero: dict[str, Any] = {"stage": self.stage}
        if o.offload_optimizer:
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": cuda}
        if o.offload_param:
            zero["offload_param"] = {"device": "cpu", "pin_memory": cuda}
        return {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "managed_gradient_accumulation": False,
            "gradient_clipping": 0.0,  # set per step from the Trainer's grad_clip
            "bf16": {"enabled": dtype == "bfloat16"},
            # fp16 weights need loss scaling: DeepSpeed's dynamic scaler skips overflowing steps.
            "fp16": {"enabled": dtype == "float16", "loss_scale": 0},
            "zero_optimization": zero,
            "zero_allow_untested_optimizer": True,
            "zero_force_ds_cpu_optimizer": False,
            "steps_per_print": 2**31,
            "wall_clock_breakdown": False,
        }

    # ------------------------------------------------------------------ compute
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, V] of the model (HF layout: row t predicts token t + 1)."""
        with self._zero_linear():
            out = self.ds(input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device),
                          use_cache=False)
        return out.logits

    @contextlib.contextmanager
    def _zero_linear(self) -> Iterator[None]:
        """torch.nn.functional.linear is DeepSpeed's ZeRO-3 one while this engine's model runs."""
        outside, torch.nn.functional.linear = torch.nn.functional.linear, self._linear
        try:
            yield
        finally:
            torch.nn.functional.linear = outside

    def backward(self, loss: torch.Tensor) -> None:
        # ZeRO divides the reduced gradients by the world size; the loss is already a share of a sum.
        self.ds.backward(loss * self.world_size)

    def micro_batch_rounds(self, n_local: int, backward: bool) -> int:
        """Forward(/backward) passes every rank must run: ZeRO-3 forwards and ZeRO backwards
        are collectives, so the busiest rank's count (collective itself when it matters)."""
        if self.world_size == 1 or (self.stage == 2 and not backward):
            return n_local
        t = torch.tensor([n_local], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t)

    def idle_pass(self, backward: bool) -> None:
        """A pass that joins the collectives of the other ranks and adds nothing to the gradients."""
        ids = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        logits = self.forward(ids, torch.ones_like(ids))
        if backward:
            self.backward(logits.float().sum() * 0.0)

    def current_lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def reduce_gradients(self) -> None:
        """Nothing to do: ZeRO reduce-scatters in each backward and finishes in `optimizer_step`."""

    def optimizer_step(self, grad_clip: float) -> tuple[float, bool]:
        """Clip (torch's rule), step AdamW and the schedule, clear gradients. Returns (grad norm
        before clipping, whether the update was applied: a non-finite norm skips it)."""
        self.zero.clip_grad = float(grad_clip)
        self.ds.step()
        norm = self.ds.get_global_grad_norm()
        norm = float("nan") if norm is None else float(norm)
        applied = bool(self.ds.was_step_applied()) and math.isfinite(norm)
        if applied:
            self.scheduler.step()
            self.step += 1
            self._masters = None
            self._refresh_full([p for g in self.groups for p in g])
        return norm, applied

    # ------------------------------------------------------------------ memory
    def offload(self, model: bool, optimizer: bool) -> dict:
        """Weights and/or optimizer partitions (fp32 masters, AdamW moments, gradient buffers)
        to host memory with DeepSpeed's offload_states. ZeRO-3's refuses optimizer state that
        is not FusedAdam's, so there the masters and moments move like the torch engine's, as
        do frozen parameters, which offload_states does not know. What ZeRO-Offload already
        keeps on the host stays there."""
        # deepspeed is optional (backend.train=deepspeed): imported on use
        from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum as S

        start, moved, include = time.perf_counter(), {"model_bytes": 0, "optimizer_bytes": 0}, set()
        if model and "model" not in self._offloaded:
            self._offloaded.add("model")
            if not self.options.offload_param:
                include.add(S.lp_params)
                moved["model_bytes"] = self._model_bytes()
                self._host_frozen = to_host([getattr(p, "ds_tensor", p) for p in self.frozen])
        if optimizer and "optimizer" not in self._offloaded:
            self._offloaded.add("optimizer")
            if not self.options.offload_optimizer:
                include |= {S.lp_grads, S.contiguous_grad_buffer}
                moved["optimizer_bytes"] = self._optimizer_bytes()
                if self.stage == 2:
                    include |= {S.optim_states, S.hp_params}
                else:
                    self._host_optimizer = to_host(self._optimizer_tensors())
        if include:
            with self._zero3_offload_order():
                self.ds.offload_states(include=include, device=OffloadDeviceEnum.cpu,
                                       pin_memory=self.device.type == "cuda")
        self._moved = {k: self._moved[k] + moved[k] for k in moved}
        return {**moved, "seconds": time.perf_counter() - start}

    def onload(self) -> dict:
        start, moved = time.perf_counter(), self._moved
        if self.ds.optimizer.offloaded_states:
            self.ds.reload_states()
        for saved in (self._host_optimizer, self._host_frozen):
            if saved is not None:
                to_device(saved)
        self._host_optimizer = self._host_frozen = None
        self._offloaded.clear()
        self._moved = {"model_bytes": 0, "optimizer_bytes": 0}
        return {**moved, "seconds": time.perf_counter() - start}

    @contextlib.contextmanager
    def _zero3_offload_order(self) -> Iterator[None]:
        """ZeRO-3's offload_states (DeepSpeed 0.19) re-points the shard of every parameter of its
        module, in module order, into the host copy of its flat buffer, which holds the trained
        ones alone, in group order: frozen ones overran it. It is shown those it holds, in order."""
        if self.stage != 3:
            yield
            return
        module, held = self.zero.module, [p for group in self.zero.fp16_groups for p in group]
        self.zero.module = torch.nn.ParameterList(held)
        try:
            yield
        finally:
            self.zero.module = module

    def _model_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (getattr(p, "ds_tensor", p) for p in self.model.parameters()))

    def _optimizer_tensors(self) -> list[torch.Tensor]:
        """fp32 master partitions and AdamW moments of this rank."""
        return self._flat_partitions() + [s[k] for s in self.optimizer.state.values() for k in ADAM_MOMENTS if k in s]

    def _optimizer_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._optimizer_tensors())

    def _flat_partitions(self) -> list[torch.Tensor]:
        """This rank's fp32 master partitions: the tensors AdamW updates and keys its state by."""
        if self.stage == 3:
            return list(self.zero.fp32_partitioned_groups_flat)
        return list(self.zero.single_partition_of_fp32_groups)

    def check_live(self, what: str, optimizer: bool = True) -> None:
        if "model" in self._offloaded or (optimizer and "optimizer" in self._offloaded):
            part = "model" if "model" in self._offloaded else "optimizer"
            raise RuntimeError(f"trainer {part} is offloaded; call onload() before {what}()")

    # ------------------------------------------------------------------ weights
    def _refresh_full(self, params: Optional[list[torch.nn.Parameter]] = None) -> None:
        """ZeRO-3: gather the full parameters (`params`, else all; collective) and keep host
        copies on rank 0."""
        if self.stage != 3:
            return
        # deepspeed is optional (backend.train=deepspeed): imported on use
        from deepspeed.runtime.zero import GatheredParameters

        full = {}
        for bucket in size_buckets(self.model.parameters() if params is None else params, GATHER_BUCKET_BYTES,
                                   lambda p: p.ds_numel * p.element_size()):
            with GatheredParameters(bucket, modifier_rank=None):
                if self.rank == 0:
                    full.update({id(q): q.data.detach().to("cpu", copy=True) for q in bucket})
        if self.rank == 0:
            self._full = {**(self._full or {}), **full}

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full weights under the model's state_dict names and order, each tensor once (tied
        copies skipped); a trained one as its fp32 master while the last `state_dict()` call's
        copy is current (a checkpoint then holds the masters, as a LoRA adapter resumes from).
        With ZeRO-3 only rank 0 holds them (a weight sync asks rank 0: execute='first')."""
        if self.stage == 3 and self._full is None:
            raise RuntimeError(f"rank {self.rank}: with deepspeed.zero_stage=3 full weights live on rank 0 only; "
                               "ask rank 0 (execute='first')")
        seen = set()
        for name, t in self.model.state_dict(keep_vars=True).items():
            if id(t) in seen:
                continue
            seen.add(id(t))
            master = (self._masters or {}).get(id(t))
            yield name, master if master is not None else (self._full or {}).get(id(t), t.detach())

    def hf_model(self) -> torch.nn.Module:
        """The current weights as an HF model on the host (what Trainer.save writes without
        LoRA): `named_weights`, the fp32 masters the last `state_dict()` call gathered
        (released here) for the trained ones."""
        from transformers import AutoModelForCausalLM

        with torch.random.fork_rng(devices=[]):
            hf = AutoModelForCausalLM.from_config(self.model.config)
        state = {name: t.float() for name, t in self.named_weights()}
        if self.model.config.tie_word_embeddings:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        hf.load_state_dict(state)
        self._masters = None
        return hf.eval()

    def load_hf_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        """Set the weights (module copies and fp32 masters) from a full HF state dict; every
        rank passes the same one and keeps its shard."""
        names = {id(t): n for n, t in reversed(list(self.model.state_dict(keep_vars=True).items()))}
        with torch.no_grad():
            for p in list(self.model.parameters()):
                self._write(p, state[names[id(p)]])
        self._masters = None
        self._refresh_full()

    def load_params(self, state: Mapping[str, torch.Tensor]) -> None:
        """Set the parameters of those names (a LoRA adapter's, on resume) from full tensors;
        every rank passes the same ones and keeps its shard."""
        params = named_params(self.model, state)
        with torch.no_grad():
            for name, t in state.items():
                self._write(params[name], t)
        self._masters = None
        self._refresh_full([p for name, p in params.items() if name in state])  # the same order on every rank

    def _write(self, p: torch.nn.Parameter, value: torch.Tensor) -> None:
        """Set `p` to the full `value`: this rank's shard (ZeRO-3) or copy, and its fp32 master if trained."""
        value = value.to(self.device, torch.float32)
        if id(p) in self._trained:
            self._set_full(p, value, None)
        if self.stage == 3:
            _copy_shard(p.ds_tensor, value, self.rank)
        else:
            p.data.copy_(value)

    # ------------------------------------------------------------------ optimizer state
    def _get_full(self, p: torch.nn.Parameter, key: Optional[str]) -> torch.Tensor:
        """The full fp32 master (key None) or AdamW moment of `p` (collective)."""
        # deepspeed is optional (backend.train=deepspeed): imported on use
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        out = safe_get_full_fp32_param(p) if key is None else safe_get_full_optimizer_state(p, key)
        return out.detach().float().reshape(p.ds_shape if self.stage == 3 else p.shape)

    def _set_full(self, p: torch.nn.Parameter, value: torch.Tensor, key: Optional[str]) -> None:
        """Write this rank's shard of a full master (key None) or AdamW moment of `p`."""
        if self.stage == 3:  # DeepSpeed's own setter mis-slices the padded last shard
            part, _ = self.zero._get_fp32_opt_state_partition(p, release_swap_buffers=False, optim_state_key=key)
            _copy_shard(part, value, self.rank)
        elif key is None:
            # deepspeed is optional (backend.train=deepspeed): imported on use
            from deepspeed.utils import safe_set_full_fp32_param
            safe_set_full_fp32_param(p, value)
        else:
            # deepspeed is optional (backend.train=deepspeed): imported on use
            from deepspeed.utils import safe_set_full_optimizer_state
            safe_set_full_optimizer_state(p, value, key)

    def _ensure_moments(self, step: float) -> None:
        """AdamW state of every flat partition (torch creates it lazily at the first step),
        with `step` updates counted, linked to ZeRO-2's per-parameter fragment views."""
        for flat in self._flat_partitions():
            state = self.optimizer.state[flat]
            if not state:
                state.update({k: torch.zeros_like(flat) for k in ADAM_MOMENTS})
            state["step"] = torch.tensor(float(step))
        self._link_fragments()

    def _link_fragments(self) -> None:
        """ZeRO-2 reads a parameter's moments through views linked once, before the first
        AdamW step creates them: link them again now that they exist."""
        if self.stage == 2:
            self.zero._hp_optimizer_states_linked = False
            self.zero._lazy_init_hp_params_optimizer_state()

    def state_dict(self) -> dict:
        """Step, schedule and the full AdamW state in torch's per-parameter format (on rank 0;
        None elsewhere). Collective: every rank calls it; it also gathers the fp32 masters
        that `hf_model` writes."""
        states = [s for s in self.optimizer.state.values() if s]  # none before the first update
        step = float(states[0]["step"]) if states else None
        if step is not None:
            self._link_fragments()
        state, masters = {}, {}
        for i, p in enumerate(p for g in self.groups for p in g):
            masters[id(p)] = self._get_full(p, None).cpu()
            if step is not None:
                state[i] = {"step": torch.tensor(step), **{k: self._get_full(p, k).cpu() for k in ADAM_MOMENTS}}
        lr = self.optimizer.param_groups[0]
        groups, start = [], 0
        for g, settings in zip(self.groups, self.group_settings):
            groups.append({**settings, "lr": lr["lr"], "initial_lr": lr.get("initial_lr", settings["lr"]),
                           "params": list(range(start, start + len(g)))})
            start += len(g)
        self._masters = masters if self.rank == 0 else None
        optimizer = {"state": state, "param_groups": groups} if self.rank == 0 else None
        return {"step": self.step, "optimizer": optimizer, "scheduler": self.scheduler.state_dict()}

    def load_moments(self, optimizer_state: Any) -> None:
        """Per-parameter AdamW moments and step counts from a torch-format optimizer state
        (either engine's checkpoint, any world size); lr and group settings stay."""
        if not isinstance(optimizer_state, Mapping) or "state" not in optimizer_state:
            raise ValueError("the checkpoint's optimizer state is not a per-parameter AdamW state (a Megatron "
                             "tensor-parallel checkpoint?); continue it with the engine that wrote it")
        params = [p for g in self.groups for p in g]
        saved = optimizer_state["state"]
        if len(optimizer_state["param_groups"]) != len(self.groups) or (saved and max(saved) >= len(params)):
            raise ValueError("the checkpoint's optimizer state does not match this model's parameters")
        if not saved:
            return
        step = float(next(iter(saved.values()))["step"])
        self._ensure_moments(step)
        for i, p in enumerate(params):
            for k in ADAM_MOMENTS:
                value = saved[i][k] if i in saved else torch.zeros(p.ds_shape if self.stage == 3 else p.shape)
                self._set_full(p, value.to(self.device, torch.float32), k)

    def load_state_dict(self, state: dict) -> None:
        self.load_moments(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        lr = state["optimizer"]["param_groups"][0]
        for group in self.optimizer.param_groups:
            group["lr"] = lr["lr"]
            group["initial_lr"] = lr.get("initial_lr", group.get("initial_lr"))
        self.step = int(state["step"])


def _copy_shard(part: torch.Tensor, value: torch.Tensor, rank: int) -> None:
    """This rank's slice of `value` flattened into the equal-sized, zero-padded shard `part`."""
    n = part.numel()
    piece = value.reshape(-1)[rank * n:(rank + 1) * n]
    flat = part.view(-1)
    flat[:piece.numel()].copy_(piece)
    flat[piece.numel():].zero_()
