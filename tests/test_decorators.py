"""The RayHelper front end: ms-swift's MyTrainer example runs unchanged without a
configuration, with the local backend and on Ray, with equal results; plus slice/flatten,
execute='first' and remote errors through decorated methods."""
import os

import numpy as np
import pytest

from orchestration import decorators
from orchestration.base_group import WorkerError
from orchestration.decorators import RayHelper

DEVICE_GROUPS = {
    "nproc_per_node": 4,
    "rollout_group": {"device": "GPU", "ranks": "list(range(0, 2))", "workers": ["model1"]},
    "train_group": {"device": "CPU", "ranks": 2, "workers": ["model2"]},
}


def mean(values):
    return float(np.mean(values))


@RayHelper.worker(group=["model1", "model2"])
class MyTrainer:
    """ms-swift's example with tiny numpy models: model1 generates targets, model2 fits them."""

    def __init__(self, args):
        self.args = args
        self._prepare_model1()
        self._prepare_model2()
        self._prepare_datasets()

    @RayHelper.function(group="model1")
    def _prepare_model1(self):
        self.model1 = np.array([2.0, -1.0])  # the generator's hidden weights

    @RayHelper.function(group="model2")
    def _prepare_model2(self):
        self.model2 = np.zeros(2)

    @RayHelper.function(group="model1", dispatch="slice", collect="flatten")
    def rollout(self, inputs):
        return [(x, float(x @ self.model1)) for x in inputs]

    @RayHelper.function(group="model2", collect=mean)
    def forward_model2(self, inputs):
        x = np.stack([s[0] for s in inputs])
        y = np.array([s[1] for s in inputs])
        err = x @ self.model2 - y
        self.model2 = self.model2 - self.args["lr"] * 2 * x.T @ err / len(y)
        return float(np.mean(err ** 2))

    @RayHelper.function(group="model2", execute="first")
    def weights(self):
        return self.model2

    def _prepare_datasets(self):
        rng = np.random.default_rng(0)
        self.dataset = list(rng.normal(size=(self.args["n"], 2)))

    def train(self):
        losses = []
        for start in range(0, len(self.dataset), self.args["batch"]):
            generated = self.rollout(self.dataset[start:start + self.args["batch"]])
            losses.append(self.forward_model2(generated))
        return losses, self.weights()

    # Probes for the dispatch semantics.
    @RayHelper.function(group="model1", dispatch="slice", collect="flatten")
    def double(self, xs, scale=1):
        return xs * 2 * scale, [len(xs)]

    @RayHelper.function(group="model1", execute="first")
    def whoami(self):
        return {"rank": os.environ.get("RANK"), "pid": os.getpid(), "has_model1": hasattr(self, "model1"),
                "has_model2": hasattr(self, "model2"), "gpus": os.environ.get("CUDA_VISIBLE_DEVICES")}

    @RayHelper.function(group="model2", dispatch="slice")
    def fail_on_rank1(self, items):
        if os.environ["RANK"] == "1":
            raise ValueError(f"cannot score {items}")
        return items


ARGS = {"n": 40, "batch": 10, "lr": 0.2}


@pytest.fixture(scope="module")
def transparent_result():
    assert not decorators.is_configured()
    return MyTrainer(ARGS).train()


def test_transparent_without_configuration(transparent_result):
    trainer = MyTrainer(ARGS)
    assert not hasattr(trainer, decorators._STATE)  # a plain instance
    assert hasattr(trainer, "model1") and hasattr(trainer, "model2")
    assert trainer.forward_model2(trainer.rollout(trainer.dataset)) > 0  # plain float, not a list
    losses, weights = transparent_result
    assert len(losses) == 4 and np.linalg.norm(weights - [2, -1]) < 0.5 * np.linalg.norm([2, -1])  # it learns
    assert MyTrainer.rollout.__name__ == "rollout"


@pytest.fixture(params=["local", "ray"])
def trainer(request):
    if request.param == "ray":
        request.getfixturevalue("ray_cluster")
    decorators.configure(DEVICE_GROUPS, backend=request.param)
    try:
        yield request.param, MyTrainer(ARGS)
    finally:
        decorators.teardown()


def test_example_matches_transparent(trainer, transparent_result):
    backend, t = trainer
    losses, weights = t.train()
    assert losses == pytest.approx(transparent_result[0])
    np.testing.assert_allclose(weights, transparent_result[1])
    # The driver ran only the undecorated setup; model1 copies skipped model2's setup.
    assert hasattr(t, "dataset") and not hasattr(t, "model1") and not hasattr(t, "model2")
    info = t.whoami()  # execute="first": rank 0's value itself, not a list
    assert info["rank"] == "0" and info["has_model1"] and not info["has_model2"]
    if backend == "ray":
        assert info["pid"] != os.getpid() and info["gpus"]  # a (fake) GPU of its own

    # Semantics through decorated methods, on the same workers.
    xs = np.arange(5.0)
    doubled, lengths = t.double(xs, scale=3)
    np.testing.assert_array_equal(doubled, xs * 6)
    assert lengths == [3, 2]  # 5 items over 2 workers, a tuple flattened element-wise
    assert t.double(np.arange(1.0))[1] == [1]  # the worker with an empty slice is skipped

    with pytest.raises(WorkerError) as err:
        t.fail_on_rank1(["a", "b", "c"])
    assert (err.value.role, err.value.rank, err.value.method) == ("model2", 1, "fail_on_rank1")
    assert "ValueError: cannot score ['c']" in str(err.value) and "remote traceback" in str(err.value)


def test_teardown_restores_plain_calls():
    decorators.configure(DEVICE_GROUPS, backend="local")
    decorators.teardown()
    assert not hasattr(MyTrainer(ARGS), decorators._STATE)


def test_group_missing_from_plan_is_named():
    decorators.configure({"nproc_per_node": 4, "g": {"device": "CPU", "ranks": 1, "workers": ["model1"]}},
                         backend="local")
    try:
        with pytest.raises(KeyError, match="group 'model2' of MyTrainer is not in the configured plan"):
            MyTrainer(ARGS)
    finally:
        decorators.teardown()
