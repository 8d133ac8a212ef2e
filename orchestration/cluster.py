"""Start a local Ray cluster or join one, with quiet defaults; tell a local run (every node on
this host) from a multi-node one. Starting a local cluster first removes what killed earlier
runs left (orchestration.cleanup) and records this process as the new cluster's owner. The
level of the project's logging (run.log_level) is set here for the driver and its workers."""
from __future__ import annotations

import ipaddress
import logging
import os
import socket
import sys
from pathlib import Path

from orchestration import cleanup
from orchestration.config import ClusterConfig, ConfigError, check_cluster

QUIET_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
             "RAY_DEDUP_LOGS": "1", "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0"}


# Ray starts its worker processes at niceness 15, below every other process on the host, so a
# role's compute would yield to anything else running there; the roles are the run's work, and
# in backend=local they run at the driver's priority. A local cluster's workers keep the
# driver's (an exported RAY_worker_niceness wins).
WORKER_PRIORITY_ENV = {"RAY_worker_niceness": "0"}
# A rank's OpenMP threads spin 100k rounds for the next parallel region, then sleep: about half
# of GNU OpenMP's default (300k), which, once a call's work had ended, kept both threads of a
# 2-threads rank spinning for 5-7 ms of CPU while the driver had its own work to do (3 ms with
# 100k; a loop of small ops ran as fast; 30k made it 1.2-1.5x slower). Sleeping at once
# (OMP_WAIT_POLICY=PASSIVE) made a rank of 2 threads wake the second at every region, 1.6x
# slower per GKD train call. An exported value wins. The cluster's processes take these
# variables when they start; then they leave the driver's environment again (its own threads
# keep OpenMP's default).
WORKER_THREADS_ENV = {"GOMP_SPINCOUNT": "100000"}


def quiet_ray_env() -> None:
    for k, v in QUIET_ENV.items():
        os.environ.setdefault(k, v)


# NVLink SHARP (multicast) off in every process of a run: NCCL's NVLS algorithms, torch's
# symmetric memory and NVSHMEM would otherwise set up multicast objects on multi-GPU hosts,
# which fails where the fabric does not offer it. Harmless without a GPU; a value exported
# before the run wins.
NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def no_multicast_env() -> dict[str, str]:
    """Set NO_MULTICAST_ENV in this process (exported values kept); returns the values in force.
    A local cluster's raylet and workers inherit them; a joined cluster's workers get them
    through the job's runtime env (`job_runtime_env`)."""
    for k, v in NO_MULTICAST_ENV.items():
        os.environ.setdefault(k, v)
    return {k: os.environ[k] for k in NO_MULTICAST_ENV}


def job_runtime_env(env: dict[str, str]) -> dict:
    """ray.init's runtime_env carrying `env` to every worker of a joined cluster. Keys the
    submitted job's own runtime env sets (`ray job submit --runtime-env-json`) are left to it:
    Ray refuses a driver that sets one of them again."""
    import json

    from ray._private.runtime_env.constants import RAY_JOB_CONFIG_JSON_ENV_VAR

    job = json.loads(os.environ.get(RAY_JOB_CONFIG_JSON_ENV_VAR) or "{}")
    taken = ((job.get("runtime_env") or {}).get("env_vars") or {}).keys()
    return {"env_vars": {k: v for k, v in env.items() if k not in taken}}


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
# The packages whose module loggers run.log_level sets; every other logger stays at WARNING.
PROJECT_LOGGERS = ("algorithms", "roles", "orchestration")
# How the level reaches a worker: WorkerGroup passes it with the rank's environment.
LOG_LEVEL_ENV = "RAYROLES_LOG_LEVEL"


class _Print(logging.Handler):
    """Records as plain lines on sys.stdout as it is at that moment (where print wrote)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stdout.write(self.format(record) + "\n")
            sys.stdout.flush()
        except Exception:
            self.handleError(record)


def check_log_level(level: str) -> str:
    """run.log_level as a level name, or a ConfigError naming the key."""
    if str(level).upper() not in LOG_LEVELS:
        raise ConfigError(f"config key 'run.log_level'={level!r} is not a log level. "
                          f"Fix: set run.log_level to one of {', '.join(LOG_LEVELS)}")
    return str(level).upper()


def set_log_level(level: str) -> None:
    """Set the project's loggers of this process to run.log_level, and the level its worker
    groups pass to their ranks. Under a Hydra app the root logger's handlers (console and
    <run dir>/<job name>.log) show the records; in a process without a console handler on the
    root logger (a Ray worker, a script, a test) they are printed as plain lines."""
    level = check_log_level(level)
    os.environ[LOG_LEVEL_ENV] = level
    root = logging.getLogger()
    if root.getEffectiveLevel() < logging.WARNING:  # Hydra sets INFO: third-party INFO stays hidden
        root.setLevel(logging.WARNING)
    console = any(type(h) is logging.StreamHandler and h.stream in (sys.stdout, sys.stderr, sys.__stdout__,
                                                                    sys.__stderr__) for h in root.handlers)
    for name in PROJECT_LOGGERS:
        project = logging.getLogger(name)
        project.setLevel(level)
        own = [h for h in project.handlers if isinstance(h, _Print)]
        if console:
            for h in own:
                project.removeHandler(h)
        elif not own:
            project.addHandler(_Print())


def log_level_env() -> dict[str, str]:
    """The environment that gives a worker this process's run.log_level (none before one is set)."""
    return {LOG_LEVEL_ENV: os.environ[LOG_LEVEL_ENV]} if LOG_LEVEL_ENV in os.environ else {}


