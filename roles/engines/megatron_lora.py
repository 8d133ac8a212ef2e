"""LoRA adapters on the Megatron engine's tensor-parallel linears, equal to peft's adapters on
the HF model the engine was converted from (same initial values, same update).

    lora = MegatronLora(gpt_model, peft_adapted_hf_model, tp_rank, tp, sequence_parallel)
    with lora.off(): ...                   # the base model alone (GRPO's reference, GKD's base teacher)
    hf = lora.hf_tensors(shards)           # {peft-adapted HF name: tensor} from every TP rank's dict
    lora.load({peft-adapted HF name: tensor})   # this rank's pieces of them

peft puts one adapter on each HF projection (q_proj, ..., down_proj); Megatron fuses them
(linear_qkv: q, k and v rows per query group; linear_fc1: this rank's gate rows, then its up
rows). Each Megatron linear gets the adapters of the projections it fuses, kept apart, so the
update is peft's exactly:
* column-parallel (linear_qkv, linear_fc1): A [r, in] replicated, B sharded by output rows as
  the base weight is (whole query groups; this rank's gate and up rows);
* row-parallel (linear_proj, linear_fc2): A sharded by input columns, B [out, r] replicated;
  the partial A x is summed over the TP ranks (reduce-scattered over positions with sequence
  parallelism) before B.
A forward hook adds scale * B A dropout(x) to the base linear's output. The adapters are
submodules of the linear they adapt (`<linear>.lora.A...`), so the base's names stay as the
converter writes them. With sequence parallelism a replicated factor sees only this rank's
positions: it is marked `sequence_parallel` and the engine sums its gradient over the TP group,
as Megatron does for norms.
"""
from __future__ import annotations

import contextlib
import re
from typing import Iterator, Mapping, Optional

import torch
import torch.nn.functional as F
from peft.tuners.lora import LoraLayer

from roles.lora import ADAPTER

