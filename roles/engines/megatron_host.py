"""Megatron-core's CUDA-only pieces, as host equivalents for the Megatron engines on CPU:
its attention scratch buffer, the rotary table, and the sequence-parallel gathers and
reduce-scatters (megatron_trainer.setup_parallel and to_megatron put them in place).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


class ScratchBuffer:
    """Megatron's attention scratch buffer (only an input shape for baddbmm with beta=0) on
    the role's device: Megatron's own allocates on CUDA only."""

    def __init__(self, device: torch.device):
        self.device = device

    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
        return torch.empty(tensor_shape, dtype=dtype, device=self.device)


def host_rope_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
    # Megatron's get_emb moves inv_freq to CUDA; this is the same table, left on the host.
    freqs = self.get_freqs_non_repeated(max_seq_len, offset)
    return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]


def host_sequence_parallel() -> None:
    """Megatron's sequence-parallel gathers and reduce-scatters (and its trainable linear's,
    which does both inside) allocate on CUDA; on a host they are these equivalents."""
    # megatron-core is optional (the megatron engines): imported on use
    from megatron.core.tensor_parallel import layers, mappings

    if getattr(layers.linear_with_grad_accumulation_and_async_allreduce, "host", False):
        return
    megatron_linear = layers.linear_with_grad_accumulation_and_async_allreduce

    def gather(input_, group, output_split_sizes=None, use_global_buffer=False):
        if group.size() == 1:
            return input_
        out = input_.new_empty((input_.shape[0] * group.size(), *input_.shape[1:]))
        dist.all_gather_into_tensor(out, input_.contiguous(), group=group)
        return out

    def reduce_scatter(input_, group, input_split_sizes=None, use_global_buffer=False):
        if group.size() == 1:
            return input_
        out = input_.new_empty((input_.shape[0] // group.size(), *input_.shape[1:]))
        dist.reduce_scatter_tensor(out, input_.contiguous(), group=group)
        return out

    def linear(input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
               grad_output_buffer=None, wgrad_deferral_limit=0, async_grad_allreduce=None, tp_group=None):
        if not sequence_parallel:
            return megatron_linear(input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, False,
                                   grad_output_buffer, wgrad_deferral_limit, async_grad_allreduce, tp_group)
        # All positions in; backward reduce-scatters the input's gradient over them.
        return F.linear(mappings.gather_from_sequence_parallel_region(input, True, group=tp_group), weight, bias)

    linear.host = True
    linear.warned = True  # (Megatron's reads this off the module's name: its CUDA tuning hint)
    mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim = gather, reduce_scatter
    layers.linear_with_grad_accumulation_and_async_allreduce = linear