def _torch_sees_gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _loopback_only() -> None:
    """Keep a local cluster on 127.0.0.1. Ray otherwise swaps a loopback node address for
    the host's IP (its multi-node default); this is the switch it uses on macOS/Windows,
    set for this process and inherited by the cluster's processes."""
    import ray._private.ray_constants as ray_constants

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False


def cluster_is_local() -> bool:
    """Whether every alive node of the connected Ray cluster runs on this host: then ranks meet
    on 127.0.0.1. Decided when a group starts; a node an autoscaler adds later is not foreseen."""
    import ray

    return all(_own_address(n["NodeManagerAddress"]) for n in ray.nodes() if n["Alive"])


def _own_address(ip: str) -> bool:
    """Loopback, or an address a socket on this host can bind (one of its interfaces)."""
    try:
        addr = ipaddress.ip_address(ip)
    except ValueError:
        return False
    if addr.is_loopback:
        return True
    try:
        with socket.socket(socket.AF_INET6 if addr.version == 6 else socket.AF_INET) as s:
            s.bind((ip, 0))
        return True
    except OSError:
        return False


def loopback_env() -> dict[str, str]:
    """Environment that makes gloo and NCCL bind the loopback interface (gloo otherwise takes
    the address the host name resolves to; NCCL its first non-loopback interface)."""
    name = loopback_interface()
    return {"GLOO_SOCKET_IFNAME": name, "NCCL_SOCKET_IFNAME": name}


def loopback_interface() -> str:
    for _, name in socket.if_nameindex():
        try:  # IFF_LOOPBACK in the interface flags
            if int(Path(f"/sys/class/net/{name}/flags").read_text(), 16) & 0x8:
                return name
        except (OSError, ValueError):
            continue
    return "lo0" if sys.platform == "darwin" else "lo"


def check_local_size(cfg: ClusterConfig, demand: dict[str, float]) -> None:
    """A new local cluster (one node) set to fewer GPUs or CPUs than the plan reserves is
    refused before it starts, naming the cluster key that sets its size."""
    for key, resource in (("simulate_gpus", "GPU"), ("num_cpus", "CPU")):
        have, need = getattr(cfg, key), int(demand.get(resource, 0))
        if have is not None and have < need:
            raise ConfigError(f"config key 'cluster.{key}'={have} gives the local cluster {have} {resource}(s), "
                              f"but the placement reserves {need}. Fix: set cluster.{key}={need} (or null), or give "
                              "the roles fewer devices in the placement config")


def init_cluster(cfg: ClusterConfig, demand: dict[str, float] | None = None):
    """Join `cfg.address` (or RAY_ADDRESS) if set, else start a local cluster sized for `demand`.

    A local cluster gets at least as many logical CPUs as the plan has CPU processes (Ray
    CPUs are scheduling slots, not cores) and `simulate_gpus` fake GPUs if set: actors
    then reserve and see GPU ids while engines compute on the CPU.
    """
    check_cluster(cfg)
    quiet_ray_env()
    import ray

    if ray.is_initialized():
        return ray
    env = no_multicast_env()
    # RAY_ADDRESS is how `ray job submit` (and a user's shell) names the running cluster.
    address = cfg.address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=cfg.log_to_driver, runtime_env=job_runtime_env(env))
        return ray
    demand = demand or {}
    check_local_size(cfg, demand)
    num_gpus = cfg.simulate_gpus
    if num_gpus is None and cfg.simulate_missing_gpus and demand.get("GPU") and not _torch_sees_gpu():
        num_gpus = int(demand["GPU"])
        print(f"cluster: no GPU visible to torch; simulating {num_gpus} GPU(s) for the plan "
              "(engines compute on the CPU)")
    num_cpus = cfg.num_cpus or max(os.cpu_count() or 1, int(demand.get("CPU", 0)) + 1)
    if cfg.node_ip in ("127.0.0.1", "localhost"):
        _loopback_only()
    removed = cleanup.remove_orphans()
    if removed:
        print(f"cluster: removed {len(removed)} leftovers of earlier runs that were killed, e.g. {removed[0]}")
    cleanup.forget_session_at_exit()  # before ray.init: runs after Ray's own exit handler
    worker_env = {k: v for k, v in {**WORKER_PRIORITY_ENV, **WORKER_THREADS_ENV}.items() if k not in os.environ}
    os.environ.update(worker_env)  # the cluster's processes inherit them from this one
    try:
        # address="local": always a new cluster, never one found running on this machine.
        context = ray.init(address="local", num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=cfg.dashboard,
                           object_store_memory=cfg.object_store_mb * 2**20 if cfg.object_store_mb else None,
                           _node_ip_address=cfg.node_ip, log_to_driver=cfg.log_to_driver,
                           _system_config={"max_direct_call_object_size": int(cfg.inline_object_mb * 2**20)},
                           configure_logging=True, logging_level="WARNING")
    finally:
        for k in worker_env:
            os.environ.pop(k, None)
    # Whoever finds this process gone removes the cluster's leftovers (orchestration.cleanup).
    cleanup.record_session(context.address_info["session_dir"])
    return ray
