"""Invalid configs across the drivers and the planner, held to one form: the driver's entry
point (algorithms/runtime/entry.py `command`, the body of every driver's Hydra main, on a
composed config) exits 2 with one line
`error: config key 'X'=V ... Fix: ...` naming a key the user can set, before anything starts
(run(), which starts Ray and the roles, is never reached)."""
import pytest

from algorithms import distill, gkd, grpo, sft
from algorithms.runtime import entry
from tests.driver_helpers import composed

DRIVERS = {"sft": (sft, sft.SFTConfig, "sft_quickstart"), "grpo": (grpo, grpo.GRPOConfig, "grpo_quickstart"),
           "gkd": (gkd, gkd.GKDConfig, "gkd_quickstart"),
           "distill": (distill, distill.DistillConfig, "distill_quickstart")}
VLLM_TP = "placement.train.gpus=2 placement.rollout.gpus=2 placement.rollout.vllm_tensor_parallel_size="
GKD_TEACHER_GROUP = ("placement.teacher_model=null placement.offload_teacher_model=false placement.teacher.gpus=1 "
                     "placement.teacher_in_trainer_process=false")

# (driver, overrides, the key the message must name)
CASES = [
    # the run loop
    ("sft", "run.steps=0", "run.steps"),
    ("grpo", "run.steps=-3", "run.steps"),
    ("sft", "run.prompts_per_step=0", "run.prompts_per_step"),
    ("sft", "run.eval_every=-1", "run.eval_every"),
    ("gkd", "run.save_every=-2", "run.save_every"),
    ("sft", "run.eval_max_new_tokens=0", "run.eval_max_new_tokens"),
    ("sft", "placement.train.gpus=2 run.prompts_per_step=1", "run.prompts_per_step"),
    # resume, restarts, trackers
    ("sft", "run.resume=/nonexistent/checkpoints/step_3", "run.resume"),
    ("distill", "run.resume=/nonexistent/checkpoints/step_3", "run.resume"),
    ("grpo", "run.keep_last=-1", "run.keep_last"),
    ("gkd", "run.max_restarts=-1", "run.max_restarts"),
    ("sft", "run.log_every=-1", "run.log_every"),
    ("sft", "run.loggers=[jsonl,comet]", "run.loggers"),
    ("grpo", "run.loggers=[tensorboard]", "run.loggers"),
    ("sft", "cluster.call_timeout_s=-5", "cluster.call_timeout_s"),
    ("sft", "cluster.inline_object_mb=-1", "cluster.inline_object_mb"),
    ("grpo", "backend.rollout=vllm rollout.compile_decode=true", "rollout.compile_decode"),
    # the trainer
    ("sft", "trainer.lr=-1e-3", "trainer.lr"),
    ("grpo", "trainer.lr=0", "trainer.lr"),
    ("gkd", "trainer.lr=-0.5", "trainer.lr"),
    ("sft", "trainer.weight_decay=-0.1", "trainer.weight_decay"),
    ("sft", "trainer.warmup_steps=-1", "trainer.warmup_steps"),
    ("sft", "trainer.grad_clip=-1", "trainer.grad_clip"),
    ("sft", "trainer.micro_batch_per_device=-1", "trainer.micro_batch_per_device"),
    ("grpo", "trainer.micro_batch_memory_mb=0", "trainer.micro_batch_memory_mb"),
    ("grpo", "trainer.optimizer=sgd", "trainer.optimizer"),
    ("grpo", "trainer.adam_eps=0", "trainer.adam_eps"),
    ("sft", "trainer.schedule=step", "trainer.schedule"),
    ("sft", "trainer.min_lr=1.0", "trainer.min_lr"),
    ("sft", "backend.train=deepspeed trainer.packing=true", "trainer.packing"),
    ("grpo", "trainer.cuda_graphs=true", "trainer.cuda_graphs"),
    ("gkd", "trainer.warmup_ratio=1.5", "trainer.warmup_ratio"),
    ("grpo", "run.log_level=LOUD", "run.log_level"),
    ("sft", "data.system=/no/such/system.txt", "data.system"),
    ("grpo", "trainer.dtype=fp8", "trainer.dtype"),
    ("sft", "trainer.betas=[0.9,1.5]", "trainer.betas"),
    ("sft", "trainer.warmup_steps=5000", "trainer.warmup_steps"),
    ("grpo", "run.steps=4 trainer.warmup_steps=4 algorithm.steps_per_generation=1", "trainer.warmup_steps"),
    # models
    ("sft", "model.path=/nonexistent/student", "model.path"),
    ("grpo", "model.path=/", "model.path"),
    ("sft", "model.hidden_size=30", "model"),
    ("sft", "model.arch=gpt2", "model"),
    ("gkd", "placement.teacher_model=/nonexistent/teacher", "placement.teacher_model"),
    ("gkd", f"{GKD_TEACHER_GROUP} teacher.model=/nonexistent/teacher", "teacher.model"),
    ("gkd", f"{GKD_TEACHER_GROUP} placement.teacher.model=/nonexistent/teacher", "placement.teacher.model"),
    # data
    ("sft", "data.train_size=0", "data.train_size"),
    ("grpo", "data.eval_size=0", "data.eval_size"),
    ("sft", "data.task=files", "data.paths"),
    ("sft", "data.task=files data.paths=[/nonexistent/train.jsonl]", "data.paths"),
    ("grpo", "data.task=bogus", "data.task"),
    ("sft", "data.arithmetic.min_operands=1", "data.arithmetic.min_operands"),
    ("sft", "data.arithmetic.min_digits=2 data.arithmetic.max_digits=1", "data.arithmetic.max_digits"),
    ("sft", "data.arithmetic.ops=/", "data.arithmetic.ops"),
    ("sft", "data.arithmetic.heldout_fraction=1.5", "data.arithmetic.heldout_fraction"),
    # engines, weight sync, rollout, cluster
    ("sft", "backend.train=jax", "backend.train"),
    ("grpo", "backend.rollout=sglang", "backend.rollout"),
    ("gkd", "backend.teacher=onnx", "backend.teacher"),
    ("sft", "backend.workers=threads", "backend.workers"),
    ("grpo", "weight_sync.path=carrier_pigeon", "weight_sync.path"),
    ("grpo", "weight_sync.bucket_mb=0", "weight_sync.bucket_mb"),
    ("grpo", "weight_sync.checksum=md5", "weight_sync.checksum"),
    ("gkd", "weight_sync.timeout_s=0", "weight_sync.timeout_s"),
    ("grpo", "rollout.max_batch_size=0", "rollout.max_batch_size"),
    ("grpo", "rollout.dtype=int8", "rollout.dtype"),
    ("sft", "cluster.placement_timeout_s=0", "cluster.placement_timeout_s"),
    ("sft", "cluster.simulate_gpus=0", "cluster.simulate_gpus"),
    ("sft", "cluster.num_cpus=0", "cluster.num_cpus"),
    ("sft", "config_file=/nonexistent/swift.yaml", "config_file"),
    # the planner
    ("sft", "placement.train.gpus=0", "placement.train.gpus"),
    ("sft", "placement.train.gpus=-1", "placement.train.gpus"),
    ("sft", "placement.train.gpus=0 placement.train.model=tiny_llama", "placement.train.model"),
    ("grpo", "placement.rollout.gpus=0", "placement.colocate_groups"),
    ("gkd", "placement.sleep_level=3", "placement.sleep_level"),
    ("gkd", "placement.colocate_groups=[[train,rollout,critic]]", "placement.colocate_groups"),
    ("gkd", "placement.train.gpus=2", "placement.colocate_groups"),
    ("gkd", "placement.teacher.gpus=1", "placement.offload_teacher_model"),
    ("gkd", "placement.teacher_model=null placement.offload_teacher_model=false placement.teacher_in_trainer_process=false",
     "placement"),
    ("distill", "placement.train={gpus:1}", "placement.train"),
    ("distill", "+placement.device_groups.sample_group.ranks=[0,0]", "placement.device_groups.sample_group.ranks"),
    # GRPO
    ("grpo", "algorithm.num_generations=1", "algorithm.num_generations"),
    ("grpo", "algorithm.scale_rewards=foo", "algorithm.scale_rewards"),
    ("grpo", "algorithm.loss_type=ppo", "algorithm.loss_type"),
    ("grpo", "algorithm.prm_aggregate=max", "algorithm.prm_aggregate"),
    ("grpo", "algorithm.reward_funcs=[]", "algorithm.reward_funcs"),
    ("grpo", "algorithm.reward_funcs=[accuracy] algorithm.reward_weights=[1,2]", "algorithm.reward_weights"),
    ("grpo", "algorithm.reward_funcs=[accurate] algorithm.reward_weights=[]", "algorithm.reward_funcs"),
    ("grpo", "algorithm.reward_funcs=[nosuchpkg.rewards.fn] algorithm.reward_weights=[]", "algorithm.reward_funcs"),
    ("grpo", "algorithm.reward_funcs=[os.path.no_such_function] algorithm.reward_weights=[]", "algorithm.reward_funcs"),
    ("grpo", "algorithm.reward_funcs=[prm,prm] algorithm.reward_weights=[]", "algorithm.reward_funcs"),
    ("grpo", "algorithm.epsilon=0", "algorithm.epsilon"),
    ("grpo", "algorithm.epsilon_high=0.1", "algorithm.epsilon_high"),
    ("grpo", "algorithm.beta=-0.1", "algorithm.beta"),
    ("grpo", "algorithm.temperature=0", "algorithm.temperature"),
    ("grpo", "algorithm.max_new_tokens=0", "algorithm.max_new_tokens"),
    ("grpo", "algorithm.steps_per_generation=0", "algorithm.steps_per_generation"),
    ("grpo", "algorithm.max_staleness=-1", "algorithm.max_staleness"),
    ("grpo", "placement=colocate algorithm.max_staleness=1", "algorithm.max_staleness"),
    ("grpo", "algorithm.warmup_sft_lr=0", "algorithm.warmup_sft_lr"),
    ("grpo", "algorithm.warmup_sft_batch=0", "algorithm.warmup_sft_batch"),
    ("grpo", "algorithm.format_pattern='('", "algorithm.format_pattern"),
    ("grpo", "algorithm.dynamic_sample=true algorithm.max_resample_times=-1", "algorithm.max_resample_times"),
    # GKD
    ("gkd", "algorithm.beta=2", "algorithm.beta"),
    ("gkd", "algorithm.topk_mode=bogus", "algorithm.topk_mode"),
    ("gkd", "algorithm.lmbda=1.5", "algorithm.lmbda"),
    ("gkd", "algorithm.temperature=0", "algorithm.temperature"),
    ("gkd", "algorithm.sft_alpha=-1", "algorithm.sft_alpha"),
    ("gkd", "algorithm.max_new_tokens=0", "algorithm.max_new_tokens"),
    ("gkd", "algorithm.logits_topk=100000", "algorithm.logits_topk"),
    ("gkd", "algorithm.logits_topk=0", "algorithm.logits_topk"),
    ("gkd", "backend.teacher=vllm", "backend.teacher"),  # full vocabulary: vLLM serves top-k only
    ("gkd", "backend.teacher=vllm algorithm.logits_topk=100", "algorithm.logits_topk"),
    ("gkd", "teacher.warmup_lr=0", "teacher.warmup_lr"),
    ("gkd", "teacher.warmup_batch=0", "teacher.warmup_batch"),
    ("gkd", "teacher.warmup_steps=-1", "teacher.warmup_steps"),
    ("gkd", "teacher.engine.micro_batch_per_device=-1", "teacher.engine.micro_batch_per_device"),
    ("gkd", "teacher.engine.micro_batch_memory_mb=0", "teacher.engine.micro_batch_memory_mb"),
    ("gkd", "backend.teacher=vllm algorithm.logits_topk=8 teacher.engine.chunked_logprobs=true",
     "teacher.engine.chunked_logprobs"),
    # A teacher in the trainer's processes: only a colocated teacher.
    ("gkd", "placement.teacher_model=null placement.offload_teacher_model=false placement.teacher.gpus=1 "
            "placement.teacher_in_trainer_process=true",
     "placement.teacher_in_trainer_process"),
    # Only vLLM engines span several ranks, each rank its own process, heads split evenly.
    ("gkd", VLLM_TP + "2", "placement.rollout.vllm_tensor_parallel_size"),
    ("gkd", "backend.rollout=vllm backend.workers=local " + VLLM_TP + "2",
     "placement.rollout.vllm_tensor_parallel_size"),
    ("gkd", "backend.rollout=vllm backend.workers=ray placement.train.gpus=3 placement.rollout.gpus=3 "
            "placement.rollout.vllm_tensor_parallel_size=3", "placement.rollout.vllm_tensor_parallel_size"),
    # distill
    ("distill", "algorithm.num_return_sequences=1", "algorithm.num_return_sequences"),
    ("distill", "algorithm.n_best_to_keep=8", "algorithm.n_best_to_keep"),
    ("distill", "algorithm.sampler_type=mcts", "algorithm.sampler_type"),
    ("distill", "algorithm.output_file=a/b.jsonl", "algorithm.output_file"),
    ("distill", "trainer.warmup_steps=5", "trainer.warmup_steps"),
    ("distill", "algorithm.top_p=0", "algorithm.top_p"),
    ("distill", "algorithm.easy_query_threshold=2", "algorithm.easy_query_threshold"),
    ("distill", "algorithm.sft_batch=0", "algorithm.sft_batch"),
    ("distill", "algorithm.warmup_lr=0", "algorithm.warmup_lr"),
    ("distill", "prm.kind=neural", "prm.kind"),
    ("distill", "prm.aggregate=max", "prm.aggregate"),
    ("distill", "orm.kind=custom", "orm.reward_fn"),
    ("distill", "orm.kind=custom orm.reward_fn=nosuchpkg.rewards.fn", "orm.reward_fn"),
    ("distill", "orm.kind=model", "orm.model"),
    ("distill", "orm.kind=model orm.model=/nonexistent/rm", "orm.model"),
    # values no comparison holds for (nan, inf), run length, seeds
    ("sft", "trainer.grad_clip=inf", "trainer.grad_clip"),
    ("sft", "trainer.adam_eps=inf", "trainer.adam_eps"),
    ("grpo", "algorithm.temperature=inf", "algorithm.temperature"),
    ("gkd", "algorithm.sft_alpha=inf", "algorithm.sft_alpha"),
    ("distill", "prm.lr=inf", "prm.lr"),
    ("sft", "run.epochs=-1", "run.epochs"),
    ("gkd", "run.epochs=nan", "run.epochs"),
    ("sft", "trainer.seed=99999999999999999999", "trainer.seed"),
    ("grpo", "data.seed=-1", "data.seed"),
    # a model's tokenizer, shape and load options
    ("sft", "model.tokenizer=/nonexistent/tokenizer", "model.tokenizer"),
    ("grpo", "model.tokenizer=bogus", "model.tokenizer"),
    ("sft", "model.dtype=float8", "model.dtype"),
    ("gkd", "model.attn_implementation=flash", "model.attn_implementation"),
    ("sft", "model.num_attention_heads=0", "model.num_attention_heads"),
    ("grpo", "model.num_key_value_heads=0", "model.num_key_value_heads"),
    ("sft", "model.intermediate_size=-1", "model.intermediate_size"),
    ("distill", "model.vocab_size=5", "model.vocab_size"),
    ("sft", "model.rms_norm_eps=-1", "model.rms_norm_eps"),
    # data
    ("grpo", "data.max_length=-5", "data.max_length"),
    ("sft", "data.train_size=100000", "data.train_size"),
    ("distill", "data.eval_size=100000", "data.eval_size"),
    ("grpo", "data.task=files data.paths=[/]", "data.paths"),
    # engine sections
    ("sft", "backend.train=deepspeed deepspeed.zero_stage=1", "deepspeed.zero_stage"),
    ("sft", "backend.train=deepspeed deepspeed.offload_param=true", "deepspeed.offload_param"),
    ("sft", "backend.train=megatron megatron.tensor_parallel_size=0", "megatron.tensor_parallel_size"),
    ("gkd", "backend.train=megatron megatron.tensor_parallel_size=2", "megatron.tensor_parallel_size"),
    ("grpo", "backend.rollout=vllm vllm.gpu_memory_utilization=2", "vllm.gpu_memory_utilization"),
    ("grpo", "backend.rollout=vllm vllm.max_model_len=0", "vllm.max_model_len"),
    ("gkd", "vllm.max_num_seqs=0", "vllm.max_num_seqs"),
]


