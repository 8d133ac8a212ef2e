"""Resume: checkpoints written whole or not at all, found again, and a run interrupted after a
checkpoint and resumed with run.resume=auto equals the uninterrupted run bitwise (torch
engine, seeded sampling): metrics of every step, the prompts drawn, the final weights."""
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from algorithms.records import checkpoints
from algorithms import gkd, grpo, sft
from algorithms.records.checkpoints import complete_checkpoints, find_resume, save_checkpoint
from algorithms.data.prompts import PromptStream
from algorithms.gkd import GKDConfig
from algorithms.sft import SFTConfig
from algorithms.config.schema import prepare
from algorithms.records.runlog import RunLog
from algorithms.records.trackers import read_metrics
from algorithms.data.tasks import Example
from algorithms.runtime.steps import Steps
from algorithms.config.schema import LoopConfig
from orchestration.config import ConfigError
from tests.driver_helpers import TINY, TINY_GKD, prepared

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one intra-op thread


# ----------------------------------------------------------------------------- pieces

def fake_save(files=("config.json", "trainer_state.pt")):
    def write(folder: Path):
        folder.mkdir(parents=True, exist_ok=True)
        for name in files:
            (folder / name).write_text("x")
    return write


def test_checkpoints_are_renamed_when_complete_and_the_newest_k_kept(tmp_path):
    for step in (2, 4, 6):
        path = save_checkpoint(tmp_path, step, fake_save(), {"stream": step * 10}, keep_last=2)
        assert path.name == f"step_{step}" and not (tmp_path / "checkpoints" / f"step_{step}.tmp").exists()
    root = tmp_path / "checkpoints"
    assert [p.name for p in complete_checkpoints(root)] == ["step_4", "step_6"]
    assert (root / "latest").read_text() == "step_6"
    assert checkpoints.driver_state(root / "step_6") == {"step": 6, "stream": 60}


def test_half_written_and_incomplete_checkpoints_are_skipped_with_a_message(tmp_path):
    save_checkpoint(tmp_path, 2, fake_save(), {}, keep_last=0)
    root = tmp_path / "checkpoints"
    fake_save()(root / "step_4.tmp")  # a crash before the rename
    fake_save(("config.json",))(root / "step_6")  # a folder missing the trainer state
    (root / "step_8").mkdir()
    (root / "step_8" / "driver_state.json").write_text("{not json")
    for name in ("config.json", "trainer_state.pt"):
        (root / "step_8" / name).write_text("x")
    said = []
    assert find_resume(tmp_path, "auto", said.append) == root / "step_2"
    assert len(said) == 3 and any("step_4.tmp" in s and "half-written" in s for s in said)
    assert any("step_6" in s and "trainer_state.pt" in s for s in said) and any("step_8" in s for s in said)
    # Nothing to resume from: a fresh start, said once; unset: a fresh start, silently.
    said.clear()
    assert find_resume(tmp_path / "elsewhere", "auto", said.append) is None and len(said) == 1
    assert find_resume(tmp_path, None, said.append) is None and len(said) == 1
    with pytest.raises(ConfigError, match="run.resume.*missing.*trainer_state.pt"):
        find_resume(tmp_path, str(root / "step_6"))


def test_a_failed_write_leaves_the_previous_checkpoint_latest(tmp_path):
    save_checkpoint(tmp_path, 2, fake_save(), {}, keep_last=0)

    def crash(folder):
        fake_save()(folder)
        raise RuntimeError("rank 1 died while saving")

    with pytest.raises(RuntimeError):
        save_checkpoint(tmp_path, 4, crash, {}, keep_last=0)
    assert find_resume(tmp_path, "auto", lambda _: None).name == "step_2"
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_2"


def test_prompt_stream_skipping_k_batches_continues_exactly():
    examples = [Example(prompt=str(i), solution="", answer=str(i)) for i in range(7)]
    straight = PromptStream(examples, 3, seed=5)
    drawn = [[ex.prompt for ex in next(straight)] for _ in range(9)]  # crosses several epochs
    for k in (0, 2, 5):
        resumed = PromptStream(examples, 3, seed=5, skip=k)
        assert resumed.drawn == k
        assert [[ex.prompt for ex in next(resumed)] for _ in range(9 - k)] == drawn[k:]


