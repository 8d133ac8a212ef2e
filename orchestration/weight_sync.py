"""Trainer -> rollout/sampler/teacher weight sync, by the best path for each target group.

    sync = WeightSync(trainer_group, cfg.weight_sync)
    records = sync.sync([rollout_group], version=step)   # one SyncRecord per target group
    metrics = sync_metrics(records)                      # sync/<role>/{path,mb,seconds,mb_per_s}

Paths (`weight_sync.path`; the role side is roles/weight_transfer.py):

* ``cuda_ipc``: trainer rank 0 hands out CUDA IPC handles of its live weights; receiving
  ranks on the same GPU (colocated bundles) copy device to device.
* ``shm``: trainer rank 0 writes each bucket into a /dev/shm file mapped by both sides;
  every receiving rank must be on its node (colocated bundles or the same node).
* ``collective``: a broadcast from trainer rank 0 over a process group of its own with
  the target ranks (gloo on CPU, NCCL on GPU), for groups on other nodes.
* ``object_store``: packed buckets through Ray's object store and the driver; any layout.
* ``file``: safetensors files that receivers load with `update_weights_from_path`, for
  engines that reload from disk; the folder (`weight_sync.file_dir`) must be readable by
  every receiver.

``auto`` takes cuda_ipc when the trainer's weights are on a GPU that every receiving rank
shares, else shm when they share trainer rank 0's node, else the collective, limited to the
paths the receiving role lists in `weight_sync_paths()`.
Groups that are not Ray worker groups (backend=local, test stand-ins) and roles without
`receive_weights` take the direct path: `state_dict_buckets` then `update_weights`, as in
one process nothing needs to travel.
"""
from __future__ import annotations

import glob
import os
import shutil
import time
from collections import defaultdict
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from orchestration.base_group import ResultOf, WorkerError
from orchestration.config import ConfigError, WeightSyncConfig

PATHS = ("cuda_ipc", "shm", "collective", "object_store", "file")
CHOICES = ("auto", *PATHS)
# Paths whose send leaves the weights for a receive that may come later (files in shared memory
# or a folder, arrays in the send's answer): the send can ride on the trainer's last call of a
# turn and the receive on the target's next call. CUDA IPC hands out the live weights (an
# offload would move them) and a broadcast needs both sides at once.
DEFERRABLE = ("shm", "file", "object_store")
CHECKSUMS = ("sample", "full")
LORA_SYNCS = ("merged", "adapter")


def check_settings(settings: WeightSyncConfig) -> None:
    if settings.path not in CHOICES:
        raise ConfigError(f"config key 'weight_sync.path'={settings.path!r} is unknown. Fix: use one of {list(CHOICES)}")
    if settings.checksum not in CHECKSUMS:
        raise ConfigError(f"config key 'weight_sync.checksum'={settings.checksum!r} is unknown. "
                          f"Fix: use one of {list(CHECKSUMS)}")
    if settings.lora not in LORA_SYNCS:
        raise ConfigError(f"config key 'weight_sync.lora'={settings.lora!r} is unknown. Fix: use one of {list(LORA_SYNCS)}")
    for key in ("bucket_mb", "timeout_s"):
        if not getattr(settings, key) > 0:
            raise ConfigError(f"config key 'weight_sync.{key}'={getattr(settings, key)} must be > 0. Fix: raise it")


@dataclass
class SyncRecord:
    """One target group's share of a sync, timed from the driver (send + receive + load)."""
    role: str
    path: str
    version: int
    bytes: int
    seconds: float
    # What it carried (roles.lora.PARTS): every weight, or a LoRA trainer's adapted tensors or adapter.
    part: str = "full"

    @property
    def mb_per_s(self) -> float:
        return self.bytes / 2**20 / max(self.seconds, 1e-9)


