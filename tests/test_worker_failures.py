"""Failures of worker groups on real Ray (and the local backend where it has them): a dead
actor, a silent rank past the call timeout, one rank failing while others block, a constructor
that raises. Each is an error naming role, rank and method, never a hang."""
import pytest

from orchestration.base_group import WorkerError
from orchestration.local import LocalWorkerGroup
from orchestration.planner import make_plan
from tests.roles_for_tests import Probe

def test_dead_actor_is_reported_not_waited_for(ray_cluster):
    from orchestration.placement import create_placement
    from orchestration.worker_group import WorkerGroup

    plan = make_plan({"train": {"gpus": 2}})
    placement = create_placement(plan, timeout_s=30)
    try:
        g = WorkerGroup(Probe, plan["train"], placement=placement)
        with pytest.raises(WorkerError, match="train rank 1 failed in die\\(\\): the actor process died"):
            g.call("die")
        g.shutdown()
    finally:
        placement.remove()


def test_silent_worker_is_reported_after_the_call_timeout(ray_cluster):
    """A rank that stops answering (sleeping past the bound, or SIGSTOPped) is reported like a
    dead one: role, rank, method and seconds waited; the group still shuts down after."""
    import os
    import signal
    import time
    from orchestration.placement import create_placement
    from orchestration.worker_group import WorkerGroup

    plan = make_plan({"train": {"gpus": 2}})
    placement = create_placement(plan, timeout_s=30)
    try:
        g = WorkerGroup(Probe, plan["train"], placement=placement, timeout_s=60)
        g.timeout_s = 2.0  # what cluster.call_timeout_s=2 gives, once the actors have started
        start = time.monotonic()
        with pytest.raises(WorkerError, match=r"train rank 1 failed in nap\(\): no answer after 2\.\ds: the actor "
                                              rf"process \(pid {g.infos[1]['pid']}\) stopped answering"):
            g.call("nap", 120)
        assert time.monotonic() - start < 20
        g.shutdown()

        g = WorkerGroup(Probe, plan["train"], placement=placement, timeout_s=60)
        g.timeout_s = 2.0
        stopped = g.infos[0]["pid"]
        os.kill(stopped, signal.SIGSTOP)
        with pytest.raises(WorkerError, match=r"train rank 0 failed in echo\(\): no answer after 2\.\ds"):
            g.call("echo", 1)
        g.shutdown()  # returns although rank 0 cannot run its exit
        deadline = time.monotonic() + 30
        while _alive(stopped) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(stopped)
    finally:
        placement.remove()


def _alive(pid: int) -> bool:
    """Running (a zombie waiting to be reaped has ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_negative_call_timeout_is_refused():
    from orchestration.cluster import init_cluster
    from orchestration.config import ClusterConfig, ConfigError

    with pytest.raises(ConfigError, match=r"'cluster.call_timeout_s'=-1 must be >= 0.*Fix"):
        init_cluster(ClusterConfig(call_timeout_s=-1))


def test_failure_while_others_block_is_raised_at_once(ray_cluster):
    import time
    from orchestration.placement import create_placement
    from orchestration.worker_group import WorkerGroup

    plan = make_plan({"train": {"gpus": 2}})
    placement = create_placement(plan, timeout_s=30)
    try:
        g = WorkerGroup(Probe, plan["train"], placement=placement)
        start = time.monotonic()
        with pytest.raises(WorkerError, match="train rank 1 failed in fail_or_hang\\(\\): RuntimeError: rank 1 gave up"):
            g.call("fail_or_hang")
        assert time.monotonic() - start < 60  # rank 0 would block for 120 s
        g.shutdown()
    finally:
        placement.remove()


def test_constructor_failure_names_init(ray_cluster):
    from orchestration.placement import create_placement
    from orchestration.worker_group import WorkerGroup

    plan = make_plan({"train": {"gpus": 1}})
    placement = create_placement(plan, timeout_s=30)
    try:
        with pytest.raises(WorkerError, match="train rank 0 failed in __init__\\(\\): TypeError"):
            WorkerGroup(Probe, plan["train"], {"no_such_arg": 1}, placement=placement)
    finally:
        placement.remove()
    with pytest.raises(WorkerError, match="train rank 0 failed in __init__"):
        LocalWorkerGroup(Probe, plan["train"], {"no_such_arg": 1})
