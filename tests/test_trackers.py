"""Trackers chosen by run.loggers (metrics.jsonl, TensorBoard, offline W&B, MLflow) fed by one
record per step, SFT phases inside a run feeding the run's trackers, and the progress output: a
bar on a terminal, a line with every metric every run.log_every steps and at the first and last
step."""
import io
import re
from pathlib import Path

import pytest

from algorithms import gkd, sft
from algorithms.gkd import GKDConfig
from algorithms.config.schema import LoopConfig
from algorithms.sft import SFTConfig
from algorithms.records.runlog import RunLog
from algorithms.records.trackers import read_metrics
from algorithms.config.checks import check_loggers
from algorithms.records.trackers import numeric
from orchestration.config import ConfigError
from tests.driver_helpers import TINY, TINY_GKD, prepared

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one intra-op thread


def scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series of the TensorBoard event files in `folder`: {tag: [(step, value)]}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def with_run(**run) -> SFTConfig:
    return SFTConfig(run=LoopConfig(**run))


def series_of(records: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """The numeric series of metrics.jsonl records: {metric: [(step, value)]}."""
    want: dict[str, list] = {}
    for r in records:
        for key, value in numeric(r).items():
            want.setdefault(key, []).append((r["step"], value))
    return want


def test_tiny_sft_run_writes_tensorboard_an_offline_wandb_run_and_mlflow(tmp_path, monkeypatch):
    """A local 3-step SFT run with every tracker: the TensorBoard scalars and the MLflow metrics
    are metrics.jsonl's numbers, step for step; the offline W&B run folder holds the run's
    records; the MLflow run has the run's name, flattened config and tags."""
    monkeypatch.delenv("WANDB_MODE", raising=False)  # the tracker sets offline itself
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg, typed, plan = prepared(SFTConfig, ["+experiment=sft_quickstart", *TINY, "backend=local",
                                               "run.loggers=[jsonl,tensorboard,wandb,mlflow]", "run.name=tiny-sft",
                                               "run.tags=[tiny,ci]", "run.save_final=false"])
    sft.validate(typed, plan)
    sft.run(typed, plan, tmp_path / "run")

    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    series = scalars(tmp_path / "run" / "tensorboard" / "tiny-sft")
    want = series_of(records)
    assert set(series) == set(want) and "train/loss" in series and "eval/accuracy" in series
    for key, points in want.items():  # TensorBoard keeps float32
        assert [s for s, _ in series[key]] == [s for s, _ in points], key
        assert [v for _, v in series[key]] == pytest.approx([v for _, v in points], rel=1e-6, abs=1e-6), key

    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    run_id = (tmp_path / "run" / "wandb" / "run_id").read_text()
    data = (runs[0] / f"run-{run_id}.wandb").read_bytes()
    assert (runs[0] / "files").is_dir() and (runs[0] / "logs").is_dir()
    # Keys, name, tags and config values are stored as plain strings in the run's records.
    for text in (b"train/loss", b"eval/accuracy", b"tiny-sft", b"tiny", b"prompts_per_step"):
        assert text in data, text
    assert b"checkpoints/step_" not in data  # no string (the record's checkpoint path) goes to numeric streams

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'run' / 'mlflow.db'}")
    [run] = client.search_runs([client.get_experiment_by_name("rayroles").experiment_id])
    assert run.info.run_id == (tmp_path / "run" / "mlflow_run_id").read_text()
    assert run.info.run_name == "tiny-sft" and run.info.status == "FINISHED"
    assert {"tiny", "ci"} <= set(run.data.tags)
    assert run.data.params["run.prompts_per_step"] == "4" and run.data.params["model.arch"] == typed.model.arch
    assert set(run.data.metrics) == set(want)
    for key, points in want.items():
        history = client.get_metric_history(run.info.run_id, key)
        assert [m.step for m in history] == [s for s, _ in points], key
        assert [m.value for m in history] == pytest.approx([v for _, v in points]), key


