"""The wire format of weight sync: buckets packed into flat byte buffers, their layout,
checksums, and the manifest's JSON form for the collective path (no Ray here; used by
roles.weight_transfer on both sides).

A bucket is a list of (HF name, tensor) pairs packed into one flat byte buffer, each
tensor at a 64-byte aligned offset, so any dtype mix travels as bytes and is unpacked as
views. A checksum is an integer sum of the tensors' bytes as int64 words ("full": every
word; "sample": one per 4 KiB page), weighted by position: exact in any summation order,
where float sums differ with thread counts. Paths whose receivers read the packed buffer
itself (PACKED_PATHS) checksum the buffer in one pass (`packed_checksum`); the others sum
tensor by tensor (`bucket_checksum`).
"""
from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import numpy as np
import torch

from roles.lora import PARTS

ALIGN = 64
_MASK = 2**64 - 1
# checksum="sample" reads one 8-byte word per 4 KiB (a page: stale, torn or misplaced pages
# and swapped tensors show) at ~3% of a full pass; "full" reads every byte (~half a copy).
STRIDES = {"full": 1, "sample": 512}
# Paths whose receivers read the sender's packed buffer as it is (a shared-memory file, an
# object-store array): their checksums are `packed_checksum`s of that buffer.
PACKED_PATHS = ("shm", "object_store")


class ChecksumError(RuntimeError):
    """Received weights differ from the sent ones; nothing was loaded."""


@dataclass
class BucketLayout:
    names: list[str]
    shapes: list[tuple[int, ...]]
    dtypes: list[str]
    offsets: list[int]
    nbytes: int


@dataclass
class Manifest:
    """What a receiver needs besides the bytes: layout, version and checksums."""
    seq: int
    version: int
    path: str
    buckets: list[BucketLayout]
    checksums: list[int] = field(default_factory=list)
    location: str = ""  # shm file prefix or safetensors folder
    stride: int = 1  # of the checksums (see STRIDES)
    # What the buckets hold: "full" (every weight), or with a LoRA trainer "adapted" (the merged
    # tensors the adapter changes) or "adapter" (its own tensors); roles.lora.PARTS.
    part: str = "full"

    @property
    def total_bytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)


def layout_of(bucket: Sequence[tuple[str, torch.Tensor]]) -> BucketLayout:
    offsets, end = [], 0
    for _, t in bucket:
        offsets.append(end)
        end += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    return BucketLayout([n for n, _ in bucket], [tuple(t.shape) for _, t in bucket],
                        [str(t.dtype).removeprefix("torch.") for _, t in bucket], offsets, end)


def pack(bucket: Sequence[tuple[str, torch.Tensor]], layout: BucketLayout, out: torch.Tensor) -> None:
    """Copy the bucket's tensors into `out` (uint8, at least layout.nbytes) at their offsets."""
    for (_, t), off in zip(bucket, layout.offsets):
        src = _bytes(t)
        out[off:off + src.numel()].copy_(src)


@functools.lru_cache(maxsize=None)
def _itemsize(dtype: str) -> int:
    return torch.empty(0, dtype=getattr(torch, dtype)).element_size()


def _nbytes(shape: tuple[int, ...], dtype: str) -> int:
    return math.prod(shape) * _itemsize(dtype)


def unpack(buf: torch.Tensor, layout: BucketLayout) -> list[tuple[str, torch.Tensor]]:
    """(name, view) pairs over a packed uint8 buffer; nothing is copied."""
    out = []
    for name, shape, dtype, off in zip(layout.names, layout.shapes, layout.dtypes, layout.offsets):
        n = _nbytes(shape, dtype)
        out.append((name, buf[off:off + n].view(getattr(torch, dtype)).view(shape)))
    return out


def packed_checksum(buf: torch.Tensor, layout: BucketLayout, stride: int = 1) -> int:
    """Checksum of a packed bucket in one pass: the int64 words of `buf[:layout.nbytes]` (the
    alignment padding travels with the tensors), every `stride`-th word plus each tensor's last
    word, each weighted by its position + 1 (moved or swapped tensors show), summed with wrap-around."""
    words = buf[:layout.nbytes]
    if words.data_ptr() % 8:
        words = words.clone()
    words = words.view(torch.int64)
    last = [(off + max(_nbytes(shape, dtype), 1) - 1) // 8
            for shape, dtype, off in zip(layout.shapes, layout.dtypes, layout.offsets)]
    index = torch.cat([torch.arange(0, words.numel(), stride), torch.tensor(last, dtype=torch.long)]).to(words.device)
    return int((words[index] * (index + 1)).sum()) & _MASK


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def tensor_checksum(t: torch.Tensor, stride: int = 1) -> int:
    """Wrapping int64 sum of the tensor's bytes read as 8-byte words, every `stride`-th word
    plus the last one (stride 1: every byte counts), and the len % 8 tail bytes as one word."""
    b = _bytes(t)
    n8 = b.numel() // 8 * 8
    words = b[:n8]
    if n8 and words.data_ptr() % 8:
        words = words.clone()
    w = words.view(torch.int64)
    total = int(w[::stride].sum()) + (int(w[-1]) if stride > 1 and n8 else 0) if n8 else 0
    return (total + int.from_bytes(b[n8:].cpu().numpy().tobytes(), "little")) & _MASK


