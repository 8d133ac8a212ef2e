"""GKD with a teacher on devices of its own scoring the next off-policy batch while the student
trains (algorithm.score_ahead): the call made ahead, its failure, and a train step failing while
it is in flight, on Ray with real roles."""
import pytest

from algorithms import gkd
from algorithms.gkd import GKDConfig
from algorithms.records.trackers import read_metrics
from tests.driver_helpers import TINY_GKD, MarkedLog, prepared

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one intra-op thread


def test_a_teacher_call_made_ahead_that_failed_is_raised_naming_the_teacher_when_read(tmp_path):
    """A call made ahead returns at once; its failure comes when the next step reads the answer,
    as the teacher's own error. `ahead` with `keep` is refused."""
    from algorithms.runtime.steps import Steps
    from orchestration.base_group import GroupFuture, WorkerError
    from orchestration.config import WeightSyncConfig

    class Group:
        def after(self, futures):
            pass

        def defer(self, *a):
            pass

        def then(self, *a):
            pass

        def drop_deferred(self):
            return True

        def async_call(self, method, *args, **kwargs):
            def failed(timeout):
                raise WorkerError("teacher", 1, method, "RuntimeError: out of memory")
            return GroupFuture(failed)

    typed, plan = prepared(GKDConfig, TINY_GKD)[1:]
    turns = Steps(plan, {"train": Group(), "teacher": Group()}, typed.run, WeightSyncConfig(),
                  MarkedLog(tmp_path, 3, []), []).turns
    future = turns.call("teacher", "logits", "a batch", 4, phase="teacher", ahead=True)
    with pytest.raises(WorkerError, match=r"teacher rank 1 failed in logits\(\): RuntimeError: out of memory"):
        future.get()
    with pytest.raises(ValueError, match="ahead=True with keep='t'"):
        turns.call("teacher", "logits", "a batch", 4, keep="t", ahead=True)


def teacher_group(tmp_path, ray_cluster) -> list[str]:
    """The quickstart with a tiny top-k teacher in a group of its own, on the test cluster."""
    return ["+experiment=gkd_quickstart", *TINY_GKD, f"teacher.cache_dir={tmp_path / 'teachers'}",
            "algorithm.logits_topk=4", "placement.teacher_model=null", "placement.offload_teacher_model=false",
            "placement.teacher.gpus=1", "placement.teacher.model=tiny_llama",
            "placement.teacher_in_trainer_process=false", f"cluster.address={ray_cluster.address}"]


def test_a_teacher_on_devices_of_its_own_scores_the_next_batch_while_the_student_trains(ray_cluster, tmp_path):
    """On Ray with the teacher in a group of its own: an off-policy step after a step with nothing
    else to do (no eval, save or generation between) had its batch scored during the previous
    step's train call, and the run computes what backend=local computes."""
    base = teacher_group(tmp_path, ray_cluster) + ["run.steps=6", "algorithm.lmbda=0.5"]
    records = {}
    for backend in ("local", "ray"):
        _, typed, plan = prepared(GKDConfig, base + [f"backend.workers={backend}"])
        gkd.validate(typed, plan)
        gkd.run(typed, plan, tmp_path / backend)
        records[backend] = read_metrics(tmp_path / backend / "metrics.jsonl")
    assert plan["teacher"].colocated_with == ()
    for local, ray in zip(records["local"], records["ray"], strict=True):
        key = "train/loss" if local["step"] else "eval/accuracy"
        assert ray[key] == pytest.approx(local[key], rel=1e-5), local["step"]
    # Eval comes at steps 0 and 6 only: every off-policy step after step 1 was scored ahead.
    ray = records["ray"][1:]
    assert [r["gkd/scored_ahead"] for r in ray] == [0.0] + [1.0 - r["gkd/on_policy"] for r in ray[1:]]
    assert 0 < sum(r["gkd/scored_ahead"] for r in ray) < len(ray) - 1  # both kinds of step ran
    assert not any("gkd/scored_ahead" in r for r in records["local"])  # a layout that cannot: no metric
    # The teacher's own work is on the timeline of every step, those scored ahead included.
    teacher = {e["step"] for e in read_metrics(tmp_path / "ray" / "timeline.jsonl") if e["role"] == "teacher"}
    assert teacher >= set(range(1, 7))


def test_a_train_step_failing_while_the_next_batch_is_scored_ahead_is_raised_and_leaves_nothing_waiting(
        ray_cluster, tmp_path, monkeypatch):
    """Step 2's train call fails while the teacher (on devices of its own) is still scoring step
    3's batch (a call that would take a minute): the run raises the trainer's error, naming role,
    rank and method, at once, and the thread watching the teacher's call ends as the roles shut
    down, long before that call would."""
    import threading
    import time

    from algorithms.runtime.turns import Turns
    from orchestration.base_group import WorkerError
    from tests.failing_roles import TeacherStallingAtCall3, TrainerFailingAtStep2

    def watching():
        return {t for t in threading.enumerate() if getattr(getattr(t, "_target", None), "__qualname__", "")
                == "Pending._watch"}
    before = watching()
    monkeypatch.setattr(gkd, "Trainer", TrainerFailingAtStep2)
    monkeypatch.setattr(gkd, "Teacher", TeacherStallingAtCall3)
    sent_ahead, call = [], Turns.call

    def spied(self, role, method, *a, ahead=False, **k):
        sent_ahead.append(ahead)
        return call(self, role, method, *a, ahead=ahead, **k)
    monkeypatch.setattr(Turns, "call", spied)
    args = teacher_group(tmp_path, ray_cluster) + ["run.steps=4", "run.eval_every=0", "algorithm.lmbda=0",
                                                   "backend.workers=ray"]
    _, typed, plan = prepared(GKDConfig, args)
    gkd.validate(typed, plan)
    with pytest.raises(WorkerError, match=r"train rank 0 failed in \S*train_step\S*\(\): RuntimeError: step 2 broke"):
        gkd.run(typed, plan, tmp_path / "run")
    raised = time.monotonic()
    assert sent_ahead.count(True) == 2  # steps 2 and 3: step 3's was in flight when step 2 failed
    while watching() - before and time.monotonic() < raised + 30:
        time.sleep(0.2)
    assert not watching() - before
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records if r["step"]] == [1]  # step 1 ran (and sent step 2's scoring ahead)
