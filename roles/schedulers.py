"""The built-in multi-turn schedulers (ms-swift's names), registered in roles.plugins.multi_turns:

* `math_tip_trick`: a wrong first answer gets ms-swift's tip ("But wait... It seems I made a
  mistake,") appended to the reply, and the model continues the same reply once.
* `gym_scheduler`: one environment per trajectory (roles.plugins.envs[gym_env], built from the
  row's `env_config`); reset gives the first messages, each turn's reply goes to step, whose
  observation is the next user turn; rewards are summed (rollout_infos total_reward, step_rewards).
* `tools`: the model calls functions (roles.plugins.tools) with Hermes/Qwen
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks; each result is a tool turn,
  a call that raises is an error message turn (rollout_infos tool_calls, tool_errors); a reply
  without a call ends the trajectory.

Environment and tool calls may be plain or async; plain ones run on a thread, so a call that
never returns is cut by its timeout. No Ray here.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import copy
import importlib
import inspect
import json
import math
import re
import threading
from typing import Any, Callable, Dict, List, Optional

from roles.orm import ORM
from roles.plugins import Env, GymEnv, MultiTurnScheduler, envs, multi_turns, tools

# A Hermes/Qwen tool call in a reply.
TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def _in_thread(fn: Callable, *args: Any) -> concurrent.futures.Future:
    """`fn(*args)` on a daemon thread: one that never returns is abandoned, not joined at exit."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def work() -> None:
        # A call that outlived its timeout finds its future cancelled: nobody reads the result.
        with contextlib.suppress(concurrent.futures.InvalidStateError):
            try:
                result = fn(*args)
            except BaseException as e:  # re-raised where the result is read
                future.set_exception(e)
            else:
                future.set_result(result)
    threading.Thread(target=work, daemon=True).start()
    return future


async def call_hook(fn: Callable, *args: Any, timeout: float) -> Any:
    """`fn(*args)` whether `fn` is async or plain, within `timeout` seconds."""
    if inspect.iscoroutinefunction(fn):
        return await asyncio.wait_for(fn(*args), timeout)
    return await asyncio.wait_for(asyncio.wrap_future(_in_thread(fn, *args)), timeout)


def scheduler_label(scheduler: Any) -> str:
    """How reports name a scheduler: its environment for gym_scheduler."""
    if isinstance(scheduler, GymScheduler):
        return f"environment '{scheduler.gym_env_name}'"
    return f"scheduler '{type(scheduler).__name__}'"


class MathTipsScheduler(MultiTurnScheduler):
    tips_prompt = "But wait... It seems I made a mistake,"

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._checks = [ORM({"kind": "numeric"}), ORM({"kind": "boxed"})]

    def correct(self, completion: str, solution: str) -> bool:
        return any(c.score([""], [completion], [solution])[0] == 1 for c in self._checks)

    def check_finished(self, infer_request: Any, response_choice: Any, current_turn: int) -> bool:
        last = infer_request.messages[-1]["content"]
        if self.tips_prompt in last:  # the tip is given once
            return True
        data = infer_request.data_dict
        solution = str(data.get("solution", data.get("answer", "")))
        if solution and self.correct(last, solution):
            return True
        return super().check_finished(infer_request, response_choice, current_turn)

    def step(self, infer_request: Any, response_choice: Any, current_turn: int) -> Dict[str, Any]:
        """The reply cut before '<answer>' or '</think>' (at a token boundary: the fewest tokens
        covering the kept text) and without its end-of-turn token, then the tip (mask 0)."""
        text, ids = response_choice.message.content, list(response_choice.token_ids)
        cut = min([text.index(tag) for tag in ("<answer>", "</think>") if tag in text], default=len(text))
        keep = len(ids)
        if cut < len(text):
            keep = next((i for i in range(1, len(ids) + 1)
                         if len(self.tokenizer.decode(ids[:i], skip_special_tokens=True)) >= cut), len(ids))
        while keep and not self.tokenizer.decode(ids[keep - 1:keep], skip_special_tokens=True):
            keep -= 1  # an end-of-turn token: the reply goes on
        kept = self.tokenizer.decode(ids[:keep], skip_special_tokens=True)
        tip = self.tokenizer(self.tips_prompt, add_special_tokens=False)["input_ids"]
        messages = infer_request.messages
        messages[-1]["content"] = messages[-1]["content"][:len(messages[-1]["content"]) - len(text)] + kept \
            + self.tips_prompt
        return {"infer_request": infer_request, "response_token_ids": ids[:keep] + tip,
                "response_loss_mask": [1] * keep + [0] * len(tip),
                "rollout_logprobs": list(response_choice.logprobs[:keep])}


