"""Outcome reward model (ORM): one score per completion.

Kinds, chosen by `ORMConfig.kind`:

* 'exact': 1.0 when the completion equals the reference after normalisation (trimmed,
  runs of whitespace collapsed to one space, case folded unless `exact_ignore_case` is off).
* 'numeric': GSM8K style. The number after the last '####' of the completion is compared
  numerically with the reference's '#### N' (or with the reference itself when it is a
  plain number). Commas, '$' and a trailing period are ignored ('#### $1,234.' is 1234).
  A completion without '####' scores 0, or, with `numeric_fallback_last_number`, its last
  number is used instead.
* 'last_number': the completion's last number equals the reference (its '#### N', or the
  reference as a plain number): bare-number answers.
* 'regex': the last match of `answer_pattern` in the completion (its first group, else the
  whole match) equals the reference.
* 'boxed': the content of the completion's last \\boxed{...} equals the reference.
  'regex' and 'boxed' compare numerically when both sides are numbers, else as 'exact' does.
* 'math': ms-swift's `math` ORM (its sampler's orm_model): the completion's and the reference's
  first \\boxed{...} (the text after '# Answer' when present; a side without one counts whole),
  LaTeX delimiters and braces dropped, equal as text or as numbers. No symbolic equivalence
  (ms-swift's sympy LaTeX parse needs antlr4, not installed here).
* 'format': 1.0 when `format_pattern` matches the completion (`re.search`), else 0.0.
* 'custom': `reward_fn`, a dotted path 'pkg.mod.fn' to a function
  fn(prompts, completions, references) -> list[float].
* 'plugin': `plugin`, '<plugin file>.py:<name>': the reward class a plugin file registers in
  `orms` (roles/plugins.py; ms-swift's external_plugins), imported in this process and called as
  ms-swift calls it, `instance(completions, **columns)`: the rows' dataset columns (`rows`
  of `score`) as lists, and `solution` (the reference) unless the rows carry one.
* 'model': a causal LM with a scalar head read at the last token of prompt + completion
  (+ eos); trained with a pairwise Bradley-Terry loss by `train_pairwise`.
* 'combined': the weighted sum over `weights` ({kind: weight}) of the kinds above.

Prompts, completions and references are lists of strings, one entry per completion (repeat
a prompt for its n samples), so `dispatch='slice'` splits them consistently; so are `rows`,
the dataset columns of each completion's row (dicts), read by the plugin kind only.

The scalar-head model (`roles/scorer_model.py`) is shared with the PRM, which reads it at the
end of every step. No Ray here; model training is single-process (call it on one rank).
"""
from __future__ import annotations

import importlib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

import torch

from roles.plugins import PluginError, plugin_reward
from roles.scorer_model import ScalarHeadModel, ScorerModelConfig, typed_config

# Kinds that judge a completion right or wrong against its reference (data.check offers them).
ANSWER_KINDS = ("numeric", "exact", "last_number", "regex", "boxed")
RULE_KINDS = ANSWER_KINDS + ("math", "format")
COMPONENT_KINDS = RULE_KINDS + ("custom", "plugin", "model")
KINDS = COMPONENT_KINDS + ("combined",)
# A number as written in answers: optional sign and '$', thousands commas, decimals.
NUMBER_RE = re.compile(r"[-+]?\$?\d{1,3}(?:,\d{3})+(?:\.\d+)?|[-+]?\$?\d+(?:\.\d+)?|[-+]?\$?\.\d+")


@dataclass
class ORMConfig(ScorerModelConfig):
    # What scores a completion: exact | numeric | last_number | regex | boxed | math | format | custom |
    # plugin | model | combined.
    kind: str = "numeric"
    # Weight of each kind when kind=combined, e.g. {numeric: 1.0, format: 0.1}; the score
    # is the weighted sum (not normalised).
    weights: Dict[str, float] = field(default_factory=dict)
    # exact: compare case-insensitively.
    exact_ignore_case: bool = True
    # numeric: without '####' in the completion, use its last number instead of scoring 0.
    numeric_fallback_last_number: bool = False
    # numeric: largest absolute difference still counted as equal.
    numeric_tolerance: float = 1e-6
    # regex: regular expression whose last match in the completion gives its answer (the first
    # group, else the whole match).
    answer_pattern: Optional[str] = None
    # format: regular expression searched in the completion (use ^, $, (?m), (?s) as needed);
    # the default asks for a last line '#### <number>'.
    format_pattern: str = r"(?m)^#### [-+]?\$?[\d,]*\.?\d+\.?\s*\Z"
    # custom: dotted path of fn(prompts, completions, references) -> list[float].
    reward_fn: Optional[str] = None
    # plugin: '<plugin file>.py:<name>', a reward class the file registers in orms.
    plugin: Optional[str] = None


