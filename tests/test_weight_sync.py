"""Weight sync trainer -> rollout/teacher/sampler groups: every path moves the weights bit
for bit, the rollout generates with what it was sent (and keeps the old weights when a
sync is skipped), corrupted buckets are refused, versions are reported."""
import glob
import os
from pathlib import Path

import pytest
import torch

from orchestration.base_group import WorkerError
from orchestration.config import ConfigError, WeightSyncConfig
from orchestration.local import LocalWorkerGroup
from orchestration.planner import make_plan
from orchestration.weight_sync import SyncRecord, WeightSync, check_settings, sync_metrics
from roles.batch import SamplingParams
from roles.rollout import Rollout
from roles.sampler import Sampler
from roles.teacher import Teacher
from roles.trainer import Trainer
from roles.weight_buckets import ChecksumError, Manifest

MODEL = "tiny_qwen2"
CPU = {"device": "cpu"}
PROMPTS = ["What is 2 + 3?", "Count to five.", "Name a colour."]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12)


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


class ProbedTrainer(Trainer):
    def nudge(self, seed: int, scale: float = 0.05) -> None:
        """A deterministic weight change, large enough to change greedy outputs."""
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(torch.randn(p.shape, generator=g).to(p.device) * scale)

    def weights(self) -> dict[str, torch.Tensor]:
        return _weights(self.model)


class ProbedRollout(Rollout):
    def weights(self) -> dict[str, torch.Tensor]:
        return _weights(self.model)


class ProbedTeacher(Teacher):
    def weights(self) -> dict[str, torch.Tensor]:
        return _weights(self.model)


class ProbedSampler(Sampler):
    def weights(self) -> dict[str, torch.Tensor]:
        return _weights(self.rollout.model)


def cpu_group(name: str, ranks: int, role: str) -> dict:
    return {name: {"device": "CPU", "ranks": ranks, "workers": [role]}}


@pytest.fixture(scope="module")
def groups(ray_cluster):
    """Trainer, rollout (2 ranks) and sampler on one node; the teacher on the other node (a
    GPU group of device rank 1 with one device per node)."""
    from orchestration.placement import create_placement
    from orchestration.worker_group import WorkerGroup

    plan = make_plan({"device_groups": {"nproc_per_node": 1, **cpu_group("t", 1, "train"), **cpu_group("r", 2, "rollout"),
                                        "te": {"device": "GPU", "ranks": [1], "workers": ["teacher"]},
                                        **cpu_group("s", 1, "sampler")}})
    placement = create_placement(plan, timeout_s=60)
    made = {}
    try:
        for role, cls in (("train", ProbedTrainer), ("rollout", ProbedRollout), ("teacher", ProbedTeacher),
                          ("sampler", ProbedSampler)):
            made[role] = WorkerGroup(cls, plan[role], {"model": MODEL, "config": CPU}, placement=placement,
                                     timeout_s=300)
        yield made
    finally:
        for g in made.values():
            g.shutdown()
        placement.remove()


def trainer_weights(trainer) -> dict[str, torch.Tensor]:
    return trainer.call("weights", execute="first")


def assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k


@pytest.mark.parametrize("path", ["shm", "collective", "object_store", "file"])
def test_each_path_moves_weights_exactly(groups, path):
    trainer, rollout = groups["train"], groups["rollout"]
    sync = WeightSync(trainer, WeightSyncConfig(path=path, bucket_mb=0.5))
    scratch = []
    try:
        for version, seed in ((11, 1), (12, 2)):  # the second sync reuses the channel
            trainer.call("nudge", seed, execute="first")
            [record] = sync.sync([rollout], version=version)
            want = trainer_weights(trainer)
            for rank_weights in rollout.call("weights"):  # both ranks
                assert_same(rank_weights, want)
            assert rollout.call("generate", PROMPTS[:2], GREEDY, dispatch="slice", collect="flatten"
                                ).weight_version == [version, version]
            assert record.path == path and record.version == version
            assert record.bytes >= sum(t.numel() * t.element_size() for k, t in want.items()
                                       if k != "lm_head.weight") and record.mb_per_s > 0
        scratch = [c["scratch"] for c in sync._channels.values() if "scratch" in c]
        assert all(glob.glob(s) for s in scratch)
    finally:
        sync.close()
    assert not any(glob.glob(s) for s in scratch)  # close() removed the shm files / temporary folder


