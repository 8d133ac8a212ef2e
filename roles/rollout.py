"""Rollout role: batched generation with a KV cache over a torch/transformers model.

`generate(prompts, sampling)` returns `Completions` (token ids, text, per-token sampling
logprobs, finish reasons, weight version), n consecutive samples per prompt. Weights come
from the trainer with `update_weights(buckets, version)` (or a saved directory, or
`receive_weights` over shared memory/a broadcast: roles.weight_transfer), and a
colocated rollout hands its memory back between generations with `sleep(level)`:

* level 1: weights are kept in host memory and the device copies released; `wake_up()`
  restores them bit for bit.
* level 2: weights are discarded; after `wake_up()` they must be loaded again with
  `update_weights` before the rollout generates.

On CUDA the torch engine keeps its static KV cache and the decode step's CUDA graph from one
`generate` call (or chunk) to the next when the next one fits them
(`torch_decode.StaticDecoder`); `sleep` drops them with the weights. The engine behind this role is
`roles.engines.torch_generate`, or with engine="vllm" `roles.engines.vllm_engine` behind
the same methods (its sleep differs on CPU: see there).
No Ray here: orchestration hosts this class in its worker groups.
"""
from __future__ import annotations

import dataclasses
import gc
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence, Union

import torch
from omegaconf import OmegaConf

from roles.engines import torch_decode
from roles.engines.options import ROLLOUT_ENGINES, check_engine
from roles.batch import Completions, SamplingParams
from roles.engines.torch_engine import pick_device, process_memory
from roles.engines.torch_generate import decode_path, generate_batch
from roles.engines.vllm_engine import VLLMEngine
from roles.lora import PARTS, merge_into
from roles.models import DTYPES, ModelSpec, build_model, load_tokenizer
from roles.multi_turn import Delta, MultiTurnConfig, make_scheduler, run_trajectories
from roles.weight_transfer import WeightReceiver

log = logging.getLogger(__name__)

# A prompt: text, a chat conversation (list of {"role", "content"} dicts) or token ids.
Prompt = Union[str, Sequence[Mapping[str, str]], Sequence[int]]


@dataclass
class RolloutConfig:
    # Device: "auto" (cuda when torch can use it, else cpu), "cpu", "cuda" or "cuda:N".
    device: str = "auto"
    # Weight dtype for generation ("float32", "bfloat16", "float16"); None keeps the model's.
    dtype: Optional[str] = None
    # Most sequences (prompts x n) the torch engine decodes together; larger requests run in
    # chunks of this size. A vLLM engine schedules all rows itself (vllm.max_num_seqs).
    max_batch_size: int = 64
    # CUDA, torch engine: run the decode step through torch.compile before it is captured as a
    # CUDA graph (fewer, fused kernels per token). Each new decode-buffer size or sampling
    # setting compiles once (tens of seconds); the buffers are kept for calls that fit them.
    compile_decode: bool = False
    # Seed of the rollout's own generator, which seeds requests whose SamplingParams.seed is None.
    seed: int = 0
    # Render prompts (a text is one user turn) with the tokenizer's chat template and its
    # generation prompt: true; false: plain text (a text as is, a conversation's contents
    # joined by newlines); null: the template when the tokenizer has one. The drivers set it
    # from data.chat.
    chat: Optional[bool] = None
    # The chat template's thinking switch (passed to apply_chat_template as enable_thinking, as
    # Qwen3's templates read it); null: the template's own default. The drivers set it from
    # data.enable_thinking.
    enable_thinking: Optional[bool] = None
    # Rank and alpha of a trainer's LoRA adapter that each weight sync sends alone
    # (weight_sync.lora=adapter; the drivers set both from trainer.lora). vLLM then serves the
    # base with enable_lora and the adapter as a LoRARequest; the torch engine merges it onto
    # its own copy of the base. 0: syncs carry merged weights.
    lora_rank: int = 0
    lora_alpha: float = 0.0


def resolve_rollout_config(config: Union[RolloutConfig, Mapping[str, Any], None]) -> RolloutConfig:
    """A RolloutConfig from None (defaults), itself, or a mapping/DictConfig of its fields."""
    if config is None:
        return RolloutConfig()
    if isinstance(config, RolloutConfig):
        return config
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RolloutConfig), config))


