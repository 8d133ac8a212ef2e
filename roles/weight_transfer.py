"""Moving a trainer's weights into other roles' processes, bucket by bucket (no Ray here).

Buckets are packed as in roles.weight_buckets. Five paths (chosen by
`orchestration.weight_sync`):

* ``cuda_ipc``: the sender hands out CUDA IPC handles of its live weights
  (torch.multiprocessing reductions); receivers on the same GPU copy device to device.
* ``shm``: the sender writes each bucket into a file in /dev/shm that stays mapped in both
  processes across syncs; receivers copy from the mapping into their weights.
* ``collective``: a process group of the sender and the receiving ranks only (its own
  TCPStore, gloo on CPU, NCCL on CUDA), separate from any data-parallel default group;
  the sender broadcasts bucket after bucket, the layout and checksums go through the store
  as JSON that receivers validate (never pickle); the store listens only on the given host.
* ``object_store``: packed buckets returned as numpy arrays (the caller carries them).
* ``file``: safetensors files in a folder, loaded with `update_weights_from_path`
  (engines that only load from disk).

Every sync carries a sequence number, the weight version and (unless checksum=None) a
checksum per bucket; a mismatch raises `ChecksumError` before anything is loaded.
"""
from __future__ import annotations

import datetime
import glob
import os
import json
import shutil
import socket
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import torch

from roles.weight_buckets import (PACKED_PATHS, STRIDES, Manifest, bucket_checksum, checksums_from_json, layout_of,
                                  manifest_from_json, manifest_to_json, pack, packed_checksum, unpack, verify)

PATHS = ("cuda_ipc", "shm", "collective", "object_store", "file")
SHM_PREFIX = "rayroles-weights-"


def _timeout(channel: dict) -> datetime.timedelta:
    return datetime.timedelta(seconds=float(channel["timeout_s"]))


def _process_group(channel: dict, store: Any, rank: int, device: torch.device) -> Any:
    """A process group of the sender (rank 0) and the receivers, apart from any default group."""
    import torch.distributed as dist

    prefixed = dist.PrefixStore(f"pg/{channel['name']}", store)
    if channel["backend"] == "nccl":
        if device.type != "cuda":
            raise RuntimeError(f"weight channel '{channel['name']}' uses NCCL (the trainer's weights are on CUDA) "
                               "but this rank computes on CPU; set weight_sync.path=shm or object_store")
        torch.cuda.set_device(device)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = _timeout(channel)
        return dist.ProcessGroupNCCL(prefixed, rank, channel["world_size"], opts)
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=channel.get("local_host") or channel["host"])]
    opts._timeout = _timeout(channel)
    return dist.ProcessGroupGloo(prefixed, rank, channel["world_size"], opts)


def _map_shm(path: str, nbytes: int, create: bool) -> torch.Tensor:
    if create:
        with open(path, "wb") as f:
            try:
                os.posix_fallocate(f.fileno(), 0, nbytes)  # no room fails here, not as SIGBUS later
            except OSError as e:
                os.unlink(path)
                free = os.statvfs(os.path.dirname(path))
                raise RuntimeError(f"no room for a {nbytes / 2**20:.1f} MiB weight bucket in {os.path.dirname(path)} "
                                   f"({free.f_bavail * free.f_frsize / 2**20:.0f} MiB free: {e.strerror}); enlarge "
                                   "it (docker --shm-size) or set weight_sync.path=collective") from None
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)


def _start_ticks(pid: int) -> int:
    """When `pid` started (clock ticks since boot, /proc/<pid>/stat field 22; 0 where unknown).
    File names carry it beside the PID, so a reused PID is not taken for the writer
    (orchestration.cleanup reads the same names)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat[stat.rindex(")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return 0


def _scratch_name(name: str) -> str:
    return f"{SHM_PREFIX}{os.getpid()}-{_start_ticks(os.getpid())}-{name}"


def _writer_gone(fields: list[str]) -> bool:
    """From a file name's "<pid>-<start>-..." fields (older names: "<pid>-..."): its writer has exited."""
    pid = int(fields[0])
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's process
        return False
    start = int(fields[1]) if len(fields) > 2 and fields[1].isdigit() else 0
    now = _start_ticks(pid)
    return bool(start and now and now != start)