class GymScheduler(MultiTurnScheduler):
    """One roles.plugins.envs environment per trajectory (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.gym_env_name = kwargs.get("gym_env")
        self.timeout = kwargs.get("timeout")  # seconds (roles.multi_turn passes env_timeout_s); None: no limit
        self._envs: Dict[str, Any] = {}
        self._rewards: Dict[str, List[float]] = {}
        self._pending: Dict[str, Optional[str]] = {}

    async def on_trajectory_start(self, requests: List[Any]) -> None:
        await asyncio.gather(*[self.start_one(r) for r in requests])

    async def start_one(self, request: Any) -> None:
        """Build and reset this request's environment; its observation is the first user turn."""
        config = request.data_dict.get("env_config") or {}
        if isinstance(config, str):
            config = json.loads(config)
        name = config.get("name", self.gym_env_name)
        if name not in envs:
            raise KeyError(f"no environment {name!r} is registered (envs has {sorted(envs)}); register it in a "
                           "plugin file with envs['name'] = Class")
        env = envs[name]({**config, "seed": config.get("seed", request.seed)})
        self._envs[request.uuid], self._rewards[request.uuid] = env, []
        if isinstance(env, GymEnv):
            observation, system = await call_hook(env.reset, dict(request.data_dict), timeout=self.timeout), None
        else:
            got = await call_hook(env.reset, request, timeout=self.timeout)
            if not (isinstance(got, (tuple, list)) and len(got) == 3):
                raise TypeError(f"reset returned {type(got).__name__}; it returns (observation, info, system_message)")
            observation, _, system = got
        if not isinstance(observation, str):
            raise TypeError(f"reset's observation is {type(observation).__name__}, not text")
        request.messages = ([{"role": "system", "content": system}] if system else []) + \
            [{"role": "user", "content": observation}]

    async def on_turn_end(self, infer_request: Any, response_choice: Any, current_turn: int) -> Dict[str, Any]:
        env = self._envs.get(infer_request.uuid)
        if env is None:
            return {"done": True}
        action = response_choice.message.content if isinstance(env, GymEnv) else copy.deepcopy(infer_request.messages)
        got = await call_hook(env.step, action, timeout=self.timeout)
        if not (isinstance(got, (tuple, list)) and len(got) == 4):
            raise TypeError(f"step returned {type(got).__name__}; it returns (observation, reward, done, info)")
        observation, reward, done, _ = got
        if not isinstance(reward, (int, float)) or isinstance(reward, bool) or not math.isfinite(reward):
            raise TypeError(f"step's reward is {reward!r}; it is a finite number")
        if not done and not isinstance(observation, str):
            raise TypeError(f"step's observation is {type(observation).__name__}, not text")
        rewards = self._rewards[infer_request.uuid]
        rewards.append(float(reward))
        self._pending[infer_request.uuid] = None if done else observation
        if done:
            await self._close(infer_request.uuid)
        return {"done": bool(done), "rollout_infos": {"total_reward": sum(rewards), "step_rewards": list(rewards),
                                                      "gym_done": bool(done)}}

    def step(self, infer_request: Any, response_choice: Any, current_turn: int) -> Dict[str, Any]:
        observation = self._pending.pop(infer_request.uuid, None)
        if observation is not None:
            infer_request.messages.append({"role": "user", "content": observation})
        return {"infer_request": infer_request}

    async def _close(self, uuid: str) -> None:
        env = self._envs.pop(uuid, None)
        if env is not None:
            try:
                await call_hook(env.close, timeout=self.timeout)
            except Exception:  # a failing close must not fail a finished trajectory
                pass

    async def close_all(self) -> None:
        await asyncio.gather(*[self._close(u) for u in list(self._envs)])


def resolve_tool(name: str) -> Callable:
    """A tool by its registered name, or a dotted path 'pkg.mod.fn' (registered under fn)."""
    if name in tools:
        return tools[name]
    module, _, attr = name.rpartition(".")
    if module:
        fn = getattr(importlib.import_module(module), attr)
        tools[attr] = fn
        return fn
    raise KeyError(f"no tool {name!r} is registered (tools has {sorted(tools)}); register one with "
                   "tools['name'] = fn in a plugin file, or give its dotted path")


class ToolScheduler(MultiTurnScheduler):
    """Tool calls in the reply -> tool turns (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        # Seconds a tool may take (None: no limit) and the chat role of its result.
        self.timeout, self.role = kwargs.get("timeout"), kwargs["tool_role"]
        self.tools = {name.rpartition(".")[2]: resolve_tool(name) for name in kwargs.get("tools") or []}
        self._counts: Dict[str, List[int]] = {}

    def check_finished(self, infer_request: Any, response_choice: Any, current_turn: int) -> bool:
        if not TOOL_CALL.search(response_choice.message.content):
            return True
        return super().check_finished(infer_request, response_choice, current_turn)

    async def step(self, infer_request: Any, response_choice: Any, current_turn: int) -> Dict[str, Any]:
        counts = self._counts.setdefault(infer_request.uuid, [0, 0])
        for body in TOOL_CALL.findall(response_choice.message.content):
            counts[0] += 1
            try:
                call = json.loads(body)
                fn = self.tools[call["name"]] if call.get("name") in self.tools else resolve_tool(str(call["name"]))
                args = call.get("arguments") or {}
                args = json.loads(args) if isinstance(args, str) else args
                result = await (asyncio.wait_for(fn(**args), self.timeout) if inspect.iscoroutinefunction(fn)
                                else call_hook(lambda: fn(**args), timeout=self.timeout))
                content = result if isinstance(result, str) else json.dumps(result, default=str)
            except BaseException as e:  # the model's call or the user's tool: an error turn the model reads
                counts[1] += 1
                reason = f"took longer than {self.timeout} s" if isinstance(e, asyncio.TimeoutError) else \
                    f"{type(e).__name__}: {e}"
                content = f"error: {reason}"
            infer_request.messages.append({"role": self.role, "content": content})
        return {"infer_request": infer_request,
                "rollout_infos": {"tool_calls": counts[0], "tool_errors": counts[1]}}


multi_turns.update({"math_tip_trick": MathTipsScheduler, "gym_scheduler": GymScheduler, "tools": ToolScheduler})
