"""GKD driver: the call order with fake roles (colocated turns, weight sync after every
update, eval cadence, on-policy fraction), real end-to-end runs on tiny models (local, on
Ray and through the CLI, a --multirun sweep), and config errors that stop before anything
starts."""
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from algorithms import gkd
from algorithms.gkd import GKDConfig
from algorithms.config.schema import as_dict
from algorithms.data.loading import load_task
from algorithms.records.trackers import read_metrics
from algorithms.records.runlog import RunLog
from orchestration.planner import make_plan
from roles.models import load_tokenizer
from tests.driver_helpers import (REPO, TINY_GKD, FakeGroup, FakeRollout, FakeTeacher, FakeTrainer, MarkedLog,
                                  by_step, check_checkpoint, check_outputs, composed,  # noqa: F401
                                  prepared)

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one intra-op thread


def run_gkd_fakes(typed, plan, tmp_path, teacher_writer=False):
    calls = []
    groups = {"train": FakeGroup("train", [FakeTrainer(True) for _ in range(plan["train"].world_size)], calls),
              "rollout": FakeGroup("rollout", [FakeRollout() for _ in range(plan["rollout"].world_size)], calls),
              "teacher": FakeGroup("teacher", [FakeTeacher() for _ in range(plan["teacher"].world_size)], calls)}
    train_set, eval_set, _ = load_task(typed.data)
    log = MarkedLog(tmp_path, typed.run.steps, calls)
    try:
        record = gkd.train(typed, plan, groups["train"], groups["rollout"], groups["teacher"], train_set, eval_set,
                           load_tokenizer(as_dict(typed.model)), log, step0={"teacher/eval_accuracy": 1.0},
                           teacher_writer=FakeGroup("writer", [FakeRollout()], calls) if teacher_writer else None)
    finally:
        log.close()
    return calls, read_metrics(tmp_path / "metrics.jsonl"), record


def eval_steps(steps, every):
    return {s for s in range(steps + 1) if s in (0, steps) or (every and s % every == 0)}


# ----------------------------------------------------------------------------- call order: GKD

GKD_COLOCATED = ["+experiment=gkd_quickstart", *TINY_GKD, "placement.train.gpus=2", "placement.rollout.gpus=2",
                 "algorithm.logits_topk=4", "run.steps=5", "run.eval_every=2", "run.save_final=false",
                 "algorithm.lmbda=0.5"]


def test_gkd_colocated_call_order(tmp_path):
    """Every step: the rollout wakes, generates, sleeps (on-policy steps only); the teacher is
    onloaded for its logits and offloaded after; the trainer is onloaded for the update and
    offloaded after the weights went to the rollout (version == step) when the rollout works
    before the next update (the next step is on-policy, or eval is due), else without a sync;
    eval wakes the rollout at step 0, every eval_every steps and at the end."""
    _, typed, plan = prepared(GKDConfig, GKD_COLOCATED)
    assert (plan["train"].offload_model, plan["train"].offload_optimizer, plan["rollout"].sleep_level,
            plan["teacher"].offload_model, plan["train"].world_size) == (True, True, 1, True, 2)
    calls, records, _ = run_gkd_fakes(typed, plan, tmp_path)
    steps, n, n_eval = typed.run.steps, typed.run.prompts_per_step, typed.data.eval_size
    on_policy = {r["step"]: bool(r["gkd/on_policy"]) for r in records if r["step"] > 0}
    assert set(on_policy.values()) == {True, False}, "seed gives no mix of on- and off-policy steps; change it"

    def rollout_turn(size):
        return [("rollout", "wake_up", None), ("rollout", "generate", size), ("rollout", "sleep", 1)]

    segments = by_step(calls)
    assert len(segments) == steps + 2
    for step, got in enumerate(segments[:-1]):
        want = [("teacher", "offload", ())] if step == 0 else []  # out of the way before anything runs
        if step > 0:
            want += rollout_turn(n) if on_policy[step] else []
            syncs = step in eval_steps(steps, typed.run.eval_every) or on_policy.get(step + 1, False)
            want += [("teacher", "onload", None), ("teacher", "logits", 4), ("teacher", "offload", ()),
                     ("train", "onload", None), ("train", "train_step", n)]
            want += [("train", "state_dict_buckets", None), ("rollout", "update_weights", step)] if syncs else []
            want += [("train", "offload", (True, True))]
        if step in eval_steps(steps, typed.run.eval_every):
            want += rollout_turn(n_eval)
        assert got == want, f"step {step}"
    assert segments[-1] == []
    skipped = [s for s in range(1, steps) if not on_policy[s + 1] and s not in eval_steps(steps, typed.run.eval_every)]
    assert skipped, "seed gives no step whose sync is skipped; change it"
    assert [r["step"] for r in records if r.get("sync/skipped")] == skipped
    assert [r["step"] for r in records] == list(range(steps + 1))
    assert {r["step"] for r in records if "eval/accuracy" in r} == {0, 2, 4, 5}
    assert records[0]["teacher/eval_accuracy"] == 1.0


