"""Torch building blocks shared by the roles: device choice, aligned token logprobs,
moving a module's tensors off the device and back, and a process's memory figures.

The device comes from config and availability, never from CUDA_VISIBLE_DEVICES alone: a
cluster with simulated GPUs sets that variable while torch.cuda stays unavailable.
"""
from __future__ import annotations

import os
import resource

import torch


def pick_device(preference: str = "auto") -> torch.device:
    """'auto' -> cuda if torch can use it, else cpu; 'cpu'/'cuda'/'cuda:N' as given."""
    if preference == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(preference)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device '{preference}' requested but torch sees no CUDA device; "
                           "use device=auto or device=cpu")
    return device


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """[B, T] logprobs aligned with input_ids: out[:, t] = log p(ids[t] | ids[:t]); out[:, 0] = 0.

    `logits` is the model output for `input_ids` ([B, T, V]); temperature divides them first.
    """
    if temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    picked = logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return torch.cat([torch.zeros_like(picked[:, :1]), picked], dim=1)


def token_entropy(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """[B, T] entropy of the next-token distribution, aligned like `token_logprobs`."""
    if temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    ent = -(logp.exp() * logp).sum(-1)
    return torch.cat([torch.zeros_like(ent[:, :1]), ent], dim=1)


def tensors_nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def process_memory(device: torch.device) -> dict[str, int]:
    """This process's host memory (resident set now and at its peak) and the peak device
    memory torch allocated on `device` (0 on CPU). Every role reports these as memory()."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    try:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # no procfs: the peak is the best figure there is
        rss = peak
    peak = max(peak, rss)  # the kernel's high-water mark can trail the current figure
    device_peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    return {"rss_bytes": rss, "rss_peak_bytes": peak, "device_peak_bytes": device_peak}
