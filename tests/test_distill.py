"""Distill/sample driver: selection and call order with fake roles, real runs on Ray and
locally on a tiny model, and ms-swift sampling YAML through config_file."""
import io
import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module

from algorithms.config.schema import LoopConfig, prepare
from algorithms.distill import DistillAlgorithm, DistillConfig, validate, run, sample, select
from algorithms.records.runlog import RunLog
from algorithms.records.trackers import read_metrics
from algorithms.data.tasks import arithmetic_examples
from algorithms.data.user_data import load_user_data
from orchestration.config import BackendConfig, ConfigError, register_schema
from orchestration.base_group import GroupFuture
from roles.batch import Completions


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one intra-op thread


class FakeGroup:
    """A worker group stand-in: records (role, method, n, dispatch, collect), answers with `fn`."""

    def __init__(self, role, fn, calls):
        self.role, self.fn, self.calls = role, fn, calls

    def call(self, method, *args, dispatch="all", execute="all", collect="none", **kwargs):
        n = args[1] if method == "sample" else None
        self.calls.append((self.role, method, n, dispatch, collect))
        return self.fn(*args, **kwargs)

    def async_call(self, method, *args, **kwargs):
        value = self.call(method, *args, **kwargs)
        return GroupFuture(lambda timeout: value)


def candidates(answer):
    """Four candidates of known scores: (text, prm, orm); B and C end with the right answer."""
    return [("A\n#### -1", 1.0, 0.0), (f"B\n#### {answer}", 0.9, 1.0), (f"C\n#### {answer}", 0.2, 1.0),
            ("D", 0.0, 0.0)]


def fake_roles(examples, calls):
    by_prompt = {ex.prompt: ex for ex in examples}
    table = {text: (p, o) for ex in examples for text, p, o in candidates(ex.answer)}

    def sample_fn(prompts, n, sampling):
        exs = [by_prompt[p[-1]["content"]] for p in prompts]
        if sampling.temperature == 0:  # greedy eval: right on the first prompt only
            texts = [ex.solution if i == 0 else "no" for i, ex in enumerate(exs)]
        else:
            texts = [t for ex in exs for t, _, _ in candidates(ex.answer)][:len(exs) * n]
        k = len(texts)
        return Completions(list(range(k)), [[1]] * k, [[2]] * k, texts, [], ["stop"] * k)

    return (FakeGroup("sampler", sample_fn, calls),
            FakeGroup("prm", lambda prompts, texts, refs: [table[t][0] for t in texts], calls),
            FakeGroup("orm", lambda prompts, texts, refs: [table[t][1] for t in texts], calls))


