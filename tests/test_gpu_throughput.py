"""benchmarks/gpu_throughput.py's generate mode on CPU (the script a GPU run starts with):
every engine in its own process on the same prompts, fixed-length completions, ratios to HF,
and vLLM request forms sent to the same engine."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def test_generate_mode_runs_every_engine_on_the_same_fixed_size_work(tmp_path):
    pytest.importorskip("vllm")
    out = tmp_path / "generate.json"
    cmd = [sys.executable, "benchmarks/gpu_throughput.py", "generate", "--device", "cpu", "--model", "nano_qwen2",
           "--rows", "8", "--samples", "4", "--new-tokens", "6", "--repeats", "1",
           "--vllm-variant", '{"kv_cache_gib": 0.25}',
           "--vllm-variant", '{"kv_cache_gib": 0.25, "request_form": "n_per_prompt_bare"}', "--out", str(out)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = json.loads(out.read_text())["runs"]
    assert [(r["engine"], r["options"].get("request_form")) for r in runs] == [
        ("hf", None), ("vllm", None), ("vllm", "n_per_prompt_bare"), ("torch", None)]
    for r in runs:
        size = r["sizes"]["8"]
        assert "error" not in r and size["tokens"] == 8 * 6  # eos ignored: every row decodes 6 tokens
        assert size["tokens_per_s"] > 0 and size["x_hf"] > 0
    assert runs[0]["sizes"]["8"]["x_hf"] == 1.0
    assert runs[1]["settings"]["engine"] == "vllm" and runs[1]["settings"]["enforce_eager"] is True
    assert "| vllm |" in done.stdout and "| torch |" in done.stdout
