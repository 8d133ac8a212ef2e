"""ms-swift code ported with only its import line changed behaves as in ms-swift.

SwiftSampler below is written as ms-swift's VanillaSampler is (sampler/prm/orm groups, prm
and orm listed in one device group); SwiftSft as its SFT pipeline (one 'default' group,
activated from the command line). On the session's Ray cluster (simulated GPUs): activation
by RayHelper.initialize and by `--use_ray true --device_groups '<json>'`, one shared actor
per rank for the groups of one device group, a `ray.put` ref argument arriving resolved,
`except ValueError` around a remote method that raises, and LOCAL_RANK agreeing with the
device each rank sees.
"""
import json
import os
import sys

import pytest

from orchestration import decorators
from orchestration.base_group import WorkerError
from orchestration.decorators import RayHelper  # was: from swift.ray_utils import RayHelper

# ---------------------------------------------------------------- ms-swift-style code (unchanged)


@RayHelper.worker(group=['sampler', 'prm', 'orm'])
class SwiftSampler:

    def __init__(self, args):
        self.args = args
        self._prepare_sampler()
        self._prepare_prm()
        self._prepare_orm()
        self.prompts = [f'q{i}' for i in range(args['n_prompts'])]

    @RayHelper.function(group='sampler')
    def _prepare_sampler(self):
        self.engine = {'prefix': self.args['prefix']}

    @RayHelper.function(group='prm')
    def _prepare_prm(self):
        self.step_scores = {}  # filled by score_steps, read by the orm of the same worker

    @RayHelper.function(group='orm')
    def _prepare_orm(self):
        self.bonus = 10.0

    @RayHelper.function(group='sampler', dispatch='slice', collect='flatten')
    def generate(self, prompts, sampling):
        return [f"{self.engine['prefix']}{p}@{sampling['temperature']}" for p in prompts]

    @RayHelper.function(group='prm', dispatch='slice', collect='flatten')
    def score_steps(self, completions):
        for c in completions:
            self.step_scores[c] = float(len(c))
        return [self.step_scores[c] for c in completions]

    @RayHelper.function(group='orm', dispatch='slice', collect='flatten')
    def score(self, completions):
        # The prm's state of this worker: set by score_steps on the same ranks.
        return [self.step_scores[c] + self.bonus for c in completions]

    @RayHelper.function(group='orm', execute='first')
    def check_answer(self, answer):
        if not answer.isdigit():
            raise ValueError(f'not a number: {answer}')
        return int(answer)

    @RayHelper.function(group='sampler')
    def sampler_env(self):
        return self._env()

    @RayHelper.function(group='prm')
    def prm_env(self):
        return self._env()

    @RayHelper.function(group='orm')
    def orm_env(self):
        return self._env()

    def _env(self):
        names = ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'CUDA_VISIBLE_DEVICES', 'RAY_SWIFT_GROUP', 'CLUSTER_NAME',
                 'WORKER_NAME', 'MASTER_ADDR', 'MASTER_PORT')
        return {'pid': os.getpid(), **{k: os.environ.get(k) for k in names}}

    def sample(self, sampling):
        completions = self.generate(self.prompts, sampling)
        self.score_steps(completions)
        return completions, self.score(completions)


@RayHelper.worker(group=['default'])
class SwiftSft:

    def __init__(self, args):
        self.args = args
        self._prepare_model()

    @RayHelper.function(group='default')
    def _prepare_model(self):
        self.weight = float(self.args['init'])

    @RayHelper.function(group='default', dispatch='slice', collect='flatten')
    def train_step(self, batch):
        self.weight += sum(batch)
        return [(int(os.environ.get('RANK', '0')), len(batch))]

    @RayHelper.function(group='default', collect='none')
    def weights(self):
        return {'weight': self.weight, 'pid': os.getpid(), 'local_rank': os.environ.get('LOCAL_RANK'),
                'visible': os.environ.get('CUDA_VISIBLE_DEVICES'), 'group': os.environ.get('RAY_SWIFT_GROUP'),
                'args': os.environ.get('RAY_SWIFT_ARGS')}


# ---------------------------------------------------------------- the port's checks

SAMPLER_GROUPS = {
    'nproc_per_node': 4,
    'sample_group': {'device': 'GPU', 'ranks': 'list(range(0, 2))', 'workers': ['sampler']},
    'rm_group': {'device': 'GPU', 'ranks': 'list(range(2, 4))', 'workers': ['prm', 'orm']},
}
SFT_GROUPS = {'nproc_per_node': 2, 'default_group': {'device': 'GPU', 'ranks': [0, 1], 'workers': ['default']}}
ARGS = {'n_prompts': 5, 'prefix': 'A:'}
SAMPLING = {'temperature': 0.7}


@pytest.fixture
def inactive():
    decorators.teardown()
    yield
    decorators.teardown()


@pytest.fixture(scope='module')
def plain():
    assert not decorators.is_configured()
    result = SwiftSampler(ARGS).sample(SAMPLING)  # not initialized: runs in this process
    assert result[0][0] == 'A:q0@0.7' and result[1][0] == len('A:q0@0.7') + 10.0
    return result


