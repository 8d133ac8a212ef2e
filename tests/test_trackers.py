"""Trackers chosen by run.loggers (metrics.jsonl, TensorBoard, offline W&B) fed by one record
per step, and the progress output: a bar on a terminal, a line with every metric every
run.log_every steps and at the first and last step."""
import io
import re
from pathlib import Path

import pytest

from algorithms import sft
from algorithms.config import LoopConfig, SFTRunConfig
from algorithms.runlog import RunLog, read_metrics
from algorithms.trackers import check_loggers, numeric
from orchestration.config import ConfigError
from tests.driver_helpers import TINY, prepared

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one intra-op thread


def scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series of the TensorBoard event files in `folder`: {tag: [(step, value)]}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def with_run(**run) -> SFTRunConfig:
    return SFTRunConfig(run=LoopConfig(**run))


def test_tiny_sft_run_writes_tensorboard_and_an_offline_wandb_run(tmp_path, monkeypatch):
    """A local 3-step SFT run with every tracker: the TensorBoard scalars are metrics.jsonl's
    numbers, step for step; the offline W&B run folder holds the run's records."""
    monkeypatch.delenv("WANDB_MODE", raising=False)  # the tracker sets offline itself
    cfg, typed, plan = prepared(SFTRunConfig, ["+experiment=sft_quickstart", *TINY, "backend=local",
                                               "run.loggers=[jsonl,tensorboard,wandb]", "run.name=tiny-sft",
                                               "run.tags=[tiny,ci]", "run.save_final=false"])
    sft.validate(typed, plan)
    sft.run(typed, plan, tmp_path / "run", resolved=cfg)

    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    series = scalars(tmp_path / "run" / "tensorboard" / "tiny-sft")
    want: dict[str, list] = {}
    for r in records:
        for key, value in numeric(r).items():
            want.setdefault(key, []).append((r["step"], value))
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
    assert b"checkpoint" not in data  # no string goes to numeric streams


def test_resumed_run_replaces_the_later_steps_in_tensorboard(tmp_path):
    cfg = with_run(loggers=["jsonl", "tensorboard"], name="r")
    log = RunLog(tmp_path, 4, stream=io.StringIO(), cfg=cfg)
    for step in range(4):
        log.step(step, {"train/loss": float(step), "checkpoint": "/x"})
    log.close()
    log = RunLog(tmp_path, 4, stream=io.StringIO(), cfg=cfg)
    assert log.rewind(1)["train/loss"] == 1.0
    log.step(2, {"train/loss": 20.0})
    log.close()
    assert scalars(tmp_path / "tensorboard" / "r")["train/loss"] == [(0, 0.0), (1, 1.0), (2, 20.0)]
    assert [r["train/loss"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0.0, 1.0, 20.0]


@pytest.mark.parametrize("loggers, says", [
    (["jsonl", "comet"], "config key 'run.loggers'=['jsonl', 'comet'] names an unknown logger 'comet'. Fix: list some of "
                         "['jsonl', 'tensorboard', 'wandb'], e.g. run.loggers=[jsonl,tensorboard]"),
    (["tensorboard"], "config key 'run.loggers'=['tensorboard'] leaves out jsonl"),
    (["jsonl", "jsonl"], "config key 'run.loggers'=['jsonl', 'jsonl'] names a logger twice. Fix: list each"),
])
def test_bad_logger_lists_are_refused_in_one_line(tmp_path, loggers, says):
    with pytest.raises(ConfigError) as refused:
        RunLog(tmp_path, 2, stream=io.StringIO(), cfg=with_run(loggers=loggers))
    assert str(refused.value).startswith(says) and "\n" not in str(refused.value)
    assert not (tmp_path / "metrics.jsonl").exists()  # refused before anything is written


def test_a_tracker_without_its_package_names_the_key_and_the_package(monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    with pytest.raises(ConfigError, match=r"^config key 'run.loggers'=\['jsonl', 'wandb'\] needs the Python package "
                                          r"'wandb', which is not installed. Fix: pip install .*wandb"):
        check_loggers(["jsonl", "wandb"])


def test_unknown_logger_in_a_driver_run_is_refused(tmp_path):
    _, typed, plan = prepared(SFTRunConfig, ["+experiment=sft_quickstart", *TINY, "backend=local",
                                             "run.loggers=[jsonl,comet]"])
    with pytest.raises(ConfigError, match="run.loggers.*comet"):
        sft.run(typed, plan, tmp_path / "run")


class Terminal(io.StringIO):
    def isatty(self):
        return True


def progress(out_dir: Path, stream, steps: int, log_every: int) -> str:
    log = RunLog(out_dir, steps, stream=stream, cfg=with_run(log_every=log_every))
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
    log = RunLog(tmp_path, 30, stream=io.StringIO(), cfg=with_run(log_every=10))
    for step in range(4):
        log.step(step, {"train/loss": 1.0})
    log.close()
    stream = io.StringIO()
    log = RunLog(tmp_path, 30, stream=stream, cfg=with_run(log_every=10))
    log.rewind(2)
    for step in range(3, 12):
        log.step(step, {"train/loss": 1.0})
    log.close()
    assert [line.split("]")[0] for line in stream.getvalue().splitlines()] == ["[ 3/30", "[10/30"]
