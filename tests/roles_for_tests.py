"""Small plain role classes used by the orchestration tests (no Ray import)."""
import os

import numpy as np
import torch


class Probe:
    """Reports where it runs and echoes what it receives."""

    # Methods whose ranks would meet in collectives: every rank is called, empty slices too.
    LOCKSTEP_METHODS = ("rank_and_len_lockstep",)

    def __init__(self, scale: float = 1.0):
        self.scale = scale
        self.rank = int(os.environ["RANK"])
        self.env = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                                                 "ENGINE_TP_SIZE", "ENGINE_TP_RANK", "ENGINE_TP_MASTER_ADDR",
                                                 "ENGINE_TP_MASTER_PORT")}

    def whoami(self) -> dict:
        return {"rank": self.rank, "env": self.env, "cuda": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
                "pid": os.getpid()}

    def echo(self, x):
        return x

    def scaled(self, x):
        return x * self.scale

    def rank_and_len(self, items):
        return [(self.rank, len(items))]

    def rank_and_len_lockstep(self, items):
        return [(self.rank, len(items))]

    def pair(self, x):
        return (x, [self.rank])

    def tag(self, items, label, extra):
        return [(label, extra["k"], x) for x in items]

    def add(self, a, b):
        return a + b

    def tensor_rank(self):
        return torch.full((2,), float(self.rank))

    def array_rank(self):
        return np.full((1, 3), self.rank)

    def metrics(self, n):
        return {"rank": [self.rank], "n": [n]}

    def fail(self, msg):
        if self.rank == 1:
            raise ValueError(msg)
        return self.rank

    def fail_or_hang(self):
        """Rank 1 fails; the others wait as if blocked in a collective with it."""
        import time
        if self.rank == 1:
            time.sleep(0.5)
            raise RuntimeError("rank 1 gave up")
        time.sleep(120)
        return self.rank

    def nap(self, seconds):
        """Rank 1 sleeps: a worker that stops answering without dying."""
        import time
        if self.rank == 1:
            time.sleep(seconds)
        return self.rank

    def die(self):
        if self.rank == 1:
            os._exit(3)
        return self.rank