def uses_template(tokenizer: Any, chat: Optional[bool], key: str = "rollout.chat") -> bool:
    """Whether prompts go through the tokenizer's chat template: `chat`, or with None whether
    the tokenizer has one. True without a template fails naming config key `key`."""
    has = bool(getattr(tokenizer, "chat_template", None))
    if chat and not has:
        raise ValueError(f"config key '{key}'=True but the tokenizer has no chat template. Fix: set {key}=false "
                         "or null for plain-text prompts, or use a tokenizer with a chat template")
    return has if chat is None else bool(chat)


def template_switches(enable_thinking: Optional[bool]) -> dict[str, bool]:
    """Keyword arguments of apply_chat_template for the template's switches: enable_thinking
    only when set (a template that tests `enable_thinking is defined` keeps its default)."""
    return {} if enable_thinking is None else {"enable_thinking": bool(enable_thinking)}


def prompt_text(tokenizer: Any, prompt: Union[str, Sequence[Mapping[str, str]]], template: bool,
                enable_thinking: Optional[bool] = None) -> str:
    """A text or conversation as the text a reply follows: chat-rendered with the generation
    prompt (and the template's thinking switch), or plain (a text as is, a conversation's
    contents joined by newlines)."""
    if template:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                             **template_switches(enable_thinking))
    return prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)


def prompt_token_ids(tokenizer: Any, text: str, template: bool) -> list[int]:
    """Token ids of a prompt_text: a rendered template holds its own special tokens; plain
    text gets the tokenizer's (a BOS where it adds one), as in pretraining."""
    return tokenizer(text, add_special_tokens=not template)["input_ids"]


def as_sampling_params(sampling: Union[SamplingParams, Mapping[str, Any]]) -> SamplingParams:
    """SamplingParams from itself or a mapping of its fields (max_new_tokens required); checked."""
    if not isinstance(sampling, SamplingParams):
        unknown = set(sampling) - {f.name for f in dataclasses.fields(SamplingParams)}
        if unknown:
            raise ValueError(f"unknown sampling fields {sorted(unknown)}; SamplingParams has "
                             f"{[f.name for f in dataclasses.fields(SamplingParams)]}")
        if "max_new_tokens" not in sampling:
            raise ValueError("sampling parameters need max_new_tokens (the run's algorithm.max_new_tokens)")
        sampling = SamplingParams(**sampling)
    problems = []
    if sampling.temperature < 0:
        problems.append(f"temperature={sampling.temperature} must be >= 0 (0 is greedy)")
    if not 0 < sampling.top_p <= 1:
        problems.append(f"top_p={sampling.top_p} must be in (0, 1]")
    if sampling.top_k < 0:
        problems.append(f"top_k={sampling.top_k} must be >= 0 (0 disables it)")
    if sampling.n < 1:
        problems.append(f"n={sampling.n} must be >= 1")
    if sampling.max_new_tokens < 0:
        problems.append(f"max_new_tokens={sampling.max_new_tokens} must be >= 0")
    if problems:
        raise ValueError("bad sampling parameters: " + "; ".join(problems))
    return sampling


def _row_seed(base: int, row: int) -> int:
    """Seed of completion `row` of a request: depends on the request seed and the row only."""
    return (base * 0x9E3779B97F4A7C15 + row * 0xBF58476D1CE4E5B9 + 1) % (2**63 - 1)


def _named_tensors(buckets) -> list[tuple[str, torch.Tensor]]:
    """Flatten buckets (lists/dicts of name -> tensor), a single bucket, or a dict into pairs."""
    if isinstance(buckets, Mapping):
        return list(buckets.items())
    pairs = []
    for item in buckets:
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            pairs.append(item)
        elif isinstance(item, Mapping):
            pairs.extend(item.items())
        else:
            pairs.extend(_named_tensors(item))
    return pairs


