"""Typed config sections owned by the orchestration layer, their validation, and the
placement part of ms-swift YAML files (`config_file=PATH`; the drivers translate the
training keys: algorithms/config/swift_keys.py).

Defaults live here, once; the YAML files under conf/ only choose values and carry a
comment above every field. `validate` merges a composed config into these dataclasses
before any actor starts, so an unknown key or a wrong type fails with its full key name.
"""
from __future__ import annotations

import difflib
import functools
import sys
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Callable, Dict, List, Mapping, Optional

import yaml
from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from orchestration.plan_types import MEGATRON_ROLES, PLACEMENT_KEYS, ROLE_ENTRY_KEYS


class ConfigError(ValueError):
    """A config that cannot run; the message names the key and the fix."""


@dataclass
class RoleDevices:
    # Number of devices (GPUs) for this role; 0: the role has no group of its own (so
    # `placement.teacher.gpus=1` on the command line adds a teacher group, `=0` removes it).
    gpus: int = 0
    # Model of this role (a local HF directory or a preset name); None: the run's model.
    model: Optional[str] = None
    # vLLM tensor-parallel size; must divide gpus (rollout and teacher only). The planner
    # places it; the drivers accept only 1 for now (one engine per rank).
    vllm_tensor_parallel_size: int = 1
    # CPU cores each rank of the role computes with (torch/OpenMP threads); None: its share of
    # its node's cores, cores / processes planned there (orchestration/rank_process.py).
    num_cpus: Optional[float] = None


@dataclass
class PlacementConfig:
    # Megatron-Ray form. Roles listed together share devices, e.g. [[train, rollout]];
    # None places every role on its own devices.
    colocate_groups: Optional[List[List[str]]] = None
    # Offload colocated model weights to host memory while another role runs.
    offload_model: bool = False
    # Offload the colocated trainer's optimizer state while another role runs.
    offload_optimizer: bool = False
    # Rollout sleep between generations when colocated: 0 never, 1 weights to host, 2 discard.
    sleep_level: int = 0
    # Teacher model colocated with the trainer (shares its devices); None: no colocated teacher.
    teacher_model: Optional[str] = None
    # Offload the colocated teacher between uses.
    offload_teacher_model: bool = False
    # On Ray, build the colocated teacher inside the trainer's processes (one process per device
    # instead of two): its logits stay on the ranks for the trainer's next call instead of
    # travelling through the driver. Torch teacher engine only (another gets its own processes).
    teacher_in_trainer_process: bool = False
    # Number of nodes the layout spans; None: 1 (Megatron form) or derived from ranks.
    nnodes: Optional[int] = None
    # Devices per node (Megatron form); None: total devices / nnodes.
    nproc_per_node: Optional[int] = None
    # Trainer devices.
    train: Optional[RoleDevices] = field(default_factory=RoleDevices)
    # Rollout (generation) devices.
    rollout: Optional[RoleDevices] = field(default_factory=RoleDevices)
    # Standalone teacher group (its own devices).
    teacher: Optional[RoleDevices] = field(default_factory=RoleDevices)
    # Swift-Ray form: {nproc_per_node: N, <group>: {device: GPU|CPU, ranks, workers: [...]}};
    # a group may add vllm_tensor_parallel_size (ranks per vLLM engine of its vLLM roles).
    # Empty: no device groups (a mapping, so `+placement.device_groups.<group>.<key>=...` can
    # add one on the command line).
    device_groups: Optional[Dict[str, Any]] = field(default_factory=dict)


@dataclass
class ClusterConfig:
    # Ray cluster to join ("auto", "ray://host:10001", "host:6379"); None: the RAY_ADDRESS
    # environment variable's (set by `ray job submit`), else a new local cluster.
    address: Optional[str] = None
    # Fake GPUs for a local cluster on a CPU machine: actors reserve GPU ids, compute on CPU.
    simulate_gpus: Optional[int] = None
    # On a machine where torch sees no GPU, give a local cluster as many simulated GPUs as
    # the plan needs (unless simulate_gpus is set), so GPU layouts run on a laptop.
    simulate_missing_gpus: bool = True
    # Logical CPUs of a local cluster; None: max(cores, CPU processes the plan needs + 1).
    num_cpus: Optional[int] = None
    # Start Ray's dashboard with a local cluster.
    dashboard: bool = False
    # Object store size of a local cluster in MiB; None: Ray's default (30% of memory).
    object_store_mb: Optional[int] = None
    # Call arguments and results up to this size (MiB) travel inside the call's message of a
    # local cluster instead of through the object store (Ray's max_direct_call_object_size,
    # 0.1 by default): a small step's batch then costs one copy, not a store write and read.
    inline_object_mb: float = 4.0
    # Address a local cluster binds to; loopback keeps it private to this machine.
    node_ip: str = "127.0.0.1"
    # Show worker logs in the driver's output.
    log_to_driver: bool = True
    # Seconds to wait for placement groups before reporting missing resources.
    placement_timeout_s: float = 60.0
    # Seconds the driver waits for a worker group's answer (a call, a constructor) before it
    # reports the first silent rank like a dead one (stopped, hung, stuck in a collective);
    # 0: no bound. Generous: a call may load a model or generate a long batch.
    call_timeout_s: float = 1800.0