@pytest.mark.parametrize("lmbda", [0.0, 1.0])
def test_gkd_lmbda_extremes(tmp_path, lmbda):
    """lmbda=0 trains on dataset responses only (generate is for eval); lmbda=1 always generates."""
    _, typed, plan = prepared(GKDConfig, GKD_COLOCATED + [f"algorithm.lmbda={lmbda}",
                                                             "algorithm.logits_topk=null"])
    calls, records, _ = run_gkd_fakes(typed, plan, tmp_path)
    n, n_eval = typed.run.prompts_per_step, typed.data.eval_size
    evals = len(eval_steps(typed.run.steps, typed.run.eval_every))
    sizes = [c[2] for c in calls if c[1] == "generate"]
    assert sizes.count(n_eval) == evals
    assert sizes.count(n) == (typed.run.steps if lmbda == 1 else 0)
    assert [r.get("gkd/on_policy") for r in records[1:]] == [lmbda] * typed.run.steps
    assert [c[2] for c in calls if c[1] == "logits"] == [None] * typed.run.steps  # full vocabulary


def test_gkd_seq_kd_teacher_writes_the_off_policy_completions(tmp_path):
    """seq_kd: every off-policy step's completions come from the teacher's rollout (never the
    dataset); on-policy steps still come from the student's."""
    _, typed, plan = prepared(GKDConfig, GKD_COLOCATED + ["algorithm.seq_kd=true"])
    calls, records, _ = run_gkd_fakes(typed, plan, tmp_path, teacher_writer=True)
    n = typed.run.prompts_per_step
    on_policy = [bool(r["gkd/on_policy"]) for r in records[1:]]
    assert 0 < sum(on_policy) < len(on_policy)
    assert [c for c in calls if c[0] == "writer"] == [("writer", "generate", n)] * on_policy.count(False)
    assert [c[2] for c in calls if c[:2] == ("rollout", "generate")].count(n) == on_policy.count(True)


def test_gkd_separate_plan_never_offloads_or_sleeps(tmp_path):
    """Roles on their own devices never take turns, whatever the offload/sleep flags say; the
    teacher scores an off-policy step's batch during the previous step's train call when nothing
    else comes between the two."""
    _, typed, _ = prepared(GKDConfig, GKD_COLOCATED + ["algorithm.logits_topk=4"])
    plan = make_plan({"offload_model": True, "offload_optimizer": True, "sleep_level": 1,
                      "train": {"gpus": 1}, "rollout": {"gpus": 2}, "teacher": {"gpus": 1, "model": "tiny_llama"}})
    calls, records, _ = run_gkd_fakes(typed, plan, tmp_path)
    assert not [c for c in calls if c[1] in ("offload", "onload", "sleep", "wake_up")]
    segments = by_step(calls)
    skipped = {r["step"] for r in records if r.get("sync/skipped")}
    ahead = {r["step"] for r in records if r.get("gkd/scored_ahead")}
    assert ahead and ahead <= {r["step"] for r in records if r.get("gkd/on_policy") == 0.0}
    for step in range(1, typed.run.steps + 1):
        methods = [c[:2] for c in segments[step]]
        at = methods.index(("train", "train_step"))
        assert (("teacher", "logits") not in methods[:at]) if step in ahead else methods[at - 1] == ("teacher", "logits")
        synced = [("train", "state_dict_buckets", None), ("rollout", "update_weights", step)]
        follows = [("teacher", "logits", 4)] if step + 1 in ahead else [] if step in skipped else synced
        assert segments[step][at + 1:at + 3] == follows, step
    assert sum(r.get("gkd/on_policy", 0) for r in records) > 0


@pytest.mark.parametrize("save", ["run.save_final=true", "run.save_every=2"])
def test_gkd_colocated_checkpoint_onloads_the_trainer(tmp_path, save):
    """A checkpoint of an offloaded trainer brings it back for the save and offloads it again."""
    _, typed, plan = prepared(GKDConfig, GKD_COLOCATED + ["run.steps=2", save])
    calls, _, record = run_gkd_fakes(typed, plan, tmp_path)
    at = calls.index(("train", "save", "step_2"))
    assert calls[at - 1:at + 2] == [("train", "onload", None), ("train", "save", "step_2"),
                                    ("train", "offload", (True, True))]
    assert ("checkpoint" in record) == (save == "run.save_final=true")


