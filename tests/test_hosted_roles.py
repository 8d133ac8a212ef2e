"""A role built in another role's processes (placement.teacher_in_trainer_process): its ranks are
the host's processes, an answer a call keeps there feeds the host's next call without passing
through the driver, Turns sends the two calls back to back, and a GKD run so computes what the
in-process run does."""
import os

import pytest
import torch

from orchestration.base_group import CALLS, Kept, WorkerError
from orchestration.local import LocalWorkerGroup
from orchestration.plan import format_table
from orchestration.planner import PlanError, as_started, make_plan
from orchestration.transport import resolve_kept
from roles.batch import Batch

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one intra-op thread


class Keeper:
    """Teacher-like: logits as a tuple, an onload and offload that report bytes."""

    def onload(self):
        return {"model_bytes": 3}

    def offload(self):
        return {"model_bytes": 5, "seconds": 0.0}

    def logits(self, batch, scale):
        return batch.input_ids.float() * scale, batch.input_ids + 1

    def fail(self, batch):
        raise ValueError("the teacher cannot")

    def pid(self):
        return os.getpid()


class Taker:
    """Trainer-like: what it receives in the batch's teacher fields."""

    def onload(self):
        return {}

    def offload(self, model: bool = True, optimizer: bool = False):
        return {"model_bytes": 0, "seconds": 0.0}

    def train_step(self, batch):
        return {"rows": len(batch), "logprobs": batch.teacher_logprobs.tolist(),
                "indices": batch.teacher_indices.tolist()}

    def fail(self, batch):
        raise RuntimeError("the trainer cannot")

    def pid(self):
        return os.getpid()


def batch_of(rows: int) -> Batch:
    ids = torch.arange(rows * 2).reshape(rows, 2)
    return Batch(input_ids=ids, attention_mask=torch.ones_like(ids), loss_mask=torch.ones(rows, 2))


@pytest.mark.parametrize("args, kwargs, kept, want, used", [
    ((Kept("t"), 1), {}, {"t": "A"}, (("A", 1), {}), {"t"}),
    ((), {"x": Kept("t", 1)}, {"t": ("A", "B")}, ((), {"x": "B"}), {"t"}),
    ((Kept("t", 0), Kept("u")), {}, {"t": ("A",), "u": 2}, (("A", 2), {}), {"t", "u"}),
    ((1, "t"), {"y": None}, {"t": "A"}, ((1, "t"), {"y": None}), set()),  # nothing named: untouched
])
def test_kept_arguments_take_the_answers_this_rank_kept(args, kwargs, kept, want, used):
    got_args, got_kwargs, got_used = resolve_kept(args, kwargs, kept)
    assert ((got_args, got_kwargs), got_used) == (want, used)


def test_a_kept_field_of_a_batch_takes_the_answer_and_a_missing_one_is_named():
    batch = batch_of(2)
    batch.teacher_logprobs, batch.teacher_indices = Kept("t", 0), Kept("t", 1)
    (resolved,), _, used = resolve_kept((batch,), {}, {"t": ("L", "I")})
    assert (resolved.teacher_logprobs, resolved.teacher_indices, used) == ("L", "I", {"t"})
    assert resolved.input_ids is batch.input_ids and batch.teacher_logprobs == Kept("t", 0)  # a copy: the driver's stays
    with pytest.raises(KeyError, match="no answer kept under 'u'"):
        resolve_kept((Kept("u"),), {}, {"t": 1})


def test_the_plan_hosts_a_colocated_teacher_in_the_trainers_processes_only_when_asked():
    plan = make_plan({"train": {"gpus": 2}, "teacher_model": "tiny_qwen2", "teacher_in_trainer_process": True})
    assert (plan["teacher"].host, plan["train"].host) == ("train", None)
    assert {r["role"]: r["host"] for r in plan.rows()} == {"train": None, "teacher": "train"}
    table = format_table(plan).splitlines()  # python -m orchestration.plan
    assert table[1].split()[-1] == "process" and table[-2].endswith("own") and table[-1].endswith("train's")
    assert make_plan({"train": {"gpus": 2}, "teacher_model": "tiny_qwen2"})["teacher"].host is None
    with pytest.raises(PlanError, match="teacher_in_trainer_process.*set teacher_model"):
        make_plan({"train": {"gpus": 1}, "teacher": {"gpus": 1}, "teacher_in_trainer_process": True})


