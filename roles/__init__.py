"""The roles of a post-training run as plain Python classes (no Ray import: orchestration
applies `ray.remote` to them), one file per role, and what they share.

- Roles: trainer (with trainer_config), rollout, teacher, sampler, orm, prm (scorer_model is
  the scalar-head model the two reward roles share).
- Data and models: batch (the dataclasses that cross role boundaries), models and tokenizers
  (tiny presets, HF loading).
- Weight sync: weight_transfer (the paths from trainer to rollout/teacher) and
  weight_buckets (its wire format).
- engines/: what runs the model behind a role (torch, DeepSpeed, Megatron-core, vLLM).
"""