def test_a_teacher_warm_up_inside_a_gkd_run_feeds_the_runs_trackers(tmp_path):
    """GKD's teacher SFT, a phase of the run: a TensorBoard run of its own named
    <run name>/teacher_warmup in its folder, with metrics.jsonl's numbers."""
    _, typed, _ = prepared(GKDConfig, ["+experiment=gkd_quickstart", *TINY_GKD, "backend=local",
                                          f"teacher.cache_dir={tmp_path / 'teachers'}", "run.name=tiny-gkd",
                                          "run.loggers=[jsonl,tensorboard]"])
    gkd.warm_teacher(typed, tmp_path / "run")
    phase = tmp_path / "run" / "teacher_warmup"
    records = read_metrics(phase / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    series = scalars(phase / "tensorboard" / "tiny-gkd" / "teacher_warmup")
    assert "train/loss" in series
    want = series_of(records)["train/loss"]
    assert [s for s, _ in series["train/loss"]] == [s for s, _ in want] == [1, 2]
    assert [v for _, v in series["train/loss"]] == pytest.approx([v for _, v in want], rel=1e-6)


def test_resumed_run_replaces_the_later_steps_in_tensorboard(tmp_path):
    cfg = with_run(loggers=["jsonl", "tensorboard"], name="r")
    log = RunLog(tmp_path, 4, cfg.run, stream=io.StringIO(), resolved_config=cfg)
    for step in range(4):
        log.step(step, {"train/loss": float(step), "checkpoint": "/x"})
    log.close()
    log = RunLog(tmp_path, 4, cfg.run, stream=io.StringIO(), resolved_config=cfg)
    assert log.rewind(1)["train/loss"] == 1.0
    log.step(2, {"train/loss": 20.0})
    log.close()
    assert scalars(tmp_path / "tensorboard" / "r")["train/loss"] == [(0, 0.0), (1, 1.0), (2, 20.0)]
    assert [r["train/loss"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0.0, 1.0, 20.0]


@pytest.mark.parametrize("loggers, says", [
    (["jsonl", "comet"], "config key 'run.loggers'=['jsonl', 'comet'] names an unknown logger 'comet'. Fix: list some of "
                         "['jsonl', 'tensorboard', 'wandb', 'mlflow', 'swanlab'], e.g. run.loggers=[jsonl,tensorboard]"),
    (["tensorboard"], "config key 'run.loggers'=['tensorboard'] leaves out jsonl"),
    (["jsonl", "jsonl"], "config key 'run.loggers'=['jsonl', 'jsonl'] names a logger twice. Fix: list each"),
])
def test_bad_logger_lists_are_refused_in_one_line(tmp_path, loggers, says):
    with pytest.raises(ConfigError) as refused:
        check_loggers(with_run(loggers=loggers).run.loggers)
    assert str(refused.value).startswith(says) and "\n" not in str(refused.value)
    assert not (tmp_path / "metrics.jsonl").exists()  # refused before anything is written


def test_a_tracker_without_its_package_names_the_key_and_the_package(monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    with pytest.raises(ConfigError, match=r"^config key 'run.loggers'=\['jsonl', 'wandb'\] needs the Python package "
                                          r"'wandb', which is not installed. Fix: pip install .*wandb"):
        check_loggers(["jsonl", "wandb"])


def test_unknown_logger_in_a_driver_run_is_refused_before_it_starts(tmp_path):
    _, typed, plan = prepared(SFTConfig, ["+experiment=sft_quickstart", *TINY, "backend=local",
                                             "run.loggers=[jsonl,comet]"])
    with pytest.raises(ConfigError, match="run.loggers.*comet"):
        sft.validate(typed, plan)


class Terminal(io.StringIO):
    def isatty(self):
        return True


def progress(out_dir: Path, stream, steps: int, log_every: int) -> str:
    log = RunLog(out_dir, steps, with_run(log_every=log_every).run, stream=stream, resolved_config=with_run(log_every=log_every))
    for step in range(steps + 1):
        log.step(step, {"train/loss": 1.0 / (step + 1), "train/tokens": 7})
    log.close()
    return stream.getvalue()


def test_without_a_terminal_only_the_periodic_lines_are_printed(tmp_path):
    lines = progress(tmp_path, io.StringIO(), 25, 10).splitlines()
    assert [re.match(r"\[\s*(\d+)/25\]", line).group(1) for line in lines] == ["0", "10", "20", "25"]
    assert "train/loss=0.09091" in lines[1] and "eta" in lines[1] and "tokens" not in lines[1]


def test_on_a_terminal_a_bar_with_the_lines_above_it(tmp_path):
    out = progress(tmp_path, Terminal(), 4, 0)
    assert "4/4" in out and "loss=" in out and re.search(r"(step/s|s/step)", out)
    printed = [line for line in re.split(r"[\r\n]", out) if re.match(r"\[\d/4\]", line)]
    assert [line[:5] for line in printed] == ["[0/4]", "[4/4]"]


def test_a_resumed_run_prints_its_first_step(tmp_path):
    log = RunLog(tmp_path, 30, with_run(log_every=10).run, stream=io.StringIO(), resolved_config=with_run(log_every=10))
    for step in range(4):
        log.step(step, {"train/loss": 1.0})
    log.close()
    stream = io.StringIO()
    log = RunLog(tmp_path, 30, with_run(log_every=10).run, stream=stream, resolved_config=with_run(log_every=10))
    log.rewind(2)
    for step in range(3, 12):
        log.step(step, {"train/loss": 1.0})
    log.close()
    assert [line.split("]")[0] for line in stream.getvalue().splitlines()] == ["[ 3/30", "[10/30"]
