"""Registries a plugin file fills, under the names an ms-swift plugin imports (users import them
from `algorithms.plugins`): `orms` (name -> reward class, ms-swift's `ORM` contract), and for
multi-turn rollouts (roles/multi_turn.py) `multi_turns` (schedulers), `envs` (environments) and
`tools` (functions the model calls), with their base classes.

A plugin file (ms-swift's `external_plugins`) is a Python file imported by its path, in every
process that scores with it (`load_plugin`); what it registers in `orms` becomes a reward
function named in `reward_funcs`, called as ms-swift calls it: `instance(completions, **columns)`
with the rows' dataset columns as lists, one entry per completion; the rollout imports the files
of algorithm.multi_turn.plugins for their schedulers, environments and tools. No Ray here.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import traceback
from typing import Any, Dict, List, Optional

# Prefix of the module name a plugin file is imported under (its path's hash follows).
MODULE_PREFIX = "rayroles_plugin_"


class ORM:
    """An outcome reward: `__call__(completions, **kwargs) -> list[float]`, one score per
    completion; kwargs are the rows' dataset columns (lists aligned with completions). `args`:
    ms-swift passes its training arguments; here it is None (nothing reads them)."""

    def __init__(self, args: Any = None, **kwargs: Any):
        self.args = args

    def __call__(self, completions: List[str], **kwargs: Any) -> List[float]:
        raise NotImplementedError


class MultiTurnScheduler:
    """ms-swift's multi-turn scheduler (roles/multi_turn.py runs it): after each model turn
    `on_turn_end` (may return {'done': bool, 'rollout_infos': {...}}), then `check_finished`
    (default: the turn was cut at the length limit, or max_turns reached), and unless finished
    `step`, which appends the next messages to `infer_request.messages` (they are encoded
    once and appended to the trajectory's tokens) and returns {'infer_request': ...}, optionally
    with 'response_token_ids' / 'response_loss_mask' / 'rollout_logprobs' replacing the turn's
    own tokens (ms-swift's contract). `on_trajectory_start(requests)` runs once before the
    first turn. Hooks may be plain or async methods. `infer_request`: roles.multi_turn.Request
    (messages, data_dict: the row's columns, uuid, seed); `response_choice`:
    roles.multi_turn.Choice (message.content, token_ids, logprobs, finish_reason)."""

    def __init__(self, infer_engine: Any = None, max_turns: Optional[int] = None, *args: Any, **kwargs: Any):
        self.infer_engine, self.max_turns = infer_engine, max_turns
        # The rollout's tokenizer (ms-swift reads it from its engine).
        self.tokenizer = kwargs.get("tokenizer")

    def on_trajectory_start(self, requests: List[Any]) -> None:
        pass

    def on_turn_end(self, infer_request: Any, response_choice: Any, current_turn: int) -> Dict[str, Any]:
        return {}

    def step(self, infer_request: Any, response_choice: Any, current_turn: int) -> Dict[str, Any]:
        return {"infer_request": infer_request}

    def check_finished(self, infer_request: Any, response_choice: Any, current_turn: int) -> bool:
        if response_choice.finish_reason == "length":
            return True
        return bool(self.max_turns) and current_turn >= self.max_turns

    @staticmethod
    def _extract_logprobs_from_choice(response_choice: Any) -> List[float]:
        return list(response_choice.logprobs or [])


class Env:
    """ms-swift's environment (the `gym_scheduler` runs one per trajectory, built as
    `Env(env_config)` from the row's `env_config` column): `reset(request) -> (observation,
    info, system_message)`, `step(messages) -> (next_observation, reward, done, info)` with the
    conversation so far (the last message is the model's), `close()`. Plain or async methods."""

    def __init__(self, env_config: Optional[Dict[str, Any]] = None):
        self.env_config = env_config

    def reset(self, config: Any) -> Any:
        raise NotImplementedError

    def step(self, action: Any) -> Any:
        raise NotImplementedError

    def close(self) -> None:
        pass


class GymEnv(Env):
    """The gym style: `reset(row) -> observation` with the row's dataset columns, `step(action)
    -> (observation, reward, done, info)` with the model's last reply as text."""

    def reset(self, row: Dict[str, Any]) -> str:
        raise NotImplementedError

    def step(self, action: str) -> Any:
        raise NotImplementedError


# name -> ORM subclass; a plugin file registers with `orms['name'] = Class`.
orms: Dict[str, type] = {}
# name -> MultiTurnScheduler subclass (algorithm.multi_turn.scheduler; built-ins: roles/schedulers.py).
multi_turns: Dict[str, type] = {}
# name -> Env subclass (algorithm.multi_turn.gym_env, or a row's env_config.name).
envs: Dict[str, type] = {}
# name -> function the model calls as a tool (algorithm.multi_turn.tools): its JSON arguments as
# keyword arguments, its result (turned to text) fed back as a tool turn.
tools: Dict[str, Any] = {}


class PluginError(ValueError):
    """A plugin file that cannot be imported, or a name it does not register."""


def load_plugin(path: str) -> dict[str, type]:
    """Import the plugin file at `path` once per process; returns the reward classes it
    registered in `orms` (name -> class; a second call returns what the first registered).
    Raises PluginError naming the file."""
    path = os.path.abspath(os.path.expanduser(path))
    name = MODULE_PREFIX + hashlib.sha1(path.encode()).hexdigest()[:12]
    if name in sys.modules:
        return dict(getattr(sys.modules[name], "_registered_orms", {}))
    if not os.path.isfile(path):
        raise PluginError(f"{path} is not a file")
    if not path.endswith(".py"):
        raise PluginError(f"{path} is not a Python file (.py)")
    before = dict(orms)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException as e:  # any error of the user's file, reported with its line
        del sys.modules[name]
        where = [f for f in traceback.extract_tb(e.__traceback__) if os.path.abspath(f.filename) == path]
        line = f" (line {where[-1].lineno})" if where else ""
        raise PluginError(f"{path} fails to import{line}: {type(e).__name__}: {e}") from None
    registered = {k: v for k, v in orms.items() if before.get(k) is not v}
    bad = sorted(k for k, v in registered.items() if not callable(v))
    if bad:
        raise PluginError(f"{path} registers {bad} in orms, which are not classes")
    module._registered_orms = registered
    return dict(registered)


def plugin_reward(spec: str) -> Any:
    """An instance of the reward `spec` = '<plugin file>:<name>' names: the file is imported
    (once per process) and orms[name] built without arguments, as ms-swift's sampler does."""
    path, sep, name = spec.rpartition(":")
    if not sep or not path or not name:
        raise PluginError(f"{spec!r} is not '<plugin file>.py:<name>'")
    load_plugin(path)
    if name not in orms:
        raise PluginError(f"{path} registers no reward {name!r} in orms (it registers {sorted(orms)})")
    return orms[name]()


def is_plugin_spec(name: str) -> bool:
    """Whether a reward name is '<plugin file>.py:<name>'."""
    path, sep, _ = name.rpartition(":")
    return bool(sep) and path.endswith(".py")
