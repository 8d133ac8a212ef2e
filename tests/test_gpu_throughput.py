"""benchmarks/gpu_throughput.py's generate mode on CPU (the script a GPU run starts with):
every engine in its own process on the same prompts, fixed-length completions, ratios to HF,
and vLLM request forms sent to the same engine."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow  # the benchmark script on CPU, each variant in a process of its own
def test_generate_mode_runs_every_engine_on_the_same_fixed_size_work(tmp_path):
    pytest.importorskip("vllm")
    out = tmp_path / "generate.json"
    cmd = [sys.executable, "benchmarks/gpu_throughput.py", "generate", "--device", "cpu", "--model", "nano_qwen2",
           "--rows", "8", "--samples", "4", "--new-tokens", "6", "--repeats", "1",
           "--vllm-variant", '{"kv_cache_gib": 0.25, "request_form": "n_per_prompt_bare"}', "--out", str(out)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = json.loads(out.read_text())["runs"]
    assert [(r["engine"], r["options"].get("request_form")) for r in runs] == [
        ("hf", None), ("vllm", "n_per_prompt_bare"), ("torch", None)]
    for r in runs:
        size = r["sizes"]["8"]
        assert "error" not in r and size["tokens"] == 8 * 6  # eos ignored: every row decodes 6 tokens
        assert size["tokens_per_s"] > 0 and size["x_hf"] > 0
    assert runs[0]["sizes"]["8"]["x_hf"] == 1.0
    assert runs[1]["settings"]["engine"] == "vllm" and runs[1]["settings"]["enforce_eager"] is True
    assert "| vllm |" in done.stdout and "| torch |" in done.stdout


def test_train_flops_count_every_weight_and_causal_attention(monkeypatch):
    """qwen2_0p5b shape with the char vocabulary: 6 x parameters per token, plus attention over half
    the row on average (12 x layers x hidden x tokens / 2)."""
    import importlib

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))  # the benchmark imports gpu_throughput's helpers
    bench = importlib.import_module("train_throughput")
    config = type("C", (), {"num_hidden_layers": 24, "hidden_size": 896})()
    assert bench.train_flops_per_token(100, config, 1024) == 600 + 12 * 24 * 896 * 512
    # The fastest quarter of the steps: the first quartile, or the fastest of fewer than 4.
    assert bench.fastest_quarter([0.5, 0.1, 0.4, 0.2, 0.3]) == pytest.approx(0.15)
    assert bench.fastest_quarter([0.3, 0.2]) == 0.2


def test_device_times_leave_out_regions_annotated_on_the_host(monkeypatch):
    """A GPU trace holds `Optimizer.step#AdamW.step` on the device's timeline beside the AdamW
    kernels it spans: the tally counts the kernels once, not the region on top."""
    import importlib

    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import FunctionEvent

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    bench = importlib.import_module("train_throughput")

    def event(name, us, annotation=False, device=DeviceType.CUDA):
        return FunctionEvent(id=0, name=name, thread=0, start_us=0, end_us=us, use_device="cuda",
                             device_type=device, is_user_annotation=annotation)

    events = [event("Optimizer.step#AdamW.step", 4500, annotation=True), event("multi_tensor_apply_kernel", 4000),
              event("gemm", 1000), event("gemm", 500), event("aten::mm", 9000, device=DeviceType.CPU)]
    assert bench.device_times(events) == {"multi_tensor_apply_kernel": [0.004, 1], "gemm": [0.0015, 2]}


@pytest.mark.slow  # the benchmark script on CPU, each variant in a process of its own
def test_train_mode_runs_the_variants_profiles_each_step_and_measures_the_teacher_forward(tmp_path):
    """The plain step beside the trainer and a trainer variant (same losses), each step
    profiled, and the teacher forward plain and with its variants (same top-k values)."""
    out, profiles = tmp_path / "train.json", tmp_path / "profiles"
    cmd = [sys.executable, "benchmarks/gpu_throughput.py", "train", "--device", "cpu", "--model", "tiny_qwen2",
           "--train-shape", "8x24", "--micro-batch", "40", "--ragged", "--steps", "1", "--warmup-steps", "1",
           "--train-variant", '{"packing": true, "activation_checkpointing": true, "optimizer": "adamw_foreach"}',
           "--profile-dir", str(profiles), "--teacher-topk", "8",
           "--teacher-variant", '{"chunked_logprobs": true}', "--teacher-variant", '{"chunked_logprobs": true, '
           '"packing": true}', "--out", str(out)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    runs = result["runs"]
    assert [r["variant"] for r in runs] == [
        "plain", "trainer {}", 'trainer {"packing": true, "activation_checkpointing": true, "optimizer": "adamw_foreach"}']
    assert all("error" not in r and r["micro_batch"] == 8 and r["tokens_per_s"] > 0 for r in runs)
    assert runs[0]["x_plain"] == 1.0
    # Same initial weights and batches: every variant trains the same losses.
    assert max(r["loss"] for r in runs) - min(r["loss"] for r in runs) < 1e-2
    assert "| plain | 8x24 |" in done.stdout
    assert all(r["tflops"] > 0 for r in runs)  # the model FLOPs of the real tokens (MFU needs a GPU's peak)
    assert sorted(p.name for p in profiles.iterdir()) == [
        "teacher_chunked_logprobs_8x24.json", "teacher_chunked_logprobs_packing_8x24.json", "teacher_plain_8x24.json",
        "train_plain_8x24.json", "train_trainer_8x24.json",
        "train_trainer_packing_activation_checkpointing_optimizer_adamw_foreach_8x24.json"]
    for run in runs:  # (the shares are of CPU time: how they split moves with the machine's load)
        shares = run["profile"]["shares"]
        assert abs(sum(shares.values()) - 1) < 1e-3 and shares["matmul"] > 0 and shares["optimizer"] > 0
    summary = json.loads((profiles / "train_plain_8x24.json").read_text())
    times = [t["s"] for t in summary["top"]]  # the ops by time, the largest first
    assert times == sorted(times, reverse=True) and all(t["calls"] > 0 for t in summary["top"])
    assert "matmul" in {t["kind"] for t in summary["top"]} and summary["busy_s"] <= summary["wall_s"]
    teachers = result["teacher"]
    assert [t["variant"] for t in teachers] == ["teacher {}", 'teacher {"chunked_logprobs": true}',
                                                'teacher {"chunked_logprobs": true, "packing": true}']
    for t in teachers:  # the options give the plain teacher's top-k values
        assert "error" not in t and t["tokens_per_s"] > 0 and t["max_abs_diff_vs_plain"] < 1e-4
        assert "attention" in t["profile"]["shares"]
    # Without the [b, T, V] float32 logits more rows go into one forward (0: sized by memory).
    assert teachers[1]["micro_batch"] >= teachers[0]["micro_batch"]
    assert "| teacher {} | 8x24 |" in done.stdout and "profile plain 8x24" in done.stdout


def test_step_profile_charges_each_idle_gap_to_the_host_phase_running_when_it_began(monkeypatch):
    """benchmarks/step_profile.py's arithmetic on a made-up trace (microseconds): overlapping
    kernels count once, a gap goes to the innermost phase running at its start."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import step_profile

    def span(name, ts, dur, cat):
        return {"ph": "X", "name": name, "ts": ts, "dur": dur, "cat": cat}
    trace = {"traceEvents": [
        span("step", 0, 100, "user_annotation"), span("train_step", 0, 100, "user_annotation"),
        span("_forward", 1, 39, "user_annotation"), span("backward", 40, 50, "user_annotation"),
        span("k1", 5, 15, "kernel"), span("k2", 10, 20, "kernel"), span("copy", 50, 10, "gpu_memcpy"),
        span("k3", 70, 25, "kernel"), span("k_next_step", 150, 5, "kernel")]}
    (got,) = step_profile.step_summaries(trace)
    assert got["device_busy_ms"] == pytest.approx((25 + 10 + 25) / 1e3)
    assert got["first_kernel_ms"] == pytest.approx(5 / 1e3)
    assert got["idle_by_phase_ms"] == {"_forward": 0.02, "backward": 0.01}
    assert got["host_phase_ms"]["backward"] == 0.05 and got["wall_ms"] == 0.1