class Started(Exception):
    pass


def test_the_table_holds_at_least_80_cases_over_every_driver():
    assert len(CASES) >= 80 and {driver for driver, _, _ in CASES} == set(DRIVERS)
    assert len({(d, o) for d, o, _ in CASES}) == len(CASES)


@pytest.mark.parametrize("driver, overrides, key", CASES, ids=[f"{d}:{o}" for d, o, _ in CASES])
def test_invalid_config_is_one_line_naming_the_key_before_anything_starts(monkeypatch, capsys, driver, overrides,
                                                                           key):
    module, schema, experiment = DRIVERS[driver]

    def started(*args, **kwargs):
        raise Started(f"{driver}.run() was reached: the config {overrides!r} was accepted")

    monkeypatch.setattr(module, "run", started)
    monkeypatch.setattr("ray.init", started)
    cfg = composed(schema, [f"+experiment={experiment}", *overrides.split()])
    with pytest.raises(SystemExit) as exit_info:
        entry.command(schema, module.validate, module.run)(cfg)
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and "Fix:" in err, err
    assert f"'{key}" in err, err


def test_the_quickstarts_themselves_pass(monkeypatch):
    """The table's base configs are valid: each case fails for its own override."""
    for name, (module, schema, experiment) in DRIVERS.items():
        cfg = composed(schema, [f"+experiment={experiment}"])
        monkeypatch.setattr(module, "run", lambda *a, **k: {"checkpoint": None})
        monkeypatch.setattr(entry, "run_dir", lambda: "/nonexistent/run_dir")
        entry.command(schema, module.validate, module.run)(cfg)