@pytest.mark.parametrize("workers", ["ray", "local"])
def test_selection_call_order_and_dataset_with_fake_roles(tmp_path, workers):
    examples = arithmetic_examples(6, seed=3)
    cfg = DistillConfig(algorithm=DistillAlgorithm(num_return_sequences=4, n_best_to_keep=2, prm_threshold=0.5),
                           run=LoopConfig(steps=2, prompts_per_step=3, eval_max_new_tokens=8),
                           backend=BackendConfig(workers=workers))
    calls = []
    sampler, prm, orm = fake_roles(examples, calls)
    log = RunLog(tmp_path, cfg.run.steps, LoopConfig(), stream=io.StringIO())
    record = sample(cfg, sampler, prm, orm, examples, examples[:2], tmp_path / "sampled.jsonl", log)
    log.close()

    # Eval (greedy, one sample per prompt), then per step: sample -> PRM -> ORM, all sliced and
    # flattened; on Ray the next step's sample is sent before this step's scores.
    sampled, scores = [("sampler", "sample", 4)], [("prm", "score", None), ("orm", "score", None)]
    steps = sampled * 2 + scores * 2 if workers == "ray" else (sampled + scores) * 2
    assert [c[:3] for c in calls] == [("sampler", "sample", 1)] + steps
    assert all(c[3:] == ("slice", "flatten") for c in calls)
    # Ranking by PRM + ORM: B (1.9), C (1.2), A (1.0), D (0.0). The best two are B and C, but
    # C's PRM 0.2 is under the threshold, so one row per prompt: B, with D rejected.
    rows = [json.loads(line) for line in (tmp_path / "sampled.jsonl").read_text().splitlines()]
    assert len(rows) == 6
    for row in rows:
        ex = next(e for e in examples if e.prompt == row["prompt"])
        assert row["messages"] == [{"role": "user", "content": ex.prompt},
                                   {"role": "assistant", "content": f"B\n#### {ex.answer}"}]
        assert row["rejected_response"] == "D" and row["answer"] == ex.answer
        assert (row["prm_score"], row["orm_score"], row["score"], row["rejected_score"]) == (0.9, 1.0, 1.9, 0.0)
    # Metrics: per step and, on the last line, totals; step 0 holds the greedy eval.
    metrics = read_metrics(tmp_path / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1, 2] and metrics[0]["eval/accuracy"] == 0.5
    assert metrics[1]["sample/kept"] == 3 and metrics[1]["sample/candidates"] == 12
    assert record["total/kept"] == 6 and record["total/candidates"] == 24
    assert record["total/accuracy_all"] == 0.5 and record["total/accuracy_kept"] == 1.0
    assert record["total/pass_at_n"] == 1.0 and record["total/prm_mean"] == pytest.approx(0.525)
    # The rows load as SFT data (data.task=files).
    data = load_user_data([str(tmp_path / "sampled.jsonl")])
    assert data.skipped == 0 and [ex.prompt for ex in data.examples] == [r["prompt"] for r in rows]
    assert data.examples[0].answer == rows[0]["answer"]


def test_select_threshold_weight_and_easy_queries():
    ex = arithmetic_examples(1, seed=5)
    texts = [t for t, _, _ in candidates(ex[0].answer)]
    prm, orm = [c[1] for c in candidates("")], [c[2] for c in candidates("")]
    correct = [0.0, 1.0, 1.0, 0.0]
    keep = lambda rows: [r["messages"][-1]["content"][0] for r in rows]
    algo = DistillAlgorithm(num_return_sequences=4, n_best_to_keep=2, prm_threshold=0.0)
    assert keep(select(ex, texts, prm, orm, correct, algo)[0]) == ["B", "C"]
    # Without the ORM in the score, A (PRM 1.0) ranks first.
    assert keep(select(ex, texts, prm, orm, correct, DistillAlgorithm(4, 2, 0.5, orm_weight=0.0))[0]) == ["A", "B"]
    # Nothing passes a threshold above every PRM score; the prompt is still counted.
    rows, counts = select(ex, texts, prm, orm, correct, DistillAlgorithm(4, 3, 1.5))
    assert rows == [] and counts["candidates"] == 4 and counts["kept"] == 0
    # Half the candidates are right by the ORM: dropped as too easy above 0.4, kept at 0.5.
    rows, counts = select(ex, texts, prm, orm, correct, DistillAlgorithm(4, 2, 0.0, easy_query_threshold=0.4))
    assert rows == [] and counts["easy_skipped"] == 1
    assert len(select(ex, texts, prm, orm, correct, DistillAlgorithm(4, 2, 0.0, easy_query_threshold=0.5))[0]) == 2


def tiny_config(placement, **algorithm):
    """A composed-like config for a few seconds of sampling from the untrained tiny model."""
    return {"placement": placement, "model": {"name": "tiny_qwen2"},
            "algorithm": {"num_return_sequences": 3, "n_best_to_keep": 1, "prm_threshold": 0.0,
                          "max_new_tokens": 8, "sft_batch": 4, **algorithm},
            "data": {"task": "arithmetic", "train_size": 16, "eval_size": 4,
                     "arithmetic": {"max_operands": 2, "ops": "+-"}},
            "run": {"steps": 2, "prompts_per_step": 3, "eval_max_new_tokens": 8}}


DEVICE_GROUPS = {"nproc_per_node": 1,
                 "sample_group": {"device": "GPU", "ranks": [0], "workers": ["sampler"]},
                 "rm_group": {"device": "CPU", "ranks": 2, "workers": ["prm", "orm"]}}


