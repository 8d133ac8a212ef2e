"""What a training step optimises.

losses.py (SFT, GRPO and GKD losses: pure torch, the Trainer calls them per micro-batch),
rollout_correction.py (the train-inference mismatch: its importance weights and metrics),
advantages.py (group-relative advantages: pure torch), rewards.py (GRPO's reward functions
as ORM/PRM scorers, weighted and summed).
"""
