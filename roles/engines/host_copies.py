"""Host copies of device tensors for offload: a role's weights or optimizer state moved to host
buffers and back in place, every reference to the tensor objects staying valid (the torch
trainer engine, DeepSpeed's and the teacher use them)."""
from __future__ import annotations

import torch


def module_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """Parameters then buffers, each tensor once (tied weights are one Parameter)."""
    seen, out = set(), []
    for t in list(module.parameters()) + list(module.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def to_host(tensors: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor, torch.device]]:
    """Copy each tensor into a host buffer (pinned when it lives on CUDA), then swap its
    storage for an empty one so the device memory is released while every reference to
    the tensor object (module, optimizer state) stays valid. Returns what `to_device` needs."""
    saved = []
    for t in tensors:
        host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)
        host.copy_(t.data, non_blocking=t.is_cuda)
        saved.append((t, host, t.device))
    if any(dev.type == "cuda" for _, _, dev in saved):
        torch.cuda.synchronize()
    for t, _, dev in saved:
        t.data = torch.empty(0, dtype=t.dtype, device=dev)
    return saved


def to_device(saved: list[tuple[torch.Tensor, torch.Tensor, torch.device]]) -> int:
    """Put host buffers back where `to_host` found them; returns the bytes moved."""
    for t, host, dev in saved:
        t.data = host.to(dev, non_blocking=True)
    if any(dev.type == "cuda" for _, _, dev in saved):
        torch.cuda.synchronize()
    return host_bytes(saved)


def host_bytes(saved) -> int:
    return sum(host.numel() * host.element_size() for _, host, _ in saved)