def check_outputs(out_dir, record, prompts):
    rows = [json.loads(line) for line in (out_dir / "sampled.jsonl").read_text().splitlines()]
    assert len(rows) == prompts == record["total/kept"]  # threshold 0: the best of each prompt
    assert all(r["messages"][0]["role"] == "user" and r["messages"][1]["role"] == "assistant" for r in rows)
    assert all({"rejected_response", "prm_score", "orm_score", "score", "prompt", "answer"} <= set(r) for r in rows)
    metrics = read_metrics(out_dir / "metrics.jsonl")
    assert "eval/accuracy" in metrics[0] and metrics[-1]["total/candidates"] == 3 * prompts
    assert 0.0 <= metrics[-1]["total/accuracy_all"] <= 1.0 and "time/generate" in metrics[-1]


# In CI: the distill driver on Ray with device groups (test_experiments_run, distill_quickstart) and
# vLLM's tensor-parallel engines (test_vllm_engine).
@pytest.mark.slow
def test_end_to_end_on_ray_with_a_tensor_parallel_vllm_sampler_and_a_cpu_reward_group(ray_cluster, tmp_path):
    """The sampler's two ranks hold one vLLM engine (device_groups.<group>.vllm_tensor_parallel_size);
    the PRM and ORM share a CPU group of two ranks. (The torch sampler on Ray: the distill
    quickstart in tests/test_experiments_run.py::test_experiment_runs_one_step_on_ray.)"""
    pytest.importorskip("vllm")
    groups = {**DEVICE_GROUPS, "nproc_per_node": 2, "sample_group": {
        "device": "GPU", "ranks": [0, 1], "workers": ["sampler"], "vllm_tensor_parallel_size": 2}}
    typed, plan = prepare({**tiny_config({"device_groups": groups}), "backend": {"rollout": "vllm"}},
                          DistillConfig)
    validate(typed, plan)
    assert plan["sampler"].world_size == 2 and plan["sampler"].tensor_parallel_size == 2
    assert plan["prm"].device == "CPU" and plan["orm"].world_size == 2 and plan["sampler"].device == "GPU"
    record = run(typed, plan, tmp_path)
    check_outputs(tmp_path, record, prompts=6)
    local = {**tiny_config({"device_groups": groups}), "backend": {"rollout": "vllm", "workers": "local"}}
    with pytest.raises(ConfigError, match="device_groups.sample_group.vllm_tensor_parallel_size"):
        validate(*prepare(local, DistillConfig))


def test_end_to_end_local_with_warmup_and_sft_on_the_kept_rows(tmp_path):
    cfg = tiny_config({"device_groups": DEVICE_GROUPS}, warmup_sft_steps=2, sft_steps=2)
    typed, plan = prepare({**cfg, "backend": {"workers": "local"}}, DistillConfig)
    validate(typed, plan)
    record = run(typed, plan, tmp_path)
    check_outputs(tmp_path, record, prompts=6)
    # The SFT phases ran and wrote their own metrics; the policy after warm-up sampled.
    warm = read_metrics(tmp_path / "warmup_sft" / "metrics.jsonl")
    tuned = read_metrics(tmp_path / "sft" / "metrics.jsonl")
    assert [m["step"] for m in warm] == [m["step"] for m in tuned] == [0, 1, 2]
    assert tuned[-1]["eval/accuracy"] == record["sft/eval_accuracy"]
    assert (tmp_path / "heldout.jsonl").read_text().count("\n") == 4
    assert (tmp_path / "sft" / "checkpoints" / "step_2" / "config.json").is_file()


SWIFT_SAMPLING = """
num_return_sequences: 4
n_best_to_keep: 2
prm_threshold: 0.8
temperature: 0.7
top_p: 0.9
max_new_tokens: 32
output_file: sampling.jsonl
sampler_type: sample
device_groups:
  nproc_per_node: 4
  sample_group:
    device: GPU
    ranks: list(range(0, 2))
    workers:
      - sampler
  rm_group:
    device: CPU
    ranks: 2
    workers:
      - prm
      - orm
"""


