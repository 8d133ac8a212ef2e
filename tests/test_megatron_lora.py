"""LoRA and sequence parallelism on the Megatron trainer engine (CPU, fp32), against the torch
engine's peft LoRA on the same model, batch and seed: one rank in this process (a Qwen3 model,
q/k norms included) and two tensor-parallel ranks over a real Ray worker group (sequence
parallelism on and off); the config checks that refuse what the engine does not map."""
import math

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, MistralConfig, Qwen3Config

from algorithms import sft
from algorithms.config.swift_keys import translate
from algorithms.runtime import entry
from orchestration.planner import make_plan
from roles.lora import LoraConfig
from roles.models import load_tokenizer, save_checkpoint
from roles.trainer import Trainer, TrainerConfig
from tests.driver_helpers import composed
from tests.test_trainer import sft_batch

pytest.importorskip("megatron.core")

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one intra-op thread
LORA = {"rank": 4, "alpha": 8.0, "dropout": 0.0}
PARTS = ("full", "adapted", "adapter", "base")


def config(lora: bool = True, **overrides) -> TrainerConfig:
    # (Full-parameter AdamW's first steps move near-zero gradients by a whole lr: a small one
    # keeps fp-level differences within the weights' tolerance.)
    base = dict(lr=1e-2 if lora else 1e-3, weight_decay=0.1, warmup_steps=1, total_steps=10, micro_batch_per_device=3,
                device="cpu", dtype="float32", lora=LoraConfig(**LORA) if lora else LoraConfig())
    return TrainerConfig(**{**base, **overrides})


def tiny_model_folder(path, config_class, **shape) -> str:
    """A random tiny model of `config_class` saved with the char tokenizer (norm weights drawn
    too, so that a norm mapped wrongly shows)."""
    tok = load_tokenizer("tiny_qwen2")
    c = config_class(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                     tie_word_embeddings=True, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                     eos_token_id=tok.eos_token_id, **shape)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(c).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.uniform_(0.5, 1.5)
    return str(save_checkpoint(model, tok, path))


def all_weights(trainer: Trainer, part: str) -> list:
    return [pair for bucket in trainer.state_dict_buckets(1024, part=part) for pair in bucket]


def assert_same_weights(got: list, want: list, atol: float) -> None:
    assert [n for n, _ in got] == [n for n, _ in want]
    for (name, a), (_, b) in zip(got, want):
        torch.testing.assert_close(a, b, atol=atol, rtol=0, msg=name)


def assert_same_step(got: dict, want: dict) -> None:
    for key in ("loss", "grad_norm", "lr", "tokens"):
        assert math.isclose(got[key], want[key], rel_tol=1e-5), (key, got[key], want[key])


def test_one_rank_lora_on_qwen3_equals_the_torch_engine_and_resumes(tmp_path):
    """The adapter starts as peft's (trainer.seed), trains only itself, and its steps, merged and
    adapter weights, base logprobs and saved checkpoint equal the torch engine's."""
    folder = tiny_model_folder(tmp_path / "qwen3", Qwen3Config)
    batch = sft_batch(6, seed=2)
    megatron, torch_ = Trainer(folder, config(), engine="megatron"), Trainer(folder, config())
    trained = {p.data_ptr() for p in megatron.engine.params}
    assert {n for n, p in megatron.model.named_parameters() if p.data_ptr() in trained} == \
        {n for n, p in megatron.model.named_parameters() if ".lora." in n}
    assert sum(p.numel() for p in megatron.engine.params) == sum(p.numel() for p in torch_.engine.params)
    assert_same_weights(all_weights(megatron, "adapter"), all_weights(torch_, "adapter"), atol=0)  # peft's init
    for _ in range(2):
        assert_same_step(megatron.train_step(batch), torch_.train_step(batch))
    for part in PARTS:
        assert_same_weights(all_weights(megatron, part), all_weights(torch_, part), atol=1e-5)
    torch.testing.assert_close(megatron.logprobs(batch), torch_.logprobs(batch), atol=1e-5, rtol=0)
    base = megatron.base_logprobs(batch)
    torch.testing.assert_close(base, torch_.base_logprobs(batch), atol=1e-5, rtol=0)
    assert (base - megatron.logprobs(batch)).abs().max() > 1e-3  # the adapter is off there, and it matters
    megatron.save(tmp_path / "ckpt")
    torch_.save(tmp_path / "torch_ckpt")
    got, want = (AutoModelForCausalLM.from_pretrained(tmp_path / d, local_files_only=True).state_dict()
                 for d in ("ckpt", "torch_ckpt"))
    for name, t in want.items():
        torch.testing.assert_close(got[name], t, atol=1e-5, rtol=0, msg=name)
    next_step = megatron.train_step(batch)
    resumed = Trainer(folder, config(), engine="megatron")
    resumed.load(tmp_path / "ckpt")
    assert resumed.step == 2 and resumed.train_step(batch) == next_step  # adapter, AdamW moments, schedule


class MegatronTrainers:
    """Several Megatron trainers of one TP group in one rank's process, by name."""

    def __init__(self, trainers: dict):
        self.trainers = {name: Trainer(**kwargs) for name, kwargs in trainers.items()}

    def run(self, name: str, method: str, *args, **kwargs):
        return getattr(self.trainers[name], method)(*args, **kwargs)

    def sequence_parallel(self, name: str) -> bool:
        return self.trainers[name].model.config.sequence_parallel