def test_sampler_on_ray_matches_the_plain_run(ray_cluster, inactive, plain):
    import ray

    RayHelper.initialize(SAMPLER_GROUPS)
    first_config = decorators._config
    RayHelper.initialize(SAMPLER_GROUPS)  # as in ms-swift, a second initialize changes nothing
    assert decorators._config is first_config
    with pytest.raises(RuntimeError, match='teardown'):
        RayHelper.initialize(SFT_GROUPS)

    sampler = SwiftSampler(ARGS)
    assert not hasattr(sampler, 'engine') and not hasattr(sampler, 'step_scores')  # set in the workers
    # A ray.put ref passed as a top-level argument arrives as its value on every rank.
    assert sampler.sample(ray.put(SAMPLING)) == plain

    # prm and orm of one device group share one actor per rank; the sampler has its own.
    prm, orm, smp = sampler.prm_env(), sampler.orm_env(), sampler.sampler_env()
    assert [e['pid'] for e in prm] == [e['pid'] for e in orm] and len({e['pid'] for e in prm}) == 2
    assert not {e['pid'] for e in smp} & {e['pid'] for e in prm} and os.getpid() not in {e['pid'] for e in smp}
    assert [e['RAY_SWIFT_GROUP'] for e in orm] == ['prm,orm'] * 2 and smp[0]['RAY_SWIFT_GROUP'] == 'sampler'
    assert [e['WORKER_NAME'] for e in orm] == ['prm-orm-0', 'prm-orm-1'] and orm[0]['CLUSTER_NAME'] == 'prm-orm'
    for env in smp + prm:  # each rank sees one GPU, and LOCAL_RANK points at it
        assert len(env['CUDA_VISIBLE_DEVICES'].split(',')) == 1 and env['LOCAL_RANK'] == '0', env
        assert env['WORLD_SIZE'] == '2' and env['MASTER_ADDR'] and int(env['MASTER_PORT']) > 0
    assert [e['RANK'] for e in prm] == ['0', '1']
    assert len({e['CUDA_VISIBLE_DEVICES'] for e in smp + prm}) == 4  # four different GPUs

    # A worker's ValueError is caught as a ValueError, and still names group, rank and method.
    assert sampler.check_answer('42') == 42
    try:
        sampler.check_answer('forty-two')
    except ValueError as e:
        caught = e
    assert isinstance(caught, WorkerError) and (caught.role, caught.rank, caught.method) == ('orm', 0, 'check_answer')
    assert 'orm rank 0 failed in check_answer(): ValueError: not a number: forty-two' in str(caught)


def test_sft_activated_from_the_command_line(ray_cluster, inactive, monkeypatch):
    argv = ['sft.py', '--use_ray', 'true', '--device_groups', json.dumps(SFT_GROUPS), '--lr', '0.1']
    monkeypatch.setattr(sys, 'argv', argv)
    sft = SwiftSft({'init': 1})  # the first @worker construction reads the flags
    assert decorators.is_configured() and not hasattr(sft, 'weight')
    assert sft.train_step([1, 2, 3]) == [(0, 2), (1, 1)]
    infos = sft.weights()
    assert [i['weight'] for i in infos] == [4.0, 4.0] and os.getpid() not in {i['pid'] for i in infos}
    assert [i['local_rank'] for i in infos] == ['0', '0'] and all(len(i['visible'].split(',')) == 1 for i in infos)
    assert infos[0]['group'] == 'default' and json.loads(infos[0]['args']) == argv[1:]


def test_use_ray_without_device_groups_names_the_flag(inactive, monkeypatch):
    monkeypatch.setattr(sys, 'argv', ['sft.py', '--use_ray', 'true'])
    with pytest.raises(ValueError, match='--use_ray true needs --device_groups'):
        SwiftSft({'init': 1})
    monkeypatch.setattr(sys, 'argv', ['sft.py', '--use_ray', 'maybe', '--device_groups', '{}'])
    with pytest.raises(ValueError, match="--use_ray expects true or false, got 'maybe'"):
        SwiftSft({'init': 1})
    monkeypatch.setattr(sys, 'argv', ['sft.py', '--use_ray=true', '--device_groups', '{"nproc_per_node": 2,'])
    with pytest.raises(ValueError, match='--device_groups is not valid JSON'):
        SwiftSft({'init': 1})
    assert not decorators.is_configured()


def test_use_ray_false_keeps_plain_objects(inactive, monkeypatch):
    monkeypatch.setattr(sys, 'argv', ['sft.py', '--use_ray', 'false'])
    sft = SwiftSft({'init': 1})
    assert sft.weight == 1.0 and sft.train_step([1, 2]) == [(int(os.environ.get('RANK', '0')), 2)]
    monkeypatch.setattr(sys, 'argv', ['sft.py', '--device_groups', json.dumps(SFT_GROUPS)])
    with pytest.warns(UserWarning, match='without --use_ray true'):
        assert SwiftSft({'init': 2}).weight == 2.0
    assert not decorators.is_configured()


def test_local_backend_shares_the_copy_per_rank(inactive, plain):
    """The in-process backend shares the same way, so a port debugs with breakpoints as it runs on Ray."""
    decorators.configure(SAMPLER_GROUPS, backend='local')
    sampler = SwiftSampler(ARGS)
    assert sampler.sample(SAMPLING) == plain  # the orm read the prm's scores: one copy per rank
    prm, orm = sampler.prm_env(), sampler.orm_env()
    assert [e['WORKER_NAME'] for e in orm] == ['prm-orm-0', 'prm-orm-1'] and prm[0]['RAY_SWIFT_GROUP'] == 'prm,orm'
    assert [e['LOCAL_RANK'] for e in prm] == ['2', '3']  # every device visible here: the planned ones