def bucket_checksum(pairs: Sequence[tuple[str, torch.Tensor]], stride: int = 1) -> int:
    """Per-tensor sums weighted by position, so swapped tensors do not cancel out."""
    return sum((i + 1) * tensor_checksum(t, stride) for i, (_, t) in enumerate(pairs)) & _MASK


def verify(manifest: Manifest, index: int, pairs: Sequence[tuple[str, torch.Tensor]],
           buf: Optional[torch.Tensor] = None) -> None:
    """Raise ChecksumError unless bucket `index` (its `pairs`, or for PACKED_PATHS its packed
    `buf`) has the checksum the sender computed."""
    if not manifest.checksums:
        return
    if manifest.path in PACKED_PATHS:
        got = packed_checksum(buf, manifest.buckets[index], manifest.stride)
    else:
        got = bucket_checksum(pairs, manifest.stride)
    want = manifest.checksums[index]
    if got != want:
        names = manifest.buckets[index].names
        raise ChecksumError(
            f"weight sync {manifest.seq} (version {manifest.version}, path '{manifest.path}'): bucket {index} of "
            f"{len(manifest.buckets)} ({len(names)} tensors, first {names[:3]}) arrived corrupted: checksum "
            f"{got:#x}, sent {want:#x}. Nothing was loaded; the weights stay at the previous version. "
            "Check memory/disk health or switch weight_sync.path")


# What a collective receiver reads from the store: plain JSON checked field by field, never
# pickle (anyone who can reach the store could write it).
DTYPES = frozenset({"float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
                    "float8_e4m3fn", "float8_e5m2"})


def manifest_to_json(m: Manifest) -> str:
    return json.dumps({"seq": m.seq, "version": m.version, "path": m.path, "stride": m.stride, "part": m.part,
                       "buckets": [[b.names, [list(s) for s in b.shapes], b.dtypes, b.offsets, b.nbytes]
                                   for b in m.buckets]})


def manifest_from_json(raw: bytes, seq: int) -> Manifest:
    """The manifest of sync `seq`; ValueError for anything but the layout manifest_to_json writes."""
    try:
        d = json.loads(raw)
        _check(d["seq"] == seq and _is_int(d["version"]) and d["path"] == "collective" and _is_int(d["stride"], 1)
               and d["part"] in PARTS, "seq, version, path, stride or part")
        buckets = [_layout(*b) for b in d["buckets"]]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"weight sync {seq}: the manifest in the store is malformed ({type(e).__name__}: {e}); "
                         "only trainer rank 0's send_weights writes it") from None
    return Manifest(seq, d["version"], "collective", buckets, [], "", d["stride"], d["part"])


def _layout(names: list, shapes: list, dtypes: list, offsets: list, nbytes: int) -> BucketLayout:
    _check(len(names) == len(shapes) == len(dtypes) == len(offsets) and _is_int(nbytes, 0), "bucket lengths")
    for name, shape, dtype, off in zip(names, shapes, dtypes, offsets):
        _check(isinstance(name, str) and dtype in DTYPES and isinstance(shape, list) and
               all(_is_int(n, 0) for n in shape) and _is_int(off, 0), f"tensor {name!r}")
        size = int(np.prod(shape, dtype=np.int64)) * torch.empty(0, dtype=getattr(torch, dtype)).element_size()
        _check(off + size <= nbytes, f"tensor {name!r} ends past its bucket")
    return BucketLayout(names, [tuple(s) for s in shapes], dtypes, offsets, nbytes)


def checksums_from_json(raw: bytes, count: int) -> list[int]:
    sums = json.loads(raw)
    _check(isinstance(sums, list) and len(sums) in (0, count) and all(_is_int(x, 0) and x < 2**64 for x in sums),
           f"checksums: want {count} integers in [0, 2**64)")
    return sums


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(f"bad {what}")


def _is_int(x: Any, low: Optional[int] = None) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and (low is None or x >= low)
