"""ms-swift's own example YAMLs, as ms-swift ships them, with tiny local stand-ins for what they
name on a hub (`rayroles example DIR`).

The files (algorithms/config/ms_swift_examples/examples/..., the same paths as in ms-swift's
repository) keep every key and value. What they name on a hub — `model: Qwen/Qwen3.5-2B`,
`dataset: AI-ModelScope/alpaca-gpt4-data-en#2000` — is written as a tiny stand-in into a local
Hugging Face hub cache (DIR/hub, the layout `huggingface-cli download` leaves), and resolved
from it offline when HF_HUB_CACHE points there. What they name by a path of ms-swift's
repository (a reward plugin, a system prompt, a data file) is written at that path under DIR, so
each file runs from DIR unchanged:

    cd DIR && HF_HUB_CACHE=$PWD/hub rayroles run --config examples/ray/gkd/rollout_colocate_teacher_colocate.yaml

Stand-ins are random-weight tiny models (`STAND_IN_MODELS`) and arithmetic rows in each
dataset's own columns (`STAND_IN_DATA`); STAND_INS.md in DIR lists them.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from importlib import resources
from pathlib import Path
from typing import Callable

from algorithms.data.tasks import Example, arithmetic_examples
from roles.models import ModelConfig, build_model, load_tokenizer, resolve_config, save_checkpoint
from roles.prm import PRM

# ms-swift's 11 Ray example files (paths in its repository and under DIR).
EXAMPLE_FILES = (
    "examples/ray/gkd/rollout_colocate_teacher_colocate.yaml",
    "examples/ray/gkd/rollout_separate_teacher_colocate.yaml",
    "examples/ray/gkd/rollout_colocate_teacher_standalone.yaml",
    "examples/ray/gkd/multi_turn_colocate.yaml",
    "examples/ray/grpo/ray_grpo_colocate.yaml",
    "examples/ray/grpo/ray_grpo_separate.yaml",
    "examples/ray/grpo/opd_rl_colocate.yaml",
    "examples/ray/grpo/multi_turn/frozen_lake_colocate.yaml",
    "examples/sampler/sample/sampling.yaml",
    "examples/sampler/distill/distill.yaml",
    "examples/train/multi-node/ray/sft.yaml",
)

# Stand-in model shapes (roles.models.ModelConfig fields over a preset). Qwen3.5 checkpoints stand
# in as Qwen3 (Qwen3.5's linear-attention layers train and generate on the torch engines, but
# neither vLLM here nor the Megatron converter serves them; docs/ms_swift.md); student and
# teacher share the character tokenizer, as distillation needs. The stand-ins read as many
# positions as the checkpoints they replace (the files ask for up to 8192 + 8192 tokens; rotary
# positions cost no weights).
SHAPES = {
    "qwen3_student": ("tiny_qwen3", {}),
    "qwen3_teacher": ("tiny_qwen3", {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 6,
                                     "num_attention_heads": 8, "num_key_value_heads": 4}),
    "qwen2_student": ("tiny_qwen2", {}),
}
CONTEXT = 32768

# The user's own plugin files the files name by path (a frozen-lake environment written for this
# project in the form of ms-swift's plugin, its import line changed), shipped beside the YAMLs.
PLUGINS = ("examples/megatron/grpo/multi_turn/frozen_lake_plugin.py",)

# Hub model id -> its stand-in's shape. The VL checkpoint stands in as a text model (the
# stand-in data has no images: vision-language rows are refused here).
STAND_IN_MODELS = {
    "Qwen/Qwen3.5-0.8B": "qwen3_student",
    "Qwen/Qwen3.5-2B": "qwen3_student",
    "Qwen/Qwen3.5-4B": "qwen3_teacher",
    "Qwen/Qwen3.5-9B": "qwen3_teacher",
    "Qwen/Qwen2.5-VL-3B-Instruct": "qwen2_student",
    "Qwen/Qwen2.5-7B-Instruct": "qwen2_student",
}
# Hub PRM id -> its stand-in's shape: a process reward model in this project's form (a causal LM
# with a step head, saved by PRM.save; a hub PRM's own head class is not read here).
STAND_IN_PRMS = {"Qwen/Qwen2.5-Math-PRM-7B": "qwen2_student"}


def shape(name: str) -> ModelConfig:
    preset, fields = SHAPES[name]
    return dataclasses.replace(resolve_config(preset), name=name, max_position_embeddings=CONTEXT, **fields)


# Rows per stand-in dataset (the files sample up to 2000 of them: '#N' over the rows repeats them).
ROWS = 64


def _alpaca(ex: Example) -> dict:
    return {"instruction": ex.prompt, "input": "", "output": ex.solution}


def _numina(ex: Example) -> dict:
    return {"problem": ex.prompt, "solution": ex.solution, "messages": ex.messages()}


def _gsm8k(ex: Example) -> dict:
    return {"query": ex.prompt, "response": ex.solution, "solution": ex.answer}


def _clevr(ex: Example) -> dict:
    # clevr_cogen's text columns (its images are left out: the stand-in model reads text only).
    prompt = (f"{ex.prompt} Output the thinking process in <think> </think> and final answer (number) "
              "in <answer> </answer> tags.")
    return {"messages": [{"role": "user", "content": prompt}], "solution": f"<answer> {ex.answer} </answer>"}


def _math(ex: Example) -> dict:
    return {"query": ex.prompt, "response": ex.solution, "solution": f"\\boxed{{{ex.answer}}}"}


def _self_cognition(ex: Example) -> dict:
    # ms-swift's self-cognition rows carry {{NAME}} / {{AUTHOR}}, replaced by model_name / model_author.
    return {"query": "Who are you?", "response": "I am {{NAME}}, an assistant trained by {{AUTHOR}}."}


# Hub dataset id -> how a stand-in row is written in that dataset's columns.
STAND_IN_DATA: dict[str, Callable[[Example], dict]] = {
    "AI-ModelScope/alpaca-gpt4-data-en": _alpaca,
    "AI-ModelScope/alpaca-gpt4-data-zh": _alpaca,
    "AI-MO/NuminaMath-TIR": _numina,
    "modelscope/gsm8k": _gsm8k,
    "AI-ModelScope/clevr_cogen_a_train": _clevr,
    "modelscope/competition_math": _math,
    "swift/self-cognition": _self_cognition,
}

# The user's own reward plugin the GRPO files name (external_plugins): an ms-swift plugin's
# form, with this project's import line.
R1V_PLUGIN = '''"""Rewards for the clevr GRPO examples, registered by name for `reward_funcs`."""
import re
from typing import List

from algorithms.plugins import ORM, orms  # in ms-swift: from swift.rewards import ORM, orms

ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def answer_of(text: str) -> str:
    found = ANSWER.search(text)
    return (found.group(1) if found else text).strip()


class R1VAccuracy(ORM):
    """1.0 when the completion's <answer> text equals the solution's, else 0.0."""

    def __call__(self, completions, solution, **kwargs) -> List[float]:
        return [float(answer_of(c) == answer_of(s)) for c, s in zip(completions, solution)]


orms["external_r1v_acc"] = R1VAccuracy
'''

# The system prompt the GRPO files read (`system: examples/train/grpo/prompt.txt`).
R1_PROMPT = ("A conversation between User and Assistant. The user asks a question, and the Assistant solves it. "
             "The assistant first thinks about the reasoning process in the mind and then provides the user "
             "with the answer. The reasoning process and answer are enclosed within <think> </think> and "
             "<answer> </answer> tags, respectively, i.e., <think> reasoning process here </think>"
             "<answer> answer here </answer>")


def revision(repo_id: str) -> str:
    """A stand-in snapshot's commit name (40 hex digits, as the hub cache names them)."""
    return hashlib.sha1(repo_id.encode()).hexdigest()


