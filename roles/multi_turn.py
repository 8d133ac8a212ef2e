"""Multi-turn rollouts: trajectories of model turns and environment/tool turns, token-exact.

The loop (`run_trajectories`, run inside the Rollout role by `Rollout.generate_trajectories`):

    requests <- one per prompt x n (messages, the row's columns, a seed)
    scheduler.on_trajectory_start(requests)       # gym: env.reset -> system + observation
    ids <- each request's messages with the chat template's generation prompt
    for turn in 1..max_turns:
        generate one model turn for every live trajectory together (from token ids)
        append the model's tokens as generated (mask 1, their sampling logprobs)
        scheduler.on_turn_end / check_finished    # gym: env.step -> reward, done
        finished or out of budget -> the trajectory leaves the batch
        scheduler.step                            # appends the next messages (observation, tool results)
        append those messages' tokens (mask 0): the template's delta, encoded once

Token-exact: the model's tokens are never decoded and encoded again; a new message's tokens
are the chat template's rendering of it after an assistant turn (`Delta`), so what the
trainer, the reference and the teacher read is exactly what was generated plus what the
environment said. `algorithm.max_new_tokens` is the budget of a whole trajectory (model and
environment tokens); a trajectory that reaches it ends with finish_reason "length".
An environment or scheduler that raises, returns the wrong type or takes longer than
`env_timeout_s` ends its trajectory with finish_reason "error" (its loss mask is all 0; the
reason, naming the environment, the row and the turn, is in rollout_infos). No Ray here.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import roles.envs  # noqa: F401  (registers the built-in environments)
from roles.batch import Completions, SamplingParams
from roles.plugins import load_plugin, multi_turns
from roles.schedulers import call_hook, scheduler_label

log = logging.getLogger(__name__)

# How a trajectory's env rewards become its reward: summed over turns, the last turn's, or none.
ENV_REWARDS = ("sum", "final", "none")


@dataclass
class MultiTurnConfig:
    # Scheduler: a name in algorithms.plugins.multi_turns (built-ins: math_tip_trick,
    # gym_scheduler, tools; ms-swift's multi_turn_scheduler). null: single-turn generation,
    # unless `tools` is set (then "tools").
    scheduler: Optional[str] = None
    # Model turns per trajectory at most (ms-swift's max_turns).
    max_turns: int = 3
    # Tokens of one model turn at most (a turn cut here goes on to the next turn); null: the
    # trajectory's remaining budget (algorithm.max_new_tokens across turns).
    max_turn_tokens: Optional[int] = None
    # gym_scheduler's environment: a name in algorithms.plugins.envs (ms-swift's gym_env); a
    # row's env_config.name wins.
    gym_env: Optional[str] = None
    # Functions the model may call with <tool_call>{"name": ..., "arguments": {...}}</tool_call>:
    # names in algorithms.plugins.tools, or dotted paths 'pkg.mod.fn' (registered under fn).
    tools: List[str] = field(default_factory=list)
    # Chat role of a tool's result ("tool" for Qwen/Hermes templates; "user" for a template
    # without a tool role).
    tool_role: str = "tool"
    # A trajectory's environment reward in GRPO: "sum" of its turns' rewards, the "final" turn's,
    # or "none" (reward functions alone). Added to the reward functions' weighted sum.
    env_reward: str = "sum"
    # Seconds an environment/scheduler call may take before its trajectory is dropped.
    env_timeout_s: float = 60.0
    # Plugin files the rollout imports for their schedulers, environments and tools
    # (a config_file's external_plugins).
    plugins: List[str] = field(default_factory=list)

    @property
    def enabled(self) -> bool:
        return self.scheduler is not None or bool(self.tools)

    @property
    def scheduler_name(self) -> str:
        return self.scheduler or "tools"


@dataclass
class Request:
    """ms-swift's RolloutInferRequest, as much as schedulers and environments read of it."""
    messages: List[Dict[str, str]]
    # The row's dataset columns (env_config, solution, ...).
    data_dict: Dict[str, Any]
    uuid: str
    # Seed of this trajectory (the step's sampling seed and the row): a resumed step replays it.
    seed: int