# Megatron linear (under decoder.layers.<i>.) -> the HF projections it holds, in fused order;
# column-parallel ones fuse several, row-parallel ones hold one.
COLUMN = {"self_attention.linear_qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          "mlp.linear_fc1": ("mlp.gate_proj", "mlp.up_proj")}
ROW = {"self_attention.linear_proj": "self_attn.o_proj", "mlp.linear_fc2": "mlp.down_proj"}
# The HF linears an adapter can sit on with this engine (under model.layers.<i>.), and their
# name suffixes (as target_modules names them).
HF_PROJECTIONS = tuple(p for parts in COLUMN.values() for p in parts) + tuple(ROW.values())
PROJECTIONS = tuple(p.rsplit(".", 1)[1] for p in HF_PROJECTIONS)
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def _dropout(p: float) -> torch.nn.Module:
    return torch.nn.Dropout(p) if p > 0 else torch.nn.Identity()


class ColumnLora(torch.nn.Module):
    """Adapters of a column-parallel linear: per HF projection (q_proj, ...), A [r, in]
    (replicated) and B [groups * rows, r] (this rank's rows). `rows`: {projection: its output
    rows of one group, for every projection the linear fuses, in order}; `adapted`: those with
    an adapter (the others add zeros)."""

    def __init__(self, rows: Mapping[str, int], adapted: list[str], groups: int, in_features: int, rank: int,
                 scale: float, dropout: float, sequence_parallel: bool):
        # megatron-core is optional (the megatron engines): imported on use
        from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

        super().__init__()
        self.rows, self.groups, self.scale, self.sequence_parallel = dict(rows), groups, scale, sequence_parallel
        self.dropout = _dropout(dropout)
        self.A = torch.nn.ParameterDict({n: torch.nn.Parameter(torch.zeros(rank, in_features)) for n in adapted})
        self.B = torch.nn.ParameterDict({n: torch.nn.Parameter(torch.zeros(groups * self.rows[n], rank))
                                         for n in adapted})
        for a in self.A.values():
            a.sequence_parallel = sequence_parallel
        for b in self.B.values():
            set_tensor_model_parallel_attributes(b, is_parallel=True, dim=0, stride=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # megatron-core is optional (the megatron engines): imported on use
        from megatron.core.tensor_parallel import (copy_to_tensor_model_parallel_region,
                                                   gather_from_sequence_parallel_region)

        deltas = {}
        for name in self.A:
            h = F.linear(self.dropout(x), self.A[name])
            # Every TP rank needs all positions of h, and the sum of the ranks' parts of its gradient.
            h = gather_from_sequence_parallel_region(h) if self.sequence_parallel else \
                copy_to_tensor_model_parallel_region(h)
            deltas[name] = F.linear(h, self.B[name]) * self.scale
        first = next(iter(deltas.values()))
        s, b = first.shape[:2]
        pieces = [deltas[n].view(s, b, self.groups, rows) if n in deltas
                  else first.new_zeros(s, b, self.groups, rows) for n, rows in self.rows.items()]
        return torch.cat(pieces, -1).flatten(-2)


class RowLora(torch.nn.Module):
    """The adapter of a row-parallel linear: A [r, in / TP] (this rank's columns), B [out, r]
    (replicated)."""

    def __init__(self, in_features: int, out_features: int, rank: int, scale: float, dropout: float,
                 sequence_parallel: bool):
        # megatron-core is optional (the megatron engines): imported on use
        from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

        super().__init__()
        self.scale, self.sequence_parallel = scale, sequence_parallel
        self.dropout = _dropout(dropout)
        self.A = torch.nn.Parameter(torch.zeros(rank, in_features))
        self.B = torch.nn.Parameter(torch.zeros(out_features, rank))
        set_tensor_model_parallel_attributes(self.A, is_parallel=True, dim=1, stride=1)
        self.B.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # megatron-core is optional (the megatron engines): imported on use
        from megatron.core.tensor_parallel import (reduce_from_tensor_model_parallel_region,
                                                   reduce_scatter_to_sequence_parallel_region)

        h = F.linear(self.dropout(x), self.A)  # this rank's part of A x
        h = reduce_scatter_to_sequence_parallel_region(h) if self.sequence_parallel else \
            reduce_from_tensor_model_parallel_region(h)
        return F.linear(h, self.B) * self.scale


def hf_adapters(hf_model: torch.nn.Module) -> dict[str, LoraLayer]:
    """The peft LoRA layers of an adapted HF model, by module name."""
    return {n: m for n, m in hf_model.named_modules() if isinstance(m, LoraLayer) and ADAPTER in m.lora_A}


def megatron_lora_problems(hf_model: torch.nn.Module) -> list[str]:
    """What of a peft-adapted HF model this engine's adapters do not map (empty: all of it)."""
    problems = []
    saved = sorted({n.split(".modules_to_save.")[0] for n, _ in hf_model.named_parameters()
                    if ".modules_to_save." in n})
    if saved:
        problems.append(f"modules_to_save {saved} (a trained copy of a vocabulary-parallel module)")
    layers = hf_adapters(hf_model)
    other = sorted(n for n in layers if not ((found := _LAYER.match(n)) and found.group(2) in HF_PROJECTIONS))
    if other:
        problems.append(f"adapters on {other} (supported: {list(PROJECTIONS)})")
    settings = {(m.r[ADAPTER], float(m.scaling[ADAPTER]), getattr(m.lora_dropout[ADAPTER], "p", 0.0))
                for m in layers.values()}
    if len(settings) > 1:
        problems.append(f"adapters of different rank/scale/dropout {sorted(settings)}")
    return problems


class MegatronLora:
    """Every adapter of one Megatron GPTModel, built from the peft adapters of the HF model it
    was converted from; their hooks, on/off switch and HF names."""

    def __init__(self, model: torch.nn.Module, hf_model: torch.nn.Module, tp_rank: int, tp: int,
                 sequence_parallel: bool):
        problems = megatron_lora_problems(hf_model)
        if problems:
            raise ValueError("trainer.lora on the megatron engine cannot map " + "; ".join(problems)
                             + f". Fix: set trainer.lora.target_modules to [all-linear] or some of {list(PROJECTIONS)} "
                             "and modules_to_save to [], or use backend.train=torch or deepspeed")
        layers = hf_adapters(hf_model)
        first = next(iter(layers.values()))
        rank, scale = first.r[ADAPTER], float(first.scaling[ADAPTER])
        dropout = getattr(first.lora_dropout[ADAPTER], "p", 0.0)
        c = hf_model.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        groups_here = c.num_key_value_heads // tp
        # Output rows of one query group (linear_qkv) or of this rank (linear_fc1), by projection.
        per_group = {"q_proj": c.num_attention_heads // c.num_key_value_heads * head_dim, "k_proj": head_dim,
                     "v_proj": head_dim, "gate_proj": c.intermediate_size // tp, "up_proj": c.intermediate_size // tp}
        self.tp_rank, self.tp, self.enabled = tp_rank, tp, True
        # (Megatron parameter name, peft-adapted HF name, the dim it is split along over TP or None: replicated)
        self.names: list[tuple[str, str, Optional[int]]] = []
        modules = dict(model.named_modules())
        for i in range(c.num_hidden_layers):
            h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
            for linear, parts in COLUMN.items():
                adapted = [p for p in parts if h + p in layers]
                if not adapted:
                    continue
                base = modules[m + linear]
                groups = groups_here if linear == "self_attention.linear_qkv" else 1
                short = {p: p.rsplit(".", 1)[1] for p in parts}
                base.lora = ColumnLora({short[p]: per_group[short[p]] for p in parts}, [short[p] for p in adapted],
                                       groups, base.input_size, rank, scale, dropout, sequence_parallel)
                for p in adapted:
                    self.names.append((f"{m}{linear}.lora.A.{short[p]}", f"{h}{p}.lora_A.{ADAPTER}.weight", None))
                    self.names.append((f"{m}{linear}.lora.B.{short[p]}", f"{h}{p}.lora_B.{ADAPTER}.weight", 0))
                base.register_forward_hook(self._hook)
            for linear, part in ROW.items():
                if h + part not in layers:
                    continue
                base = modules[m + linear]
                base.lora = RowLora(base.input_size_per_partition, base.output_size, rank, scale, dropout,
                                    sequence_parallel)
                self.names.append((f"{m}{linear}.lora.A", f"{h}{part}.lora_A.{ADAPTER}.weight", 1))
                self.names.append((f"{m}{linear}.lora.B", f"{h}{part}.lora_B.{ADAPTER}.weight", None))
                base.register_forward_hook(self._hook)
        self.params = dict(model.named_parameters())
        self.load({n: t for n, t in hf_model.state_dict().items() if ".lora_A." in n or ".lora_B." in n})

    def _hook(self, module: torch.nn.Module, args: tuple, output: tuple) -> Optional[tuple]:
        if not self.enabled:
            return None
        out, bias = output
        return out + module.lora(args[0]), bias

    @contextlib.contextmanager
    def off(self) -> Iterator[None]:
        """The base model alone while inside (the adapters add nothing)."""
        self.enabled = False
        try:
            yield
        finally:
            self.enabled = True

    def load(self, hf: Mapping[str, torch.Tensor]) -> None:
        """Set the adapters from peft-adapted HF tensors (each rank takes its piece); names this
        model has no adapter for are refused."""
        by_hf = {h: (m, dim) for m, h, dim in self.names}
        unknown = sorted(set(hf) - set(by_hf))
        if unknown:
            raise ValueError(f"the Megatron model has no adapter tensors {unknown[:5]}")
        with torch.no_grad():
            for name, t in hf.items():
                m, dim = by_hf[name]
                self.params[m].copy_(t if dim is None else t.chunk(self.tp, dim)[self.tp_rank])

    def hf_tensors(self, shards: list[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The adapters' peft-adapted HF tensors from every TP rank's Megatron dict."""
        return {hf: shards[0][m] if dim is None else torch.cat([s[m] for s in shards], dim)
                for m, hf, dim in self.names}
