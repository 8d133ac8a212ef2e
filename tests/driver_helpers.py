"""Shared by the driver tests: tiny run overrides, composing/preparing a run config as the
drivers' main does, fake roles and a fake worker group recording the call order, and checks
of a run's outputs."""
import io
import math
from pathlib import Path

import torch
from hydra import compose, initialize_config_module

from algorithms.config.schema import LoopConfig, prepare
from algorithms.records.runlog import RunLog
from algorithms.records.trackers import read_metrics
from orchestration.base_group import BaseWorkerGroup
from orchestration.config import register_schema
from roles.batch import Completions

REPO = Path(__file__).resolve().parent.parent
# Small enough for seconds per run; eval_size differs from prompts_per_step so a generate
# call's size tells a training generation from an eval one.
TINY = ["run.steps=3", "run.prompts_per_step=4", "data.train_size=50", "data.eval_size=3",
        "run.eval_max_new_tokens=12", "trainer.warmup_steps=1"]
TINY_GKD = TINY + ["algorithm.max_new_tokens=12", "placement.teacher_model=tiny_llama", "teacher.warmup_steps=2",
                   "teacher.warmup_batch=4"]


def composed(schema: type, overrides: list[str]):
    register_schema(schema)
    with initialize_config_module(config_module="conf", version_base=None):
        return compose(config_name="config", overrides=overrides)


def prepared(schema: type, overrides: list[str]):
    """(composed DictConfig, typed config, plan), as the driver's main builds them."""
    cfg = composed(schema, overrides)
    typed, plan = prepare(cfg, schema)
    return cfg, typed, plan


def run_one_thread(driver, schema: type, overrides: list[str], out_dir) -> dict:
    """`driver.run` of the composed `overrides` in this process with one intra-op thread (the
    number of threads restored after)."""
    _, typed, plan = prepared(schema, overrides)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return driver.run(typed, plan, out_dir)
    finally:
        torch.set_num_threads(threads)


# ----------------------------------------------------------------------------- fake roles

class FakeTrainer:
    """Refuses to compute or save while offloaded, like the real Trainer."""

    def __init__(self, needs_teacher: bool = False):
        self.offloaded, self.steps, self.needs_teacher = False, 0, needs_teacher

    def _live(self, what):
        if self.offloaded:
            raise RuntimeError(f"fake trainer is offloaded; call onload() before {what}()")

    def train_step(self, batch, temperature=1.0):
        self._live("train_step")
        assert len(batch) > 0 and batch.loss_mask.sum() > 0
        if self.needs_teacher:
            assert batch.teacher_logprobs is not None and batch.teacher_logprobs.shape[:2] == batch.input_ids.shape
        self.steps += 1
        return {"loss": 1.0 / self.steps, "grad_norm": 0.5}

    def state_dict_buckets(self, bucket_mb):
        # Like the real Trainer, buckets are read from host buffers while offloaded.
        return [[("w", torch.full((2,), float(self.steps)))]]

    def offload(self, model=True, optimizer=True):
        self.offloaded = True
        return {}

    def onload(self):
        self.offloaded = False
        return {}

    def save(self, path):
        self._live("save")
        Path(path).mkdir(parents=True, exist_ok=True)
        return Path(path)

    def memory(self):
        return {"rss_bytes": 1}


class FakeRollout:
    """Asleep it refuses to generate; sleep(2) discards the weights until the next update."""

    def __init__(self):
        self.asleep, self.has_weights, self.version = False, True, 0

    def generate(self, prompts, sampling):
        if self.asleep or not self.has_weights:
            raise RuntimeError(f"fake rollout cannot generate (asleep={self.asleep}, weights={self.has_weights})")
        n = len(prompts)
        return Completions(list(range(n)), [[5, 6, 7]] * n, [[8, 9, 10]] * n, ["#### 0"] * n,
                           [[-1.0] * 3] * n, ["stop"] * n, [self.version] * n)

    def update_weights(self, buckets, version):
        assert buckets and buckets[0][0][0] == "w"
        self.has_weights, self.version = True, version

    def sleep(self, level=1):
        self.asleep = True
        if level == 2:
            self.has_weights = False

    def wake_up(self):
        self.asleep = False

    def memory(self):
        return {"rss_bytes": 2}