@dataclass
class Message:
    role: str
    content: str


@dataclass
class Choice:
    """ms-swift's response choice of one model turn."""
    message: Message
    token_ids: List[int]
    logprobs: List[float]
    finish_reason: str


@dataclass
class Trajectory:
    request: Request
    prompt_ids: List[int] = field(default_factory=list)
    ids: List[int] = field(default_factory=list)  # completion: model and environment tokens
    mask: List[int] = field(default_factory=list)
    logprobs: List[float] = field(default_factory=list)
    text: str = ""  # the last model turn's text
    finish: Optional[str] = None  # None while live; "stop", "length" or "error"
    infos: Dict[str, Any] = field(default_factory=dict)


class Delta:
    """Token ids of messages appended after an assistant turn, as the chat template renders
    them: rendered after a fixed conversation ending with an assistant reply and cut at its
    end, then what the template writes after a reply's end-of-turn token that the model did
    not generate (e.g. Qwen's newline after <|im_end|>). Plain text: each message on a line."""

    BASE = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]

    def __init__(self, tokenizer: Any, template: bool, switches: Dict[str, Any]):
        self.tokenizer, self.template, self.switches = tokenizer, template, switches
        if template:
            self.base = tokenizer.apply_chat_template(self.BASE, tokenize=False, **switches)
            # The template's text after an assistant reply's content (its end of turn).
            self.tail = self.base[self.base.rindex("a") + 1:]

    def ids(self, messages: List[Dict[str, str]], last_token: Optional[int]) -> List[int]:
        if not self.template:
            return self.tokenizer("\n" + "".join(m["content"] + "\n" for m in messages),
                                  add_special_tokens=False)["input_ids"]
        full = self.tokenizer.apply_chat_template(self.BASE + list(messages), tokenize=False,
                                                  add_generation_prompt=True, **self.switches)
        if not full.startswith(self.base):
            raise ValueError("the chat template renders an earlier turn differently once messages follow it; "
                             "its turns cannot be appended token-exactly")
        ended = "" if last_token is None else self.tokenizer.decode([last_token])
        head = self.tail[len(ended):] if ended and self.tail.startswith(ended) else self.tail
        return self.tokenizer(head + full[len(self.base):], add_special_tokens=False)["input_ids"]


class StepError(Exception):
    """An environment or scheduler call that failed for one trajectory."""


def make_scheduler(cfg: MultiTurnConfig, tokenizer: Any) -> Any:
    """The configured scheduler, after importing cfg.plugins (for their registrations)."""
    for path in cfg.plugins:
        load_plugin(path)
    name = cfg.scheduler_name
    if name not in multi_turns:
        raise ValueError(f"algorithm.multi_turn.scheduler={name!r} is registered nowhere; known: "
                         f"{sorted(multi_turns)} (a plugin file registers more in multi_turns)")
    return multi_turns[name](max_turns=cfg.max_turns, tokenizer=tokenizer, gym_env=cfg.gym_env,
                             tools=list(cfg.tools), tool_role=cfg.tool_role, timeout=cfg.env_timeout_s)


