"""Weight sync trainer -> one rollout rank, per path, against a plain memory copy.

Starts a local Ray cluster with a Trainer and a Rollout (one CPU process each on one node,
or with device=cuda both colocated on one GPU) holding a Qwen2 model of `hidden_size`/`layers`/`vocab_size` (the default: ~56M fp32
parameters, ~225 MB) and times `WeightSync.sync` end to end (the driver's call until the
rollout has loaded every weight: packing, transfer, checksums, copy into the model) for
each path in `paths`. In the same run it times `torch.Tensor.copy_` of the same number of
bytes between two pre-touched buffers in one process, with as many threads as an actor
has (1), and prints MiB/s and the ratio to that copy. After the timed syncs of a path the
rollout's weights are compared with the trainer's, bit for bit.

    python benchmarks/weight_sync.py
    python benchmarks/weight_sync.py paths=[shm,collective] reps=10 checksum=full bucket_mb=128
    python benchmarks/weight_sync.py device=cuda paths=[cuda_ipc,shm,object_store,file]

Writes weight_sync.json into the Hydra run directory (outputs/<date>/<time>/).
"""
from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import List

import hydra
import torch
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from algorithms.records.runlog import run_dir
from orchestration.config import ClusterConfig, WeightSyncConfig
from orchestration.weight_sync import WeightSync
from roles.models import ModelConfig
from roles.rollout import Rollout
from roles.trainer import Trainer
from roles.weight_buckets import layout_of
from orchestration.cluster import init_cluster
from orchestration.placement import create_placement
from orchestration.planner import make_plan
from orchestration.worker_group import WorkerGroup


@dataclass
class WeightSyncBench:
    # Qwen2 width; with layers and vocab_size it sets the bytes moved per sync.
    hidden_size: int = 512
    # Decoder layers.
    layers: int = 8
    # Vocabulary rows of the (untied) embedding and output head.
    vocab_size: int = 32000
    # Paths to time: cuda_ipc (device=cuda only), shm, collective, object_store, file.
    paths: List[str] = field(default_factory=lambda: ["shm", "collective", "object_store", "file"])
    # MiB per weight bucket.
    bucket_mb: float = 64.0
    # Receivers verify each bucket's checksum (as in training runs).
    verify: bool = True
    # Checksum kind: "sample" (a word per 4 KiB page) or "full" (every byte).
    checksum: str = "sample"
    # Untimed syncs per path first (channel set-up, first-touch page faults).
    warmup: int = 1
    # Timed syncs per path; the median is reported.
    reps: int = 5
    # Ray object store of the local cluster in MiB (holds the object_store path's buckets).
    object_store_mb: int = 1024
    # Ratio to the memory copy that the best of shm/collective should reach.
    target: float = 0.3
    # "cpu": two CPU processes; "cuda": both roles colocated on one real GPU (the memory copy
    # is then device to device, and cuda_ipc can be timed).
    device: str = "cpu"


class BenchTrainer(Trainer):
    def fingerprint(self) -> dict:
        return {n: t.detach().cpu().clone() for n, t in self.model.state_dict().items()}

    def sync_bytes(self, bucket_mb: float) -> int:
        """Bytes one sync moves (packed buckets, alignment included)."""
        return sum(layout_of(b).nbytes for b in self.state_dict_buckets(bucket_mb, None, False))

    def nudge(self) -> None:
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(1e-3)


class BenchRollout(Rollout):
    def fingerprint(self) -> dict:
        return {n: t.detach().cpu().clone() for n, t in self.model.state_dict().items()}


class Memcpy:
    """copy_ of `nbytes` between two buffers in this process, one thread, pages already touched
    (on "cuda": device to device, synchronised)."""

    def __init__(self, nbytes: int, device: str):
        self.src = torch.ones(nbytes, dtype=torch.uint8, device=device)
        self.dst = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self.cuda = device == "cuda"
        self.seconds: list[float] = []
        self()

    def __call__(self) -> None:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        if self.cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        self.dst.copy_(self.src)
        if self.cuda:
            torch.cuda.synchronize()
        self.seconds.append(time.perf_counter() - t0)
        torch.set_num_threads(threads)