def test_a_teacher_engine_other_than_torchs_gets_processes_of_its_own(caplog):
    from algorithms import gkd
    from algorithms.gkd import GKDConfig
    from tests.driver_helpers import TINY_GKD, prepared

    _, typed, plan = prepared(GKDConfig, ["+experiment=gkd_quickstart", *TINY_GKD])
    assert plan["teacher"].host == "train" and gkd.hosting(typed, plan) is plan  # the quickstart's torch teacher
    _, typed, plan = prepared(GKDConfig, ["+experiment=gkd_quickstart", *TINY_GKD, "backend.teacher=vllm",
                                             "algorithm.logits_topk=8"])
    gkd.validate(typed, plan)
    started = gkd.hosting(typed, plan)
    assert started["teacher"].host is None and plan["teacher"].host == "train"
    assert started["train"] == plan["train"] and "processes of its own" in caplog.text


@pytest.mark.parametrize("engine, hosted", [("torch", True), ("vllm", False), ("megatron", False), (None, True)])
def test_a_hosted_role_keeps_its_host_only_with_an_engine_that_can_share(engine, hosted):
    plan = make_plan({"train": {"gpus": 2}, "teacher_model": "tiny_qwen2", "teacher_in_trainer_process": True})
    started, notes = as_started(plan, {} if engine is None else {"teacher": engine})
    assert started["teacher"].host == ("train" if hosted else None) and started["train"] == plan["train"]
    assert (started is plan) == hosted and len(notes) == (0 if hosted else 1)
    if not hosted:
        assert notes[0].startswith(f"the {engine} teacher engine runs in processes of its own, not in the train role's")
    unhosted = make_plan({"train": {"gpus": 2}, "teacher_model": "tiny_qwen2"})
    assert as_started(unhosted, {"teacher": "vllm"}) == (unhosted, [])


def test_the_plan_command_shows_the_teacher_where_its_engine_starts():
    from hydra import compose, initialize_config_module

    from orchestration.plan import plan_from_config

    for engine, process in (("torch", "train's"), ("vllm", "own")):
        with initialize_config_module(config_module="conf", version_base=None):
            cfg = compose(config_name="config", overrides=["+experiment=gkd_quickstart", f"backend.teacher={engine}"])
        _, plan, _, notes = plan_from_config(cfg)  # python -m orchestration.plan +experiment=gkd_quickstart ...
        assert format_table(plan).splitlines()[-1].endswith(process)
        assert len(notes) == (engine != "torch")


def test_keep_needs_ranks_of_their_own():
    group = LocalWorkerGroup(Keeper, make_plan({"train": {"gpus": 1}})["train"])
    with pytest.raises(ValueError, match="keep='t' needs ranks that are processes of their own"):
        group.call("logits", batch_of(1), 1.0, dispatch="slice", keep="t")


def two_ranks():
    return make_plan({"device_groups": {"nproc_per_node": 2, "g": {"device": "CPU", "ranks": 2,
                                                                    "workers": ["prm", "orm"]}}})


