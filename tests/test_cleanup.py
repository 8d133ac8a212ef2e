"""`python -m orchestration.cleanup` removes what killed runs left behind, and only that: weight
files and Ray session processes whose recorded owner is gone; those of a live owner stay."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchestration import cleanup

HOLD = "import sys, time; f = open(sys.argv[1], 'a'); print('ready', flush=True); time.sleep(120)"


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def holder(path: Path, title: str) -> subprocess.Popen:
    """A process with `path` open, its argv[0] set to `title` (Ray's agents show "ray::...")."""
    proc = subprocess.Popen([title, "-c", HOLD, str(path)], executable=sys.executable, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def fake_session(root: Path, name: str, owner: int, start: int) -> tuple[Path, Path]:
    session = root / "ray" / name
    (session / "logs").mkdir(parents=True)
    record = root / f"{cleanup.SESSION_PREFIX}{owner}-{start}.json"
    record.write_text(json.dumps({"pid": owner, "start": start, "session_dir": str(session)}))
    return session, record


def test_weight_files_of_gone_writers_are_removed(tmp_path):
    me, dead = os.getpid(), dead_pid()
    start = cleanup.start_ticks(me)
    assert start
    gone = [f"{dead}-{start}-train-rollout-0", f"{me}-{start + 1}-train-rollout-0",  # a reused PID
            f"{dead}-shm-0"]  # an older name: PID only
    kept = [f"{me}-{start}-train-rollout-0", f"{me}-shm-1"]
    for name in gone + kept:
        (tmp_path / (cleanup.WEIGHT_PREFIX + name)).write_bytes(b"\0" * 64)
    folder = tmp_path / f"{cleanup.WEIGHT_PREFIX}{dead}-{start}-file"  # path "file"'s temporary folder
    folder.mkdir()
    (folder / "model-00001-of-00001.safetensors").write_bytes(b"x")
    (tmp_path / "unrelated").write_text("x")

    listed = cleanup.remove_orphans([str(tmp_path)], dry_run=True)
    assert len(listed) == 4 and (tmp_path / (cleanup.WEIGHT_PREFIX + gone[0])).exists()  # a dry run removes nothing
    assert sorted(cleanup.remove_orphans([str(tmp_path)])) == sorted(listed)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted([cleanup.WEIGHT_PREFIX + n for n in kept] + ["unrelated"])


def test_session_processes_of_a_gone_driver_are_ended(tmp_path):
    dead, me = dead_pid(), os.getpid()
    orphaned, orphan_record = fake_session(tmp_path, "session_2001-01-01_00-00-00_000001_1", dead, 12345)
    live, live_record = fake_session(tmp_path, "session_2001-01-01_00-00-00_000002_2", me, cleanup.start_ticks(me))
    procs = {"agent": holder(orphaned / "logs" / "agent.log", "ray::DashboardAgent"),
             "pager": holder(orphaned / "logs" / "raylet.out", "less"),  # someone reading the logs: not Ray's
             "live": holder(live / "logs" / "agent.log", "ray::RuntimeEnvAgent")}
    try:
        assert cleanup.session_processes(str(orphaned)) == [procs["agent"].pid]
        done = cleanup.remove_orphans([str(tmp_path)])
        assert done == [f"process {procs['agent'].pid} (ray::DashboardAgent) of Ray session {orphaned}"]
        assert procs["agent"].wait(timeout=10) is not None
        assert procs["pager"].poll() is None and procs["live"].poll() is None
        assert not orphan_record.exists() and live_record.exists()
        assert cleanup.remove_orphans([str(tmp_path)]) == []  # nothing twice
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()


def test_records_name_their_owner_and_bad_ones_are_ignored(tmp_path):
    record = cleanup.record_session("/tmp/ray/session_2001-01-01_00-00-00_000003_3", str(tmp_path))
    assert record == cleanup.session_record_path(str(tmp_path))
    assert cleanup.read_record(record) == {"pid": os.getpid(), "start": cleanup.start_ticks(os.getpid()),
                                           "session_dir": "/tmp/ray/session_2001-01-01_00-00-00_000003_3"}
    assert cleanup.session_orphans([str(tmp_path)]) == []  # its owner runs this test
    dead = dead_pid()
    for i, bad in enumerate([{"pid": dead, "start": 1, "session_dir": "/"},  # not a Ray session folder
                             {"pid": str(dead), "start": 1, "session_dir": "/tmp/ray/session_x"}]):
        (tmp_path / f"{cleanup.SESSION_PREFIX}{dead}-{i}.json").write_text(json.dumps(bad))
    (tmp_path / f"{cleanup.SESSION_PREFIX}{dead}-9.json").write_text("not json")
    assert cleanup.session_orphans([str(tmp_path)]) == []


def test_command_line(tmp_path):
    orphan = tmp_path / f"{cleanup.WEIGHT_PREFIX}{dead_pid()}-7-train-rollout-0"
    orphan.write_bytes(b"x")
    run = [sys.executable, "-m", "orchestration.cleanup", "--folder", str(tmp_path)]
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(run + ["--dry-run"], cwd=root, capture_output=True, text=True, check=True).stdout
    assert out == f"would remove weight file {orphan}\n" and orphan.exists()
    out = subprocess.run(run, cwd=root, capture_output=True, text=True, check=True).stdout
    assert out == f"removed weight file {orphan}\n" and not orphan.exists()
    out = subprocess.run(run, cwd=root, capture_output=True, text=True, check=True).stdout
    assert out == "nothing left behind by earlier runs\n"


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_a_reused_pid_is_not_the_owner():
    assert cleanup.start_ticks(dead_pid()) is None
    assert cleanup.owner_alive(os.getpid(), cleanup.start_ticks(os.getpid()))
    assert not cleanup.owner_alive(os.getpid(), cleanup.start_ticks(os.getpid()) + 1)


class Niceness:
    def nice(self) -> int:
        return os.nice(0)


# The driver starts its local cluster as the drivers do (start_roles: init_cluster, placement, an
# actor) and first reports what that cluster gives its processes: the variables that switch
# NVLink multicast off in a worker (a joined cluster's: tests/test_multi_gpu.py) and its OpenMP
# wait policy, the actor's niceness beside its own, and the inline size of a call's objects.
DRIVER = """
import json, os, sys, time
import ray
from orchestration import cleanup
cleanup.default_folders = lambda: [sys.argv[1]]  # records here, not in /dev/shm
from orchestration.cluster import NO_MULTICAST_ENV
from orchestration.config import ClusterConfig
from orchestration.launch import start_roles
from orchestration.planner import make_plan
from tests.test_cleanup import Niceness

os.environ.pop("RAY_worker_niceness", None)
cfg = type("Cfg", (), {})()
cfg.backend = type("B", (), {"workers": "ray"})()
cfg.cluster = ClusterConfig(num_cpus=2, log_to_driver=False, object_store_mb=128, inline_object_mb=2)
plan = make_plan({"device_groups": {"nproc_per_node": 1, "c": {"device": "CPU", "ranks": 1, "workers": ["orm"]}}})
roles = start_roles(cfg, plan, {"orm": (Niceness, {})})

@ray.remote(num_cpus=0)
def seen():
    return {k: os.environ.get(k) for k in [*NO_MULTICAST_ENV, "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "RAY_worker_niceness"]}

print("ready", json.dumps({"env": ray.get(seen.remote()), "actor_nice": roles["orm"].call("nice")[0],
                           "driver_nice": os.nice(0),
                           "driver_env": [os.environ.get(k) for k in ("RAY_worker_niceness", "GOMP_SPINCOUNT")],
                           "inline": ray._private.worker._global_node._config["max_direct_call_object_size"]}),
      flush=True)
time.sleep(300)
"""


def test_a_killed_driver_leaves_nothing_running_after_cleanup(tmp_path):
    """A driver started a local cluster and was SIGKILLed: Ray's agents outlive it; the next
    cleanup ends every Ray process of that session. Before: its workers had the no-multicast
    variables (one exported before the run kept its value), OpenMP's default wait policy with a
    shorter spin (GOMP_SPINCOUNT), its actor ran at the driver's niceness (Ray's default would
    put it at 15; the variables saying so left the driver's environment), and its calls carry
    objects up to cluster.inline_object_mb inline."""
    import time

    from orchestration.cluster import NO_MULTICAST_ENV

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items()
           if k not in (*NO_MULTICAST_ENV, "RAY_ADDRESS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "RAY_worker_niceness")}
    env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "0"  # exported before the run: kept
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, str(tmp_path)], cwd=root, stdout=subprocess.PIPE,
                              text=True, env=env)
    try:
        ready, seen = driver.stdout.readline().strip().split(" ", 1)
        assert ready == "ready"
        seen = json.loads(seen)
        assert seen["env"] == {**NO_MULTICAST_ENV, "TORCH_SYMM_MEM_DISABLE_MULTICAST": "0", "OMP_WAIT_POLICY": None,
                               "GOMP_SPINCOUNT": "100000", "RAY_worker_niceness": "0"}
        assert seen["actor_nice"] == seen["driver_nice"] and seen["inline"] == 2 * 2**20
        assert seen["driver_env"] == [None, None]  # taken by the cluster's processes, then gone
        [record] = tmp_path.glob(f"{cleanup.SESSION_PREFIX}{driver.pid}-*.json")
        session = cleanup.read_record(str(record))["session_dir"]
    finally:
        driver.kill()
        driver.wait()
    time.sleep(3)  # what dies with the driver has died
    left = cleanup.session_processes(session)
    assert left, "nothing of the session outlived its driver: this test no longer shows anything"
    done = cleanup.remove_orphans([str(tmp_path)])
    assert done and not record.exists()
    deadline = time.monotonic() + 10
    while cleanup.session_processes(session) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert cleanup.session_processes(session) == []
