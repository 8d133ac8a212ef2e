"""Sampler role: best-of-N candidate generation for distillation/sampling pipelines.

`sample(prompts, n, sampling)` returns n candidates per prompt (consecutive, as
`Completions`), which a PRM/ORM then scores to keep the best. Generation is a `Rollout`
the sampler owns (or is given), so the same engine choice, weight updates and sleep/wake
apply. No Ray here.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping, Optional, Sequence, Union

from roles.batch import Completions, SamplingParams
from roles.models import ModelSpec
from roles.rollout import Prompt, Rollout, RolloutConfig, as_sampling_params
from roles.weight_transfer import WeightReceiver


class Sampler(WeightReceiver):
    # No state a fresh rank could not get back (weights: its model path or a sync), so a lost
    # rank may be replaced (orchestration.launch.restartable).
    RESTARTABLE = True
    def __init__(self, model: Optional[ModelSpec] = None, tokenizer: Any = None,
                 config: Union[RolloutConfig, Mapping[str, Any], None] = None, *, rollout: Optional[Rollout] = None,
                 engine: str = "torch", engine_options: Optional[Mapping[str, Any]] = None):
        if (model is None) == (rollout is None):
            raise ValueError("Sampler needs exactly one of `model` (a model spec to build a Rollout from) "
                             "or `rollout` (an existing Rollout)")
        self.rollout = rollout if rollout is not None else Rollout(model, tokenizer, config, engine=engine,
                                                                      engine_options=engine_options)

    def sample(self, prompts: Sequence[Prompt], n: int,
               sampling: Union[SamplingParams, Mapping[str, Any]],
               chat: Optional[bool] = None) -> Completions:
        """n candidates per prompt; `n` overrides sampling.n."""
        sampling = dataclasses.replace(as_sampling_params(sampling), n=n)
        return self.rollout.generate(prompts, sampling, chat=chat)

    @property
    def device(self):
        return self.rollout.device

    @property
    def weight_version(self) -> int:
        return self.rollout.weight_version

    def update_weights(self, buckets: Iterable, version: int, part: str = "full") -> None:
        self.rollout.update_weights(buckets, version, part)

    def update_weights_from_path(self, path, version: int, part: str = "full") -> None:
        self.rollout.update_weights_from_path(path, version, part)

    def sleep(self, level: int = 1) -> dict[str, float]:
        return self.rollout.sleep(level)

    def wake_up(self) -> dict[str, float]:
        return self.rollout.wake_up()

    def memory(self) -> dict[str, int]:
        return self.rollout.memory()