def test_step_profile_runs_a_trainer_step_on_cpu(tmp_path):
    """The script end to end on CPU: the marked phases show in the traced step (no device)."""
    out = tmp_path / "profile.json"
    cmd = [sys.executable, "benchmarks/step_profile.py", "--device", "cpu", "--model", "nano_qwen2", "--rows", "2",
           "--tokens", "16", "--warmup-steps", "1", "--steps", "1", "--profile-steps", "1",
           "--variant", '{"packing": true}', "--out", str(out)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (step,) = json.loads(out.read_text())["traced"]
    assert {"train_step", "_forward", "pack", "backward", "optimizer_step"} <= set(step["host_phase_ms"])
    assert step["device_busy_ms"] == 0 and step["first_kernel_ms"] is None


@pytest.mark.slow  # the benchmark script on CPU, each engine in a process of its own
def test_rollout_engines_runs_every_workload_on_every_engine(tmp_path):
    """benchmarks/rollout_engines.py (the GPU run's rollout benchmark) on CPU at a tiny size: raw
    vLLM, the vLLM Rollout with and without logprobs, the torch Rollout and HF on the fixed and
    long-tail workloads, multi-turn against single-turn, and the mismatch metrics."""
    pytest.importorskip("vllm")
    import math

    out = tmp_path / "engines.json"
    cmd = [sys.executable, "benchmarks/rollout_engines.py", "--device", "cpu", "--model", "tiny_qwen2",
           "--vocab-size", "4096", "--rows", "8", "--samples", "4", "--new-tokens", "6", "--long-tail-max", "16",
           "--mean-length", "6", "--turn-tokens", "4", "--repeats", "2", "--calibration-rounds", "1",
           "--engines", "vllm", "torch", "hf", "--vllm-options", '{"kv_cache_gib": 0.25}', "--out", str(out)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(out.read_text())
    engines = summary["engines"]
    assert sorted(engines) == ["hf", "torch", "vllm"] and all(e["process"]["exit"] == 0 for e in engines.values())
    variants = {**engines["vllm"], "torch": engines["torch"]["torch"], "hf": engines["hf"]["hf"]}
    for name in ("vllm_raw", "vllm_rollout", "vllm_rollout_no_logprobs", "torch", "hf"):
        fixed = variants[name]["fixed"]
        assert fixed["tokens"] == 8 * 6 and fixed["x_raw_vllm"] > 0, (name, fixed)  # eos ignored
        assert len(fixed["walls_s"]) == 2  # one wall per round
        assert 1 <= variants[name]["long_tail"]["length_max"] <= 16
    assert variants["vllm_raw"]["fixed"]["x_raw_vllm"] == 1.0 == variants["vllm_raw"]["fixed"]["x_raw_vllm_wall"]
    rollout = variants["vllm_rollout"]["long_tail"]
    assert rollout["x_raw_vllm_wall"] == pytest.approx(variants["vllm_raw"]["long_tail"]["wall_s"] / rollout["wall_s"])
    for name in ("vllm_rollout", "torch"):
        multi = variants[name]["multi_turn"]
        assert multi["tokens"] == variants[name]["single_turn"]["tokens"] == 8 * 3 * 4  # 3 turns of 4 tokens
        assert multi["x_single_turn_time"] > 0
    for engine in ("vllm", "torch"):
        mismatch = engines[engine]["mismatch"]
        assert math.isfinite(mismatch["kl"]) and mismatch["ratio_max"] >= 1.0
    assert "| vllm_rollout | fixed |" in done.stdout


def test_shared_device_times_each_side_alone_then_both_at_once(tmp_path):
    """benchmarks/shared_device.py (generation and training at once on one device) on CPU at a
    tiny size with the torch rollout: each side alone, then both in their own processes at once."""
    out = tmp_path / "shared.json"
    cmd = [sys.executable, "benchmarks/shared_device.py", "--device", "cpu", "--model", "tiny_qwen2", "--engine",
           "torch", "--rows", "8", "--samples", "2", "--new-tokens", "6", "--train-rows", "8", "--train-tokens", "16",
           "--calls", "2", "--steps", "3", "--out", str(out)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    res = json.loads(out.read_text())
    assert len(res["rollout_alone_s"]) == len(res["rollout_together_s"]) == 2
    assert len(res["train_alone_s"]) == len(res["train_together_s"]) == 3
    assert res["serial_s"] == pytest.approx(sum(res["rollout_alone_s"]) + sum(res["train_alone_s"]))
    assert res["x_serial"] == pytest.approx(res["together_wall_s"] / res["serial_s"])
    (r0, r1), (t0, t1) = res["rollout_together_span"], res["train_together_span"]
    assert r0 < t1 and t0 < r1  # the two sides ran at the same time
    assert res["together_wall_s"] >= max(sum(res["rollout_together_s"]), sum(res["train_together_s"]))
    assert "| together |" in done.stdout