def _remove_stale_shm(folder: str) -> None:
    """Files of senders whose process is gone (a killed actor cannot clean up after itself)."""
    for path in glob.glob(os.path.join(folder, SHM_PREFIX + "*")):
        fields = os.path.basename(path)[len(SHM_PREFIX):].split("-")
        if fields[0].isdigit() and int(fields[0]) != os.getpid() and _writer_gone(fields):
            try:
                Path(path).unlink(missing_ok=True)
            except OSError:  # another user's file
                pass


class WeightSender:
    """Mixed into a role with `state_dict_buckets(bucket_mb, dtype, to_cpu)` (the Trainer)."""

    def open_weight_channel(self, name: str, path: str, host: str, world_size: int, file_dir: Optional[str],
                            timeout_s: float) -> dict:
        """Prepare a path once; returns the channel description receivers need. `timeout_s`
        (weight_sync.timeout_s) bounds a broadcast and the forming of its process group."""
        if path not in PATHS:
            raise ValueError(f"unknown weight sync path {path!r}; choose one of {PATHS}")
        channel = {"name": name, "path": path, "timeout_s": timeout_s}
        if path == "shm":
            folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
            _remove_stale_shm(folder)
            channel["location"] = os.path.join(folder, _scratch_name(name))
            channel["scratch"] = channel["location"] + "-*"  # what may be deleted once all is done
        elif path == "file":
            if not file_dir:  # removed again by close_weight_channels
                self.__dict__.setdefault("_temp_dirs", []).append(
                    os.path.join(tempfile.gettempdir(), _scratch_name(name)))
            folder = file_dir or self._temp_dirs[-1]
            Path(folder).expanduser().mkdir(parents=True, exist_ok=True)
            channel["location"] = str(Path(folder).expanduser())
            if not file_dir:
                channel["scratch"] = channel["location"]
        elif path == "collective":
            import torch.distributed as dist

            # Listening only on `host` (127.0.0.1 in a local run); a TCPStore given just a port
            # listens on every address.
            sock = socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
            store = dist.TCPStore(host, sock.getsockname()[1], None, True, timeout=_timeout(channel),
                                  wait_for_workers=False, master_listen_fd=sock.fileno())
            sock.detach()  # the store closes the descriptor
            on_cuda = self.weight_device().startswith("cuda")
            channel.update(host=host, port=store.port, world_size=world_size,
                           backend="nccl" if on_cuda else "gloo")
            self._sender_state()[name] = {"store": store, "pg": None, "buf": None, "last_seq": None}
        return channel

    def weight_device(self) -> str:
        """Where the weights live ("cpu", "cuda:0"): CUDA IPC and NCCL need them on a GPU."""
        return str(getattr(self, "device", "cpu"))

    def send_weights(self, channel: dict, seq: int, version: int, bucket_mb: float,
                     checksum: Optional[str], dtype: Optional[str] = None, part: str = "full") -> dict:
        """Send the weights along `channel` with per-bucket checksums ("full", "sample" or None:
        none: weight_sync.checksum, None without weight_sync.verify); `part`: every weight, or
        with a LoRA trainer the adapted tensors or the adapter (roles.lora.PARTS). Returns
        {"manifest", "bytes", "seconds"} and, for path object_store, "payload"."""
        t0 = time.perf_counter()
        buckets = self.state_dict_buckets(bucket_mb, dtype, False, **({} if part == "full" else {"part": part}))
        path = channel["path"]
        if checksum is not None and checksum not in STRIDES:
            raise ValueError(f"checksum={checksum!r}; choose one of {sorted(STRIDES)} or None")
        stride = STRIDES.get(checksum, 1)
        manifest = Manifest(seq, int(version), path, [layout_of(b) for b in buckets], [],
                            channel.get("location", ""), stride, part)
        sums = (lambda bucket: bucket_checksum(bucket, stride)) if checksum else None
        out: dict[str, Any] = {}
        if path == "collective":
            self._broadcast(channel, manifest, buckets, sums)
        elif path == "cuda_ipc":
            from torch.multiprocessing.reductions import reduce_tensor

            # Handles of the live CUDA tensors: receivers copy from them, no staging buffer. Tensors
            # made for this send (a LoRA trainer's merged weights) are held until the next one.
            out["payload"] = [[(n, reduce_tensor(t.detach())) for n, t in b] for b in buckets]
            self._ipc_held = buckets
            manifest.checksums = [sums(b) for b in buckets] if sums else []
        else:
            payload = []
            for i, (bucket, layout) in enumerate(zip(buckets, manifest.buckets)):
                if path == "file":
                    self._write_file(manifest.location, i, len(buckets), bucket)
                else:
                    buf = self._shm_buffer(manifest.location, i, layout.nbytes) if path == "shm" else \
                        torch.from_numpy(np.empty(layout.nbytes, dtype=np.uint8))
                    pack(bucket, layout, buf)
                    if path == "object_store":
                        payload.append(buf.numpy())
                    if checksum:
                        manifest.checksums.append(packed_checksum(buf, layout, stride))
                if sums and path == "file":
                    manifest.checksums.append(sums(bucket))
            if path == "file":
                _prune_files(manifest.location, len(buckets))
            if path == "object_store":
                out["payload"] = payload
        out.update(manifest=manifest, bytes=manifest.total_bytes, seconds=time.perf_counter() - t0)
        return out

    def close_weight_channels(self) -> None:
        """Unlink shared-memory files and drop process groups and stores."""
        for path in getattr(self, "_shm_maps", {}):
            Path(path).unlink(missing_ok=True)
        for folder in getattr(self, "_temp_dirs", []):
            shutil.rmtree(folder, ignore_errors=True)
        self._shm_maps, self._senders, self._temp_dirs, self._ipc_held = {}, {}, [], None

    # ---- internals ----------------------------------------------------------------------
    def _sender_state(self) -> dict:
        if not hasattr(self, "_senders"):
            self._senders = {}
        return self._senders

    def _shm_buffer(self, prefix: str, index: int, nbytes: int) -> torch.Tensor:
        maps = self.__dict__.setdefault("_shm_maps", {})
        path = f"{prefix}-{index}"
        if path not in maps or maps[path].numel() != nbytes:
            maps[path] = _map_shm(path, nbytes, create=True)
        return maps[path]

    def _write_file(self, folder: str, index: int, count: int, bucket) -> None:
        from safetensors.torch import save_file

        name = f"model-{index + 1:05d}-of-{count:05d}.safetensors"
        tmp = os.path.join(folder, f".{name}.tmp")
        save_file({n: t.detach().contiguous().cpu() for n, t in bucket}, tmp)
        os.replace(tmp, os.path.join(folder, name))

    def _broadcast(self, channel: dict, manifest: Manifest, buckets: list, sums: Any) -> None:
        state = self._sender_state()[channel["name"]]
        store = state["store"]
        if state["pg"] is None:
            device = next((t.device for b in buckets for _, t in b), torch.device("cpu"))
            state["pg"] = _process_group(channel, store, 0, device)
        if state["last_seq"] is not None:
            for key in ("manifest", "checksums"):
                store.delete_key(f"w/{state['last_seq']}/{key}")
        store.set(f"w/{manifest.seq}/manifest", manifest_to_json(manifest))
        largest = max((layout.nbytes for layout in manifest.buckets), default=0)
        device = next((t.device for b in buckets for _, t in b), torch.device("cpu"))
        if state["buf"] is None or state["buf"].shape[1] < largest or state["buf"].device != device:
            state["buf"] = torch.empty(2, largest, dtype=torch.uint8, device=device)
        # Two buffers: bucket i+1 is packed while bucket i travels.
        works = [None, None]
        for i, (bucket, layout) in enumerate(zip(buckets, manifest.buckets)):
            if works[i % 2] is not None:
                works[i % 2].wait()
            view = state["buf"][i % 2, :layout.nbytes]
            pack(bucket, layout, view)
            works[i % 2] = state["pg"].broadcast(view, 0)
            if sums:
                manifest.checksums.append(sums(bucket))
        for work in works:
            if work is not None:
                work.wait()
        store.set(f"w/{manifest.seq}/checksums", json.dumps(manifest.checksums))
        state["last_seq"] = manifest.seq


