"""The reward model with a scalar head that the ORM (kind=model) and the PRM share: its config
fields, a causal LM backbone with a linear head and its own AdamW, saved as an HF checkpoint
plus HEAD_FILE. No Ray here; training is single-process (call it on one rank)."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Mapping, Sequence

import torch
from omegaconf import OmegaConf

from roles.batch import pad_sequences
from roles.engines.torch_engine import pick_device
from roles.models import build_model, load_tokenizer

# File next to the HF weights holding the value head, optimizer and step.
HEAD_FILE = "value_head.pt"


@dataclass
class ScorerModelConfig:
    """Fields of a reward model with a scalar head (kind=model), shared by ORMConfig and PRMConfig."""
    # model: preset name, local checkpoint directory, or a model config mapping.
    model: Any = None
    # model: "auto" (cuda when available), "cpu" or "cuda[:N]".
    device: str = "auto"
    # model: seed of the value head's initialisation.
    seed: int = 0
    # model: wrap the prompt in the tokenizer's chat template (when it has one).
    use_chat_template: bool = True
    # model: sequences per forward pass when scoring or training.
    micro_batch: int = 16
    # model: AdamW learning rate of training the head and model (ORM.train_pairwise, PRM.train_steps).
    lr: float = 1e-5
    # model: AdamW weight decay.
    weight_decay: float = 0.0
    # model: gradient-norm clip per optimizer step; 0 disables it.
    max_grad_norm: float = 1.0


def typed_config(cls: type, config: Any, overrides: Mapping[str, Any], key: str):
    """A `cls` dataclass from None / an instance / a mapping, plus keyword overrides.
    Unknown keys and wrong types fail here, naming the key."""
    if isinstance(config, cls) and not overrides:
        return config
    try:
        merged = OmegaConf.merge(OmegaConf.structured(cls), config or {}, dict(overrides))
        return OmegaConf.to_object(merged)
    except Exception as err:
        raise ValueError(f"bad {key} config: {err}") from err


class ScalarHeadModel:
    """A causal LM backbone with a linear head giving one scalar per token, and its own
    AdamW. The ORM reads the scalar at the last token, the PRM at each step's end."""

    def __init__(self, model: Any, device: str, seed: int, use_chat_template: bool, lr: float, weight_decay: float,
                 max_grad_norm: float, micro_batch: int):
        if model is None:
            raise ValueError("model-based scoring needs `model` (a preset name, a checkpoint "
                             "directory or a model config)")
        self.device = pick_device(device)
        self.tokenizer = load_tokenizer(model)
        self.lm = build_model(model).to(self.device)
        self.use_chat_template = use_chat_template and bool(getattr(self.tokenizer, "chat_template", None))
        self.max_grad_norm, self.micro_batch = max_grad_norm, micro_batch
        self.max_length = int(getattr(self.lm.config, "max_position_embeddings", 0) or 0)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.head = torch.nn.Linear(self.lm.config.hidden_size, 1).to(self.device)
            torch.nn.init.normal_(self.head.weight, std=1.0 / math.sqrt(self.lm.config.hidden_size + 1))
            torch.nn.init.zeros_(self.head.bias)
        self.optimizer = torch.optim.AdamW(self.parameters(), lr=lr, weight_decay=weight_decay)
        self.step = 0
        self.eval()

    def parameters(self) -> List[torch.nn.Parameter]:
        return list(self.lm.parameters()) + list(self.head.parameters())

    def train(self) -> None:
        self.lm.train()
        self.head.train()

    def eval(self) -> None:
        self.lm.eval()
        self.head.eval()

    def text_ids(self, text: str) -> List[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def prompt_ids(self, prompt: str) -> List[int]:
        """The prompt as the model sees it before a reply (chat template when it has one)."""
        if self.use_chat_template:
            prompt = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                        add_generation_prompt=True, tokenize=False)
        return self.text_ids(prompt)

    def values(self, seqs: Sequence[List[int]]) -> torch.Tensor:
        """[B, T] scalar per token of right-padded `seqs` (float32; graph kept in train mode)."""
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        ids, mask = pad_sequences(list(seqs), pad)
        ids, mask = ids.to(self.device), mask.to(self.device)
        hidden = self.lm.base_model(input_ids=ids, attention_mask=mask).last_hidden_state
        return self.head(hidden.to(self.head.weight.dtype)).squeeze(-1).float()

    def optimizer_step(self) -> float:
        """Clip, step and zero the gradients; returns the gradient norm before clipping."""
        params = [p for p in self.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm if self.max_grad_norm > 0 else float("inf"))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return float(norm)

    def save(self, out_dir: str | os.PathLike) -> Path:
        """HF-format backbone + tokenizer (loadable with plain transformers) and HEAD_FILE."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.lm.save_pretrained(out)
        self.tokenizer.save_pretrained(out)
        torch.save({"head": self.head.state_dict(), "optimizer": self.optimizer.state_dict(), "step": self.step},
                   out / HEAD_FILE)
        return out

    def load(self, in_dir: str | os.PathLike) -> None:
        from transformers import AutoModelForCausalLM

        in_dir = Path(in_dir)
        if not (in_dir / HEAD_FILE).is_file():
            raise ValueError(f"{in_dir} has no {HEAD_FILE}; expected a directory written by save()")
        lm = AutoModelForCausalLM.from_pretrained(in_dir, local_files_only=True, dtype=self.lm.dtype)
        self.lm.load_state_dict(lm.state_dict())
        state = torch.load(in_dir / HEAD_FILE, map_location=self.device, weights_only=True)
        self.head.load_state_dict(state["head"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])
