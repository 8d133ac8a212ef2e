"""Trainer role: optimises a causal LM with a pluggable per-token loss, and serves its
per-token logprobs, its weights in buckets for sync, checkpoints and offload/onload.

    trainer = Trainer("tiny_qwen2", TrainerConfig(lr=1e-3), loss_fn=my_loss)
    metrics = trainer.train_step(batch)          # loss, grad_norm, lr, tokens, sequences, step
    logprobs = trainer.logprobs(batch)           # [B, T], aligned like every per-token field

A loss function is `loss_fn(logprobs, batch, extras) -> (loss, metrics)`. It is called
once per micro-batch with that micro-batch (`logprobs` [b, t] carries gradients and is
aligned with `batch.input_ids`, 0 at position 0 and on padding) and returns *its share*
of the step loss: the step loss is the sum of the returned values over all micro-batches
of all data-parallel ranks. `extras` holds the counts of the whole step (every micro-batch
of every rank) to normalise by: `global_tokens` (loss tokens), `global_sequences` and
`global_micro_batches`; the `temperature` the logprobs were computed at; and
the per-token tensors named in `loss_inputs`: `"logits"` ([b, t, V], aligned: row t is
the temperature-scaled distribution of token t) and `"entropy"` ([b, t]). The returned
metrics are averaged over micro-batches and ranks, weighted by loss tokens; every call
must return the same keys.

Data parallel: with WORLD_SIZE > 1 (a worker group of several ranks) each rank gets a
slice of the batch, gradients are summed across ranks once per step and every rank
returns the same global metrics. With Megatron tensor parallel, the ranks of one TP group
train on their slices joined (one data-parallel share) and each returns its own rows'
logprobs, so drivers dispatch='slice' the same way. No Ray here.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F

from roles.batch import Batch, batch_to, fitting_rows, slice_batch, token_bytes
from roles.engines.collectives import size_buckets, tensor_bytes
from roles.engines.deepspeed_trainer import DeepSpeedTrainEngine
from roles.engines.megatron_trainer import MegatronTrainEngine
from roles.engines.options import TRAIN_ENGINES, check_engine
from roles.engines.torch_engine import process_memory, token_entropy, token_logprobs
from roles.engines.torch_trainer import TorchTrainEngine, rank_device, rng_state, set_rng_state
from roles.engines.train_kernels import TrainKernelOptions, topk_logprobs, vocab_logprobs
from roles.lora import (PARTS, adapter_config, adapter_off, adapter_state, adapter_weights, add_adapter, base_name,
                        merged_weights, scalings, tied_aliases, write_adapter)
from roles.trainer_config import KERNEL_OPTIONS, TrainerConfig, resolve_trainer_config
from roles.models import (ModelConfig, ModelSpec, build_model, load_tokenizer, model_skeleton, resolve_config,
                          save_checkpoint)
from roles.weight_transfer import WeightSender

LossFn = Callable[[torch.Tensor, Batch, dict], Tuple[torch.Tensor, dict]]
# What a loss may ask for beyond the token logprobs: the aligned logits [b, t, V] (divided by
# the temperature), the entropy [b, t] (logged), and the log-softmax at batch.teacher_indices
# with the log mass outside them, ([b, t, k], [b, t]) (GKD's student against a top-k teacher).
LOSS_INPUTS = ("logits", "entropy", "student_topk")
# A loss metric named with this ending is the step's largest value (over micro-batches and
# ranks), not the token-weighted mean the others are.
PEAK_SUFFIX = "_max"
STATE_FILE = "trainer_state.pt"
# A LoRA trainer's checkpoint holds the adapter in PEFT's format in this folder, beside the merged model.
ADAPTER_DIR = "adapter"


@dataclasses.dataclass(frozen=True)
class BaseTeacher:
    """The base model (LoRA adapter off) as the teacher of `train_step`: its top-k logprobs
    (None: the full vocabulary) at `temperature`, as `Teacher.logits` gives them."""
    topk: Optional[int]
    temperature: float


def sft_loss(logprobs: torch.Tensor, batch: Batch, extras: dict) -> tuple[torch.Tensor, dict]:
    """Token-level negative log-likelihood over `loss_mask`, normalised by the loss tokens
    of the whole step (so micro-batching and data parallel do not change it)."""
    mask = batch.loss_mask.to(logprobs.device, logprobs.dtype)
    return -(logprobs * mask).sum() / max(extras["global_tokens"], 1.0), {}


def host_floats(values: Sequence[Union[float, torch.Tensor]]) -> list[float]:
    """Python floats of floats and 0-d tensors, the tensors read together (one wait for the device)."""
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    read = iter(torch.stack([t.detach().double().reshape(()).to(tensors[0].device) for t in tensors]).tolist()
                if tensors else [])
    return [next(read) if isinstance(v, torch.Tensor) else float(v) for v in values]


class Trainer(WeightSender):
    # Ranks of a trainer group meet in collectives here (gradient and metric sums, ZeRO
    # passes, tensor-parallel row joins): worker groups call every rank, empty slices too.
    LOCKSTEP_METHODS = ("train_step", "logprobs")

    def __init__(self, model: ModelSpec, config: Union[TrainerConfig, Mapping, None] = None,
                 loss_fn: Optional[LossFn] = None, loss_inputs: Sequence[str] = (),
                 engine: str = "torch", engine_options: Optional[Mapping[str, Any]] = None):
        self.config = resolve_trainer_config(config)
        check_engine("train", engine, TRAIN_ENGINES)
        self.engine_name = engine
        on = [k for k in KERNEL_OPTIONS if getattr(self.config, k)]
        if on and engine != "torch":
            raise ValueError(f"trainer {on} need the torch engine, not {engine}")
        unknown = sorted(set(loss_inputs) - set(LOSS_INPUTS))
        if unknown:
            raise ValueError(f"loss_inputs {unknown} unknown; choose from {LOSS_INPUTS}")
        self.loss_fn = loss_fn or sft_loss
        self.loss_inputs = tuple(loss_inputs)
        self.model_config: ModelConfig = resolve_config(model)
        self.tokenizer = load_tokenizer(self.model_config)
        device = rank_device(self.config.device)
        dtype = self.config.dtype
        if dtype == "auto":
            dtype = "bfloat16" if device.type == "cuda" else "float32"
        c = self.config
        optim = dict(device=device, dtype=dtype, lr=c.lr, weight_decay=c.weight_decay, betas=c.betas,
                     eps=c.adam_eps, optimizer=c.optimizer, warmup_steps=c.warmup_steps, total_steps=c.total_steps,
                     schedule=c.schedule, min_lr=c.min_lr,
                     seed=c.seed)
        model = build_model(self.model_config)
        # With LoRA the adapters go into the model in place (its class and forward stay): the
        # engines see a model whose trainable parameters are the adapters'.
        self.peft = None
        if c.lora.rank:
            with torch.random.fork_rng(devices=[]):  # the adapter's initial A: the same for every seed-equal run
                torch.manual_seed(c.seed)
                self.peft = add_adapter(model, c.lora)
        self._lora_scale, self._lora_aliases = scalings(model), tied_aliases(model)
        # The adapted HF model's parameter names and vocabulary (the Megatron engine's model has its own).
        self._hf_params, self._vocab_size = {n for n, _ in model.named_parameters()}, model.config.vocab_size
        if engine == "megatron":
            self.engine = MegatronTrainEngine(model, options=engine_options or {}, **optim)
        elif engine == "deepspeed":
            self.engine = DeepSpeedTrainEngine(model, options=engine_options or {}, **optim)
        else:
            self.engine = TorchTrainEngine(model, **optim)
            self.engine.set_options(TrainKernelOptions(packing=c.packing, compile=c.compile, cuda_graphs=c.cuda_graphs,
                                                       activation_checkpointing=c.activation_checkpointing,
                                                       fused_logprobs=c.fused_logprobs))
        self.model, self.device = self.engine.model, device
        self.rank, self.world_size = self.engine.rank, self.engine.world_size

    @property
    def step(self) -> int:
        """Optimizer updates applied so far."""
        return self.engine.step

    # ------------------------------------------------------------------ compute
    def _micro_size(self, batch: Batch, backward: bool) -> int:
        """Rows per forward pass for this share (micro_batch_per_device 0: as many as fit the
        activation budget, all of them for a small share)."""
        if self.config.micro_batch_per_device:
            return self.config.micro_batch_per_device
        return fitting_rows(len(batch), batch.input_ids.shape[1], token_bytes(self.model, backward),
                            self.config.micro_batch_memory_mb)

    def _micro_batches(self, batch: Batch, backward: bool):
        n = len(batch)
        size = self._micro_size(batch, backward)
        for start in range(0, n, size):
            stop = min(start + size, n)
            # Trailing positions that are padding in every row of the micro-batch are cut.
            used = batch.attention_mask[start:stop].any(0).nonzero()
            width = int(used.max()) + 1 if len(used) else 1
            yield start, stop, slice_batch(batch, start, stop, width)

    def _forward(self, mb: Batch, temperature: float, inputs: Sequence[str],
                 on_device: Optional[Batch] = None) -> tuple[torch.Tensor, dict]:
        """Aligned logprobs [b, t] (0 at position 0 and on padding) and the requested extras.
        `on_device`: `mb` already moved (batch_to); the engine is given the host tensors."""
        dev = on_device if on_device is not None else mb
        ids, valid = dev.input_ids.to(self.device), dev.attention_mask.to(self.device).bool()
        zero = torch.zeros((), device=self.device)
        topk = "student_topk" in inputs
        if topk and mb.teacher_indices is None:
            raise ValueError("the loss asks for student_topk: the batch needs teacher_indices (a top-k teacher)")
        # The engine's logprobs without the padded [B, T, V] logits: fused, packed or chunked.
        chunked = self.config.chunked_logprobs and not set(inputs) & set(LOSS_INPUTS)
        without_logits = self.config.fused_logprobs or getattr(self.engine, "packed_logprobs", False)
        if (without_logits and "logits" not in inputs) or chunked:
            logprobs, entropy, top, rest = self.engine.token_logprobs(
                mb.input_ids, mb.attention_mask, temperature, entropy="entropy" in inputs,
                topk_indices=mb.teacher_indices if topk else None, chunked=chunked)
            out = {} if entropy is None else {"entropy": entropy}
            if topk:
                out["student_topk"] = (top, rest)
            return torch.where(valid, logprobs, zero), out
        logits = self.engine.forward(mb.input_ids, mb.attention_mask)
        out = {}
        logprobs = torch.where(valid, token_logprobs(logits, ids, temperature), zero)
        if "entropy" in inputs:
            out["entropy"] = torch.where(valid, token_entropy(logits, temperature), zero)
        if topk:  # row t of the logits is aligned position t + 1's distribution
            top, rest = topk_logprobs(logits[:, :-1].float() / temperature,
                                      dev.teacher_indices.to(self.device)[:, 1:].long())
            out["student_topk"] = (F.pad(top, (0, 0, 1, 0)), F.pad(rest, (1, 0)))
        if "logits" in inputs:
            # Row t holds the distribution of token t: HF's row t - 1, shifted down by one.
            out["logits"] = F.pad(logits[:, :-1].float() / temperature, (0, 0, 1, 0))
        return logprobs, out

    def _join_rows(self, batch: Batch) -> tuple[Batch, slice]:
        """Tensor-parallel peers (Megatron) compute on the union of their slices; returns it and
        this rank's own rows. Other engines: the batch as given."""
        join = getattr(self.engine, "join_rows", None)
        return join(batch) if join else (batch, slice(None))

    def _idle_passes(self, n_local: int, backward: bool) -> int:
        """Passes this rank adds so that it runs as many as the busiest rank: DeepSpeed ZeRO's
        forwards/backwards are collectives. 0 for engines without that need."""
        rounds = getattr(self.engine, "micro_batch_rounds", None)
        return rounds(n_local, backward) - n_local if rounds else 0

    def _train_mode(self, on: bool) -> None:
        """The model in train (dropout on) or eval mode, switched only when it changes: a switch
        walks every submodule (about a millisecond on a 24-layer model, each step)."""
        if self.model.training != on:
            self.model.train(on)

    def train_step(self, batch: Batch, temperature: float = 1.0, reference: bool = False,
                   teacher: Optional[BaseTeacher] = None) -> dict[str, float]:
        """One optimizer update on `batch` (this rank's share); returns global metrics. With LoRA,
        the base model (the adapter off) can stand in for a second model, with no copy of the
        weights: `reference` sets batch.ref_logprobs to its logprobs (GRPO's KL reference),
        `teacher` the teacher fields to its distributions (`base_teacher`)."""
        self.engine.check_live("train_step")
        if reference or teacher is not None:
            batch = dataclasses.replace(batch)
            if reference:
                batch.ref_logprobs = self.base_logprobs(batch, temperature)
            if teacher is not None:
                scored = self.base_teacher(batch, teacher.topk, teacher.temperature)
                batch.teacher_logprobs, batch.teacher_indices = scored if teacher.topk else (scored, None)
        batch, _ = self._join_rows(batch)
        micro_batches = -(-len(batch) // self._micro_size(batch, backward=True))
        local = [float(batch.loss_mask.sum()), float(len(batch)), float(micro_batches),
                 float(len(batch) == 0)]
        idle = self._idle_passes(micro_batches, backward=True)
        global_tokens, global_sequences, global_micro_batches, empty_ranks = self.engine.all_reduce_sum(local)
        base = {"global_tokens": global_tokens, "global_sequences": global_sequences,
                "global_micro_batches": global_micro_batches, "temperature": temperature}
        lr = self.engine.current_lr()
        self._train_mode(True)
        # Loss and metrics stay on the device until the step's end: a micro-batch never waits for it.
        loss_sum, weighted, peaks = 0.0, {}, {}
        for _, _, mb in self._micro_batches(batch, backward=True):
            dev = batch_to(mb, self.device)
            logprobs, extras = self._forward(mb, temperature, self.loss_inputs, on_device=dev)
            loss, metrics = self.loss_fn(logprobs, dev, {**base, **extras})
            self.engine.backward(loss)
            loss_sum = loss_sum + loss.detach().double()
            w = float(mb.loss_mask.sum())
            for k, v in metrics.items():
                v = v.detach().double() if isinstance(v, torch.Tensor) else float(v)
                if k.endswith(PEAK_SUFFIX):  # the largest value of the step, not a mean
                    peaks[k] = torch.maximum(torch.as_tensor(peaks[k]), torch.as_tensor(v)) if k in peaks else v
                    continue
                weighted[k] = weighted.get(k, 0.0) + v * w
        for _ in range(idle):
            self.engine.idle_pass(backward=True)
        self.engine.reduce_gradients()
        keys, peak_keys = sorted(weighted), sorted(peaks)
        if empty_ranks:  # a rank without rows ran no loss: every rank sums the same metric names
            named = self.engine.all_gather_object((keys, peak_keys))
            keys, peak_keys = (sorted(set().union(*(n[i] for n in named))) for i in (0, 1))
        # The update is queued before the metrics are read: the device is not left waiting for the
        # host to launch it (the loss and metric tensors are copies the update does not touch).
        grad_norm, _ = self.engine.optimizer_step(self.config.grad_clip)
        totals = self.engine.all_reduce_sum(host_floats([loss_sum] + [weighted.get(k, 0.0) for k in keys]))
        out = {"loss": totals[0], "grad_norm": grad_norm, "lr": lr, "tokens": global_tokens,
               "sequences": global_sequences, "step": float(self.engine.step)}
        out.update({k: v / max(global_tokens, 1.0) for k, v in zip(keys, totals[1:])})
        if peak_keys:  # the same names on every rank (a rank without rows holds no values)
            ranks = self.engine.all_gather_object({k: float(v) for k, v in peaks.items()})
            out.update({k: max(r[k] for r in ranks if k in r) for k in peak_keys})
        return out

    @torch.no_grad()
    def logprobs(self, batch: Batch, temperature: float = 1.0,
                 entropy: bool = False) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Per-token logprobs [B, T] of `batch.input_ids` under the current weights (CPU, fp32),
        aligned like every per-token field; with `entropy`, also the entropy [B, T]."""
        self.engine.check_live("logprobs", optimizer=False)
        self._train_mode(False)
        batch, own = self._join_rows(batch)
        B, T = batch.input_ids.shape
        lp, ent = torch.zeros(B, T), torch.zeros(B, T)
        idle = self._idle_passes(-(-B // self._micro_size(batch, backward=False)), backward=False)
        for start, stop, mb in self._micro_batches(batch, backward=False):
            out, extras = self._forward(mb, temperature, ("entropy",) if entropy else ())
            width = out.shape[1]
            lp[start:stop, :width] = out.float().cpu()
            if entropy:
                ent[start:stop, :width] = extras["entropy"].float().cpu()
        for _ in range(idle):
            self.engine.idle_pass(backward=False)
        return (lp[own], ent[own]) if entropy else lp[own]

    # ------------------------------------------------------------------ the base model (LoRA)
    def _require_adapter(self, what: str) -> None:
        if self.peft is None:
            raise ValueError(f"trainer.{what}: the base model with the adapter off needs trainer.lora.rank >= 1; "
                             "without LoRA the reference or teacher is a role of its own")

    def _adapter_off(self):
        """A context in which the model computes as its base: the engine's own adapters off
        (Megatron's, which sit on its parallel linears) or peft's."""
        own = getattr(self.engine, "adapter_off", None)
        return own() if own is not None else adapter_off(self.peft)

    @torch.no_grad()
    def base_logprobs(self, batch: Batch, temperature: float = 1.0) -> torch.Tensor:
        """`logprobs` of the base model: the same weights with the LoRA adapter off (its initial
        policy, as a separately loaded base model gives them)."""
        self._require_adapter("base_logprobs")
        with self._adapter_off():
            return self.logprobs(batch, temperature)

    @torch.no_grad()
    def base_teacher(self, batch: Batch, topk: Optional[int], temperature: float):
        """The base model (adapter off) as a teacher: what `Teacher.logits(batch, topk,
        temperature=temperature)` of a separately loaded base model returns (aligned log-softmax
        [B, T, V], or its top-k (values, indices) [B, T, k]; 0 at position 0 and on padding)."""
        self._require_adapter("base_teacher")
        self.engine.check_live("base_teacher", optimizer=False)
        self._train_mode(False)
        B, T = batch.input_ids.shape
        width = topk or self._vocab_size  # (the head's weight: a shard under ZeRO-3)
        values, indices = torch.zeros(B, T, width), torch.zeros(B, T, width, dtype=torch.long) if topk else None
        idle = self._idle_passes(-(-B // self._micro_size(batch, backward=False)), backward=False)
        with self._adapter_off():
            for start, stop, mb in self._micro_batches(batch, backward=False):
                logits = self.engine.forward(mb.input_ids, mb.attention_mask)
                keep = mb.attention_mask[:, 1:].bool().unsqueeze(-1).to(logits.device)
                t = logits.shape[1]
                # Row t of the logits predicts token t + 1: it becomes aligned position t + 1.
                for out, got in zip((values, indices), vocab_logprobs(logits, topk, False, temperature)):
                    out[start:stop, 1:t] = torch.where(keep, got[:, :-1], 0).cpu()
            for _ in range(idle):
                self.engine.idle_pass(backward=False)
        return (values, indices) if topk else values

    # ------------------------------------------------------------------ weights
    def state_dict_buckets(self, bucket_mb: float, dtype: Optional[str] = None, to_cpu: bool = True,
                           part: str = "full") -> list[list[tuple[str, torch.Tensor]]]:
        """All weights as [(HF name, tensor)] lists of at most `bucket_mb` MiB each (a larger
        tensor gets a bucket of its own), in the model's state_dict order; a tied weight
        appears once. `dtype` casts (e.g. 'bfloat16' for the rollout); `to_cpu` returns
        host copies that can cross processes and are not changed by later steps. With LoRA,
        `part` (roles.lora.PARTS): "full" every weight with the adapter merged in, "adapted"
        only those the adapter changes (merged), "adapter" the adapter's own tensors
        (PEFT's names), "base" every weight of the base (the adapter left out)."""
        if part not in (*PARTS, "base"):
            raise ValueError(f"part={part!r}; choose one of {[*PARTS, 'base']}")
        if part != "full" and self.peft is None:
            raise ValueError(f"state_dict_buckets(part={part!r}) needs trainer.lora; without it every sync is full")
        cast = getattr(torch, dtype) if dtype else None

        def named():
            weights = self.engine.named_weights()
            if self.peft is None:
                return weights
            if part == "adapter":
                return adapter_weights(weights, self._lora_aliases)
            if part == "base":
                return ((hf, t) for hf, t in ((base_name(n), t) for n, t in weights) if hf is not None)
            return merged_weights(weights, self._lora_scale, only_adapted=part == "adapted")

        def prepared():
            for name, t in named():
                t = t.detach()
                if cast is not None:
                    t = t.to(cast)
                yield name, t.to("cpu", copy=True) if to_cpu else t

        return list(size_buckets(prepared(), bucket_mb * 2**20, lambda pair: tensor_bytes(pair[1])))

    def offload(self, model: bool = True, optimizer: bool = True) -> dict[str, float]:
        """Move the weights and/or optimizer state into host buffers, releasing device
        memory; returns bytes moved and seconds."""
        return self.engine.offload(model, optimizer)

    def onload(self) -> dict[str, float]:
        """Bring back whatever `offload` moved; state is bit-identical to before."""
        return self.engine.onload()

    def memory(self) -> dict[str, int]:
        """Host RSS (now, peak) and peak device memory of this rank's process."""
        return process_memory(self.device)

    # ------------------------------------------------------------------ checkpoints
    def save(self, out_dir: Union[str, os.PathLike]) -> Path:
        """HF-format weights + tokenizer (loadable by plain transformers), optimizer,
        scheduler and step (rank 0), and each rank's RNG state."""
        self.engine.check_live("save")
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        state = self.engine.state_dict()  # every rank: a sharded engine gathers its state here
        lora_rank0 = self.peft is not None and self.rank == 0  # (ZeRO-3's full weights live on rank 0 alone)
        adapter = list(adapter_weights(self.engine.named_weights(), self._lora_aliases)) if lora_rank0 else None
        if self.rank == 0:
            if adapter is not None:  # the adapter as PEFT saves it, and the merged model beside it
                write_adapter(out / ADAPTER_DIR, adapter, adapter_config(self.peft, self.model_config.path))
                save_checkpoint(self._merged_model(), self.tokenizer, out)
            else:
                hf = self.model if self.engine_name == "torch" else self.engine.hf_model()
                save_checkpoint(hf, self.tokenizer, out)
            torch.save({**state, "config": dataclasses.asdict(self.config),
                        "world_size": self.world_size}, out / STATE_FILE)
        self.engine.barrier()
        torch.save(rng_state(), out / f"rng_state_rank{self.rank}.pt")
        self.engine.barrier()
        return out

    def load(self, in_dir: Union[str, os.PathLike]) -> None:
        """Restore what `save` wrote (weights, optimizer, scheduler, step, this rank's RNG)."""
        self.engine.check_live("load")
        src = Path(in_dir)
        if self.peft is not None:  # the base stays as built; the adapter comes back exactly
            from safetensors.torch import load_file

            state = adapter_state(load_file(str(src / ADAPTER_DIR / "adapter_model.safetensors")))
            own = self._hf_params  # (a trained copy that tied modules share: once)
            self.engine.load_params({n: t for n, t in state.items() if n in own})
            self.engine.load_state_dict(torch.load(src / STATE_FILE, map_location="cpu", weights_only=True))
            self._load_rng(src)
            return
        saved = build_model(ModelConfig(name=src.name, path=str(src), dtype="float32"))
        if self.engine_name == "torch":
            self.model.load_state_dict(saved.state_dict())
        else:
            self.engine.load_hf_weights(saved.state_dict())
        self.engine.load_state_dict(torch.load(src / STATE_FILE, map_location="cpu", weights_only=True))
        self._load_rng(src)

    def load_optimizer_moments(self, in_dir: Union[str, os.PathLike]) -> None:
        """Continue from a checkpoint's optimizer moments (AdamW m, v and their step counts)
        while keeping this run's learning rate, schedule and step: a phase that follows
        another (GRPO after an SFT warm start) then starts with calibrated updates instead of
        the sign-like first updates of a fresh AdamW."""
        self.engine.check_live("load_optimizer_moments")
        saved = torch.load(Path(in_dir) / STATE_FILE, map_location="cpu", weights_only=True)
        self.engine.load_moments(saved["optimizer"])

    def _merged_model(self) -> torch.nn.Module:
        """A plain HF model of the base's class holding the merged weights (the export): its
        modules built without weights, then given the merged tensors (no second model's memory
        or initialisation; a tied head takes the embedding's)."""
        model = model_skeleton(self.model_config)
        got = model.load_state_dict(dict(merged_weights(self.engine.named_weights(), self._lora_scale)), strict=False,
                                    assign=True)
        model.tie_weights()
        unset = [n for n, p in model.named_parameters() if p.is_meta]
        assert not got.unexpected_keys and not unset, (got.unexpected_keys, unset)
        return model

    def _load_rng(self, src: Path) -> None:
        rng_file = src / f"rng_state_rank{self.rank}.pt"
        if rng_file.is_file():
            set_rng_state(torch.load(rng_file, weights_only=True))