def _prune_files(folder: str, count: int) -> None:
    """Drop bucket files of an earlier sync that had more buckets."""
    for f in Path(folder).glob("model-*-of-*.safetensors"):
        if not f.name.endswith(f"-of-{count:05d}.safetensors"):
            f.unlink(missing_ok=True)


class WeightReceiver:
    """Mixed into a role with `update_weights(pairs, version)` and
    `update_weights_from_path(path, version)` (Rollout, Sampler, Teacher)."""

    def weight_sync_paths(self) -> tuple[str, ...]:
        """Paths this role can receive by; an engine that loads only from disk returns ("file",)."""
        return PATHS

    def receive_weights(self, channel: dict, manifest: Optional[Manifest] = None, payload: Optional[list] = None,
                        seq: Optional[int] = None) -> dict:
        """Receive one sync (the manifest comes through the store for path collective),
        verify its checksums, load it; returns {"bytes", "seconds", "version"}."""
        t0 = time.perf_counter()
        path = channel["path"]
        if path == "collective":
            manifest, buckets = self._receive_broadcast(channel, seq)
        elif path == "shm":
            bufs = [self._shm_view(f"{manifest.location}-{i}", layout.nbytes)
                    for i, layout in enumerate(manifest.buckets)]
        elif path == "object_store":
            with warnings.catch_warnings():  # zero-copy views of read-only object-store arrays; only read
                warnings.simplefilter("ignore", UserWarning)
                bufs = [torch.from_numpy(a) for a in payload]
        elif path == "file":
            buckets = [self._read_file(manifest, i) for i in range(len(manifest.buckets))] if manifest.checksums else []
        elif path == "cuda_ipc":  # the sender's device memory, mapped for this call only
            buckets = [[(n, rebuild(*args)) for n, (rebuild, args) in b] for b in payload]
        else:
            raise ValueError(f"unknown weight sync path {path!r}; choose one of {PATHS}")
        if path in PACKED_PATHS:
            buckets = [unpack(buf, layout) for buf, layout in zip(bufs, manifest.buckets)]
        for i, pairs in enumerate(buckets):
            verify(manifest, i, pairs, bufs[i] if path in PACKED_PATHS else None)
        part = {} if manifest.part == "full" else {"part": manifest.part}  # (receivers without LoRA take none)
        if path == "file":  # loaded by the engine itself (it may only read from disk)
            self.update_weights_from_path(manifest.location, manifest.version, **part)
        else:
            self.update_weights([p for pairs in buckets for p in pairs], manifest.version, **part)
        if path == "cuda_ipc":  # copies done before the mapping goes: the sender may free or offload it
            torch.cuda.synchronize()
        return {"bytes": manifest.total_bytes, "seconds": time.perf_counter() - t0, "version": manifest.version,
                "part": manifest.part}

    def receive_sent(self, channel: dict, sent: dict) -> dict:
        """`receive_weights` of the sync `sent` (trainer rank 0's send_weights answer, passed rank
        to rank); adds the send's own seconds as "send_seconds"."""
        out = self.receive_weights(channel, sent["manifest"], sent.get("payload"))
        return {**out, "send_seconds": sent["seconds"]}

    def close_weight_receivers(self) -> None:
        """Unmap shared memory and drop process groups."""
        self._shm_views, self._receivers = {}, {}

    # ---- internals ----------------------------------------------------------------------
    def _shm_view(self, path: str, nbytes: int) -> torch.Tensor:
        """The sender's file, mapped once; mapped again if the sender made a new one."""
        views = self.__dict__.setdefault("_shm_views", {})
        inode = os.stat(path).st_ino
        if path not in views or views[path][0] != inode or views[path][1].numel() != nbytes:
            views[path] = (inode, _map_shm(path, nbytes, create=False))
        return views[path][1]

    def _read_file(self, manifest: Manifest, index: int) -> list[tuple[str, torch.Tensor]]:
        from safetensors.torch import load_file

        count = len(manifest.buckets)
        state = load_file(os.path.join(manifest.location, f"model-{index + 1:05d}-of-{count:05d}.safetensors"))
        return [(n, state[n]) for n in manifest.buckets[index].names]

    def _receive_broadcast(self, channel: dict, seq: int) -> tuple[Manifest, list]:
        import torch.distributed as dist

        states = self.__dict__.setdefault("_receivers", {})
        state = states.get(channel["name"])
        if state is None or state["port"] != channel["port"]:
            own = getattr(self, "device", None)
            device = own if channel["backend"] == "nccl" and isinstance(own, torch.device) else torch.device("cpu")
            store = dist.TCPStore(channel["host"], channel["port"], None, False, timeout=_timeout(channel))
            state = {"store": store, "port": channel["port"], "device": device, "buf": None,
                     "pg": _process_group(channel, store, channel["rank"], device)}
            states[channel["name"]] = state
        manifest = manifest_from_json(state["store"].get(f"w/{seq}/manifest"), seq)
        total = manifest.total_bytes
        buf = state["buf"]
        if buf is None or buf.numel() != total:
            buf = torch.empty(total, dtype=torch.uint8, device=state["device"])
            # Kept between syncs in host memory (no page faults next time), never on a GPU.
            state["buf"] = buf if state["device"].type == "cpu" else None
        buckets, works, start = [], [], 0
        for layout in manifest.buckets:  # all posted at once: no gap between buckets
            view = buf[start:start + layout.nbytes]
            works.append(state["pg"].broadcast(view, 0))
            buckets.append(unpack(view, layout))
            start += layout.nbytes
        for work in works:
            work.wait()
        raw = state["store"].get(f"w/{seq}/checksums")
        manifest.checksums = checksums_from_json(raw, len(manifest.buckets))
        return manifest, buckets