def load_reward_fn(path: Optional[str], key: str) -> Callable:
    """Import 'pkg.mod.fn'; a bad path fails with an error naming the config key."""
    if not path or "." not in path:
        raise ValueError(f"{key}={path!r}: expected a dotted path 'package.module.function'")
    module_name, _, attr = path.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"{key}='{path}': cannot import module '{module_name}' ({err})") from err
    fn = getattr(module, attr, None)
    if fn is None:
        raise ValueError(f"{key}='{path}': module '{module_name}' has no attribute '{attr}'")
    if not callable(fn):
        raise ValueError(f"{key}='{path}': '{attr}' is a {type(fn).__name__}, not a function")
    return fn


def compile_pattern(pattern: Optional[str], key: str) -> "re.Pattern":
    """A regular expression of the config; a missing or broken one fails naming `key`."""
    if not pattern:
        raise ValueError(f"{key} is unset; the kind using it needs a regular expression")
    try:
        return re.compile(pattern)
    except re.error as err:
        raise ValueError(f"{key}={pattern!r} is not a valid regex: {err}") from err


def _to_number(text: str) -> Optional[float]:
    try:
        return float(text.replace(",", "").replace("$", ""))
    except ValueError:
        return None


def last_number(text: str) -> Optional[float]:
    """The last number of the text; None when it has none."""
    found = NUMBER_RE.findall(text)
    return _to_number(found[-1]) if found else None


def extract_answer(text: str, fallback_last_number: bool = False) -> Optional[float]:
    """The number after the last '####' (its first number), else optionally the last
    number of the text; None when there is none."""
    _, sep, tail = text.rpartition("####")
    if sep:
        m = NUMBER_RE.search(tail)
        return _to_number(m.group()) if m else None
    return last_number(text) if fallback_last_number else None


def last_boxed(text: str) -> Optional[str]:
    """The content of the last \\boxed{...} (nested braces kept); None when there is none
    or it is not closed."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for i in range(begin, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth < 0:
            return text[begin:i]
    return None


def reference_number(reference: str) -> Optional[float]:
    """The reference's '#### N', or the reference itself as a plain number."""
    if "####" in reference:
        return extract_answer(reference)
    return _to_number(reference.strip().rstrip("."))


def math_answer(text: str) -> str:
    """The answer of ms-swift's math ORM: the text after '# Answer' (if any), its first
    \\boxed{...} without nested braces (else the whole text), LaTeX \\( \\) \\[ \\] and braces dropped."""
    text = text.split("# Answer")[1] if "# Answer" in text else text
    boxed = re.search(r"\\boxed{([^}]*)}", text.strip())
    text = boxed.group(1).strip() if boxed else text.strip()
    text = re.sub(r"\\\(|\\\)|\\\[|\\]", "", text)
    return text.replace("}}", "}").replace("{", "").replace("}", "").strip()


def normalize_text(text: str, ignore_case: bool = True) -> str:
    text = " ".join(text.split())
    return text.casefold() if ignore_case else text


def reference_text(reference: str) -> str:
    """The answer a reference holds: the text after its last '####', else all of it."""
    return reference.rpartition("####")[2].strip()


