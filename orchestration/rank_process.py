"""What a rank's process sets up for itself before its role is built: torch's threads, the index
of its GPU among the devices it sees, the TCP store its group meets at; and `node_processes`, which
the driver reads from the plan to size those threads. Used by the Ray worker groups
(orchestration/worker_group.py)."""
from __future__ import annotations

import os
import socket
from typing import Any

import ray


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity), else the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no sched_getaffinity (macOS)
        return os.cpu_count() or 1


def set_threads(num_cpus: float | None, node_procs: int) -> int:
    """torch's threads for this rank: `num_cpus` (its role's, from the plan), else this node's
    usable cores over the `node_procs` processes planned on it; OpenMP/MKL get the same in the
    environment for the processes this one starts. No core is held back for the driver: it
    waits while the ranks compute, and a local cluster's ranks spin only briefly once a call's
    work ends (cluster.WORKER_THREADS_ENV). On 2 cores the GRPO quickstart's one process slot
    computes with 2 threads: its fastest steps measured 1.05-1.07x the in-process run's against
    1.68-1.69x with 1 (docs/benchmarks.md, "Threads per rank")."""
    n = max(1, round(num_cpus)) if num_cpus else max(1, usable_cores() // max(node_procs, 1))
    os.environ.update({"OMP_NUM_THREADS": str(n), "MKL_NUM_THREADS": str(n)})
    try:
        import torch
    except ImportError:
        return n
    torch.set_num_threads(n)
    return n


def node_processes(plan: Any, node: int) -> int:
    """Processes planned on `node`: one per device slot in use there (colocated roles share one)."""
    return len({(r.device, n, d) for r in plan.roles.values() for n, d in zip(r.nodes, r.local_devices)
                if n == node})


def visible_index() -> int | None:
    """Where this actor's GPU is among the devices it sees (CUDA_VISIBLE_DEVICES): 0 when Ray shows
    it only its own; None without a GPU."""
    ids = ray.get_runtime_context().get_accelerator_ids().get("GPU", [])
    visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if not ids:
        return None
    return visible.index(ids[0]) if ids[0] in visible else 0


def store_on(sock: socket.socket) -> Any:
    """A TCPStore server listening on `sock` (only where it is bound), shared by every store that
    this process opens on its port (multi_tenant); None where torch.distributed is missing."""
    try:
        import torch.distributed as dist
    except ImportError:
        dist = None
    if dist is None or not dist.is_available():
        sock.close()
        return None
    sock.listen(128)
    store = dist.TCPStore("127.0.0.1", sock.getsockname()[1], None, True, wait_for_workers=False,
                          multi_tenant=True, master_listen_fd=sock.fileno())
    sock.detach()  # the store closes the descriptor
    return store
