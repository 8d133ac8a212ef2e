"""How a driver's loop runs on its roles.

steps.py (the loop's frame: where it starts, resume, the end of each step with eval and save,
the end of the run), turns.py (turn-taking on shared devices: onload/offload and wake/sleep
riding on the roles' own calls, one-call turns checked), weights.py (which weights the
rollout holds, and when and how the trainer's go there), ahead.py (generation ahead of
training within max_staleness), entry.py (the one command-line entry: prepare -> validate ->
run, restarts after a lost trainer rank, one-line errors), warm_start.py (the rows of GRPO's
SFT warm start, multi-turn and tool rows encoded as the rollout encodes a trajectory).
"""
