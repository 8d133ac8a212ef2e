"""Python logging of the drivers and roles: their messages reach the log files of the root logger
(a Hydra app's <run dir>/<job name>.log) with the periodic metrics lines, at the level of
run.log_level, in the driver and in its Ray workers; a bad level is refused naming the key."""
import logging
import os
import subprocess
import sys

import pytest

from algorithms import sft
from algorithms.sft import SFTConfig
from algorithms.records.trackers import read_metrics
from algorithms.config.schema import LoopConfig
from orchestration.cluster import set_log_level
from orchestration.config import ConfigError
from orchestration.planner import make_plan
from tests.driver_helpers import REPO, TINY, prepared

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one intra-op thread


@pytest.fixture
def log_file(tmp_path):
    """A file handler on the root logger, as Hydra's job log is; the level set back after."""
    path = tmp_path / "job.log"
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("[%(name)s][%(levelname)s] - %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    yield path
    root.removeHandler(handler)
    handler.close()
    set_log_level("INFO")


def tiny_sft(tmp_path, *overrides):
    cfg, typed, plan = prepared(SFTConfig, ["+experiment=sft_quickstart", *TINY, "backend=local",
                                               "run.save_final=false", *overrides])
    sft.validate(typed, plan)
    return sft.run(typed, plan, tmp_path / "run")


def test_sft_messages_and_metrics_lines_reach_the_log_file(tmp_path, log_file, capsys):
    """The driver's start line is a record of algorithms.sft; the metrics lines printed on the
    console every run.log_every steps (and at the first and last) are in the file too."""
    tiny_sft(tmp_path, "run.log_every=2")
    lines = log_file.read_text().splitlines()
    assert any(line.startswith("[algorithms.sft][INFO] - sft: 50 train / 3 held-out examples; 3 steps x 4 sequences")
               for line in lines), lines
    metrics = [line for line in lines if line.startswith("[algorithms.records.runlog][INFO] - [")]
    assert [line.split(" - ")[1][:5] for line in metrics] == ["[0/3]", "[2/3]", "[3/3]"]
    last = read_metrics(tmp_path / "run" / "metrics.jsonl")[-1]
    assert f"train/loss={last['train/loss']:.4g}" in metrics[-1]
    # The console shows the start line (plainly, as print did) and each metrics line once.
    out = capsys.readouterr().out.splitlines()
    assert sum(line.startswith("sft: 50 train") for line in out) == 1
    assert [line[:5] for line in out if line.startswith("[")] == ["[0/3]", "[2/3]", "[3/3]"]


def test_log_level_warning_hides_the_info_lines(tmp_path, log_file, capsys):
    tiny_sft(tmp_path, "run.log_level=WARNING")
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [0, 1, 2, 3]
    assert "sft:" not in log_file.read_text() and "[3/3]" not in log_file.read_text()
    out = capsys.readouterr().out
    assert "sft:" not in out and "[3/3]" in out  # the progress on the console stays
    assert logging.getLogger("algorithms.sft").getEffectiveLevel() == logging.WARNING
    logging.getLogger("algorithms.sft").warning("still shown")
    assert "[algorithms.sft][WARNING] - still shown" in log_file.read_text()


@pytest.mark.parametrize("level", ["LOUD", "warn", ""])
def test_a_bad_log_level_is_refused_naming_the_key(tmp_path, level):
    with pytest.raises(ConfigError) as refused:
        tiny_sft(tmp_path, f"run.log_level='{level}'")
    assert str(refused.value) == (f"config key 'run.log_level'={level!r} is not a log level. "
                                  "Fix: set run.log_level to one of DEBUG, INFO, WARNING, ERROR")
    assert not (tmp_path / "run").exists()  # refused before anything starts


def test_third_party_info_stays_hidden_where_the_project_logs_at_debug(log_file):
    root = logging.getLogger()
    root.setLevel(logging.INFO)  # what Hydra's job logging sets
    set_log_level("debug")
    logging.getLogger("algorithms.grpo").debug("project detail")
    logging.getLogger("urllib3.connectionpool").info("third-party chatter")
    text = log_file.read_text()
    assert "project detail" in text and "third-party chatter" not in text
    assert root.level == logging.WARNING


class LevelProbe:
    """A role that reports its process's logging setup."""

    def levels(self) -> dict:
        from orchestration.cluster import _Print

        project = logging.getLogger("roles")
        return {"pid": os.getpid(), "roles": logging.getLogger("roles.trainer").getEffectiveLevel(),
                "algorithms": logging.getLogger("algorithms.common").getEffectiveLevel(),
                "printed": any(isinstance(h, _Print) for h in project.handlers)}


# One level other than the default INFO shows the ranks take the run's: ERROR went the same way
# (set_log_level's variable, read by every rank at start).
@pytest.mark.parametrize("level", ["DEBUG"])
def test_ray_workers_log_at_the_runs_level(ray_cluster, level):
    from orchestration.placement import create_placement
    from orchestration.worker_group import WorkerGroup

    set_log_level(level)
    plan = make_plan({"train": {"gpus": 1}})
    placement = create_placement(plan, timeout_s=30)
    group = WorkerGroup(LevelProbe, plan["train"], placement=placement)
    try:
        ranks = group.call("levels")
    finally:
        group.shutdown()
        placement.remove()
        set_log_level("INFO")
    assert len(ranks) == 1 and all(r["pid"] != os.getpid() for r in ranks)
    want = getattr(logging, level)
    # A worker's root logger has no console handler: records are printed (Ray prefixes the rank).
    assert ranks == [{"pid": r["pid"], "roles": want, "algorithms": want, "printed": True} for r in ranks]


@pytest.mark.slow  # in CI: the driver's log file in process (test_sft_messages_and_metrics_lines_reach_the_log_file)
def test_cli_run_writes_its_messages_to_the_hydra_job_log(tmp_path):
    """The documented command: <run dir>/sft.log holds the driver's lines and the metrics lines;
    the console shows the metrics lines without Hydra's prefix."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "algorithms.sft", "+experiment=sft_quickstart", "backend=local", *TINY,
           "run.save_final=false", f"hydra.run.dir={run_dir}"]
    done = subprocess.run(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    log = (run_dir / "sft.log").read_text()
    assert "[algorithms.sft][INFO] - sft: 50 train / 3 held-out examples" in log
    assert "[algorithms.records.runlog][INFO] - [0/3]" in log and "[algorithms.records.runlog][INFO] - [3/3]" in log
    assert [line[:5] for line in done.stdout.splitlines() if line.startswith("[") and "/3]" in line[:6]] == \
        ["[0/3]", "[3/3]"]


def test_a_metrics_line_shows_a_negative_zero_as_zero(tmp_path):
    """A mean of values that sum to 0 can come out -0.0 (GRPO's advantages/mean): shown as 0."""
    import io

    from algorithms.records.runlog import RunLog

    stream = io.StringIO()
    log = RunLog(tmp_path, 1, LoopConfig(), stream=stream)
    log.step(1, {"advantages/mean": -0.0, "advantages/min": -2.5})
    line = stream.getvalue()
    assert "advantages/mean=0 " in line + " " and "advantages/min=-2.5" in line