def test_a_hosted_role_runs_in_its_hosts_processes_and_its_kept_answers_feed_the_hosts_call(ray_cluster):
    from orchestration.placement import create_placement
    from orchestration.worker_group import WorkerGroup

    plan = two_ranks()
    placement = create_placement(plan, timeout_s=30)
    try:
        trainer = WorkerGroup(Taker, plan["prm"], placement=placement)
        with pytest.raises(ValueError, match="no restarts"):
            WorkerGroup(Keeper, plan["orm"], placement=placement, host=trainer, restarts=1)
        trainer.restarts_left = 1  # a host that restarts would come back without the hosted role
        with pytest.raises(ValueError, match="no restarts of either"):
            WorkerGroup(Keeper, plan["orm"], placement=placement, host=trainer)
        trainer.restarts_left = 0
        teacher = WorkerGroup(Keeper, plan["orm"], placement=placement, host=trainer)
        assert teacher.hosted_by is trainer and teacher.workers is trainer.workers
        assert teacher.call("pid") == trainer.call("pid") and len(set(trainer.call("pid"))) == 2
        batch = batch_of(3)  # rows 0-1 to rank 0, row 2 to rank 1
        before = CALLS.remote
        # Waited for before any call of the host: sent on its own.
        assert teacher.call("logits", batch, 10.0, dispatch="slice", keep="t") == Kept("t")
        assert CALLS.remote - before == 2
        batch.teacher_logprobs, batch.teacher_indices = Kept("t", 0), Kept("t", 1)
        got = trainer.call("train_step", batch, dispatch="slice")
        assert got == [{"rows": 2, "logprobs": [[0.0, 10.0], [20.0, 30.0]], "indices": [[1, 2], [3, 4]]},
                       {"rows": 1, "logprobs": [[40.0, 50.0]], "indices": [[5, 6]]}]
        # Taken once: the memory is free again, and a second use names what is missing.
        with pytest.raises(WorkerError, match=r"prm rank [01] failed in train_step\(\).*no answer kept under 't'"):
            trainer.call("train_step", batch, dispatch="slice")
        # A batch smaller than the ranks: every rank keeps an answer (the empty one too).
        teacher.call("logits", batch_of(1), 1.0, dispatch="slice", keep="t")
        small = batch_of(1)
        small.teacher_logprobs, small.teacher_indices = Kept("t", 0), Kept("t", 1)
        assert trainer.call("train_step", small, dispatch="slice")[0]["indices"] == [[1, 2]]
        # A host call that waits for a kept call (`after`) does not carry it: that one goes first.
        before = CALLS.remote
        kept = teacher.async_call("logits", batch_of(2), 3.0, dispatch="slice", keep="t")
        trainer.after([kept])
        pair = batch_of(2)
        pair.teacher_logprobs, pair.teacher_indices = Kept("t", 0), Kept("t", 1)
        assert [r["logprobs"] for r in trainer.call("train_step", pair, dispatch="slice")] == [[[0.0, 3.0]], [[6.0, 9.0]]]
        assert CALLS.remote - before == 4 and kept.get() == Kept("t")
        assert trainer.call("pid", execute="first") != os.getpid()
        teacher.shutdown()  # the host's processes stay
        assert len(trainer.call("pid")) == 2
        trainer.shutdown()
    finally:
        placement.remove()