def test_gkd_sleep_level_2_generates_with_weights(tmp_path):
    _, typed, plan = prepared(GKDConfig, GKD_COLOCATED + ["placement.sleep_level=2", "algorithm.lmbda=1",
                                                             "run.steps=2"])
    calls, _, _ = run_gkd_fakes(typed, plan, tmp_path)
    assert [c[2] for c in calls if c[1] == "sleep"] == [2] * 4


def test_gkd_end_to_end_local_full_vocab_then_topk_from_cached_teacher(tmp_path, capsys):
    """Full vocabulary with the trainer kept loaded (the first run warms the teacher up and
    caches it), then top-4 with the trainer offloaded between turns and the cached teacher."""
    cache = tmp_path / "teachers"
    base = ["+experiment=gkd_quickstart", *TINY_GKD, "backend=local", f"teacher.cache_dir={cache}"]
    cfg, typed, plan = prepared(GKDConfig, base + ["placement.offload_model=false",
                                                      "placement.offload_optimizer=false"])
    gkd.validate(typed, plan)
    assert typed.algorithm.logits_topk is None and plan["teacher"].offload_model and plan["rollout"].sleep_level == 1
    record = gkd.run(typed, plan, tmp_path / "full")
    records = check_outputs(tmp_path / "full", 3, {"generate", "teacher", "train", "sync_weights"})
    assert 0.0 <= records[0]["teacher/eval_accuracy"] <= 1.0
    assert record["teacher/eval_accuracy"] == records[0]["teacher/eval_accuracy"]
    assert "teacher_topk_mass" not in str(records)
    check_checkpoint(record["checkpoint"], typed.model.arch)
    warmup = read_metrics(tmp_path / "full" / "teacher_warmup" / "metrics.jsonl")
    assert [r["step"] for r in warmup] == [0, 1, 2]
    assert len(list(cache.iterdir())) == 1
    assert "training the teacher" in capsys.readouterr().out

    _, typed, plan = prepared(GKDConfig, base + ["algorithm.logits_topk=4"])
    assert typed.algorithm.logits_topk == 4 and plan["train"].offload_model
    record = gkd.run(typed, plan, tmp_path / "topk")
    records = check_outputs(tmp_path / "topk", 3, {"generate", "teacher", "train", "sync_weights"})
    assert all(0.0 < r["train/teacher_topk_mass"] <= 1.0 + 1e-6 for r in records[1:])
    assert "from cache" in capsys.readouterr().out
    assert not (tmp_path / "topk" / "teacher_warmup").exists() and len(list(cache.iterdir())) == 1
    check_checkpoint(record["checkpoint"], typed.model.arch)


# ----------------------------------------------------------------------------- CLI

def cli(module: str, overrides: list[str], run_dir: Path, **popen) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "0"}
    return subprocess.Popen([sys.executable, "-m", module, *overrides, f"hydra.run.dir={run_dir}"], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"{proc.args} ran over {timeout}s:\n{out[-2000:]}\n{err[-2000:]}")
    return proc.returncode, out, err


# The quickstart's settings run in CI in process (test_experiments_run) and GKD on Ray from an
# ms-swift file in test_swift_args; this is the command itself, in its own process.
@pytest.mark.slow
def test_gkd_cli_quickstart_on_ray(ray_cluster, tmp_path):
    """The quickstart command with tiny settings, in its own process, joining the session's Ray
    cluster (cluster.address; the teacher warm-up included: an SFT run on a trainer actor)."""
    rc, out, err = finish(cli("algorithms.gkd", ["+experiment=gkd_quickstart", *TINY_GKD,
                                                 f"teacher.cache_dir={tmp_path / 'teachers'}",
                                                 f"cluster.address={ray_cluster.address}"], tmp_path / "run"),
                          timeout=300)
    assert rc == 0, out[-2000:] + err[-4000:]
    check_outputs(tmp_path / "run", 3, {"generate", "teacher", "train", "sync_weights"})
    assert (tmp_path / "run" / "checkpoints" / "step_3" / "config.json").is_file()
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "teacher_warmup" / "metrics.jsonl")] == [0, 1, 2]
    assert '"eval/accuracy"' in out.strip().splitlines()[-1]