class Rollout(WeightReceiver):
    # No state a fresh rank could not get back (weights: its model path or a sync), so a lost
    # rank may be replaced (orchestration.launch.restartable).
    RESTARTABLE = True
    def __init__(self, model: ModelSpec, tokenizer: Any = None,
                 config: Union[RolloutConfig, Mapping[str, Any], None] = None,
                 engine: str = "torch", engine_options: Optional[Mapping[str, Any]] = None):
        self.config = resolve_rollout_config(config)
        check_engine("rollout", engine, ROLLOUT_ENGINES)
        if self.config.max_batch_size < 1:
            raise ValueError(f"rollout.max_batch_size={self.config.max_batch_size} must be >= 1")
        self.device = pick_device(self.config.device)
        # A tokenizer object is used as given; a spec (or None: the model's) is loaded.
        self.tokenizer = tokenizer if hasattr(tokenizer, "decode") else load_tokenizer(
            model if tokenizer is None else tokenizer)
        uses_template(self.tokenizer, self.config.chat)  # chat=true needs a template: refused here
        self._vllm = None
        if engine == "vllm":  # vLLM holds the model; generation, weights and sleep go to it
            self._vllm = VLLMEngine(model, self.tokenizer, self.device, self.config.dtype, engine_options, "rollout",
                                    lora_rank=self.config.lora_rank)
            tok, self.weight_version = self.tokenizer, 0
            self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
            self.eos_ids = ({tok.eos_token_id} | self._vllm.eos_ids) - {None}
            self._rng = torch.Generator().manual_seed(self.config.seed)
            return
        net = build_model(model)
        if self.config.dtype is not None:
            if self.config.dtype not in DTYPES:
                raise ValueError(f"rollout.dtype='{self.config.dtype}'; choose one of {sorted(DTYPES)} or null")
            net = net.to(DTYPES[self.config.dtype])
        self.model = net.to(self.device).eval().requires_grad_(False)
        self.weight_version = 0
        tok = self.tokenizer
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = ({tok.eos_token_id} | set(eos if isinstance(eos, (list, tuple)) else [eos])) - {None}
        self._rng = torch.Generator().manual_seed(self.config.seed)
        # Parameters by canonical name; every state_dict name (tied aliases, persistent
        # buffers) maps to the tensor it loads into.
        self._params: dict[str, torch.nn.Parameter] = dict(self.model.named_parameters())
        canonical = {id(p): n for n, p in self._params.items()}
        self._alias = {n: canonical[id(p)] for n, p in self.model.named_parameters(remove_duplicate=False)}
        saved = set(self.model.state_dict())
        self._buffers = {n: b for n, b in self.model.named_buffers() if n in saved}
        self._alias.update({n: n for n in self._buffers})
        self._meta = {n: (tuple(t.shape), t.dtype) for n, t in {**self._params, **self._buffers}.items()}
        self._sleep_level = 0  # 0: awake
        self._host: Optional[dict[str, torch.Tensor]] = None  # weights held in host memory while asleep
        self._weights_valid = True  # False from sleep(2) until the next update_weights
        # The base's tensors that a received LoRA adapter is merged onto, by HF name (kept from the
        # first adapter on: weights in place then hold base + adapter).
        self._lora_base: dict[str, torch.Tensor] = {}
        # The static decode path's KV cache and CUDA graph, kept across calls until sleep (CUDA only).
        self._decoder = torch_decode.StaticDecoder(compile=self.config.compile_decode)
        blocker = torch_decode.unsupported(self.model)
        if blocker is not None and self.device.type in torch_decode.STATIC_DEVICES:
            log.info(f"rollout: {type(self.model).__name__} decodes with plain generation, not the static KV "
                     f"cache: {blocker}")

    # ---- generation -------------------------------------------------------------------

    def generate(self, prompts: Sequence[Prompt], sampling: Union[SamplingParams, Mapping[str, Any]],
                 chat: Optional[bool] = None) -> Completions:
        """n completions per prompt, consecutive; see the module docstring. `chat`: how text
        and conversation prompts are rendered in this call (None: rollout.chat)."""
        self._check_ready()
        sampling = as_sampling_params(sampling)
        if isinstance(prompts, (str, bytes)):
            raise TypeError("prompts must be a list of prompts, not a single string; wrap it in a list")
        prompt_ids = [self._encode(p, self.config.chat if chat is None else chat) for p in prompts]
        limit = self._vllm.max_model_len if self._vllm else self.model.config.max_position_embeddings
        too_long = [i for i, p in enumerate(prompt_ids) if len(p) + sampling.max_new_tokens > limit]
        if too_long:
            raise ValueError(f"prompts {too_long[:5]} plus max_new_tokens={sampling.max_new_tokens} exceed the "
                             f"model's max_position_embeddings (vLLM: vllm.max_model_len)={limit}; shorten them "
                             "or lower max_new_tokens")
        rows = [i for i in range(len(prompt_ids)) for _ in range(sampling.n)]
        base_seed = sampling.seed if sampling.seed is not None else int(
            torch.randint(0, 2**62, (1,), generator=self._rng))
        sampled = sampling.temperature > 0
        stop_ids = sorted((set() if sampling.ignore_eos else self.eos_ids) | set(sampling.stop_token_ids))
        kwargs = dict(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                      max_new_tokens=sampling.max_new_tokens, stop_ids=stop_ids)
        out = Completions([], [], [], [], [], [], [])
        if self._vllm:
            # One request per prompt with its n samples and the prompt's seed; vLLM schedules
            # them all itself (vllm.max_num_seqs at a time).
            result = self._vllm.generate_batch(prompt_ids, **kwargs, n=sampling.n, ignore_eos=sampling.ignore_eos,
                                               seeds=[_row_seed(base_seed, i) for i in range(len(prompt_ids))]
                                               if sampled else None, logprobs=sampling.logprobs)
            return self._finish(out, rows, prompt_ids, result)
        seeds = [_row_seed(base_seed, r) for r in range(len(rows))] if sampled else None
        # The torch engine decodes chunks of max_batch_size rows.
        step = self.config.max_batch_size
        for start in range(0, len(rows), step):
            chunk = rows[start:start + step]
            generators = None if seeds is None else [
                torch.Generator(self.device).manual_seed(seeds[start + j]) for j in range(len(chunk))]
            result = generate_batch(self.model, [prompt_ids[i] for i in chunk], **kwargs, pad_id=self.pad_id,
                                    generators=generators, decoder=self._decoder)
            self._finish(out, chunk, prompt_ids, result)
        return out

    def _finish(self, out: Completions, rows: Sequence[int], prompt_ids, result) -> Completions:
        """Append the generated `rows` (prompt indices) to `out`, with texts and versions."""
        out.prompt_index.extend(rows)
        out.prompt_ids.extend(list(prompt_ids[i]) for i in rows)
        out.completion_ids.extend(result.tokens)
        out.logprobs.extend(result.logprobs)
        out.finish_reasons.extend(result.finish_reasons)
        out.texts.extend(self.tokenizer.batch_decode(result.tokens, skip_special_tokens=True) if rows else [])
        out.weight_version.extend([self.weight_version] * len(rows))
        return out

    def generate_trajectories(self, prompts: Sequence[Sequence[Mapping[str, str]]],
                              sampling: Union[SamplingParams, Mapping[str, Any]],
                              multi_turn: Union[MultiTurnConfig, Mapping[str, Any]], rows: Sequence[Mapping],
                              chat: Optional[bool] = None) -> Completions:
        """n multi-turn trajectories per conversation (roles.multi_turn): model turns generated
        together from token ids, environment/tool turns appended as the chat template's tokens;
        `rows`: each prompt's dataset columns (env_config, solution, ...); sampling.max_new_tokens
        is a trajectory's budget across turns. The loop runs here, next to the engine, so a turn
        waits only on this rank's own environments."""
        self._check_ready()
        sampling = as_sampling_params(sampling)
        cfg = multi_turn if isinstance(multi_turn, MultiTurnConfig) else OmegaConf.to_object(
            OmegaConf.merge(OmegaConf.structured(MultiTurnConfig), multi_turn))
        chat = self.config.chat if chat is None else chat
        template = uses_template(self.tokenizer, chat)
        seed = sampling.seed if sampling.seed is not None else int(torch.randint(0, 2**62, (1,), generator=self._rng))
        out = run_trajectories(lambda ids, s: self.generate(ids, s), lambda messages: self._encode(messages, chat),
                               Delta(self.tokenizer, template, template_switches(self.config.enable_thinking)),
                               make_scheduler(cfg, self.tokenizer), cfg, prompts, rows, sampling, seed)
        out.weight_version = [self.weight_version] * len(out)
        return out

    def _encode(self, prompt: Prompt, chat: Optional[bool]) -> list[int]:
        if isinstance(prompt, str) or (len(prompt) and isinstance(prompt[0], Mapping)):
            template = uses_template(self.tokenizer, chat)
            text = prompt_text(self.tokenizer, prompt, template, self.config.enable_thinking)
            ids = prompt_token_ids(self.tokenizer, text, template)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError(f"prompt {prompt!r} has no tokens; a prompt needs at least one")
        return ids

    def _check_ready(self) -> None:
        if self._vllm:
            return self._vllm.check_ready()
        if self._sleep_level:
            fix = "call wake_up() before generate"
            if self._host is None:
                fix += ", then update_weights(...) since sleep(level=2) discarded the weights"
            raise RuntimeError(f"Rollout is asleep (sleep(level={self._sleep_level})); {fix}")
        if not self._weights_valid:
            raise RuntimeError("Rollout weights were discarded by sleep(level=2); call update_weights(buckets, "
                               "version) or update_weights_from_path(dir, version) before generate")

    # ---- weights ----------------------------------------------------------------------

    def update_weights(self, buckets: Union[Iterable, str, os.PathLike], version: int, part: str = "full") -> None:
        """Load weights from buckets of (name, tensor) pairs (a trainer's state_dict_buckets) and
        set weight_version. `part` (roles.lora.PARTS) "full": every weight, names and shapes
        exactly the model's; "adapted": some of them (a LoRA trainer's merged tensors, after a
        full sync); "adapter": a LoRA adapter's tensors (PEFT names; rollout.lora_rank set),
        served or merged onto the base. On a mismatch nothing is loaded. Asleep, the weights go to
        host memory and reach the device on wake_up(). A path is passed on to
        update_weights_from_path."""
        if isinstance(buckets, (str, os.PathLike)):
            return self.update_weights_from_path(buckets, version, part)
        if part not in PARTS:
            raise ValueError(f"update_weights(part={part!r}); choose one of {PARTS}")
        pairs = _named_tensors(buckets)
        if part == "adapter" and not self.config.lora_rank:
            raise ValueError("update_weights(part='adapter'): this rollout has rollout.lora_rank=0 and serves merged "
                             "weights; build it with the trainer's lora_rank and lora_alpha (weight_sync.lora=adapter)")
        if part != "full" and not (self._vllm.weights_valid if self._vllm else self._weights_valid):
            raise RuntimeError(f"update_weights(part={part!r}) builds on weights that sleep(level=2) discarded; "
                               "send every weight (part='full') first")
        if self._vllm:
            if part == "adapter":
                self._vllm.load_adapter(pairs, self._lora_scale, self.config.lora_rank)
            else:
                self._vllm.load_weights(pairs, version, complete=part == "full")
            self.weight_version = int(version)
            return
        if part == "adapter":
            pairs = list(merge_into(self._base_of, pairs, self._lora_scale))
        unknown = [n for n, _ in pairs if n not in self._alias]
        wrong = [f"{n}: got {tuple(t.shape)}, model has {self._meta[self._alias[n]][0]}"
                 for n, t in pairs if n in self._alias and tuple(t.shape) != self._meta[self._alias[n]][0]]
        missing = sorted(set(self._meta) - {self._alias[n] for n, _ in pairs if n in self._alias}) \
            if part == "full" else []
        if unknown or wrong or missing:
            parts = [f"{len(unknown)} unknown names {unknown[:5]}" if unknown else "",
                     f"{len(wrong)} wrong shapes {wrong[:5]}" if wrong else "",
                     f"{len(missing)} weights missing {missing[:5]}" if missing else ""]
            raise ValueError(f"update_weights(version={version}) does not match the rollout's model "
                             f"({type(self.model).__name__}): " + "; ".join(p for p in parts if p)
                             + ". Buckets must hold the model's state_dict names with their shapes, all of them.")
        if part == "full":
            self._lora_base = {}  # a new base
        with torch.no_grad():
            for name, tensor in pairs:
                self._destination(self._alias[name]).copy_(tensor)
        self._weights_valid = True
        self.weight_version = int(version)

    @property
    def _lora_scale(self) -> float:
        """alpha / rank of the adapter an adapter-only sync carries."""
        return self.config.lora_alpha / self.config.lora_rank

    def _base_of(self, name: str) -> torch.Tensor:
        """The base tensor an adapter is merged onto: what the weight held before the first adapter."""
        if name not in self._alias:
            raise ValueError(f"update_weights(part='adapter'): the adapter changes {name!r}, which the rollout's "
                             f"model ({type(self.model).__name__}) does not have")
        if name not in self._lora_base:
            self._lora_base[name] = self._destination(self._alias[name]).detach().clone()
        return self._lora_base[name]

    def update_weights_from_path(self, path: Union[str, os.PathLike], version: int, part: str = "full") -> None:
        """Load weights from a safetensors file or a directory of them (save_pretrained output)."""
        from safetensors.torch import load_file

        path = Path(path)
        files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
        if not files or not all(f.is_file() and f.suffix == ".safetensors" for f in files):
            raise ValueError(f"no safetensors weights at {path}; give a directory written by save_pretrained "
                             "or a .safetensors file")
        state: dict[str, torch.Tensor] = {}
        for f in files:
            state.update(load_file(str(f), device="cpu"))
        self.update_weights([state], version, part)

    def _destination(self, name: str) -> torch.Tensor:
        """Where weight `name` is written now: the live tensor, or its host copy while asleep."""
        if name in self._buffers or not self._sleep_level:
            return self._buffers[name] if name in self._buffers else self._params[name].data
        if self._host is None:
            self._host = {}
        if name not in self._host:
            shape, dtype = self._meta[name]
            self._host[name] = torch.empty(shape, dtype=dtype, pin_memory=self.device.type == "cuda")
        return self._host[name]

    # ---- sleep / wake -----------------------------------------------------------------

    @property
    def sleep_level(self) -> int:
        """0 when awake, else the level of the last sleep()."""
        return self._vllm.sleep_level if self._vllm else self._sleep_level

    def sleep(self, level: int = 1) -> dict[str, float]:
        """Release the device memory of the weights and of the decode buffers kept between calls.
        1: keep the weights in host memory; 2: discard them. Returns the weight bytes released
        from the device and the seconds it took."""
        if self._vllm:
            return self._vllm.sleep(level)
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 (weights to host memory) or 2 (weights discarded), got {level}")
        start = time.perf_counter()
        self._decoder.release()  # its graph holds the weights' addresses, which wake_up changes
        released_at = time.perf_counter()
        if self._sleep_level:
            if level == 2:  # deeper sleep: drop what level 1 kept
                self._host, self._weights_valid = None, False
            self._sleep_level = max(self._sleep_level, level)
            return {"model_bytes": 0, "seconds": time.perf_counter() - start}
        released = sum(p.numel() * p.element_size() for p in self._params.values())
        host = {} if level == 1 else None
        for name, p in self._params.items():
            if host is not None:
                # On CPU the live tensor already is host memory: keep it as is, no copy.
                host[name] = p.data if p.device.type == "cpu" else \
                    torch.empty_like(p.data, device="cpu", pin_memory=True).copy_(p.data)
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self._host, self._sleep_level = host, level
        if level == 2:
            self._weights_valid = False
        copied_at = time.perf_counter()
        if self.device.type == "cuda":  # on CPU freed tensors return at once; a full gc costs ~0.3 s
            gc.collect()
            torch.cuda.empty_cache()
        end = time.perf_counter()
        # Its parts, logged as move/rollout_sleep_<part>_s: the decode buffers and graphs dropped,
        # the weights copied out, the freed memory returned to the device.
        return {"model_bytes": released, "seconds": end - start, "buffers_s": released_at - start,
                "weights_s": copied_at - released_at, "free_s": end - copied_at}

    def wake_up(self) -> dict[str, float]:
        """Bring the weights back to the device (level 2 without an update since: allocated, unset).
        Returns the weight bytes restored from host memory and the seconds it took."""
        if self._vllm:
            return self._vllm.wake_up()
        start, restored = time.perf_counter(), 0
        if not self._sleep_level:
            return {"model_bytes": 0, "seconds": 0.0}
        for name, p in self._params.items():
            if self._host is not None and name in self._host:
                p.data = self._host[name].to(self.device, non_blocking=True)
                restored += p.numel() * p.element_size()
            else:
                shape, dtype = self._meta[name]
                p.data = torch.empty(shape, dtype=dtype, device=self.device)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._host, self._sleep_level = None, 0
        return {"model_bytes": restored, "seconds": time.perf_counter() - start}

    def engine_info(self) -> dict[str, Any]:
        """Engine name, this rank's place in a tensor-parallel engine, weight bytes it holds."""
        if self._vllm:
            return self._vllm.info()
        # decode: "static" (torch_decode's KV cache, CUDA graph) or "dynamic" (plain generation).
        return {"engine": "torch", "decode": decode_path(self.model), "tensor_parallel_size": 1,
                "tensor_parallel_rank": 0,
                "weight_bytes": sum(p.numel() * p.element_size() for p in self.model.parameters())}

    def memory(self) -> dict[str, int]:
        """Host RSS (now, peak) and peak device memory of this rank's process."""
        return process_memory(self.device)