def test_rewind_drops_the_lines_written_after_the_checkpoint(tmp_path):
    log = RunLog(tmp_path, 4, LoopConfig(), stream=open("/dev/null", "w"))
    for step in range(4):
        with log.phase("train", "train"):
            pass
        log.step(step, {"train/loss": float(step)})
    log.close()
    log = RunLog(tmp_path, 4, LoopConfig(), stream=open("/dev/null", "w"))
    assert log.rewind(1)["train/loss"] == 1.0
    log.step(2, {"train/loss": 20.0})
    log.close()
    assert [(r["step"], r["train/loss"]) for r in read_metrics(tmp_path / "metrics.jsonl")] == \
        [(0, 0.0), (1, 1.0), (2, 20.0)]
    assert {e["step"] for e in read_metrics(tmp_path / "timeline.jsonl")} == {0, 1}


# ----------------------------------------------------------------------------- stop and resume

class Interrupted(Exception):
    pass


def interrupt_after(monkeypatch, step: int):
    """Make the run die right after step `step`'s record is written (past its checkpoint's step)."""
    end_step = Steps.end_step

    def dying(self, s, metrics, state=None):
        record = end_step(self, s, metrics, state)
        if s == step:
            raise Interrupted(f"killed after step {s}")
        return record

    monkeypatch.setattr(Steps, "end_step", dying)


def comparable(records: list[dict]) -> list[dict]:
    """Records without what depends on the clock or the process (times, memory, bytes moved, remote
    calls) and the weight syncs' figures (a resumed run sends the loaded weights once more)."""
    return [{k: v for k, v in r.items()
             if not k.startswith(("time/", "mem/", "move/", "sync/", "calls/", "rollout/generate_s"))}
            for r in records]


def weights(checkpoint: str) -> dict:
    return load_file(str(Path(checkpoint) / "model.safetensors"))


CASES = {
    "sft": (sft, SFTConfig, ["+experiment=sft_quickstart", *TINY]),
    "grpo": (grpo, grpo.GRPOConfig, ["+experiment=grpo_quickstart", *TINY, "algorithm.num_generations=2",
                                        "algorithm.max_new_tokens=8", "algorithm.warmup_sft_steps=0",
                                        "algorithm.beta=0.04", "data.train_size=6"]),
    "gkd": (gkd, GKDConfig, ["+experiment=gkd_quickstart", *TINY_GKD, "algorithm.lmbda=0.5",
                                "algorithm.logits_topk=4"]),
    # Multi-turn: each step's trajectories (model turns, the environment's replies, its seeds and
    # rewards) are seeded by (run seed, step), so the resumed steps replay them.
    "grpo_multi_turn": (grpo, grpo.GRPOConfig, ["+experiment=grpo_quickstart", *TINY, "algorithm.num_generations=2",
                                                "algorithm.max_new_tokens=24", "algorithm.warmup_sft_steps=0",
                                                "data.train_size=6", "algorithm.multi_turn.scheduler=gym_scheduler",
                                                "algorithm.multi_turn.gym_env=arithmetic_retry",
                                                "algorithm.multi_turn.max_turns=2", "algorithm.multi_turn.max_turn_tokens=8"]),
    # LoRA: the adapter, its optimizer state and the RNG come back; GRPO's KL reference and GKD's
    # teacher are the trainer's own base (adapter off); GRPO's rollout takes adapter-only syncs.
    "sft_lora": (sft, SFTConfig, ["+experiment=sft_quickstart", *TINY, "trainer.lora.rank=4"]),
    "grpo_lora": (grpo, grpo.GRPOConfig, ["+experiment=grpo_quickstart", *TINY, "algorithm.num_generations=2",
                                          "algorithm.max_new_tokens=8", "algorithm.warmup_sft_steps=0",
                                          "algorithm.beta=0.04", "data.train_size=6", "trainer.lora.rank=4",
                                          "weight_sync.lora=adapter"]),
    "gkd_lora": (gkd, GKDConfig, ["+experiment=gkd_quickstart", *TINY, "algorithm.max_new_tokens=12",
                                  "placement.teacher_model=nano_qwen2", "teacher.warmup_steps=0",
                                  "algorithm.lmbda=0.5", "trainer.lora.rank=4"]),
}