@pytest.mark.slow  # Hydra's sweep in a process of its own
def test_gkd_multirun_sweeps_beta(tmp_path):
    """`--multirun algorithm.beta=0,1`: one run directory per value, each with its own
    resolved config and metrics (the teacher warm-up is cached once and reused)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "algorithms.gkd", "--multirun", "+experiment=gkd_quickstart", *TINY_GKD,
         "backend=local", f"teacher.cache_dir={tmp_path / 'teachers'}", "algorithm.beta=0,1",
         f"hydra.sweep.dir={tmp_path / 'sweep'}"], cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    rc, out, err = finish(proc, timeout=400)
    assert rc == 0, out[-2000:] + err[-4000:]
    for job, beta in (("0", 0.0), ("1", 1.0)):
        run = tmp_path / "sweep" / job
        assert yaml.safe_load((run / "resolved_config.yaml").read_text())["algorithm"]["beta"] == beta
        steps = [r["step"] for r in read_metrics(run / "metrics.jsonl")]
        assert steps[0] == 0 and steps[-1] == 3
    assert len(list((tmp_path / "teachers").iterdir())) == 1


# A config error's one line and exit 2 through gkd's main (friendly_errors):
# tests/test_swift_args.py::test_the_command_line_stops_a_bad_file_in_one_line.
CLI_ERRORS = {  # name: (overrides, the key the message names)
    "unknown_key": (["algorithm.lmbdaa=0.5"], "algorithm.lmbdaa"),
}


@pytest.fixture(scope="module")
def cli_errors(tmp_path_factory):
    """Every config-error command, started at once (each only imports, composes and validates).
    {name: (exit code, stdout, stderr, run dir)}."""
    root = tmp_path_factory.mktemp("cli_errors")
    procs = {name: cli("algorithms.gkd", ["+experiment=gkd_quickstart", *overrides], root / name)
             for name, (overrides, _) in CLI_ERRORS.items()}
    return {name: (*finish(p, timeout=180), root / name) for name, p in procs.items()}


def nothing_started(out: str, run_dir: Path) -> bool:
    """No cluster, no teacher warm-up, no metrics."""
    written = {p.name for p in run_dir.iterdir()} if run_dir.exists() else set()
    return "cluster:" not in out and "teacher" not in out and not {"metrics.jsonl", "teacher_warmup"} & written


# In CI the command line's config error is test_swift_args::test_the_command_line_stops_a_bad_file_in_one_line.
@pytest.mark.slow
def test_gkd_cli_unknown_key_is_refused_before_anything_starts(cli_errors):
    """An override naming a key the config lacks is refused before Hydra composes: exit 2 and one
    line naming the key, the nearest one and the fix (orchestration.config.checked_command_line)."""
    rc, out, err, run_dir = cli_errors["unknown_key"]
    assert rc == 2 and err.strip().splitlines() == [
        "error: config key 'algorithm.lmbdaa'=0.5 is not a key of 'algorithm' (did you mean 'algorithm.lmbda'?). "
        "Fix: use a key of GKDConfig (python -m <driver> --cfg job lists them)"], err
    assert nothing_started(out, run_dir)


def test_gkd_topk_tail_mode_runs(tmp_path):
    """The tail bucket needs the teacher's top-k at the loss temperature (0.9 here)."""
    _, typed, plan = prepared(GKDConfig, ["+experiment=gkd_quickstart", *TINY_GKD, "backend=local",
                                             "teacher.warmup_steps=0", "run.steps=1", "trainer.warmup_steps=0",
                                             "run.save_final=false", "algorithm.logits_topk=4",
                                             "algorithm.topk_mode=tail"])
    gkd.validate(typed, plan)
    gkd.run(typed, plan, tmp_path)
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert len(records) == 2 and math.isfinite(records[1]["train/loss"])


