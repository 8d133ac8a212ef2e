"""Real roles that fail or stall on cue, for driver tests on Ray (imported by the actors)."""
import time

from roles.teacher import Teacher
from roles.trainer import Trainer


class TrainerFailingAtStep2(Trainer):
    """A real Trainer whose second train step raises."""

    calls = 0

    def train_step(self, *args, **kwargs):
        self.calls += 1
        if self.calls == 2:
            raise RuntimeError("step 2 broke")
        return super().train_step(*args, **kwargs)


class TeacherStallingAtCall3(Teacher):
    """A real Teacher whose third logits call takes a minute first."""

    calls = 0

    def logits(self, *args, **kwargs):
        self.calls += 1
        if self.calls == 3:
            time.sleep(60)
        return super().logits(*args, **kwargs)