def check_cluster(cluster: ClusterConfig) -> None:
    """The ClusterConfig values a cluster can start with; else a ConfigError naming the key."""
    rules = {"placement_timeout_s": (lambda v: v > 0, "> 0", "the seconds to wait for placement groups, e.g. 60"),
             "call_timeout_s": (lambda v: v >= 0, ">= 0", "the seconds a worker may stay silent, or 0 for no bound"),
             "inline_object_mb": (lambda v: v >= 0, ">= 0", "a size in MiB, e.g. 4 (0: everything through the "
                                                            "object store)")}
    rules.update({key: (lambda v: v is None or v >= 1, ">= 1 (or null)", "a positive count, or null for the default")
                  for key in ("simulate_gpus", "num_cpus", "object_store_mb")})
    for key, (ok, want, fix) in rules.items():
        value = getattr(cluster, key)
        if not ok(value):
            raise ConfigError(f"config key 'cluster.{key}'={value!r} must be {want}. Fix: set it to {fix}")


@dataclass
class BackendConfig:
    # Where roles run: "ray" (actors on placement groups) or "local" (in this process).
    workers: str = "ray"
    # Trainer engine: "torch", "deepspeed" (options under deepspeed.) or "megatron" (megatron.).
    train: str = "torch"
    # Rollout and sampler engine: "torch" or "vllm" (options under vllm.).
    rollout: str = "torch"
    # Teacher engine: "torch", "vllm" or "megatron".
    teacher: str = "torch"


@dataclass
class WeightSyncConfig:
    # MiB per weight bucket (one shared-memory file, broadcast or safetensors file each);
    # a tensor larger than this travels in a bucket of its own.
    bucket_mb: float = 64.0
    # How trainer weights reach rollout/sampler/teacher groups: "auto" (CUDA IPC when the
    # receiving ranks share trainer rank 0's GPU, shared memory when they share its node,
    # else a collective broadcast), "cuda_ipc", "shm", "collective" (gloo on CPU, NCCL on
    # GPU), "object_store" or "file" (safetensors reloaded from disk, for engines that only
    # load from disk).
    path: str = "auto"
    # Receivers check a checksum per bucket before loading anything.
    verify: bool = True
    # What the checksum reads: "sample" (one 8-byte word per 4 KiB page plus each tensor's
    # last word: ~3% of a copy) or "full" (every byte: ~half a copy on each side).
    checksum: str = "sample"
    # Folder for path "file", readable by every receiving node; None: a temporary folder on
    # trainer rank 0's node.
    file_dir: Optional[str] = None
    # Seconds a broadcast (or forming its process group) may wait for the other side.
    timeout_s: float = 600.0
    # With trainer.lora, what a sync carries: "merged" (every weight with the adapter merged in the
    # first time, then only the tensors the adapter changes) or "adapter" (the adapter's own
    # tensors, each time: vLLM serves them on the base with enable_lora, the torch rollout merges
    # them onto its own copy of the base; ms-swift's vllm_enable_lora).
    lora: str = "merged"


@dataclass
class PlanCliConfig:
    # Print the plan as JSON instead of a table.
    json: bool = False
    # Also start the cluster, place one idle actor per planned rank and print where each
    # landed (node, visible devices): a check that a cluster can hold the layout.
    launch: bool = False


@dataclass
class PlanConfig:
    """Schema of `python -m orchestration.plan`."""
    # Placement in either ms-swift form.
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    # Ray cluster to start or join.
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    # Worker backend and engines.
    backend: BackendConfig = field(default_factory=BackendConfig)
    # An ms-swift YAML file (either form) used instead of the composed placement.
    config_file: Optional[str] = None
    # Output options of the plan CLI.
    plan: PlanCliConfig = field(default_factory=PlanCliConfig)
    # Sections the drivers read; the planner accepts and ignores them, so any driver
    # experiment can be planned.
    model: Any = None
    # Driver section (ignored by the planner).
    trainer: Any = None
    # Driver section (ignored by the planner).
    rollout: Any = None
    # Driver section (ignored by the planner).
    teacher: Any = None
    # Driver section (ignored by the planner).
    data: Any = None
    # Driver section (ignored by the planner).
    run: Any = None
    # Driver section (ignored by the planner).
    algorithm: Any = None
    # Engine options section (ignored by the planner).
    vllm: Any = None


