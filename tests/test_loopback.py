"""A local run opens nothing reachable from the network: every socket its worker processes
listen on (Ray's, the data-parallel TCPStore and gloo, the weight-sync store and gloo) is on
a loopback address; the weight-sync store carries validated JSON, never pickle."""
import ipaddress
import json

import psutil
import pytest
import torch

from orchestration.cluster import _own_address, cluster_is_local
from orchestration.config import WeightSyncConfig
from orchestration.planner import make_plan
from orchestration.weight_sync import WeightSync
from roles.rollout import Rollout
from roles.trainer import Trainer
from roles.weight_buckets import Manifest, layout_of
from roles.weight_buckets import manifest_from_json, manifest_to_json

MODEL = "tiny_qwen2"
CPU = {"device": "cpu"}


def listeners(pid: int) -> list[tuple[str, int]]:
    return [(c.laddr.ip, c.laddr.port) for c in psutil.Process(pid).net_connections("inet")
            if c.status == psutil.CONN_LISTEN]


def is_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip.split("%")[0])
    return (getattr(addr, "ipv4_mapped", None) or addr).is_loopback


class DataParallelTrainer(Trainer):
    def process_group_size(self) -> int:
        return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


def test_two_rank_run_with_collective_sync_listens_only_on_loopback(ray_cluster):
    """Two data-parallel trainer ranks and a rollout, synced by the collective: every socket their
    processes listen on is on loopback. The two ranks also train as one rank does (the same
    losses, gradient norms and logprobs, identical replicas of the single trainer's weights)."""
    import math

    from orchestration.placement import create_placement
    from orchestration.worker_group import WorkerGroup
    from tests.test_trainer import sft_batch

    assert cluster_is_local()  # two simulated nodes, both on this host
    batch = sft_batch(7, seed=3)  # sliced 4 + 3: uneven token counts and micro-batch counts
    kwargs = {"model": MODEL, "config": dict(lr=1e-3, micro_batch_per_device=2, device="cpu", dtype="float32",
                                             warmup_steps=0, total_steps=10)}
    plan = make_plan({"device_groups": {"nproc_per_node": 1, "t": {"device": "CPU", "ranks": 2, "workers": ["train"]},
                                        "r": {"device": "CPU", "ranks": 1, "workers": ["rollout"]}}})
    placement = create_placement(plan, timeout_s=60)
    made = []
    try:
        trainer = WorkerGroup(DataParallelTrainer, plan["train"], kwargs, placement=placement, timeout_s=300)
        made.append(trainer)
        rollout = WorkerGroup(Rollout, plan["rollout"], {"model": MODEL, "config": CPU}, placement=placement,
                              timeout_s=300)
        made.append(rollout)
        assert trainer.call("process_group_size") == [2, 2]  # the data-parallel group is up
        dp = [trainer.call("train_step", batch, dispatch="slice") for _ in range(2)]
        replicas = trainer.call("state_dict_buckets", 1024)
        dp_logprobs = trainer.call("logprobs", batch, dispatch="slice", collect="flatten")
        assert {i["ip"] for i in trainer.infos + rollout.infos} == {"127.0.0.1"}
        sync = WeightSync(trainer, WeightSyncConfig(path="collective", bucket_mb=0.5))
        [record] = sync.sync([rollout], version=1)  # the broadcast group is up too (kept for the next sync)
        assert record.path == "collective" and record.bytes > 0
        channel = next(iter(sync._channels.values()))
        seen = {pid: listeners(pid) for pid in {i["pid"] for i in trainer.infos + rollout.infos}}
        ports = {port for found in seen.values() for _, port in found}
        # What the check must see to mean anything: the data-parallel store and the weight-sync store.
        assert int(trainer.infos[0]["port"]) in ports and channel["port"] in ports, seen
        exposed = {pid: [a for a in found if not is_loopback(a[0])] for pid, found in seen.items()}
        assert not any(exposed.values()), f"listening beyond loopback: {exposed}"
        sync.close()
    finally:
        for g in made:
            g.shutdown()
        placement.remove()
    single = Trainer(**kwargs)
    ref = [single.train_step(batch) for _ in range(2)]
    for ranks, want in zip(dp, ref):
        assert ranks[0] == ranks[1]  # every rank reports the same global metrics
        assert ranks[0]["tokens"] == want["tokens"] and ranks[0]["sequences"] == 7
        for key in ("loss", "grad_norm"):
            assert math.isclose(ranks[0][key], want[key], abs_tol=1e-5), (key, ranks[0][key], want[key])
    rank0, rank1 = ([t for b in r for t in b] for r in replicas)
    ref_weights = dict(single.model.state_dict())
    for (name, a), (_, b) in zip(rank0, rank1):
        assert torch.equal(a, b), name  # replicas stay identical
        torch.testing.assert_close(a, ref_weights[name], atol=1e-5, rtol=0, msg=name)
    torch.testing.assert_close(dp_logprobs, single.logprobs(batch), atol=1e-5, rtol=0)


def test_own_addresses():
    assert _own_address("127.0.0.1") and _own_address("::1")
    assert not _own_address("192.0.2.77")  # TEST-NET-1: never an interface here
    assert not _own_address("not-an-ip")


def test_manifest_travels_as_checked_json():
    bucket = [("a.weight", torch.zeros(3, 4)), ("b.bias", torch.ones(5, dtype=torch.bfloat16))]
    manifest = Manifest(7, 3, "collective", [layout_of(bucket)], stride=512)
    back = manifest_from_json(manifest_to_json(manifest).encode(), 7)
    assert back == manifest
    good = json.loads(manifest_to_json(manifest))
    bad_cases = [
        dict(good, seq=8),  # another sync's manifest
        dict(good, buckets=[[["a.weight"], [[3, 4]], ["load"], [0], 64]]),  # not a dtype
        dict(good, buckets=[[["a.weight"], [[3, 4]], ["float32"], [0], 16]]),  # 48 bytes in a 16-byte bucket
        dict(good, buckets=[[["a.weight"], [[-3, 4]], ["float32"], [0], 64]]),
        dict(good, version="3"),
    ]
    for bad in bad_cases:
        with pytest.raises(ValueError, match="weight sync 7: the manifest in the store is malformed"):
            manifest_from_json(json.dumps(bad).encode(), 7)
    with pytest.raises(ValueError, match="malformed"):
        manifest_from_json(b"\x80\x04\x95 pickled", 7)
