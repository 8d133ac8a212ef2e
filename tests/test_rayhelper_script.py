"""ms-swift's RayHelper example (its Ray page's MyTrainer) runs when written as one script.

The class then lives in the script's `__main__`, so Ray pickles it by value and its methods
travel with the globals they read. The example, with the import line changed and its methods
doing tiny real work (model1 generates with tiny_qwen2, model2 takes an SGD step on the
result), runs in its own process and its own Ray (few CPUs) as `python script.py --use_ray true
--device_groups '<json>'`, as `python -m pkg.script ...`, with `RayHelper.initialize(...)` in
the script, and imported from a module beside a script. Each run prints where each group ran:
model1 and model2 in two actors when in two device groups, in one when listed in one.
Only two device groups make two worker groups, the second built while the first lives:
the layout in which a `__main__` class must not carry the first one's workers (and locks).
"""
import json
import os
import signal
import subprocess
import sys

import cloudpickle
import pytest
import torch

from orchestration import decorators
from roles.models import build_model

# The page's example; `...` filled in with tiny work and `train()` printing what ran where.
TRAINER = '''\
import json
import os

import torch
from torch.utils.data import DataLoader, TensorDataset

from orchestration.decorators import RayHelper  # was: from swift.ray_utils import RayHelper
from roles.models import build_model


@RayHelper.worker(group=['model1', 'model2'])
class MyTrainer:

    def __init__(self, args):
        self.args = args
        self._prepare_model1()
        self._prepare_model2()
        self._prepare_datasets()

    @RayHelper.function(group='model1')
    def _prepare_model1(self):
        self.model1 = build_model('tiny_qwen2')

    @RayHelper.function(group='model2')
    def _prepare_model2(self):
        self.model2 = build_model('tiny_qwen2').train()
        self.optimizer = torch.optim.SGD(self.model2.parameters(), lr=self.args['lr'])
        self.steps = 0

    @RayHelper.function(group='model1')
    def rollout(self, inputs):
        tokens = self.model1.generate(inputs, attention_mask=torch.ones_like(inputs), do_sample=False,
                                      max_new_tokens=self.args['new_tokens'])
        return {'tokens': tokens, **where()}

    @RayHelper.function(group='model2')
    def forward_model2(self, inputs):
        tokens = torch.cat([rank['tokens'] for rank in inputs])  # one result per model1 rank
        loss = self.model2(input_ids=tokens, labels=tokens).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.steps += 1
        return {'loss': loss.item(), 'step': self.steps, **where()}

    def _prepare_datasets(self):
        self.dataset = TensorDataset(torch.arange(3, 19).view(4, 4))

    def train(self):
        steps = []
        for (batch,) in DataLoader(self.dataset, batch_size=2):
            generated = self.rollout(batch)
            steps.append({'rollout': [{k: v for k, v in rank.items() if k != 'tokens'} for rank in generated],
                          'tokens': generated[0]['tokens'].tolist(), 'model2': self.forward_model2(generated)})
        print('RESULT ' + json.dumps({'driver': os.getpid(), 'steps': steps}))


def where():
    return {'pid': os.getpid(), 'group': os.environ.get('RAY_SWIFT_GROUP'), 'rank': os.environ.get('RANK')}
'''
ARGS = "{'lr': 0.5, 'new_tokens': 3}"
MAIN = f"\n\nif __name__ == '__main__':\n    MyTrainer({ARGS}).train()\n"

SEPARATE = {'nproc_per_node': 2, 'rollout_group': {'device': 'CPU', 'ranks': 1, 'workers': ['model1']},
            'train_group': {'device': 'CPU', 'ranks': 1, 'workers': ['model2']}}
SHARED = {'nproc_per_node': 1, 'one_group': {'device': 'CPU', 'ranks': 1, 'workers': ['model1', 'model2']}}


def initialize_main(device_groups: dict) -> str:
    return (f"\n\nif __name__ == '__main__':\n    RayHelper.initialize({device_groups!r})\n"
            f"    MyTrainer({ARGS}).train()\n")


IMPORTED = f'''\
from orchestration.decorators import RayHelper
from my_trainer import MyTrainer  # the class from a module beside this script

RayHelper.initialize({SHARED!r})
MyTrainer({ARGS}).train()
'''


@pytest.fixture(scope='module')
def expected():
    """Greedy tokens of the first batch and model2's first loss on them, computed here."""
    model = build_model('tiny_qwen2')
    batch = torch.arange(3, 19).view(4, 4)[:2]
    with torch.no_grad():
        tokens = model.generate(batch, attention_mask=torch.ones_like(batch), do_sample=False, max_new_tokens=3)
        loss = model(input_ids=tokens, labels=tokens).loss.item()
    return tokens.tolist(), loss