def test_ms_swift_sampling_yaml_loads_through_config_file_and_plans(tmp_path):
    path = tmp_path / "sampling.yaml"
    path.write_text(SWIFT_SAMPLING)
    typed, plan = prepare({"config_file": str(path)}, DistillConfig)
    validate(typed, plan)
    algo = typed.algorithm
    assert (algo.num_return_sequences, algo.n_best_to_keep, algo.prm_threshold, algo.temperature, algo.top_p,
            algo.max_new_tokens, algo.output_file) == (4, 2, 0.8, 0.7, 0.9, 32, "sampling.jsonl")
    assert plan["sampler"].ranks == (0, 1) and plan["sampler"].device == "GPU"
    assert plan["prm"].device == plan["orm"].device == "CPU" and plan["prm"].colocated_with == ("orm",)
    # orm_model: math is ms-swift's math ORM; a PRM id that is neither local nor cached is refused by name.
    path.write_text(SWIFT_SAMPLING + "sampler_engine: vllm\nprm_model: Qwen/Qwen2.5-Math-PRM-7B\norm_model: math\n")
    with pytest.raises(ConfigError, match=r"1 key\(s\) .*prm_model='Qwen/Qwen2.5-Math-PRM-7B'"):
        prepare({"config_file": str(path)}, DistillConfig)
    path.write_text(SWIFT_SAMPLING.replace("n_best_to_keep: 2", "n_best_to_keep: 4"))
    typed, plan = prepare({"config_file": str(path)}, DistillConfig)
    with pytest.raises(ConfigError, match="algorithm.n_best_to_keep.*must lie in"):
        validate(typed, plan)


def test_quickstart_composes_validates_and_plans():
    register_schema(DistillConfig)
    with initialize_config_module(config_module="conf", version_base=None):
        cfg = compose(config_name="config", overrides=["+experiment=distill_quickstart"])
    typed, plan = prepare(cfg, DistillConfig)
    validate(typed, plan)
    assert plan["sampler"].device == "GPU" and plan["prm"].device == "CPU" and plan["prm"].world_size == 2
    assert typed.prm.kind == "arithmetic" and typed.orm.kind == "numeric"
    assert typed.algorithm.warmup_sft_steps > 0 and typed.algorithm.sft_steps > 0
    # Its SFT phases run on the sampler's single rank: a Megatron TP of 2 cannot split it.
    typed.backend.train, typed.megatron.tensor_parallel_size = "megatron", 2
    with pytest.raises(ConfigError, match="megatron.tensor_parallel_size"):
        validate(typed, plan)


def test_a_sampling_resumed_after_a_generation_sent_ahead_draws_the_same_prompts(tmp_path, monkeypatch):
    """On Ray step k+1's prompts are drawn (and their generation sent) before step k is scored: the
    state written after step k still points the stream at step k+1's prompts, so a run resumed
    from it keeps what a straight run keeps."""
    examples = arithmetic_examples(12, seed=5)
    cfg = DistillConfig(algorithm=DistillAlgorithm(num_return_sequences=4, n_best_to_keep=1),
                           run=LoopConfig(steps=3, prompts_per_step=2, eval_max_new_tokens=8))

    def sampled(out: Path, resumed=None) -> str:
        log = RunLog(out, cfg.run.steps, LoopConfig(), stream=io.StringIO())
        try:
            sample(cfg, *fake_roles(examples, []), examples, examples[:2], out / "sampled.jsonl", log, resumed)
        finally:
            log.close()
        return (out / "sampled.jsonl").read_text()

    straight = sampled(tmp_path / "straight")
    step = RunLog.step

    def dying(self, s, metrics, quiet=False):
        if s == 2:
            raise RuntimeError("killed during sampling step 2")
        return step(self, s, metrics, quiet)

    with monkeypatch.context() as m:
        m.setattr(RunLog, "step", dying)
        with pytest.raises(RuntimeError, match="killed"):
            sampled(tmp_path / "resumed")
    state = json.loads((tmp_path / "resumed" / "sampling_state.json").read_text())
    assert state["step"] == 1 and state["stream"] == 1  # step 2's prompts were drawn already
    assert sampled(tmp_path / "resumed", state) == straight and straight.count("\n") == 6