class FakeTeacher:
    VOCAB = 16

    def __init__(self):
        self.offloaded = False

    def logits(self, batch, topk=None, tail=False, temperature=1.0):
        if self.offloaded:
            raise RuntimeError("fake teacher is offloaded; call onload() before logits()")
        B, T = batch.input_ids.shape
        if topk is None:
            return torch.log_softmax(torch.zeros(B, T, self.VOCAB), -1)
        return torch.full((B, T, topk), -math.log(topk)), torch.zeros(B, T, topk, dtype=torch.long)

    def offload(self):
        self.offloaded = True

    def onload(self):
        self.offloaded = False

    def memory(self):
        return {"rss_bytes": 3}


def summary(method, args):
    """What a call-order assertion needs to know of a call's arguments."""
    if method in ("generate", "train_step"):
        return len(args[0])
    if method == "logits":
        return args[1]
    if method == "update_weights":
        return args[1]
    if method == "sleep":
        return args[0]
    if method == "offload":
        return tuple(args)
    if method == "save":  # ranks write into step_N.tmp, renamed to step_N once complete
        return Path(args[0]).name.removesuffix(".tmp")
    return None


class FakeGroup(BaseWorkerGroup):
    """The real dispatch/collect over in-process fake ranks; records (role, method, summary)
    once per group call into a list shared by all groups, a deferred method (an onload riding
    on the turn's first call) just before the call that carries it."""

    def __init__(self, role, ranks, calls):
        self.role, self.ranks, self.calls, self.world_size = role, ranks, calls, len(ranks)
        self._carried = {}

    def async_call(self, method, *args, **kwargs):
        if method != "memory":  # per-step figures, not part of the call order under test
            self.calls.extend((self.role, m, summary(m, a)) for m, a, *_ in self._deferred)
            self.calls.append((self.role, method, summary(method, args)))
            self.calls.extend((self.role, m, summary(m, a)) for m, a, *_ in self._then)
        return super().async_call(method, *args, **kwargs)

    def _submit(self, index, method, args, kwargs, before=(), deps=(), then=()):
        self._carried[index] = {m: getattr(self.ranks[index], m)(*a) for m, a in before}
        value = getattr(self.ranks[index], method)(*args, **kwargs)
        self._carried[index].update({m: getattr(self.ranks[index], m)(*a) for m, a in then})
        return value

    def _wait(self, handles, method, indices, timeout):
        return handles


class MarkedLog(RunLog):
    """A RunLog that puts ('log', 'step', N) into the call list when step N is recorded."""

    def __init__(self, out_dir, total_steps, calls):
        super().__init__(out_dir, total_steps, LoopConfig(), stream=io.StringIO())
        self.calls = calls

    def step(self, step, metrics, quiet=False):
        self.calls.append(("log", "step", step))
        return super().step(step, metrics, quiet)


def by_step(calls):
    """Calls split at the step markers: [calls of step 0, ..., calls of step N, calls after]."""
    segments, current = [], []
    for c in calls:
        if c[0] == "log":
            assert c[2] == len(segments), f"step markers out of order: {c} after {len(segments)} steps"
            segments.append(current)
            current = []
        else:
            current.append(c)
    return segments + [current]


# ----------------------------------------------------------------------------- run outputs

def check_outputs(out: Path, steps: int, phases: set[str]) -> list[dict]:
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(steps + 1))
    for r in (records[0], records[-1]):
        assert 0.0 <= r["eval/accuracy"] <= 1.0
    for r in records[1:]:
        assert math.isfinite(r["train/loss"]) and r["train/loss"] > 0
        assert phases <= {k[len("time/"):] for k in r if k.startswith("time/")}, r
        assert all(v >= 0 for k, v in r.items() if k.startswith("time/"))
    assert (out / "resolved_config.yaml").is_file()
    return records


def check_checkpoint(path: str, arch: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.model_type == arch
    logits = model(torch.tensor([[1, 2, 3]])).logits
    assert torch.isfinite(logits).all()


