"""Shared fixtures: one Ray cluster for the whole test session.

The cluster has two simulated nodes on this machine: a head node with 12 fake GPUs and a
second node with 4, so single-node layouts of 8 GPUs (beside a module-scoped 4-GPU one) and
2-node layouts both place.
Fake GPUs give actors CUDA_VISIBLE_DEVICES while torch.cuda stays unavailable.
"""
import os

import pytest

from orchestration.cluster import quiet_ray_env

quiet_ray_env()
# Keep every Ray address on loopback (Ray otherwise resolves 127.0.0.1 to the host's IP).
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
HEAD_GPUS, WORKER_GPUS = 12, 4


def pytest_collection_modifyitems(config, items):
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    several = pytest.mark.skip(reason=f"needs 2 or more CUDA GPUs (torch sees {gpus})")
    for item in items:
        if "gpu" in item.keywords and not gpus:
            item.add_marker(skip)
        if "multi_gpu" in item.keywords and gpus < 2:
            item.add_marker(several)


@pytest.fixture(scope="session")
def ray_cluster():
    import ray
    from ray.cluster_utils import Cluster

    common = dict(num_cpus=8, object_store_memory=256 * 2**20, node_ip_address="127.0.0.1")
    cluster = Cluster(initialize_head=True, head_node_args=dict(num_gpus=HEAD_GPUS, include_dashboard=False, **common))
    cluster.add_node(num_gpus=WORKER_GPUS, **common)
    ray.init(address=cluster.address, log_to_driver=False, logging_level="WARNING")
    assert ray.nodes()[0]["NodeManagerAddress"] == "127.0.0.1"
    cluster.wait_for_nodes()
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module (pytestmark = pytest.mark.usefixtures("one_thread")):
    tiny models gain nothing from more, and on a busy 2-core machine spinning threads stall
    each other (a second one cost 10x)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