def time_path(trainer, rollout, path: str, cfg: WeightSyncBench, memcpy: Memcpy) -> dict:
    sync = WeightSync(trainer, WeightSyncConfig(path=path, bucket_mb=cfg.bucket_mb, verify=cfg.verify,
                                                checksum=cfg.checksum))
    try:
        for i in range(cfg.warmup):
            sync.sync([rollout], version=i)
        records = []
        for i in range(cfg.reps):
            trainer.call("nudge", execute="first")  # new bytes each time, as after a train step
            records += sync.sync([rollout], version=cfg.warmup + i)
            memcpy()  # interleaved, so that load from elsewhere on the machine hits both alike
    finally:
        sync.close()
    want, got = trainer.call("fingerprint", execute="first"), rollout.call("fingerprint", execute="first")
    exact = want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    seconds = [r.seconds for r in records]
    return {"path": path, "bytes": records[0].bytes, "median_s": statistics.median(seconds),
            "min_s": min(seconds), "seconds": seconds, "exact": exact}


ConfigStore.instance().store(name="weight_sync_bench", node=WeightSyncBench)


@hydra.main(config_path=None, config_name="weight_sync_bench", version_base=None)
def main(raw) -> None:
    cfg: WeightSyncBench = OmegaConf.to_object(raw)

    heads = max(1, cfg.hidden_size // 64)
    model = ModelConfig(name="bench_qwen2", tokenizer="char", hidden_size=cfg.hidden_size,
                        intermediate_size=cfg.hidden_size * 11 // 4, num_hidden_layers=cfg.layers,
                        num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                        vocab_size=cfg.vocab_size, tie_word_embeddings=False)
    if cfg.device == "cuda":
        plan = make_plan({"colocate_groups": [["train", "rollout"]], "train": {"gpus": 1}, "rollout": {"gpus": 1}})
    else:
        plan = make_plan({"device_groups": {"nproc_per_node": 1,
                                            "t": {"device": "CPU", "ranks": 1, "workers": ["train"]},
                                            "r": {"device": "CPU", "ranks": 1, "workers": ["rollout"]}}})
    cluster = ClusterConfig(object_store_mb=cfg.object_store_mb, log_to_driver=False, simulate_missing_gpus=False)
    ray = init_cluster(cluster, plan.demand())
    placement = create_placement(plan, cluster.placement_timeout_s)
    kwargs = {"model": model, "config": {"device": cfg.device}}
    trainer = WorkerGroup(BenchTrainer, plan["train"], kwargs, placement=placement, timeout_s=600)
    rollout = WorkerGroup(BenchRollout, plan["rollout"], kwargs, placement=placement, timeout_s=600)
    try:
        memcpy = Memcpy(trainer.call("sync_bytes", cfg.bucket_mb, execute="first"), cfg.device)
        results = [time_path(trainer, rollout, path, cfg, memcpy) for path in cfg.paths]
    finally:
        trainer.shutdown(), rollout.shutdown()
        placement.remove()
        ray.shutdown()
    nbytes = results[0]["bytes"]
    memcpy = nbytes / 2**20 / statistics.median(memcpy.seconds[1:])
    for r in results:
        r["mb_per_s"] = nbytes / 2**20 / r["median_s"]
        r["ratio_to_memcpy"] = r["mb_per_s"] / memcpy

    print(f"weight sync trainer -> 1 rollout rank: {nbytes / 2**20:.1f} MiB per sync, buckets of {cfg.bucket_mb} MiB, "
          f"verify={cfg.verify} ({cfg.checksum}), median of {cfg.reps}")
    print(f"{'path':<13} {'median s':>9} {'MiB/s':>8} {'x memcpy':>9}  exact")
    print(f"{'memcpy':<13} {nbytes / 2**20 / memcpy:>9.3f} {memcpy:>8.0f} {1.0:>9.2f}")
    for r in results:
        print(f"{r['path']:<13} {r['median_s']:>9.3f} {r['mb_per_s']:>8.0f} {r['ratio_to_memcpy']:>9.2f}  {r['exact']}")
    best = max((r["ratio_to_memcpy"] for r in results if r["path"] in ("shm", "collective", "cuda_ipc")),
               default=0.0)
    print(f"best of cuda_ipc/shm/collective: {best:.2f}x memcpy; target >= {cfg.target}x: {'met' if best >= cfg.target else 'NOT met'}")
    out = run_dir() / "weight_sync.json"
    out.write_text(json.dumps({"config": asdict(cfg), "bytes": nbytes, "memcpy_mb_per_s": memcpy,
                               "results": results, "target_met": best >= cfg.target}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