def test_two_tensor_parallel_ranks_with_lora_and_sequence_parallel_equal_the_torch_engine(ray_cluster, tmp_path):
    """TP=2 on 2 ranks, each batch sliced 4 + 3 and joined inside: full-parameter training with
    sequence parallelism, and LoRA without and with it, give the torch engine's losses, gradient
    norms, logprobs (with the adapter off too) and weights in every part (merged, adapter, base);
    a LoRA checkpoint saved after step 1 and loaded after step 2 gives step 2 again."""
    from orchestration.placement import create_placement
    from orchestration.worker_group import WorkerGroup

    batch = sft_batch(7, seed=3)
    runs = {"full_sp": (False, True), "lora": (True, False), "lora_sp": (True, True)}
    trainers = {name: {"model": "tiny_qwen2", "config": config(lora), "engine": "megatron",
                       "engine_options": {"tensor_parallel_size": 2, "sequence_parallel": sp}}
                for name, (lora, sp) in runs.items()}
    plan = make_plan({"device_groups": {"nproc_per_node": 1, "g": {"device": "CPU", "ranks": 2, "workers": ["train"]}}})
    placement = create_placement(plan, timeout_s=60)
    group, got = None, {}
    try:
        group = WorkerGroup(MegatronTrainers, plan["train"], {"trainers": trainers}, placement=placement,
                            timeout_s=300)
        assert group.call("sequence_parallel", "lora_sp") == [True, True]
        assert group.call("sequence_parallel", "lora") == [False, False]
        for name, (lora, _) in runs.items():
            steps = [group.call("run", name, "train_step", batch, dispatch="slice")]
            if name == "lora_sp":
                group.call("run", name, "save", str(tmp_path / "ckpt"))
            steps.append(group.call("run", name, "train_step", batch, dispatch="slice"))
            logprobs = group.call("run", name, "logprobs", batch, dispatch="slice", collect="flatten")
            base = (group.call("run", name, "base_logprobs", batch, dispatch="slice", collect="flatten")
                    if lora else None)
            parts = {part: [p for b in group.call("run", name, "state_dict_buckets", 1024, part=part, execute="first")
                            for p in b] for part in (PARTS if lora else ("full",))}
            got[name] = steps, logprobs, base, parts
        group.call("run", "lora_sp", "load", str(tmp_path / "ckpt"))
        again = group.call("run", "lora_sp", "train_step", batch, dispatch="slice")
    finally:
        if group is not None:
            group.shutdown()
        placement.remove()
    for name, (lora, _) in runs.items():
        steps, logprobs, base, parts = got[name]
        single = Trainer("tiny_qwen2", config(lora))
        for per_rank in steps:
            assert all(r == per_rank[0] for r in per_rank)  # every rank reports the same global metrics
            assert_same_step(per_rank[0], single.train_step(batch))
        torch.testing.assert_close(logprobs, single.logprobs(batch), atol=1e-5, rtol=0)
        if lora:
            torch.testing.assert_close(base, single.base_logprobs(batch), atol=1e-5, rtol=0)
        for part, weights in parts.items():
            assert_same_weights(weights, all_weights(single, part), atol=1e-4 if part == "full" and not lora else 1e-5)
    for before, after in zip(got["lora_sp"][0][1], again):
        assert after["step"] == before["step"] == 2.0
        for key in ("loss", "grad_norm", "lr"):
            assert after[key] == pytest.approx(before[key], rel=1e-6), key


def refusal(capsys, monkeypatch, overrides: list[str]) -> str:
    """The one-line error of the SFT quickstart with `overrides`, before anything starts."""
    monkeypatch.setattr(sft, "run", lambda *a, **k: pytest.fail(f"{overrides} was accepted"))
    cfg = composed(sft.SFTConfig, ["+experiment=sft_quickstart", *overrides])
    with pytest.raises(SystemExit):
        entry.command(sft.SFTConfig, sft.validate, sft.run)(cfg)
    return capsys.readouterr().err


def test_what_the_megatron_engine_does_not_map_is_refused_before_start(tmp_path, capsys, monkeypatch):
    mistral = tiny_model_folder(tmp_path / "mistral", MistralConfig)
    err = refusal(capsys, monkeypatch, ["backend.train=megatron", f"model.path={mistral}"])
    assert "'backend.train'='megatron'" in err and "model_type 'mistral'" in err
    assert "backend.train=torch or deepspeed" in err
    err = refusal(capsys, monkeypatch, ["backend.train=megatron", "trainer.lora.rank=8",
                                        "trainer.lora.modules_to_save=[lm_head]"])
    assert "'trainer.lora'" in err and "lm_head" in err and "backend.train=torch or deepspeed" in err
    # LoRA on the converter's projections, with sequence parallelism, passes the checks.
    monkeypatch.setattr(sft, "run", lambda *a, **k: {"checkpoint": None})
    monkeypatch.setattr(entry, "run_dir", lambda: str(tmp_path / "run"))
    cfg = composed(sft.SFTConfig, ["+experiment=sft_quickstart", "backend.train=megatron", "trainer.lora.rank=8",
                                   "trainer.lora.target_modules=[q_proj,v_proj,down_proj]",
                                   "megatron.sequence_parallel=true"])
    entry.command(sft.SFTConfig, sft.validate, sft.run)(cfg)


def test_ms_swift_sequence_parallel_sets_the_megatron_field():
    _, out, _ = translate({"tensor_model_parallel_size": 2, "sequence_parallel": True}, "sft",
                          OmegaConf.structured(sft.SFTConfig))
    assert out["megatron.sequence_parallel"] is True and out["megatron.tensor_parallel_size"] == 2