def test_teacher_and_sampler_receive_like_the_rollout(groups):
    """auto takes the collective to the teacher on the other node and shm to the sampler on the
    trainer's; shm to another node is refused naming the key."""
    trainer, teacher = groups["train"], groups["teacher"]
    assert trainer.infos[0]["node_id"] != teacher.infos[0]["node_id"]
    assert trainer.infos[0]["node_id"] == groups["sampler"].infos[0]["node_id"]
    sync = WeightSync(trainer, WeightSyncConfig())
    try:
        trainer.call("nudge", 3, execute="first")
        records = sync.sync([teacher, groups["sampler"]], version=4)
        want = trainer_weights(trainer)
        assert [r.path for r in records] == ["collective", "shm"]
        assert_same(teacher.call("weights", execute="first"), want)
        assert_same(groups["sampler"].call("weights", execute="first"), want)
        comps = groups["sampler"].call("sample", PROMPTS[:1], 2, GREEDY, execute="first")
        assert comps.weight_version == [4, 4]
    finally:
        sync.close()
    with pytest.raises(ConfigError, match="'weight_sync.path'='shm'.*other nodes.*Fix"):
        WeightSync(trainer, WeightSyncConfig(path="shm")).path_for(teacher)


def test_two_syncs_in_one_step_add_up():
    """A step can receive twice (at its generation and at its eval): the record holds both."""
    mb = 2**20
    first = sync_metrics([SyncRecord("rollout", "shm", 1, 2 * mb, 0.5)])
    assert first == {"sync/rollout/path": "shm", "sync/rollout/mb": 2.0, "sync/rollout/seconds": 0.5,
                     "sync/rollout/mb_per_s": 4.0}
    both = {**first, **sync_metrics([SyncRecord("rollout", "shm", 2, 6 * mb, 1.5)], first)}
    assert both["sync/rollout/mb"] == 8.0 and both["sync/rollout/seconds"] == 2.0
    assert both["sync/rollout/mb_per_s"] == 4.0
    # Two records of one call add up too; another role's figures stay apart.
    out = sync_metrics([SyncRecord("rollout", "shm", 3, mb, 1.0), SyncRecord("teacher", "file", 3, mb, 0.25),
                        SyncRecord("rollout", "shm", 3, mb, 1.0)], first)
    assert (out["sync/rollout/mb"], out["sync/rollout/seconds"]) == (4.0, 2.5)
    assert (out["sync/teacher/mb"], out["sync/teacher/seconds"]) == (1.0, 0.25)


def reference_outputs(weights: dict, device: str = "cpu") -> list[list[int]]:
    """Greedy completions of a model built here and loaded with `weights`."""
    ref = Rollout(MODEL, config={"device": device})
    ref.update_weights([list(weights.items())], version=0)
    return ref.generate(PROMPTS, GREEDY).completion_ids


def test_rollout_generates_with_each_synced_version(groups):
    trainer, rollout = groups["train"], groups["rollout"]
    sync = WeightSync(trainer, WeightSyncConfig(bucket_mb=0.25))
    trainer.call("nudge", 5, execute="first")
    metrics = sync_metrics(sync.sync([rollout], 1))
    assert metrics["sync/rollout/path"] == "shm" and metrics["sync/rollout/mb_per_s"] > 0
    old = reference_outputs(trainer_weights(trainer))
    out = rollout.call("generate", PROMPTS, GREEDY, dispatch="slice", collect="flatten")
    assert out.completion_ids == old and out.weight_version == [1, 1, 1]

    trainer.call("nudge", 6, execute="first")  # new weights, sync skipped: the rollout keeps the old ones
    new = reference_outputs(trainer_weights(trainer))
    assert new != old
    out = rollout.call("generate", PROMPTS, GREEDY, dispatch="slice", collect="flatten")
    assert out.completion_ids == old and out.weight_version == [1, 1, 1]

    sync.sync([rollout], 2)
    out = rollout.call("generate", PROMPTS, GREEDY, dispatch="slice", collect="flatten")
    assert out.completion_ids == new and out.weight_version == [2, 2, 2]
    sync.close()


