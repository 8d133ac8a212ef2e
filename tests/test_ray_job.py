"""Existing clusters: a driver joins the cluster named by RAY_ADDRESS, so
`ray job submit -- python -m algorithms.grpo ...` runs on the cluster a user started with
`ray start --head` (here on 127.0.0.1) instead of starting a private one."""
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestration import cleanup

REPO = Path(__file__).resolve().parent.parent
RAY = str(Path(sys.executable).with_name("ray"))
TINY_GRPO = ["+experiment=grpo_quickstart", "run.steps=1", "run.prompts_per_step=2", "run.eval_max_new_tokens=4",
             "data.train_size=8", "data.eval_size=2", "model=nano_qwen2", "trainer.warmup_steps=0",
             "algorithm.num_generations=2", "algorithm.max_new_tokens=4", "algorithm.warmup_sft_steps=0",
             "rollout.dtype=float32"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# In CI: a driver joining a running cluster (test_multi_gpu's joined cluster, the session's cluster
# everywhere else).
@pytest.mark.slow
def test_ray_job_submit_runs_grpo_on_the_running_cluster(tmp_path):
    gcs, dashboard = free_port(), free_port()
    # Ports of its own for every server the head starts: the session's test cluster already
    # holds Ray's defaults (a second dashboard agent on 52365 never comes up).
    ports = [f"--{name}={free_port()}" for name in ("dashboard-agent-listen-port", "dashboard-agent-grpc-port",
                                                     "metrics-export-port", "runtime-env-agent-port",
                                                     "ray-client-server-port", "node-manager-port",
                                                     "object-manager-port")]
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1"}
    env.pop("RAY_ADDRESS", None)
    temp = Path("/tmp") / f"rayjob-{os.getpid()}"  # Ray's socket paths must stay short
    start = subprocess.run([RAY, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={gcs}", "--num-cpus=4",
                            "--num-gpus=1", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
                            f"--dashboard-port={dashboard}", "--disable-usage-stats", f"--temp-dir={temp}", *ports],
                           env=env, capture_output=True, text=True, timeout=180)
    try:
        assert start.returncode == 0, start.stderr[-3000:]
        run_dir = tmp_path / "run"
        submit = [RAY, "job", "submit", "--address", f"http://127.0.0.1:{dashboard}", "--", "bash", "-c",
                  f"cd {REPO} && {sys.executable} -m algorithms.grpo {' '.join(TINY_GRPO)} hydra.run.dir={run_dir}"]
        # The job server answers before its agent is up on a busy machine; nothing was submitted then.
        deadline = time.monotonic() + 180
        while True:
            job = subprocess.run(submit, env=env, capture_output=True, text=True, timeout=600)
            if "No available agent" not in job.stderr + job.stdout or time.monotonic() > deadline:
                break
            time.sleep(2)
        assert job.returncode == 0, (job.stdout[-3000:], job.stderr[-3000:])
        assert "succeeded" in job.stdout
        # It joined this cluster: no cluster of its own (that would have simulated the GPU it lacks).
        assert "simulating" not in job.stdout
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [0, 1] and "eval/accuracy" in rows[-1]
        assert (run_dir / "checkpoints" / "step_1" / "config.json").is_file()
    finally:
        # Only this cluster's processes: `ray stop` would end every Ray cluster of the machine.
        for session in temp.glob("session_2*"):
            cleanup.end_session(str(session))
        shutil.rmtree(temp, ignore_errors=True)
