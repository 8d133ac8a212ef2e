"""What a run trains and evaluates on, and how its text meets the tokenizer.

tasks.py (generated arithmetic and GSM problems as `Example`s), user_data.py (a user's
JSONL/JSON/CSV/Parquet files with ms-swift's columns), loading.py (the `data:` section:
training and held-out rows within the models' context), prompts.py (chat-template rendering,
dataset replies encoded as completions, the resumable prompt stream), answers.py (data.check:
right or wrong, and greedy accuracy). Nothing here starts a role or imports Ray.
"""