def test_gkd_student_topk_with_fused_logprobs_follows_the_full_logits_run(tmp_path, monkeypatch):
    """trainer.fused_logprobs against a top-k teacher: the student's loss reads its log-softmax at
    the teacher's tokens (trained at the loss temperature) and never the full logits; the losses
    are the full-logits run's (torch.compile traced by dynamo and AOTAutograd here)."""
    import functools

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    base = ["+experiment=gkd_quickstart", *TINY_GKD, "backend=local", "teacher.warmup_steps=0", "run.steps=2",
            "trainer.warmup_steps=0", "run.save_final=false", "algorithm.logits_topk=4", "algorithm.lmbda=0",
            "trainer.compile=true"]
    records: list = []
    step = RunLog.step
    monkeypatch.setattr(RunLog, "step", lambda self, *a, **k: records.append(step(self, *a, **k)) or records[-1])
    losses = {}
    for fused in (False, True):
        _, typed, plan = prepared(GKDConfig, base + [f"trainer.fused_logprobs={str(fused).lower()}"])
        gkd.validate(typed, plan)
        assert gkd.student_topk(typed, plan) == fused and gkd.gkd_loss(typed, plan).loss_inputs == (
            ("student_topk",) if fused else ("logits",))
        records.clear()
        gkd.run(typed, plan, tmp_path / str(fused))
        losses[fused] = [r["train/loss"] for r in records if r["step"] > 0]
    assert len(losses[True]) == 2
    # Step 1 starts from the same weights: only the log-softmax differs (over k tokens against
    # the whole vocabulary, float32), a few ulps; records keep 6 decimals (abs 5e-7).
    assert losses[True][0] == pytest.approx(losses[False][0], rel=1e-5, abs=1e-6)
    # Step 2 follows one AdamW update, which divides each gradient element by its own magnitude:
    # an element whose gradient is near 0 moves by up to lr whatever its last bits, so the
    # paths' ulp-level differences reach the loss at about 1e-4 (1.1e-4 measured on one CPU
    # kind, under 1e-4 on another). A wrong student top-k differs by far more (the losses are ~0.1).
    assert losses[True][1] == pytest.approx(losses[False][1], rel=1e-3)


def test_two_sleeping_vllm_engines_in_one_gpu_process_are_refused_before_start(monkeypatch):
    """vLLM's sleep mode is process-wide: a local run with a vLLM rollout and a vLLM teacher on a
    GPU that sleep would put both to sleep; refused by check(), with the keys that fix it."""
    from orchestration.config import ConfigError

    base = ["+experiment=gkd_quickstart", *TINY_GKD, "backend=local", "backend.rollout=vllm",
            "backend.teacher=vllm", "algorithm.logits_topk=8"]
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    _, typed, plan = prepared(GKDConfig, base)
    with pytest.raises(ConfigError, match="two GPU vLLM engines in one process.*backend.workers=ray"):
        gkd.validate(typed, plan)
    _, typed, plan = prepared(GKDConfig, base + ["placement.sleep_level=0", "placement.offload_teacher_model=false"])
    gkd.validate(typed, plan)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    _, typed, plan = prepared(GKDConfig, base)
    gkd.validate(typed, plan)  # on CPU vLLM has no sleep mode: nothing is shared


def test_a_failed_offload_is_the_error_raised_when_the_next_turn_fails_for_it(tmp_path):
    """On Ray the next turn's first call waits for the previous turn's offload where it runs; when
    that offload failed, the call fails too, and the turn raises the offload's own error (naming its
    role and method), not the waiting call's."""
    from algorithms.runtime.steps import Steps
    from orchestration.base_group import GroupFuture, WorkerError
    from orchestration.config import WeightSyncConfig

    def failed_offload(timeout):
        raise WorkerError("teacher", 0, "offload", "RuntimeError: device lost")

    class Group:
        def after(self, futures):
            self.waits = futures

        def defer(self, *a):
            pass

        def call(self, method, *args, **kwargs):
            raise WorkerError("train", 0, "onload+train_step", "a call it waited for failed")

    typed, plan = prepared(GKDConfig, TINY_GKD)[1:]
    turns = Steps(plan, {"train": Group()}, typed.run, WeightSyncConfig(), MarkedLog(tmp_path, 3, []), []).turns
    turns._pending = [("teacher", "offload", GroupFuture(failed_offload))]
    with pytest.raises(WorkerError, match=r"teacher rank 0 failed in offload\(\): RuntimeError: device lost"):
        with turns.turn("train"):
            turns.roles["train"].call("train_step")
    assert turns.roles["train"].waits  # the train call was sent to wait for the offload


def test_a_relative_teacher_folder_reaches_the_roles_as_an_absolute_path(tmp_path, monkeypatch):
    """Actors of a cluster the run joins do not work in the driver's directory: a teacher given as
    a relative folder goes to them absolute (as the student's model.path does); a preset stays a name."""
    from algorithms import gkd

    (tmp_path / "teacher").mkdir()
    monkeypatch.chdir(tmp_path)
    _, typed, plan = prepared(GKDConfig, TINY_GKD + ["placement.teacher_model=./teacher"])
    assert gkd.teacher_spec(typed, plan) == str(tmp_path / "teacher")
    _, typed, plan = prepared(GKDConfig, TINY_GKD)
    assert gkd.teacher_spec(typed, plan) == "tiny_llama"