@pytest.mark.parametrize("driver, overrides, key, missing", [
    ("grpo", "backend.rollout=vllm", "backend.rollout", "vllm"),
    ("distill", "backend.rollout=vllm", "backend.rollout", "vllm"),  # the sampler's engine
    ("gkd", "backend.teacher=vllm algorithm.logits_topk=8", "backend.teacher", "vllm"),
    ("sft", "backend.train=deepspeed", "backend.train", "deepspeed"),
    ("grpo", "backend.train=megatron", "backend.train", "megatron"),
])
def test_a_backend_whose_package_is_missing_is_named_before_anything_starts(monkeypatch, capsys, driver, overrides,
                                                                            key, missing):
    """A backend's package hidden from the import system: the same one-line error, naming the
    backend key and how to install it or pick the torch engine."""
    import importlib.util

    module, schema, experiment = DRIVERS[driver]
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.split(".")[0] == missing else find_spec(name, *a))
    monkeypatch.setattr(module, "run", lambda *a, **k: pytest.fail("run() was reached"))
    cfg = composed(schema, [f"+experiment={experiment}", *overrides.split()])
    with pytest.raises(SystemExit) as exit_info:
        entry.command(schema, module.validate, module.run)(cfg)
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1, err
    assert f"'{key}'" in err and "is not installed" in err and f"{key}=torch" in err, err