def flip_byte(path: str, position: int) -> None:
    """Corrupt one byte in place (a negative position counts from the end)."""
    with open(path, "r+b") as f:
        f.seek(position, os.SEEK_END if position < 0 else os.SEEK_SET)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x5A]))


@pytest.mark.parametrize("path,checksum", [("shm", "sample"), ("object_store", "full"), ("file", "sample")])
def test_corrupted_bucket_is_refused_and_nothing_loads(groups, path, checksum):
    trainer, rollout = groups["train"], groups["rollout"]
    sync = WeightSync(trainer, WeightSyncConfig(path=path, bucket_mb=0.5))
    try:
        sync.sync([rollout], version=20)
        before = rollout.call("weights", execute="first")
        trainer.call("nudge", 7, execute="first")
        channel = sync._channel(path, None)
        sent = trainer.call("send_weights", channel, 99, 21, 0.5, checksum, execute="first")
        manifest: Manifest = sent["manifest"]
        payload = sent.get("payload")
        last = len(manifest.buckets) - 1
        if path == "shm":
            flip_byte(f"{manifest.location}-{last}", 0)  # the trainer's shared-memory file
        elif path == "object_store":
            payload = [a.copy() for a in payload]
            payload[last][0] ^= 0x01  # one bit of the bucket's first tensor
        else:
            flip_byte(str(sorted(Path(manifest.location).glob("*.safetensors"))[last]), -8)  # tensor data
        with pytest.raises(WorkerError, match=rf"ChecksumError: weight sync 99 \(version 21, path '{path}'\): "
                                              rf"bucket {last} of {last + 1} .*arrived corrupted.*Nothing was loaded"):
            rollout.call("receive_weights", channel, manifest, payload)
        assert_same(rollout.call("weights", execute="first"), before)
        assert rollout.call("generate", PROMPTS[:2], GREEDY, dispatch="slice", collect="flatten"
                            ).weight_version == [20, 20]
    finally:
        sync.close()


def test_local_backend_paths_and_checks():
    plan = make_plan({"train": {"gpus": 1}, "rollout": {"gpus": 1}})
    trainer = LocalWorkerGroup(ProbedTrainer, plan["train"], {"model": MODEL, "config": CPU})
    rollout = LocalWorkerGroup(ProbedRollout, plan["rollout"], {"model": MODEL, "config": CPU})
    for version, path in enumerate(["auto", "shm", "object_store", "file"], start=1):
        trainer.workers[0].nudge(version)
        sync = WeightSync(trainer, WeightSyncConfig(path=path, bucket_mb=0.5))
        [record] = sync.sync([rollout], version)
        assert record.path == ("direct" if path == "auto" else path)
        assert_same(rollout.workers[0].weights(), trainer.workers[0].weights())
        assert rollout.workers[0].weight_version == version
        scratch = [c["scratch"] for c in sync._channels.values() if "scratch" in c]
        assert bool(scratch) == (path in ("shm", "file")) and all(glob.glob(s) for s in scratch)
        sync.remove_scratch()  # what the driver does at exit, with no actor to ask
        assert not any(glob.glob(s) for s in scratch)
        sync.close()
    with pytest.raises(ConfigError, match="'collective' needs backend=ray"):
        WeightSync(trainer, WeightSyncConfig(path="collective")).sync([rollout], 9)
    for bad, key in (({"path": "nccl"}, "weight_sync.path"), ({"bucket_mb": 0}, "weight_sync.bucket_mb"),
                     ({"checksum": "crc32"}, "weight_sync.checksum")):
        with pytest.raises(ConfigError, match=rf"'{key}'.*Fix"):
            check_settings(WeightSyncConfig(**bad))


