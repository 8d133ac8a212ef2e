"""The trainer engines' data-parallel process group and what runs over it: joining the group,
metric sums and object gathers, and gradients summed in flat buckets. `size_buckets` cuts a
sequence of tensors into runs of bounded bytes, for those gradient buckets, ZeRO-3 weight
gathers and the Trainer's weight-sync buckets.
"""
from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Callable, Hashable, Iterable, Iterator, Optional, TypeVar

import torch
import torch.distributed as dist

# How long ranks wait for each other in a collective before the step fails.
DIST_TIMEOUT = timedelta(minutes=30)
# Gradients are all-reduced in flat buckets of about this size.
GRAD_BUCKET_BYTES = 32 * 2**20

Item = TypeVar("Item")


def init_data_parallel(device: torch.device) -> tuple[int, int]:
    """(rank, world size) from RANK/WORLD_SIZE; joins the process group when WORLD_SIZE > 1."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world <= 1:
        return 0, 1
    if not os.environ.get("MASTER_ADDR") or not os.environ.get("MASTER_PORT"):
        raise RuntimeError(f"WORLD_SIZE={world} but MASTER_ADDR/MASTER_PORT are not set: data parallel needs "
                           "one process per rank (a Ray worker group); the local backend runs ranks in one "
                           "process, so give the trainer one rank there")
    if dist.is_initialized():
        if dist.get_world_size() != world or dist.get_rank() != rank:
            raise RuntimeError(f"a process group of world size {dist.get_world_size()} (rank {dist.get_rank()}) "
                               f"is already running, but this rank is {rank} of {world}")
        return rank, world
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
                            rank=rank, world_size=world, timeout=DIST_TIMEOUT)
    return rank, world


class DataParallelCollectives:
    """Metric sums, object gathers and barriers over the default process group, for engines
    whose ranks all hold the same model (plain data parallel, ZeRO); needs `world_size` and
    `device`."""

    world_size: int
    device: torch.device

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        if self.world_size == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.tolist()

    def all_gather_object(self, obj: object) -> list:
        """`obj` of every rank (a picklable value), in rank order."""
        if self.world_size == 1:
            return [obj]
        out: list = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def size_buckets(items: Iterable[Item], limit: float, nbytes: Callable[[Item], int],
                 key: Optional[Callable[[Item], Hashable]] = None) -> Iterator[list[Item]]:
    """Consecutive runs of `items` of at most `limit` bytes each (`nbytes(item)`; an item larger
    than that gets a run of its own), in order; with `key`, a run also ends where key(item) changes."""
    bucket: list = []
    size, last = 0, None
    for item in items:
        n, k = nbytes(item), key(item) if key is not None else None
        if bucket and (size + n > limit or k != last):
            yield bucket
            bucket, size = [], 0
        bucket.append(item)
        size, last = size + n, k
    if bucket:
        yield bucket


def all_reduce_gradients(params: list[torch.nn.Parameter], group: Any = None,
                         bucket_bytes: int = GRAD_BUCKET_BYTES) -> None:
    """Sum the gradients of `params` over `group` (None: every rank), in flat buckets of one
    dtype. A parameter without a gradient joins with zeros: unused on this rank, it must still
    take part in the collective."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    for bucket in size_buckets([p.grad for p in params], bucket_bytes, tensor_bytes, key=lambda g: g.dtype):
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, group=group)
        offset = 0
        for g in bucket:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