def sync_metrics(records: list[SyncRecord], before: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
    """The records' metrics. A step can hold two syncs to one role (a receive at the step's
    generation, another at its eval): with `before` (the step's metrics so far) megabytes and
    seconds add up to what is already there, and the rate is the sum's."""
    out: dict[str, Any] = {}
    for r in records:
        key = f"sync/{r.role}/"
        so_far = out if key + "mb" in out else before or {}
        mb = r.bytes / 2**20 + so_far.get(key + "mb", 0.0)
        seconds = r.seconds + so_far.get(key + "seconds", 0.0)
        out.update({key + "path": r.path, key + "mb": mb, key + "seconds": seconds,
                    key + "mb_per_s": mb / max(seconds, 1e-9)})
        if r.part != "full":  # (a LoRA trainer's: what this sync's bytes are)
            out[key + "part"] = r.part
    return out


def _is_ray(group: Any) -> bool:
    return hasattr(group, "infos")  # orchestration.worker_group.WorkerGroup, without importing ray


def _role(group: Any) -> str:
    return getattr(group, "role", type(group).__name__)


class WeightSync:
    """Holds the channels (shared-memory files, process groups) of one trainer group across syncs."""

    def __init__(self, trainer: Any, settings: WeightSyncConfig, adapter: bool = False, whole_each_time: bool = False):
        """`adapter`: the trainer trains a LoRA adapter (trainer.lora), so syncs after the first
        may carry less (weight_sync.lora); `whole_each_time`: the receivers drop their weights
        between syncs (sleep level 2), so a merged sync sends every weight each time."""
        check_settings(settings)
        self.trainer, self.settings, self.whole_each_time = trainer, settings, whole_each_time
        self._adapter = adapter
        self._whole: set[int] = set()  # groups that hold every weight of the trainer's (merged)
        self.records: list[SyncRecord] = []
        self._paths: dict[int, str] = {}
        self._channels: dict[tuple, dict] = {}
        self._opened: list[Any] = []  # target groups holding receiver state
        self._seq = 0
        self._checksum = settings.checksum if settings.verify else None

    # ---- choosing a path ------------------------------------------------------------------
    def path_for(self, group: Any) -> str:
        if id(group) not in self._paths:
            self._paths[id(group)] = self._choose(group)
        return self._paths[id(group)]

    def _accepts(self, group: Any) -> tuple[str, ...]:
        """Paths the group's role receives by; () for roles without receive_weights."""
        if _is_ray(group):
            try:
                return tuple(group.call("weight_sync_paths", execute="first"))
            except WorkerError as e:
                if "AttributeError" in str(e):
                    return ()
                raise
        workers = getattr(group, "workers", None)
        if workers and hasattr(workers[0], "receive_weights"):
            return tuple(workers[0].weight_sync_paths())
        return ()

    def _choose(self, group: Any) -> str:
        wanted, role = self.settings.path, _role(group)
        accepts = self._accepts(group)
        if not accepts:
            if wanted != "auto":
                raise ConfigError(f"config key 'weight_sync.path'={wanted!r}: role {role} has no receive_weights "
                                  "(only update_weights). Fix: weight_sync.path=auto (direct update_weights)")
            return "direct"
        ray = _is_ray(group) and _is_ray(self.trainer)
        if not ray:
            if wanted in ("collective", "cuda_ipc"):
                raise ConfigError(f"config key 'weight_sync.path'={wanted!r} needs backend=ray (a process per "
                                  "rank). Fix: weight_sync.path=auto")
            return "direct" if wanted == "auto" else self._accepted(wanted, accepts, role)
        home = self.trainer.infos[0]
        local = all(info["node_id"] == home["node_id"] for info in group.infos)
        # CUDA IPC: trainer weights on a GPU that every receiving rank sees as its own.
        same_gpu = (local and bool(home["cuda_visible_devices"]) and
                    all(i["cuda_visible_devices"] == home["cuda_visible_devices"] for i in group.infos) and
                    self.trainer.call("weight_device", execute="first").startswith("cuda"))
        reachable = {"cuda_ipc": same_gpu, "shm": local, "file": local or bool(self.settings.file_dir)}
        if wanted != "auto" and not reachable.get(wanted, True):
            raise ConfigError(f"config key 'weight_sync.path'={wanted!r}: {role} ranks do not share "
                              f"{'a GPU holding the weights' if wanted == 'cuda_ipc' else 'a node'} with trainer "
                              "rank 0 (other nodes or devices). Fix: weight_sync.path=auto or collective")
        if wanted != "auto":
            return self._accepted(wanted, accepts, role)
        feasible = [p for p in PATHS if p in accepts and reachable.get(p, True)]
        if not feasible:
            raise ConfigError(f"role {role} receives weights only by {list(accepts)}, which cannot reach its nodes "
                              "from trainer rank 0. Fix: set weight_sync.file_dir to a folder shared by the nodes")
        return feasible[0]

    @staticmethod
    def _accepted(path: str, accepts: tuple[str, ...], role: str) -> str:
        if path not in accepts:
            raise ConfigError(f"config key 'weight_sync.path'={path!r}: role {role} receives weights only by "
                              f"{list(accepts)}. Fix: weight_sync.path=auto or one of those")
        return path

    # ---- what a sync carries ------------------------------------------------------------
    def part_for(self, group: Any) -> str:
        """What the next sync to `group` carries (roles.lora.PARTS): "full" without LoRA; with it,
        per weight_sync.lora, the adapter alone, or the merged weights, whole the first time (and
        after every sleep that dropped them), then only the tensors the adapter changes."""
        if not self._adapter:
            return "full"
        if self.settings.lora == "adapter":
            return "adapter"
        return "adapted" if id(group) in self._whole and not self.whole_each_time else "full"

    def _took(self, group: Any, part: str) -> None:
        if part == "full":
            self._whole.add(id(group))

    def forget(self, group: Any) -> None:
        """`group` lost its weights (a replaced rank): its next merged sync is whole."""
        self._whole.discard(id(group))

    # ---- a send and a receive riding on other calls ------------------------------------
    def defers(self, group: Any) -> bool:
        """Whether `group` can take the weights apart from their send: Ray groups on a DEFERRABLE path."""
        return _is_ray(group) and _is_ray(self.trainer) and self.path_for(group) in DEFERRABLE

    def send_args(self, group: Any, version: int) -> tuple:
        """Arguments of trainer rank 0's `send_weights` for `group` (a `defers` one), the channel
        opened on first use."""
        self._seq += 1
        part = self.part_for(group)
        self._took(group, part)
        return (self._channel(self.path_for(group), None), self._seq, version, self.settings.bucket_mb, self._checksum,
                None, part)

    def receive_later(self, group: Any, channel: dict, sent: Any) -> None:
        """`group`'s receive, queued on its next call. `sent` is send_weights' answer, or a
        ResultOf standing for it (its ranks then take it from trainer rank 0 rank to rank)."""
        self._remember(group)
        group.defer("receive_sent", channel, sent)

    def received(self, group: Any, version: int, answers: list) -> SyncRecord:
        """The record of a receive that rode on `group`'s call (`answers`: its ranks' receive_sent
        results): seconds are the send's plus the slowest rank's receive, as the ranks timed them."""
        answers = [a for a in answers if a]
        seconds = answers[0]["send_seconds"] + max(a["seconds"] for a in answers)
        record = SyncRecord(_role(group), self.path_for(group), version, answers[0]["bytes"], seconds,
                            answers[0].get("part", "full"))
        self.records.append(record)
        return record

    # ---- syncing ----------------------------------------------------------------------
    def sync(self, targets: list[Any], version: int) -> list[SyncRecord]:
        """Trainer rank 0's weights into every rank of each target group; one record per group."""
        self._seq += 1
        by_path: dict[tuple, list] = defaultdict(list)
        for group in targets:
            by_path[self.path_for(group), self.part_for(group)].append(group)
        records = []
        for (path, part), groups in by_path.items():
            if path == "direct":
                records += self._direct(groups, version, part)
            elif path == "collective":
                records += [self._collective(g, version, part) for g in groups]
            else:  # one send serves every group reading the same shm files/folder/arrays/handles
                records += self._send_then_receive(path, groups, version, part)
            for g in groups:
                self._took(g, part)
        self.records += records
        return records

    def _direct(self, groups: list, version: int, part: str) -> list[SyncRecord]:
        t0 = time.perf_counter()
        lora = {} if part == "full" else {"part": part}  # (stand-ins without LoRA take no part)
        buckets = self.trainer.call("state_dict_buckets", self.settings.bucket_mb, execute="first", **lora)
        nbytes = sum(t.numel() * t.element_size() for b in buckets for _, t in b)
        records = []
        for g in groups:
            g.call("update_weights", buckets, version, **lora)
            records.append(SyncRecord(_role(g), "direct", version, nbytes, time.perf_counter() - t0, part))
        return records

    def _send_then_receive(self, path: str, groups: list, version: int, part: str) -> list[SyncRecord]:
        channel = self._channel(path, None)
        t0 = time.perf_counter()
        sending = self.trainer.async_call("send_weights", channel, self._seq, version, self.settings.bucket_mb,
                                          self._checksum, None, part, execute="first")
        # The receivers take the send's manifest and payload from trainer rank 0's answer, rank to
        # rank: they start once it is written, without a round trip through the driver.
        futures = [g.async_call("receive_weights", channel, ResultOf(sending, "manifest"), ResultOf(sending, "payload"))
                   for g in groups]
        sent = sending.get()  # a failed send is the error raised, not its receivers'
        records = []
        for g, future in zip(groups, futures):
            self._remember(g)
            future.get()
            records.append(SyncRecord(_role(g), path, version, sent["bytes"], time.perf_counter() - t0, part))
        return records

    def _collective(self, group: Any, version: int, part: str) -> SyncRecord:
        channel, seq = self._channel("collective", group), self._seq

        def per_rank(n: int, i: int) -> tuple[tuple, dict]:
            # Rank 0 of the broadcast group is the trainer; each rank binds its own node address.
            return (dict(channel, rank=i + 1, local_host=group.infos[i]["ip"]),), {"seq": seq}

        t0 = time.perf_counter()
        self._remember(group)
        receiving = group.async_call("receive_weights", dispatch=per_rank)
        sent = self.trainer.async_call("send_weights", channel, seq, version, self.settings.bucket_mb,
                                       self._checksum, None, part, execute="first").get()
        receiving.get()
        return SyncRecord(_role(group), "collective", version, sent["bytes"], time.perf_counter() - t0, part)

    def _channel(self, path: str, group: Any) -> dict:
        key = (path, id(group))
        if key not in self._channels:
            name = f"{_role(self.trainer)}-{_role(group)}" if group is not None else path
            host = self.trainer.infos[0]["ip"] if _is_ray(self.trainer) else "127.0.0.1"
            world = 1 + group.world_size if group is not None else 1
            self._channels[key] = self.trainer.call("open_weight_channel", name, path, host, world,
                                                    self.settings.file_dir, self.settings.timeout_s, execute="first")
        return self._channels[key]

    def _remember(self, group: Any) -> None:
        if all(g is not group for g in self._opened):
            self._opened.append(group)

    def close(self) -> None:
        """Unlink shared memory and drop process groups on both sides (best effort)."""
        for group, method in [(g, "close_weight_receivers") for g in self._opened] + \
                             [(self.trainer, "close_weight_channels")] * bool(self._channels):
            try:
                group.call(method)
            except WorkerError:
                pass
        self.remove_scratch()
        self._channels, self._opened, self._paths = {}, [], {}

    def remove_scratch(self) -> None:
        """Delete the trainer's shared-memory files and temporary folders from this process,
        without calling any actor: what a driver can still do at exit, after its actors are
        gone (on another node than trainer rank 0 this finds nothing to delete)."""
        for channel in self._channels.values():
            for path in glob.glob(channel["scratch"]) if "scratch" in channel else []:
                if os.path.isdir(path):
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    Path(path).unlink(missing_ok=True)