def test_packed_checksum_reads_the_buffer_once_and_catches_what_the_tensor_sums_catch():
    """shm and object_store buckets are checksummed as their packed buffer: swapped tensors,
    a sampled word and each tensor's last word show; with "full" every word does."""
    import torch

    from roles.weight_buckets import layout_of, pack, packed_checksum

    def packed(pairs):
        layout = layout_of(pairs)
        buf = torch.zeros(layout.nbytes, dtype=torch.uint8)
        pack(pairs, layout, buf)
        return buf, layout

    a, b = torch.arange(6.0), torch.arange(6.0).flip(0)
    assert packed_checksum(*packed([("x", a), ("y", b)])) != packed_checksum(*packed([("x", b), ("y", a)]))
    page, odd = torch.zeros(2048), torch.zeros(3, dtype=torch.bfloat16)  # 8 KiB, then a 6-byte tensor
    buf, layout = packed([("p", page), ("o", odd)])
    clean = packed_checksum(buf, layout, 512)
    for byte, stride, caught in ((512 * 8, 512, True), (1023 * 8, 512, True), (5 * 8, 512, False), (5 * 8, 1, True),
                                 (8192 + 5, 512, True)):  # 8192 + 5: the last byte of the bf16 tensor
        bad = buf.clone()
        bad[byte] ^= 1
        assert (packed_checksum(bad, layout, stride) != packed_checksum(buf, layout, stride)) == caught, byte
    assert packed_checksum(buf, layout, 512) == clean


def test_checksum_catches_swapped_tensors_and_teacher_checks_names():
    from roles.weight_buckets import bucket_checksum

    a, b = torch.arange(6.0), torch.arange(6.0).flip(0)
    assert bucket_checksum([("x", a), ("y", b)]) != bucket_checksum([("x", b), ("y", a)])
    page = torch.zeros(2048)  # 8 KiB: "sample" reads words 0, 512, 1023 (the last)
    for stride, word, caught in ((512, 512, True), (512, 1023, True), (512, 5, False), (1, 5, True)):
        bad = page.clone()
        bad.view(torch.int64)[word] = 1
        assert (bucket_checksum([("p", bad)], stride) != bucket_checksum([("p", page)], stride)) == caught
    assert bucket_checksum([("x", a.to(torch.bfloat16)[:5])]) == bucket_checksum([("x", a[:5].to(torch.bfloat16))])
    assert issubclass(ChecksumError, RuntimeError)
    teacher = Teacher(MODEL, config=CPU)
    with pytest.raises(ValueError, match="teacher.update_weights.*missing"):
        teacher.update_weights([[("model.norm.weight", torch.ones(teacher.model.config.hidden_size))]], 1)


@pytest.mark.gpu
def test_colocated_on_one_gpu_syncs_by_cuda_ipc():
    """Trainer and rollout as Ray actors sharing the one real GPU: auto takes CUDA IPC; the
    host-staged paths move CUDA weights exactly too."""
    from orchestration.cluster import init_cluster
    from orchestration.config import ClusterConfig
    from orchestration.placement import create_placement
    from orchestration.worker_group import WorkerGroup

    plan = make_plan({"colocate_groups": [["train", "rollout"]], "train": {"gpus": 1}, "rollout": {"gpus": 1}})
    ray = init_cluster(ClusterConfig(simulate_missing_gpus=False, log_to_driver=False), plan.demand())
    placement = create_placement(plan, timeout_s=60)
    gpu = {"model": MODEL, "config": {"device": "cuda"}}
    trainer = rollout = None
    try:
        trainer = WorkerGroup(ProbedTrainer, plan["train"], gpu, placement=placement, timeout_s=300)
        rollout = WorkerGroup(ProbedRollout, plan["rollout"], gpu, placement=placement, timeout_s=300)
        for version, path in enumerate(["auto", "cuda_ipc", "shm", "object_store", "file"], start=1):
            sync = WeightSync(trainer, WeightSyncConfig(path=path, bucket_mb=0.5, checksum="full"))
            trainer.call("nudge", version, execute="first")
            [record] = sync.sync([rollout], version)
            assert record.path == ("cuda_ipc" if path == "auto" else path)
            assert_same(rollout.call("weights", execute="first"), trainer_weights(trainer))
            want = reference_outputs(trainer_weights(trainer), "cuda")
            out = rollout.call("generate", PROMPTS, GREEDY, execute="first")
            assert out.weight_version == [version] * len(PROMPTS)
            assert out.completion_ids == want
            sync.close()
    finally:
        for g in (trainer, rollout):
            if g is not None:
                g.shutdown()
        placement.remove()
        ray.shutdown()


