"""Model factory: presets build and run, checkpoints round-trip through plain transformers."""
import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen2Config, \
    Qwen2ForCausalLM

from roles.models import ModelConfig, build_model, load_tokenizer, preset_dir, preset_names, resolve_config, \
    save_checkpoint
from roles.tokenizers import build_char_tokenizer

PROMPT = "((12+7)*3)-5"


def _ids(tok, texts=(PROMPT, "1+1=2")):
    return tok(list(texts), padding=True, return_tensors="pt")


def test_presets_are_documented_and_typed():
    names = preset_names()
    assert {"tiny_qwen2", "tiny_llama", "small_qwen2", "tiny_qwen2_gpt2"} <= set(names)
    for name in names:
        path = preset_dir() / f"{name}.yaml"
        lines = path.read_text().splitlines()
        # Every field has a comment on the line above it.
        for i, line in enumerate(lines):
            if line and not line.startswith("#"):
                assert lines[i - 1].startswith("#"), f"{path}: no comment above '{line}'"
        cfg = resolve_config(name)
        assert isinstance(cfg, ModelConfig) and cfg.name == name and cfg.path is None


@pytest.mark.parametrize("name,cls", [("tiny_qwen2", Qwen2ForCausalLM), ("tiny_llama", LlamaForCausalLM),
                                      ("small_qwen2", Qwen2ForCausalLM)])
def test_preset_builds_and_runs_forward_backward(name, cls):
    model, tok = build_model(name), load_tokenizer(name)
    assert isinstance(model, cls)
    cfg = model.config
    assert cfg.hidden_size // cfg.num_attention_heads >= 32
    assert cfg.vocab_size == len(tok) and cfg.eos_token_id == tok.eos_token_id
    n_params = sum(p.numel() for p in model.parameters())
    assert 2e5 < n_params < 5e6
    batch = _ids(tok)
    out = model(**batch, labels=batch["input_ids"])
    assert out.logits.shape == (2, batch["input_ids"].shape[1], len(tok))
    assert torch.isfinite(out.loss)
    out.loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_preset_is_deterministic_from_its_seed_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = build_model("tiny_qwen2")
    assert torch.equal(torch.rand(1), before)
    b = build_model("tiny_qwen2")
    c = build_model(ModelConfig(name="tiny_qwen2", seed=1))
    for (k, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), k
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)


def test_gpt2_preset_uses_gpt2_vocabulary():
    model = build_model("tiny_qwen2_gpt2")
    tok = load_tokenizer("tiny_qwen2_gpt2")
    assert model.config.vocab_size == len(tok) == 50260
    with torch.no_grad():
        logits = model(**_ids(tok, ["Natalia sold clips to 48 of her friends."])).logits
    assert logits.shape[-1] == 50260


@pytest.mark.parametrize("name", ["tiny_qwen2", "tiny_llama"])
def test_checkpoint_round_trip_with_plain_transformers(name, tmp_path):
    model, tok = build_model(name), load_tokenizer(name)
    save_checkpoint(model, tok, tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    plain_model = AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True)
    plain_tok = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    batch, plain_batch = _ids(tok), _ids(plain_tok)
    assert torch.equal(batch["input_ids"], plain_batch["input_ids"])
    # The factory loads the same directory by path, as a string or as model.path.
    ours = build_model(str(tmp_path))
    by_field = build_model({"path": str(tmp_path)})
    assert load_tokenizer(str(tmp_path))(PROMPT)["input_ids"] == tok(PROMPT)["input_ids"]
    with torch.no_grad():
        ref = model(**batch).logits
        for other in (plain_model.eval(), ours, by_field):
            assert torch.equal(other(**batch).logits, ref)
    # Greedy generation works from the saved generation config.
    out = plain_model.generate(**_ids(plain_tok, [PROMPT]), max_new_tokens=4, do_sample=False)
    assert out.shape == (1, len(PROMPT) + 4)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_user_checkpoint_saved_by_transformers_loads(arch, tmp_path):
    tok = build_char_tokenizer()
    common = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)
    torch.manual_seed(0)
    if arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    model.eval().save_pretrained(tmp_path / "ckpt")
    tok.save_pretrained(tmp_path / "ckpt")
    loaded = build_model(ModelConfig(path=str(tmp_path / "ckpt")))
    assert type(loaded) is type(model) and not loaded.training
    batch = _ids(load_tokenizer(str(tmp_path / "ckpt")))
    with torch.no_grad():
        assert torch.equal(loaded(**batch).logits, model(**batch).logits)
    # Its own tokenizer wins over a preset's tokenizer field (`model=tiny_qwen2_gpt2 model.path=...`).
    assert len(load_tokenizer(ModelConfig(path=str(tmp_path / "ckpt"), tokenizer="gpt2"))) == len(tok)
    # A checkpoint without tokenizer files may borrow a named tokenizer.
    model.save_pretrained(tmp_path / "bare")
    assert len(load_tokenizer(ModelConfig(path=str(tmp_path / "bare"), tokenizer="char"))) == len(tok)
    with pytest.raises(ValueError, match="no tokenizer"):
        load_tokenizer(str(tmp_path / "bare"))


