"""Pictures of a run: curves.png with the curves the run logged, timeline.png, and the
timeline as Chrome trace events that tracing tools read."""
import json

from algorithms.records.plots import CURVES, chrome_trace, write_run_pictures
from algorithms.records.runlog import RunLog
from algorithms.config.schema import LoopConfig


def fake_run(tmp_path, keys):
    log = RunLog(tmp_path, 4, LoopConfig(), stream=open("/dev/null", "w"))
    for step in range(5):
        with log.phase("generate", "rollout"):
            pass
        with log.phase("train", "train"):
            pass
        log.step(step, {k: 0.1 * step for k in keys} if step else {"eval/accuracy": 0.0})
    log.close()


def test_a_run_gets_curves_a_timeline_and_a_trace(tmp_path):
    from PIL import Image

    fake_run(tmp_path, ["reward/mean", "train/loss", "train/kl", "rollout/completion_length"])
    written = {p.name for p in write_run_pictures(tmp_path)}
    assert written == {"curves.png", "timeline.png", "trace.json"}
    # Five panels (reward, accuracy, loss, KL, length) in a grid 3 wide and 2 high.
    assert Image.open(tmp_path / "curves.png").size == (int(4.2 * 3 * 80), int(2.8 * 2 * 80))
    assert Image.open(tmp_path / "timeline.png").size[0] == 720
    trace = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    tracks = {e["args"]["name"]: e["tid"] for e in trace if e["ph"] == "M"}
    assert set(tracks) == {"rollout", "train"}
    slices = [e for e in trace if e["ph"] == "X"]
    assert len(slices) == 10 and {e["name"] for e in slices} == {"generate", "train"}
    assert all(e["tid"] == tracks[e["cat"]] and e["dur"] >= 0 and isinstance(e["ts"], int) for e in slices)


def test_no_curve_no_picture(tmp_path):
    fake_run(tmp_path, ["time/x"])
    names = {p.name for p in write_run_pictures(tmp_path)}
    assert "curves.png" in names  # eval/accuracy at step 0 is a curve
    fake_run(tmp_path / "none", [])
    (tmp_path / "none" / "metrics.jsonl").write_text('{"step": 0, "time/step_wall": 0.1}\n')
    assert "curves.png" not in {p.name for p in write_run_pictures(tmp_path / "none")}


def test_chrome_trace_times_are_microseconds():
    events = [{"step": 1, "role": "train", "phase": "train", "start": 0.5, "end": 1.25}]
    (meta, span) = chrome_trace(events)["traceEvents"]
    assert meta["ph"] == "M" and (span["ts"], span["dur"]) == (500000, 750000)
    assert {k for _, keys in CURVES for k in keys} >= {"reward/mean", "train/loss", "train/kl", "train/entropy"}