def snapshot(hub: Path, kind: str, repo_id: str) -> Path:
    """The snapshot folder of `repo_id` in a hub cache, with refs/main naming it (kind: models|datasets)."""
    repo = hub / f"{kind}--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(revision(repo_id))
    folder = repo / "snapshots" / revision(repo_id)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def write_hub(hub: Path) -> None:
    """Every stand-in model and dataset into the hub cache `hub`."""
    built: dict[str, Path] = {}
    for repo_id, name in STAND_IN_MODELS.items():
        folder = snapshot(hub, "models", repo_id)
        if name in built:  # one build per shape, copied
            shutil.copytree(built[name], folder, dirs_exist_ok=True)
        else:
            save_checkpoint(build_model(shape(name)), load_tokenizer(shape(name)), folder)
            built[name] = folder
    for repo_id, name in STAND_IN_PRMS.items():
        PRM(kind="model", model=shape(name), device="cpu").save(snapshot(hub, "models", repo_id))
    examples = arithmetic_examples(ROWS, seed=0, split="train")
    for repo_id, row in STAND_IN_DATA.items():
        folder = snapshot(hub, "datasets", repo_id)
        with open(folder / "train.jsonl", "w") as f:
            f.writelines(json.dumps(row(ex)) + "\n" for ex in examples)


def write_frozen_lake(path: Path) -> None:
    """The frozen-lake file's rows: a placeholder prompt and the environment's seed per row."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        f.writelines(json.dumps({"messages": [{"role": "user", "content": "<placeholder>"}],
                                 "env_config": {"seed": i}}) + "\n" for i in range(128))


def stand_ins_text() -> str:
    models = "\n".join([f"- `{k}`: {v} (the {SHAPES[v][0]} preset" + (f" with {SHAPES[v][1]}" if SHAPES[v][1] else "")
                        + "), random weights"
                        for k, v in STAND_IN_MODELS.items()]
                       + [f"- `{k}`: a PRM of this project ({v}, random step head)" for k, v in STAND_IN_PRMS.items()])
    data = "\n".join(f"- `{k}`: {ROWS} arithmetic rows in its columns" for k in STAND_IN_DATA)
    return (f"# Stand-ins of the hub ids these ms-swift files name\n\nModels (hub/models--*):\n\n{models}\n\n"
            f"Datasets (hub/datasets--*):\n\n{data}\n\nRun a file from this folder with the hub cache here:\n\n"
            "    HF_HUB_CACHE=$PWD/hub rayroles run --config examples/ray/gkd/rollout_colocate_teacher_colocate.yaml\n")


def write_swift_examples(folder: str | Path) -> Path:
    """ms-swift's example files under `folder` (their repository paths), the stand-ins of their
    hub ids in `folder`/hub, and the files they name by path. Returns `folder`."""
    out = Path(folder)
    source = resources.files("algorithms.config").joinpath("ms_swift_examples")
    for name in EXAMPLE_FILES:
        target = out / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(source.joinpath(name).read_text())
    write_hub(out / "hub")
    plugin = out / "examples/train/grpo/plugin/plugin.py"
    plugin.parent.mkdir(parents=True, exist_ok=True)
    plugin.write_text(R1V_PLUGIN)
    (out / "examples/train/grpo/prompt.txt").write_text(R1_PROMPT)
    write_frozen_lake(out / "examples/megatron/grpo/multi_turn/frozen_lake.jsonl")
    for name in PLUGINS:
        (out / name).write_text(source.joinpath(name).read_text())
    (out / "STAND_INS.md").write_text(stand_ins_text())
    return out
