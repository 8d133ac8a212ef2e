"""The engines behind the roles, swappable by config (`backend.train|rollout|teacher`).

- Training: torch_trainer (plain data parallel), deepspeed_trainer (ZeRO), megatron_trainer
  (tensor parallel; megatron_convert maps HF weights), with collectives (the data-parallel
  group, gradient all-reduce), train_kernels (packing, compiled and fused forwards) and
  host_copies (offload to host memory).
- Generation: torch_generate (the dynamic KV-cache loop), torch_decode (static cache and CUDA
  graphs), decoding (what both share: the sampling head, padded prompts, results); vllm_engine
  with vllm_build.
- Shared: torch_engine (device choice, token logprobs, memory figures), options (each
  engine's config section, free of heavy imports).
"""