class ORM:
    """Outcome scores: `score(prompts, completions, references) -> list[float]`."""
    # No state a fresh rank could not get back (weights: its model path or a sync), so a lost
    # rank may be replaced (orchestration.launch.restartable).
    RESTARTABLE = True

    def __init__(self, config: ORMConfig | Mapping[str, Any] | None = None, **overrides: Any):
        self.config = cfg = typed_config(ORMConfig, config, overrides, "orm")
        if cfg.kind not in KINDS:
            raise ValueError(f"orm.kind='{cfg.kind}'; choose one of {list(KINDS)}")
        if cfg.kind == "combined":
            if not cfg.weights:
                raise ValueError("orm.kind=combined needs orm.weights, e.g. {numeric: 1.0, format: 0.1}")
            unknown = sorted(set(cfg.weights) - set(COMPONENT_KINDS))
            if unknown:
                raise ValueError(f"orm.weights has unknown kinds {unknown}; use {list(COMPONENT_KINDS)}")
            self.weights = dict(cfg.weights)
        else:
            self.weights = {cfg.kind: 1.0}
        self.reward_fn = load_reward_fn(cfg.reward_fn, "orm.reward_fn") if "custom" in self.weights else None
        self.plugin = None
        if "plugin" in self.weights:
            try:
                self.plugin = plugin_reward(cfg.plugin or "")
            except PluginError as e:
                raise ValueError(f"orm.plugin={cfg.plugin!r}: {e}") from None
        if "format" in self.weights:
            self.format_re = compile_pattern(cfg.format_pattern, "orm.format_pattern")
        if "regex" in self.weights:
            self.answer_re = compile_pattern(cfg.answer_pattern, "orm.answer_pattern")
        self.model = None
        if "model" in self.weights:
            self.model = ScalarHeadModel(cfg.model, cfg.device, cfg.seed, cfg.use_chat_template, cfg.lr,
                                         cfg.weight_decay, cfg.max_grad_norm, cfg.micro_batch)

    # ------------------------------------------------------------------------- scoring

    def score(self, prompts: Sequence[str], completions: Sequence[str],
              references: Optional[Sequence[Optional[str]]] = None,
              rows: Optional[Sequence[Mapping[str, Any]]] = None) -> List[float]:
        """One score per completion: the weighted sum of the configured kinds. `rows`: each
        completion's dataset columns (the plugin kind passes them on; None: no columns)."""
        n = len(completions)
        references = list(references) if references is not None else [None] * n
        rows = list(rows) if rows is not None else [{}] * n
        if len(prompts) != n or len(references) != n or len(rows) != n:
            raise ValueError(f"orm.score needs one prompt, reference and row per completion; got "
                             f"{len(prompts)} prompts, {n} completions, {len(references)} references, {len(rows)} rows")
        total = [0.0] * n
        for kind, weight in self.weights.items():
            scores = self._score_kind(kind, list(prompts), list(completions), references, rows)
            total = [t + weight * s for t, s in zip(total, scores)]
        return total

    def _score_kind(self, kind: str, prompts: List[str], completions: List[str], references: list,
                    rows: list) -> List[float]:
        if kind in ANSWER_KINDS + ("math",) and any(r is None for r in references):
            raise ValueError(f"orm kind '{kind}' needs a reference for every completion")
        if kind == "exact":
            ic = self.config.exact_ignore_case
            return [float(normalize_text(c, ic) == normalize_text(r, ic)) for c, r in zip(completions, references)]
        if kind == "numeric":
            fallback = self.config.numeric_fallback_last_number
            return [self._same_number(extract_answer(c, fallback), reference_number(r))
                    for c, r in zip(completions, references)]
        if kind == "last_number":
            return [self._same_number(last_number(c), reference_number(r)) for c, r in zip(completions, references)]
        if kind == "regex":
            return [self._same_answer(self._regex_answer(c), r) for c, r in zip(completions, references)]
        if kind == "boxed":
            return [self._same_answer(last_boxed(c), r) for c, r in zip(completions, references)]
        if kind == "math":
            return [self._same_number_or_text(math_answer(c), math_answer(r)) for c, r in zip(completions, references)]
        if kind == "format":
            return [float(self.format_re.search(c) is not None) for c in completions]
        if kind == "custom":
            out = [float(x) for x in self.reward_fn(prompts, completions, references)]
            if len(out) != len(completions):
                raise ValueError(f"orm.reward_fn='{self.config.reward_fn}' returned {len(out)} scores "
                                 f"for {len(completions)} completions")
            return out
        if kind == "plugin":
            return self._plugin_scores(completions, references, rows)
        return self._model_scores(prompts, completions)

    def _plugin_scores(self, completions: List[str], references: list, rows: list) -> List[float]:
        """The plugin's scores: ms-swift's call, the rows' columns batched into lists (None where
        a row lacks a column), `solution` the reference when no row carries one."""
        names = list(dict.fromkeys(k for row in rows for k in row))
        columns = {k: [row.get(k) for row in rows] for k in names}
        columns.setdefault("solution", references)
        out = self.plugin(completions, **columns)
        if out is None or len(out) != len(completions):
            raise ValueError(f"orm.plugin={self.config.plugin!r} returned {None if out is None else len(out)} "
                             f"scores for {len(completions)} completions")
        # ms-swift reads None as 'no score' (NaN); one sum of weighted scores has no such value.
        return [0.0 if x is None else float(x) for x in out]

    def _same_number(self, got: Optional[float], want: Optional[float]) -> float:
        if got is None or want is None:
            return 0.0
        return float(abs(got - want) <= self.config.numeric_tolerance)

    def _same_answer(self, got: Optional[str], reference: str) -> float:
        """1.0 when an extracted answer equals the reference's: as numbers when both are
        numbers, else as text normalised like 'exact'."""
        if got is None:
            return 0.0
        want = reference_text(reference)
        numbers = _to_number(got.strip().rstrip(".")), _to_number(want.rstrip("."))
        if None not in numbers:
            return self._same_number(*numbers)
        ic = self.config.exact_ignore_case
        return float(normalize_text(got, ic) == normalize_text(want, ic))

    def _same_number_or_text(self, got: str, want: str) -> float:
        numbers = _to_number(got), _to_number(want)
        return self._same_number(*numbers) if None not in numbers else float(got == want)

    def _regex_answer(self, completion: str) -> Optional[str]:
        matches = list(self.answer_re.finditer(completion))
        if not matches:
            return None
        last = matches[-1]
        return last.group(1) if self.answer_re.groups else last.group(0)

    # -------------------------------------------------------------------------- model

    def _sequences(self, prompts: Sequence[str], completions: Sequence[str]) -> List[List[int]]:
        m = self.model
        eos = [m.tokenizer.eos_token_id] if m.tokenizer.eos_token_id is not None else []
        seqs = [m.prompt_ids(p) + m.text_ids(c) + eos for p, c in zip(prompts, completions)]
        # The score is read at the end, so an over-long sequence loses its beginning.
        return [s[-m.max_length:] if m.max_length else s for s in seqs]

    def _last_values(self, seqs: List[List[int]]) -> torch.Tensor:
        values = self.model.values(seqs)
        last = torch.tensor([len(s) - 1 for s in seqs], device=values.device)
        return values[torch.arange(len(seqs), device=values.device), last]

    @torch.no_grad()
    def _model_scores(self, prompts: List[str], completions: List[str]) -> List[float]:
        self.model.eval()
        seqs, mb = self._sequences(prompts, completions), self.model.micro_batch
        return [float(v) for i in range(0, len(seqs), mb) for v in self._last_values(seqs[i:i + mb])]

    def _require_model(self, method: str) -> ScalarHeadModel:
        if self.model is None:
            raise ValueError(f"orm.{method} needs a model; orm.kind='{self.config.kind}' has none "
                             "(set orm.kind=model and orm.model)")
        return self.model

    def train_pairwise(self, chosen: Sequence[str], rejected: Sequence[str],
                       prompts: Optional[Sequence[str]] = None) -> Dict[str, float]:
        """One AdamW step on the Bradley-Terry loss -log sigmoid(r(chosen) - r(rejected)),
        averaged over the pairs. `prompts` (one per pair) default to empty prompts."""
        m = self._require_model("train_pairwise")
        if len(chosen) != len(rejected) or (prompts is not None and len(prompts) != len(chosen)):
            raise ValueError("train_pairwise needs as many rejected completions (and prompts) as chosen ones")
        if not chosen:
            raise ValueError("train_pairwise got no pairs")
        prompts = list(prompts) if prompts is not None else [""] * len(chosen)
        m.train()
        n, half = len(chosen), max(1, m.micro_batch // 2)
        loss_sum = correct = margin_sum = 0.0
        for i in range(0, n, half):
            p = prompts[i:i + half]
            seqs = self._sequences(p, chosen[i:i + half]) + self._sequences(p, rejected[i:i + half])
            r = self._last_values(seqs)
            k = len(p)
            margin = r[:k] - r[k:]
            loss = -torch.nn.functional.logsigmoid(margin).sum()
            (loss / n).backward()
            loss_sum += loss.item()
            correct += (margin > 0).sum().item()
            margin_sum += margin.sum().item()
        grad_norm = m.optimizer_step()
        m.eval()
        return {"loss": loss_sum / n, "accuracy": correct / n, "margin": margin_sum / n,
                "grad_norm": grad_norm, "pairs": float(n), "step": float(m.step)}

    def save(self, out_dir: str | os.PathLike) -> Path:
        return self._require_model("save").save(out_dir)

    def load(self, in_dir: str | os.PathLike) -> None:
        self._require_model("load").load(in_dir)