def register_schema(schema: type) -> None:
    """Make `schema` the typed base of conf/config.yaml (its `base_config` entry).

    Each entry point registers its own schema before Hydra composes, so the composed
    config is typed and its defaults come from the dataclasses.
    """
    ConfigStore.instance().store(name="base_config", node=schema)


def validate(cfg: DictConfig | Mapping, schema: type, sections: list[str] | None = None) -> DictConfig:
    """Merge `cfg` into `schema` (only `sections` of it, if given) and return the typed config.

    Unknown keys and wrong types raise ConfigError naming the full key.
    """
    cfg = cfg if isinstance(cfg, DictConfig) else OmegaConf.create(dict(cfg))
    if sections is not None:
        cfg = OmegaConf.masked_copy(cfg, [s for s in sections if s in cfg])
    try:  # a plain copy, so keys Hydra let in with '+key=' are checked too
        typed = OmegaConf.merge(OmegaConf.structured(schema), OmegaConf.create(OmegaConf.to_container(cfg)))
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        first = str(getattr(e, "msg", e)).splitlines()[0]
        raise ConfigError(f"config key '{key}': {first}. Fix: use a key and type of {schema.__name__} "
                          "(python -m <driver> --cfg job lists them)") from None
    if typed.backend.workers not in ("ray", "local"):
        raise ConfigError(f"config key 'backend.workers': unknown value {typed.backend.workers!r}. "
                          "Fix: use backend=ray or backend=local")
    return typed


@functools.cache
def config_groups() -> frozenset:
    """The config groups under conf/ (`placement=separate` picks one of their files)."""
    return frozenset(p.name for p in resources.files("conf").iterdir() if p.is_dir() and p.name != "__pycache__")


@functools.cache
def group_choices(group: str) -> list[str]:
    """The choices of a config group: its YAML files under conf/<group>/."""
    return sorted(p.name[:-5] for p in resources.files("conf").joinpath(group).iterdir() if p.name.endswith(".yaml"))


def unknown_override(args: list[str], schema: type) -> Optional[str]:
    """The error for the first command-line override `key=value` whose key `schema` lacks (with
    the nearest key), or whose value the key's type refuses, else None. (Hydra's own messages
    for these span several lines, and for a missing key suggest `+key=value`, which a typed
    config refuses too.) Group choices, `+`/`~` overrides, sweeps, interpolations, Hydra's keys
    and flags pass, and so does anything below a list or a free-form mapping."""
    top = OmegaConf.structured(schema)
    for arg in args:
        key, eq, value = arg.partition("=")
        parts = key.split(".")
        group = key.lstrip("+")
        if eq and group in config_groups() and "," not in value and "${" not in value and value != "null":
            choices = group_choices(group)
            if value not in choices:  # (Hydra's own message spans several lines)
                close = difflib.get_close_matches(value, choices, n=1, cutoff=0.6)
                hint = f" (did you mean {key}={close[0]}?)" if close else ""
                return (f"config key '{group}'={value} names no file conf/{group}/{value}.yaml{hint}. Fix: use one "
                        f"of {choices}" + (", or model.path=/a/local/model/folder" if group == "model" else ""))
            continue
        if not eq or arg.startswith(("-", "+", "~")) or "/" in key or parts[0] == "hydra" or (
                len(parts) == 1 and parts[0] in config_groups()):
            continue
        node: Any = top
        for i, part in enumerate(parts):
            if not isinstance(node, DictConfig) or node._is_none() or OmegaConf.get_type(node) is dict:
                break  # a list, a value, an unset section or a free-form mapping: not checked further
            if part not in node:
                where = ".".join(parts[:i])
                close = difflib.get_close_matches(part, [str(k) for k in node.keys()], n=1, cutoff=0.6)
                hint = f" (did you mean '{'.'.join([*parts[:i], close[0]])}'?)" if close else ""
                return (f"config key '{key}'={value} is not a key of {f'{where!r}' if where else 'the config'}{hint}. "
                        f"Fix: use a key of {schema.__name__} (python -m <driver> --cfg job lists them)")
            node = node._get_node(part)
        else:
            problem = _refused_value(top, key, arg, node)
            if problem:
                return f"config key '{key}'={value} {problem}"
    return None