def test_turns_send_a_kept_call_and_the_trainers_call_back_to_back(ray_cluster, tmp_path):
    """Turns.call with keep returns at once and sends nothing: the teacher's call rides on the
    trainer's next call (one round trip, run first there), which takes the answers; the teacher's
    onload and offload are logged when the step settles; a teacher that failed is the error
    raised, not the trainer's missing answer, and a trainer that failed after it is named as the
    trainer."""
    from algorithms.gkd import GKDConfig
    from algorithms.runtime.steps import Steps
    from orchestration.config import WeightSyncConfig
    from orchestration.placement import create_placement
    from orchestration.worker_group import WorkerGroup
    from tests.driver_helpers import TINY_GKD, MarkedLog, prepared

    _, typed, plan = prepared(GKDConfig, TINY_GKD + ["placement.offload_teacher_model=true"])
    places = two_ranks()
    placement = create_placement(places, timeout_s=30)
    try:
        trainer = WorkerGroup(Taker, places["prm"], placement=placement)
        teacher = WorkerGroup(Keeper, places["orm"], placement=placement, host=trainer)
        log = MarkedLog(tmp_path, 3, [])
        turns = Steps(plan, {"train": trainer, "teacher": teacher}, typed.run, WeightSyncConfig(), log, []).turns
        turns.settle()  # the teacher's first offload, sent as the run starts
        batch = batch_of(4)
        before = CALLS.remote
        out = turns.call("teacher", "logits", batch, 2.0, dispatch="slice", phase="teacher", keep="t")
        assert out == Kept("t") and len(turns._kept) == 1  # not waited for
        batch.teacher_logprobs, batch.teacher_indices = Kept("t", 0), Kept("t", 1)
        with turns.turn("train", one_call=True):
            got = trainer.call("train_step", batch, dispatch="slice")
        assert CALLS.remote - before == 2  # one call per rank: the teacher's rode on the trainer's
        assert [r["logprobs"] for r in got] == [[[0.0, 2.0], [4.0, 6.0]], [[8.0, 10.0], [12.0, 14.0]]]
        turns.settle()
        assert not turns._kept
        assert log._sums["move/teacher_onload_bytes"] == 2 * 3  # both ranks, from the kept call
        assert log._sums["move/teacher_offload_bytes"] == 2 * 5 * 2  # the first offload and the turn's

        turns.call("teacher", "fail", batch_of(4), dispatch="slice", keep="t")
        # Both teacher ranks failed; the error names one that had answered when the driver looked.
        with pytest.raises(WorkerError, match=r"orm rank [01] failed in onload\+fail\+offload\(\).*the teacher cannot"):
            with turns.turn("train", one_call=True):
                trainer.call("train_step", batch, dispatch="slice")
        assert not turns._kept

        turns.call("teacher", "logits", batch_of(4), 2.0, dispatch="slice", phase="teacher", keep="t")
        with pytest.raises(WorkerError, match=r"prm rank [01] failed in .*fail.*the trainer cannot"):
            with turns.turn("train", one_call=True):
                trainer.call("fail", batch, dispatch="slice")
        assert not turns._kept
        trainer.shutdown()
    finally:
        placement.remove()


@pytest.mark.parametrize("topk", [None, 4])
def test_gkd_with_the_teacher_in_the_trainers_processes_computes_the_in_process_run(ray_cluster, tmp_path, topk):
    """The GKD driver on Ray with placement.teacher_in_trainer_process: the teacher's logits stay
    on the trainer's ranks (1 remote call a step: the trainer's, which the teacher's rides on, plus
    the rollout's on on-policy steps) and the losses equal those of backend=local."""
    from algorithms import gkd
    from algorithms.gkd import GKDConfig
    from algorithms.records.trackers import read_metrics
    from tests.driver_helpers import TINY_GKD, prepared

    base = ["+experiment=gkd_quickstart", *TINY_GKD, f"teacher.cache_dir={tmp_path / 'teachers'}",
            f"algorithm.logits_topk={'null' if topk is None else topk}", "run.steps=3", "run.save_final=false"]
    records = {}
    for backend in ("local", "ray"):
        _, typed, plan = prepared(GKDConfig, base + [f"backend.workers={backend}",
                                                        f"cluster.address={ray_cluster.address}",
                                                        "placement.teacher_in_trainer_process=true"])
        gkd.validate(typed, plan)
        gkd.run(typed, plan, tmp_path / backend)
        records[backend] = read_metrics(tmp_path / backend / "metrics.jsonl")
    assert plan["teacher"].host == "train"
    for local, ray in zip(records["local"], records["ray"], strict=True):
        assert ray["train/loss" if local["step"] else "eval/accuracy"] == pytest.approx(
            local["train/loss" if local["step"] else "eval/accuracy"], rel=1e-5), local["step"]
    assert {r["calls/remote"] - 1 * r.get("gkd/on_policy", 0) for r in records["ray"][1:-1]} == {1}