def test_model_config_from_hydra_style_mapping():
    cfg = resolve_config(OmegaConf.create({"name": "custom", "arch": "llama", "hidden_size": 64,
                                           "num_attention_heads": 2, "num_key_value_heads": 1,
                                           "num_hidden_layers": 1, "intermediate_size": 64}))
    model = build_model(cfg)
    assert isinstance(model, LlamaForCausalLM) and model.config.num_hidden_layers == 1


@pytest.mark.parametrize("fields,message", [
    ({"hidden_size": 64, "num_attention_heads": 4}, "head size 16"),
    ({"num_key_value_heads": 3}, "must divide"),
    ({"arch": "gpt2"}, "not supported"),
])
def test_bad_presets_are_refused_with_the_key(fields, message):
    with pytest.raises(ValueError, match=message):
        build_model(ModelConfig(**fields))


def test_unknown_spec_and_unknown_key_are_refused(tmp_path):
    with pytest.raises(ValueError, match="neither a local directory, a preset .* nor a model in the local "
                                         "Hugging Face cache"):
        build_model("no_such_preset")
    with pytest.raises(ValueError, match="huggingface-cli download org/not-cached"):
        resolve_config("org/not-cached")
    with pytest.raises(Exception, match="hidden_sise"):
        resolve_config({"hidden_sise": 3})
    with pytest.raises(ValueError, match="no config.json"):
        build_model(ModelConfig(path=str(tmp_path)))


def test_a_hub_repo_id_in_the_local_cache_resolves_offline(tmp_path, monkeypatch):
    """A repo id ("org/name") is read from the Hugging Face cache's snapshot, never downloaded."""
    from huggingface_hub import constants

    snapshot = tmp_path / "hub" / "models--org--tiny" / "snapshots" / ("a" * 40)
    save_checkpoint(build_model("tiny_qwen2"), load_tokenizer("tiny_qwen2"), snapshot)
    (tmp_path / "hub" / "models--org--tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--org--tiny" / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    cfg = resolve_config("org/tiny")
    assert cfg.path == str(snapshot) and cfg.name == "org/tiny"
    assert build_model("org/tiny").config.vocab_size == build_model("tiny_qwen2").config.vocab_size
    with pytest.raises(ValueError, match=f"local Hugging Face cache \\({tmp_path / 'hub'}\\)"):
        resolve_config("org/other")


@pytest.mark.parametrize("preset", ["tiny_qwen2", "tiny_llama"])
def test_saved_char_tokenizer_keeps_spaces_and_newlines(preset, tmp_path):
    """A checkpoint's config.json must not make AutoTokenizer swap in its model type's
    tokenizer class, which drops the char tokenizer's whitespace."""
    save_checkpoint(build_model(preset), load_tokenizer(preset), tmp_path / "ckpt")
    text = "a\nb c\n#### 12"
    assert load_tokenizer(str(tmp_path / "ckpt"))(text)["input_ids"] == build_char_tokenizer()(text)["input_ids"]