def _refused_value(top: DictConfig, key: str, arg: str, node: Any) -> Optional[str]:
    """Why the typed config `top` refuses the value of override `arg` for `key` (its `node`), else None."""
    try:
        override = OverridesParser.create().parse_overrides([arg])[0]
    except HydraException:
        return None  # Hydra reports its own syntax errors
    if override.is_sweep_override():
        return None
    value = override.value()
    if isinstance(value, str) and "${" in value:
        return None  # an interpolation: resolved (and checked) later
    try:
        OmegaConf.update(top, key, value, merge=True)
    except OmegaConfBaseException as e:
        wanted = str(node._metadata.ref_type).replace("typing.", "")
        wanted = getattr(node._metadata.ref_type, "__name__", wanted) if "[" not in wanted else wanted
        first = str(getattr(e, "msg", e)).splitlines()[0].rstrip(".")
        return f"does not fit the key's type {wanted} ({first}). Fix: give it a value of type {wanted}"
    return None


def checked_command_line(schema: type) -> Callable:
    """Around a Hydra main: an override naming a key `schema` lacks exits 2 with one line, the
    nearest key and the fix, before Hydra composes anything."""
    def wrap(main: Callable) -> Callable:
        @functools.wraps(main)
        def checked(*args, **kwargs):
            problem = unknown_override(sys.argv[1:], schema)
            if problem:
                print(f"error: {problem}", file=sys.stderr)
                sys.exit(2)
            return main(*args, **kwargs)
        return checked
    return wrap


def read_config_file(path: str) -> dict:
    """The keys of an ms-swift YAML file (`config_file=PATH`), any form; errors name the path."""
    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except OSError as e:
        raise ConfigError(f"config key 'config_file'={path!r} cannot be read ({e.strerror}). Fix: pass an existing YAML path") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config key 'config_file'={path!r} is not valid YAML ({e}). Fix: correct the file") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config key 'config_file'={path!r} must hold a mapping of keys, got "
                          f"{type(data).__name__}. Fix: write one 'key: value' per line")
    return data


def split_config_file(data: Mapping) -> tuple[dict, list[tuple[str, str, Any]]]:
    """(placement keys, [(where, key, value)] training keys) of a config_file's keys. The
    Megatron form's role sections (train:, rollout:, teacher:) hold a role's devices (gpus,
    model, vllm_tensor_parallel_size: placement) and that role's training keys (where:
    'train.lr'); the drivers translate the training keys (algorithms/config/swift_keys.py: the
    vLLM keys of a rollout or teacher section set that role's engine alone)."""
    placement, items = {}, []
    for key, value in data.items():
        if key in MEGATRON_ROLES and isinstance(value, Mapping):
            placement[key] = {k: v for k, v in value.items() if k in ROLE_ENTRY_KEYS}
            items += [(f"{key}.{k}", k, v) for k, v in value.items() if k not in ROLE_ENTRY_KEYS]
        elif key in PLACEMENT_KEYS:
            placement[key] = value
        else:
            items.append((key, key, value))
    return placement, items


def apply_placement(cfg: DictConfig, placement: Mapping) -> bool:
    """Replace cfg.placement with a config_file's placement keys (`split_config_file`; either
    form, orchestration/planner.py) when there are any. Returns whether there were."""
    if not placement:
        return False
    merged = OmegaConf.structured(PlacementConfig)
    for key, value in placement.items():  # one key at a time, so an error names its key
        try:
            merged = OmegaConf.merge(merged, {key: value})
        except OmegaConfBaseException as e:
            where = getattr(e, "full_key", "") or key
            for part in where.split(".")[1:]:  # the value at the nested key the error names
                value = value.get(part) if isinstance(value, Mapping) else value
            first = str(getattr(e, "msg", e)).splitlines()[0].rstrip(".")
            raise ConfigError(f"config key 'config_file'={cfg.config_file!r} sets {where}={value!r}, which does not "
                              f"fit the placement's types ({first}). Fix: correct {where} in the file") from None
    cfg.placement = merged
    return True


def placement_dict(cfg: DictConfig) -> dict:
    """The placement section as a plain dict for the planner; role sections with gpus 0 (no
    group of their own) are left out, and refused when they set anything else."""
    placement = OmegaConf.to_container(cfg.placement, resolve=True)
    for role in ("train", "rollout", "teacher"):
        entry = placement.get(role)
        if entry is None or entry["gpus"]:
            continue
        extra = {k: v for k, v in entry.items() if k != "gpus" and v != getattr(RoleDevices, k)}
        if extra:
            key = next(iter(extra))
            raise ConfigError(f"config key 'placement.{role}.{key}'={extra[key]!r} is set but placement.{role}.gpus=0 "
                              f"gives the {role} no devices. Fix: set placement.{role}.gpus to its device count, "
                              f"or drop placement.{role}.{key}")
        del placement[role]
    return placement