def load_named_weights(module: torch.nn.Module, pairs: Sequence[tuple[str, torch.Tensor]], owner: str) -> None:
    """Copy (state_dict name, tensor) pairs into `module`: names and shapes must match and
    cover every weight (a tied weight once is enough); on a mismatch nothing is loaded."""
    params = dict(module.named_parameters())
    canonical = {id(p): n for n, p in params.items()}
    alias = {n: canonical[id(p)] for n, p in module.named_parameters(remove_duplicate=False)}
    saved = set(module.state_dict())
    targets = {**{n: p.data for n, p in params.items()},
               **{n: b for n, b in module.named_buffers() if n in saved}}
    alias.update({n: n for n in targets if n not in alias})
    unknown = [n for n, _ in pairs if n not in alias]
    wrong = [n for n, t in pairs if n in alias and tuple(t.shape) != tuple(targets[alias[n]].shape)]
    missing = sorted(set(targets) - {alias[n] for n, _ in pairs if n in alias})
    if unknown or wrong or missing:
        raise ValueError(f"{owner}.update_weights: the weights do not match its model ({type(module).__name__}): "
                         f"unknown names {unknown[:5]}, wrong shapes {wrong[:5]}, missing {missing[:5]}. "
                         "Send the model's own state_dict names and shapes, all of them")
    with torch.no_grad():
        for name, t in pairs:
            targets[alias[name]].copy_(t)