def stop_and_resume(driver, schema, base, resume_overrides, tmp_path, monkeypatch):
    """(straight records, resumed records, straight record, resumed record): `base` run straight,
    and killed after step 3 then resumed with `resume_overrides` added."""
    _, typed, plan = prepared(schema, base)
    driver.validate(typed, plan)
    straight = driver.run(typed, plan, tmp_path / "straight")
    with monkeypatch.context() as m:
        interrupt_after(m, 3)
        with pytest.raises(Interrupted):
            driver.run(typed, plan, tmp_path / "resumed")
    assert [r["step"] for r in read_metrics(tmp_path / "resumed" / "metrics.jsonl")] == [0, 1, 2, 3]
    _, typed, plan = prepared(schema, base + ["run.resume=auto", *resume_overrides])
    driver.validate(typed, plan)
    resumed = driver.run(typed, plan, tmp_path / "resumed")
    want, got = (read_metrics(tmp_path / d / "metrics.jsonl") for d in ("straight", "resumed"))
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(6))
    return want, got, straight, resumed


@pytest.mark.parametrize("name", sorted(CASES))
def test_stop_and_resume_equals_a_straight_run(name, tmp_path, monkeypatch):
    """5 steps with a checkpoint every 2: straight, and killed after step 3 then resumed from
    step 2 (step 3's metrics, written after the checkpoint, are replaced)."""
    driver, schema, overrides = CASES[name]
    base = overrides + ["backend=local", "run.steps=5", "run.save_every=2", "run.eval_every=2",
                        f"teacher.cache_dir={tmp_path / 'teachers'}" if name.startswith("gkd") else "run.keep_last=0"]
    want, got, straight, resumed = stop_and_resume(driver, schema, base, [], tmp_path, monkeypatch)
    assert comparable(got) == comparable(want)
    if name == "grpo_multi_turn":  # trajectories with environment turns, replayed after the resume
        assert all(r["multi_turn/env_tokens"] > 0 for r in want if r["step"] >= 1)
    a, b = weights(straight["checkpoint"]), weights(resumed["checkpoint"])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    if name.endswith("_lora"):  # the adapter itself, as PEFT saved it
        a, b = (load_file(str(Path(r["checkpoint"]) / "adapter" / "adapter_model.safetensors")) for r in (straight, resumed))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # The resumed run continued from step 2's checkpoint, with its optimizer: step counts agree.
    state = torch.load(Path(resumed["checkpoint"]) / "trainer_state.pt", weights_only=True)
    assert state["step"] == 5
    # Resuming a finished run trains nothing and reports the last checkpoint.
    _, typed, plan = prepared(schema, base + ["run.resume=auto"])
    again = driver.run(typed, plan, tmp_path / "resumed")
    assert again["checkpoint"] == resumed["checkpoint"]
    assert len(read_metrics(tmp_path / "resumed" / "metrics.jsonl")) == 6
    assert json.loads((Path(resumed["checkpoint"]) / "driver_state.json").read_text())["step"] == 5


def test_an_interruption_between_the_checkpoint_and_its_line_loses_no_line(tmp_path, monkeypatch):
    """Killed after step 2's checkpoint was written but before step 2's record reached
    metrics.jsonl: the resumed run writes step 2's record from the checkpoint, every step once,
    and the records equal a straight run's."""
    driver, schema, overrides = CASES["sft"]
    base = overrides + ["backend=local", "run.steps=5", "run.save_every=2", "run.eval_every=2"]
    _, typed, plan = prepared(schema, base)
    straight = read_metrics(Path(driver.run(typed, plan, tmp_path / "straight")["checkpoint"]).parent.parent
                            / "metrics.jsonl")
    save = Steps.save

    def dying(self, step, state):
        path = save(self, step, state)
        if step == 2:
            raise Interrupted(f"killed after step {step}'s checkpoint")
        return path

    with monkeypatch.context() as m:
        m.setattr(Steps, "save", dying)
        with pytest.raises(Interrupted):
            driver.run(typed, plan, tmp_path / "resumed")
    assert [r["step"] for r in read_metrics(tmp_path / "resumed" / "metrics.jsonl")] == [0, 1]
    _, typed, plan = prepared(schema, base + ["run.resume=auto"])
    driver.run(typed, plan, tmp_path / "resumed")
    got = read_metrics(tmp_path / "resumed" / "metrics.jsonl")
    assert [r["step"] for r in got] == list(range(6))
    assert comparable(got) == comparable(straight)
    assert "eval/accuracy" in got[2] and "train/loss" in got[2]