class LoraTrainer(Trainer):
    def learn(self, seed: int) -> None:
        """One update on random rows: the adapter moves (its B starts at zero)."""
        from roles.batch import Batch

        ids = torch.randint(3, 40, (4, 10), generator=torch.Generator().manual_seed(seed))
        mask = torch.ones_like(ids)
        self.train_step(Batch(input_ids=ids, attention_mask=mask, loss_mask=mask))

    def merged(self) -> dict[str, torch.Tensor]:
        return {n: t for b in self.state_dict_buckets(64) for n, t in b}


LORA = {"rank": 4, "alpha": 8.0, "dropout": 0.0}


@pytest.fixture(scope="module")
def lora_groups(ray_cluster):
    """A LoRA trainer, a rollout that takes merged syncs and one that takes the adapter alone."""
    from orchestration.placement import create_placement
    from orchestration.worker_group import WorkerGroup

    # (Two rollouts: the second on the bundles planned for a sampler.)
    plan = make_plan({"device_groups": {"nproc_per_node": 1, **cpu_group("t", 1, "train"),
                                        **cpu_group("m", 1, "rollout"), **cpu_group("a", 1, "sampler")}})
    placement = create_placement(plan, timeout_s=60)
    made = {}
    try:
        made["train"] = WorkerGroup(LoraTrainer, plan["train"], {"model": MODEL, "config": {**CPU, "lr": 5e-2,
                                                                                           "lora": LORA}},
                                    placement=placement, timeout_s=300)
        made["merged"] = WorkerGroup(ProbedRollout, plan["rollout"], {"model": MODEL, "config": CPU},
                                     placement=placement, timeout_s=300)
        made["adapter"] = WorkerGroup(ProbedRollout, plan["sampler"], {"model": MODEL, "config": {
            **CPU, "lora_rank": LORA["rank"], "lora_alpha": LORA["alpha"]}}, placement=placement, timeout_s=300)
        yield made
    finally:
        for g in made.values():
            g.shutdown()
        placement.remove()


@pytest.mark.parametrize("path", ["shm", "collective", "object_store", "file"])
def test_each_path_carries_a_lora_trainers_merged_and_adapter_syncs(lora_groups, path):
    """Merged: every weight the first time, then only the adapted tensors; adapter-only: the
    adapter's tensors each time, merged by the rollout onto its base. Both rollouts then hold
    the trainer's merged weights, on every path."""
    trainer = lora_groups["train"]
    syncs = {kind: WeightSync(trainer, WeightSyncConfig(path=path, bucket_mb=0.5, lora=kind), adapter=True)
             for kind in ("merged", "adapter")}
    try:
        parts = {"merged": [], "adapter": []}
        for version in (1, 2):
            trainer.call("learn", version + 10 * len(path), execute="first")
            want = trainer.call("merged", execute="first")
            for kind, sync in syncs.items():
                [record] = sync.sync([lora_groups[kind]], version=version)
                parts[kind].append((record.part, record.bytes))
                got = lora_groups[kind].call("weights", execute="first")
                for name, t in want.items():
                    assert torch.allclose(got[name], t, atol=1e-6), (kind, name)
        assert [p for p, _ in parts["merged"]] == ["full", "adapted"]
        assert [p for p, _ in parts["adapter"]] == ["adapter", "adapter"]
        assert parts["adapter"][0][1] < parts["merged"][1][1] < parts["merged"][0][1]
    finally:
        for sync in syncs.values():
            sync.close()