def run_trajectories(generate: Callable[[List[List[int]], SamplingParams], Completions],
                     encode: Callable[[List[Dict[str, str]]], List[int]], delta: Delta, scheduler: Any,
                     cfg: MultiTurnConfig, prompts: Sequence[Sequence[Dict[str, str]]], rows: Sequence[Dict],
                     sampling: SamplingParams, seed: int) -> Completions:
    """n trajectories per prompt (consecutive), as Completions with completion_mask and
    rollout_infos. `generate(ids, sampling)`: one model turn of every row in `ids`; `encode`: a
    conversation's token ids with the generation prompt; `seed`: the request's (each turn's
    sampling and each trajectory's Request.seed derive from it)."""
    n, budget, label = sampling.n, sampling.max_new_tokens, scheduler_label(scheduler)
    trajs = [Trajectory(Request([dict(m) for m in prompts[i // n]], dict(rows[i // n]), f"{i // n}-{i % n}",
                                (seed * 1_000_003 + i) % 2**62)) for i in range(len(prompts) * n)]
    loop = asyncio.new_event_loop()
    try:
        def guarded(what: str, turn: int, items: List[Trajectory], fn: Callable, *args: Callable) -> list:
            """Run `fn(traj, *[a(traj)])` for each trajectory concurrently; a failure drops that one."""
            async def one(t: Trajectory) -> Any:
                try:
                    return await call_hook(fn, *[a(t) for a in args], timeout=cfg.env_timeout_s)
                except BaseException as e:  # the user's code: any error drops this trajectory
                    reason = "took longer than env_timeout_s=%s s" % cfg.env_timeout_s \
                        if isinstance(e, asyncio.TimeoutError) else f"{type(e).__name__}: {e}"
                    drop(t, f"{label} failed at {what} (row {t.request.uuid}, turn {turn}): {reason}")
                    return None

            async def all_() -> list:
                return await asyncio.gather(*[one(t) for t in items])
            return loop.run_until_complete(all_())

        def drop(t: Trajectory, reason: str) -> None:
            log.warning(reason)
            t.finish, t.infos["error"] = "error", reason

        # Start: schedulers may rewrite the first messages (an environment's observation); one
        # with a per-request start_one (gym_scheduler) fails per trajectory.
        if hasattr(scheduler, "start_one"):
            guarded("reset", 0, trajs, scheduler.start_one, lambda t: t.request)
        else:
            try:
                loop.run_until_complete(call_hook(scheduler.on_trajectory_start, [t.request for t in trajs],
                                                  timeout=cfg.env_timeout_s))
            except BaseException as e:  # every trajectory shares this call
                for t in trajs:
                    drop(t, f"{label} failed at on_trajectory_start (turn 0): {type(e).__name__}: {e}")
        for t in trajs:  # (one whose start failed keeps its row's prompt: a real, masked-out sequence)
            t.prompt_ids = encode(t.request.messages)
        for turn in range(1, cfg.max_turns + 1):
            live = [t for t in trajs if t.finish is None]
            if not live:
                break
            # One model turn for every live trajectory; each keeps at most its remaining budget.
            room = [min(budget - len(t.ids), cfg.max_turn_tokens or budget) for t in live]
            out = generate([t.prompt_ids + t.ids for t in live],
                           dataclasses.replace(sampling, n=1, max_new_tokens=max(room),
                                               seed=(seed * 1_009 + turn) % 2**62))
            choices = []
            for t, r, toks, lps, why in zip(live, room, out.completion_ids, out.logprobs, out.finish_reasons):
                why = "length" if len(toks) > r else why  # cut here at its own budget
                toks, lps = list(toks[:r]), list(lps[:r])
                text = delta.tokenizer.decode(toks, skip_special_tokens=True)
                t.ids += toks
                t.mask += [1] * len(toks)
                t.logprobs += lps
                t.text = text
                msgs = t.request.messages
                if msgs and msgs[-1]["role"] == "assistant":  # a continued reply (e.g. math_tip_trick)
                    msgs[-1]["content"] += text
                    t.text = msgs[-1]["content"]
                else:
                    msgs.append({"role": "assistant", "content": text})
                choices.append(Choice(Message("assistant", text), toks, lps, why))
            ends = guarded("on_turn_end", turn, live, scheduler.on_turn_end, lambda t: t.request,
                           lambda t: choices[live.index(t)], lambda t: turn)
            going = []
            for t, choice, end in zip(live, choices, ends):
                if t.finish is not None:
                    continue
                if not isinstance(end, dict):
                    if end is not None:
                        drop(t, f"{label} returned {type(end).__name__} from on_turn_end (row {t.request.uuid}, "
                                f"turn {turn}); it returns a dict")
                        continue
                    end = {}
                t.infos.update(end.get("rollout_infos") or {})
                t.infos["num_turns"] = turn
                done = end["done"] if "done" in end else scheduler.check_finished(t.request, choice, turn)
                if choice.finish_reason == "length" and len(t.ids) >= budget:
                    t.finish = "length"
                elif done or turn >= cfg.max_turns:
                    t.finish = choice.finish_reason if choice.finish_reason in ("stop", "length") else "stop"
                else:
                    going.append((t, choice))
            # The next messages (observations, tool results) and their tokens.
            counts = {id(t): len(t.request.messages) for t, _ in going}
            choice_of = {id(t): c for t, c in going}
            steps = guarded("step", turn, [t for t, _ in going], scheduler.step, lambda t: t.request,
                            lambda t: choice_of[id(t)], lambda t: turn)
            for (t, choice), ret in zip(going, steps):
                if t.finish is not None:
                    continue
                ret = ret if isinstance(ret, dict) else {}
                if isinstance(ret.get("infer_request"), Request):
                    t.request = ret["infer_request"]
                t.infos.update(ret.get("rollout_infos") or {})
                try:
                    _replace_turn(t, choice, ret)
                except ValueError as e:
                    drop(t, f"{label} failed at step (row {t.request.uuid}, turn {turn}): {e}")
                    continue
                new = t.request.messages[counts[id(t)]:]
                if new:
                    try:
                        extra = delta.ids(new, t.ids[-1] if t.ids else None)
                    except Exception as e:  # a message the template cannot render
                        drop(t, f"{label}: the messages of turn {turn} (row {t.request.uuid}) cannot be rendered: "
                                f"{type(e).__name__}: {e}")
                        continue
                    left = budget - len(t.ids)
                    t.ids += extra[:left]
                    t.mask += [0] * len(extra[:left])
                    t.logprobs += [0.0] * len(extra[:left])
                    if len(extra) >= left:
                        t.finish = "length"
                elif len(t.ids) >= budget:
                    t.finish = "length"
        for t in trajs:
            t.finish = t.finish or "length"
    finally:
        if hasattr(scheduler, "close_all"):  # environments of trajectories that ended early
            loop.run_until_complete(scheduler.close_all())
        loop.close()
    out = Completions([i // n for i in range(len(trajs))], [t.prompt_ids for t in trajs], [t.ids for t in trajs],
                      [t.text for t in trajs], [t.logprobs if sampling.logprobs else [] for t in trajs],
                      [t.finish for t in trajs])
    out.completion_mask = [[0] * len(t.ids) if t.finish == "error" else t.mask for t in trajs]
    out.rollout_infos = [t.infos for t in trajs]
    return out


def _replace_turn(t: Trajectory, choice: Choice, ret: Dict[str, Any]) -> None:
    """ms-swift's step may return the turn's tokens itself ('response_token_ids', with
    'response_loss_mask' and 'rollout_logprobs' for the mask-1 tokens): they replace the ones
    generated (math_tip_trick cuts the reply and appends its tip, mask 0)."""
    if "response_token_ids" not in ret:
        return
    toks = [int(x) for x in ret["response_token_ids"]]
    mask = [int(x) for x in ret.get("response_loss_mask") or [1] * len(toks)]
    if len(mask) != len(toks):
        raise ValueError(f"scheduler step returned {len(toks)} response_token_ids but {len(mask)} response_loss_mask")
    given = list(ret.get("rollout_logprobs") or [])
    kept = iter(given if len(given) == sum(mask) else choice.logprobs)
    lps = [next(kept, 0.0) if m else 0.0 for m in mask]
    cut = len(t.ids) - len(choice.token_ids)
    t.ids, t.mask, t.logprobs = t.ids[:cut] + toks, t.mask[:cut] + mask, t.logprobs[:cut] + lps


__all__ = ["MultiTurnConfig", "Request", "Choice", "Message", "Delta", "run_trajectories", "make_scheduler",
           "ENV_REWARDS"]