def test_distill_resumes_its_sampling_and_then_the_sft_phase(tmp_path, monkeypatch):
    """Killed after sampling step 3's record (its state not yet written), resumed: the same kept
    rows and sampling metrics as a straight run; then the SFT phase runs once."""
    from algorithms import distill
    from tests.test_distill import DEVICE_GROUPS, tiny_config

    def config(**run):
        cfg = tiny_config({"device_groups": DEVICE_GROUPS}, sft_steps=2)
        cfg["run"].update(steps=4, **run)
        typed, plan = prepare({**cfg, "backend": {"workers": "local"}}, distill.DistillConfig)
        distill.validate(typed, plan)
        return typed, plan

    straight = distill.run(*config(), tmp_path / "straight")
    step = RunLog.step

    def dying(self, s, metrics, quiet=False):
        record = step(self, s, metrics, quiet)
        if s == 3 and self.dir == tmp_path / "resumed":
            raise Interrupted("killed after sampling step 3")
        return record

    with monkeypatch.context() as m:
        m.setattr(RunLog, "step", dying)
        with pytest.raises(Interrupted):
            distill.run(*config(), tmp_path / "resumed")
    assert json.loads((tmp_path / "resumed" / "sampling_state.json").read_text())["step"] == 2
    resumed = distill.run(*config(resume="auto"), tmp_path / "resumed")
    rows = [(tmp_path / d / "sampled.jsonl").read_text() for d in ("straight", "resumed")]
    assert rows[0] == rows[1] and rows[0].count("\n") == straight["total/kept"] == resumed["total/kept"]
    want, got = (read_metrics(tmp_path / d / "metrics.jsonl") for d in ("straight", "resumed"))
    assert comparable(got) == comparable(want) and [r["step"] for r in got] == list(range(5))
    assert resumed["sft/eval_accuracy"] == straight["sft/eval_accuracy"]
    # Once more: sampling and SFT had finished, nothing runs again.
    again = distill.run(*config(resume="auto"), tmp_path / "resumed")
    assert again["sft/checkpoint"] == resumed["sft/checkpoint"]
    assert len(read_metrics(tmp_path / "resumed" / "sft" / "metrics.jsonl")) == 3


def test_a_killed_cli_run_resumes_in_its_hydra_directory(tmp_path):
    """The documented way: SIGKILL the driver after a checkpoint, then the same command with
    run.resume=auto and hydra.run.dir=<the old run>: metrics.jsonl holds every step once."""
    import os
    import signal
    import subprocess
    import sys
    import time

    steps, run_dir = 16, tmp_path / "run"
    cmd = [sys.executable, "-m", "algorithms.sft", "+experiment=sft_quickstart", "backend=local", *TINY,
           f"run.steps={steps}", "run.save_every=4", "run.keep_last=2", f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    repo = Path(__file__).resolve().parent.parent
    proc = subprocess.Popen(cmd, cwd=repo, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    latest, deadline = run_dir / "checkpoints" / "latest", time.monotonic() + 300
    while not latest.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    killed_at = [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")]
    assert killed_at[-1] < steps
    done = subprocess.run(cmd + ["run.resume=auto"], cwd=repo, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from" in done.stdout
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == list(range(steps + 1))
    kept = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    assert kept == [f"step_{steps - 4}", f"step_{steps}"]  # keep_last=2


# Sharded engines' save and reload, continuing as they went on before: DeepSpeed in
# tests/test_deepspeed_engine.py::test_zero_two_ranks_match_the_torch_engine, Megatron TP=2 in
# tests/test_megatron_engine.py::test_tensor_parallel_ranks_match_the_torch_engine.
# In CI: every driver's stop and resume in process (test_stop_and_resume_equals_a_straight_run).
@pytest.mark.slow
def test_a_colocated_grpo_run_resumes_on_separate_devices(ray_cluster, tmp_path, monkeypatch):
    """Placement may change between the interruption and the resume (same rank counts): the
    resumed run on separate devices equals the colocated straight run."""
    _, _, overrides = CASES["grpo"]
    base = [*overrides, "run.steps=5", "run.save_every=2", "run.eval_every=0", "algorithm.beta=0.0"]
    separate = ["placement.colocate_groups=null", "placement.offload_model=false",
                "placement.offload_optimizer=false", "placement.sleep_level=0"]
    want, got, straight, resumed = stop_and_resume(grpo, grpo.GRPOConfig, base, separate, tmp_path, monkeypatch)
    assert comparable(got) == comparable(want)
    a, b = weights(straight["checkpoint"]), weights(resumed["checkpoint"])
    assert all(torch.equal(a[k], b[k]) for k in a)
