"""What a run writes into its directory, and reads back on resume.

runlog.py (metrics.jsonl and the trackers fed each step, phase timers, timeline.jsonl, the
progress bar, events.jsonl), trackers.py (jsonl, TensorBoard, W&B, MLflow), plots.py
(curves.png, timeline.png, trace.json), checkpoints.py (written whole or not at all; found
again by run.resume).
"""