# A guard against a hang, not a speed target: a script takes 20-30 s alone, several times that on a
# loaded 2-core host.
SCRIPT_TIMEOUT_S = 480


def run_script(folder, command: list[str]) -> dict:
    """Run `command` in `folder` with its own Ray (RAY_ADDRESS dropped), return its RESULT."""
    env = {k: v for k, v in os.environ.items() if k != 'RAY_ADDRESS'}
    env['OMP_NUM_THREADS'] = '1'  # tiny models; on a 2-core host more threads only contend
    proc = subprocess.Popen([sys.executable, *command], cwd=folder, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=SCRIPT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the script and the Ray processes it started
        out, _ = proc.communicate()
        pytest.fail(f'{command} did not finish in {SCRIPT_TIMEOUT_S} s:\n{out[-4000:]}')
    assert proc.returncode == 0, f'{command} exited {proc.returncode}:\n{out[-4000:]}'
    lines = [line for line in out.splitlines() if line.startswith('RESULT ')]
    assert len(lines) == 1, out[-4000:]
    return json.loads(lines[0][len('RESULT '):])


def check(result: dict, expected, shared: bool) -> None:
    tokens, first_loss = expected
    steps = result['steps']
    assert len(steps) == 2 and steps[0]['tokens'] == tokens  # model1 generated as here
    assert steps[0]['model2'][0]['loss'] == pytest.approx(first_loss, rel=1e-4)  # model2 before its step
    assert [s['model2'][0]['step'] for s in steps] == [1, 2]  # one model2 copy kept its state
    rollout, model2 = steps[0]['rollout'][0], steps[0]['model2'][0]
    assert result['driver'] not in (rollout['pid'], model2['pid']) and (rollout['rank'], model2['rank']) == ('0', '0')
    if shared:  # one device group: one actor serves both
        assert rollout['pid'] == model2['pid'] and rollout['group'] == model2['group'] == 'model1,model2'
    else:
        assert rollout['pid'] != model2['pid'] and (rollout['group'], model2['group']) == ('model1', 'model2')
    assert {s['rollout'][0]['pid'] for s in steps} == {rollout['pid']}
    assert {s['model2'][0]['pid'] for s in steps} == {model2['pid']}


def test_one_script_from_the_command_line(tmp_path, expected):
    (tmp_path / 'my_trainer.py').write_text(TRAINER + MAIN)
    command = ['my_trainer.py', '--use_ray', 'true', '--device_groups', json.dumps(SEPARATE)]
    check(run_script(tmp_path, command), expected, shared=False)


@pytest.mark.slow  # for time: CI runs the plain script forms of the same example
def test_one_script_run_with_python_m(tmp_path, expected):
    (tmp_path / 'pkg').mkdir()
    (tmp_path / 'pkg' / '__init__.py').write_text('')
    (tmp_path / 'pkg' / 'my_trainer.py').write_text(TRAINER + MAIN)
    command = ['-m', 'pkg.my_trainer', '--use_ray', 'true', '--device_groups', json.dumps(SEPARATE)]
    check(run_script(tmp_path, command), expected, shared=False)


def test_one_script_that_initializes_in_code(tmp_path, expected):
    (tmp_path / 'my_trainer.py').write_text(TRAINER + initialize_main(SHARED))
    check(run_script(tmp_path, ['my_trainer.py']), expected, shared=True)


@pytest.mark.slow  # for time: CI runs the plain script forms of the same example
def test_class_imported_from_a_module_beside_the_script(tmp_path, expected):
    (tmp_path / 'my_trainer.py').write_text(TRAINER + MAIN)
    (tmp_path / 'train.py').write_text(IMPORTED)
    check(run_script(tmp_path, ['train.py']), expected, shared=True)


@pytest.fixture
def inactive():
    decorators.teardown()
    yield
    decorators.teardown()


def test_a_main_class_pickles_by_value_while_its_workers_live(inactive):
    """What Ray does with a script's class: cloudpickle it by value. The live workers (whose
    groups hold locks) must not travel with it."""
    decorators.configure(SEPARATE, backend='local')
    script = {'__name__': '__main__'}
    exec(compile(TRAINER, 'my_trainer.py', 'exec'), script)
    cls = script['MyTrainer']
    cls({'lr': 0.5, 'new_tokens': 3})  # in-process workers: the configuration now holds their groups
    assert decorators._config.owners
    blob = cloudpickle.dumps(cls)
    assert b'_prepare_model1' in blob and b'LocalWorkerGroup' not in blob  # by value, without the workers
    assert cloudpickle.loads(blob).__name__ == 'MyTrainer'
