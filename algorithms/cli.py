"""One entry point for every driver, installed as the `rayroles` command.

    rayroles grpo|gkd|sft|distill [overrides]      same as python -m algorithms.<driver> [overrides]
    rayroles run --config X.yaml [overrides]       the driver an ms-swift file is written for
    python -m algorithms.cli config_file=X.yaml    the same
    rayroles plan [overrides]                      python -m orchestration.plan
    rayroles example DIR                           ms-swift's own Ray example YAMLs with local
                                                   stand-ins for their hub ids, and small quick
                                                   versions with a local student and teacher, in DIR

`run` reads the file's `rlhf_type` (grpo, gkd); a file with ms-swift's sampling keys is a
distill run, any other an SFT run. Overrides are Hydra's (`run.steps=3`) and win over the file.
"""
from __future__ import annotations

import importlib
import json
import shutil
import sys
from importlib import resources
from pathlib import Path
from typing import Optional

from algorithms.config.swift_examples import write_swift_examples
from algorithms.config.swift_keys import output_run_dir
from algorithms.data.tasks import arithmetic_examples
from orchestration.config import ConfigError, read_config_file
from roles.models import build_model, load_tokenizer, save_checkpoint

DRIVERS = {"grpo": "algorithms.grpo", "gkd": "algorithms.gkd", "sft": "algorithms.sft",
           "distill": "algorithms.distill", "plan": "orchestration.plan"}
# Keys of ms-swift's `swift sample` that no training file has.
SAMPLING_KEYS = {"sampler_type", "sampler_engine", "num_return_sequences", "n_best_to_keep", "prm_model",
                 "orm_model", "prm_threshold", "num_sampling_batch_size", "num_sampling_batches"}
USAGE = __doc__.split("\n\n")[1]


def driver_of(path: str) -> str:
    """The driver an ms-swift file is written for."""
    data = read_config_file(path)
    kind = data.get("rlhf_type")
    if kind is not None:
        if kind not in ("grpo", "gkd"):
            raise ConfigError(f"config key 'rlhf_type'={kind!r} in {path}: the drivers here are grpo and gkd "
                              "(and sft, distill without rlhf_type). Fix: set rlhf_type: grpo or gkd")
        return kind
    return "distill" if SAMPLING_KEYS & set(data) else "sft"


def forward(module: str, args: list[str]) -> None:
    """Run a driver's (or the planner's) Hydra main with `args` as its command line. A driver's
    entry reads a config_file's output folder itself (runtime/entry.py); the planner's is read here."""
    sys.argv = [module, *args] if module.startswith("algorithms.") else output_run_dir([module, *args])
    importlib.import_module(module).main()


def config_of(args: list[str]) -> tuple[Optional[str], list[str]]:
    """(the config file of `--config X`, `--config=X` or `config_file=X`, the other arguments)."""
    rest, path = [], None
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--config" and i + 1 < len(args):
            path, i = args[i + 1], i + 2
            continue
        if arg.startswith(("--config=", "config_file=", "+config_file=")):
            path = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    return path, rest


def write_example(folder: str) -> Path:
    """ms-swift's own example files with their stand-ins (`write_swift_examples`), and small quick
    versions: a local student (tiny_qwen2) and teacher (small_qwen2) model folder, an arithmetic
    dataset (data/train.jsonl, chat rows) and four short YAMLs in ms-swift's form that use them."""
    out = Path(folder)
    (out / "data").mkdir(parents=True, exist_ok=True)
    for name, preset in (("student", "tiny_qwen2"), ("teacher", "small_qwen2")):
        save_checkpoint(build_model(preset), load_tokenizer(preset), out / name)
    with open(out / "data" / "train.jsonl", "w") as f:
        for ex in arithmetic_examples(400, seed=0, split="train"):
            f.write(json.dumps({"messages": ex.messages()}) + "\n")
    for yaml_file in resources.files("algorithms.config").joinpath("ms_swift_examples").iterdir():
        if yaml_file.name.endswith(".yaml"):
            shutil.copyfile(str(yaml_file), out / yaml_file.name)
    return write_swift_examples(out)


def main(argv: Optional[list[str]] = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in DRIVERS:
        return forward(DRIVERS[args[0]], args[1:])
    if args and args[0] == "example" and len(args) == 2:
        out = write_example(args[1])
        print(f"wrote ms-swift's example files under {out}/examples with stand-ins for their hub ids in "
              f"{out}/hub ({out}/STAND_INS.md), and quick versions: {out}/student, {out}/teacher, "
              f"{out}/data/train.jsonl, {', '.join(sorted(p.name for p in out.glob('*.yaml')))}; next: cd {out} && "
              "rayroles run --config gkd_colocated_teacher.yaml, or HF_HUB_CACHE=$PWD/hub rayroles run --config "
              "examples/ray/gkd/rollout_colocate_teacher_colocate.yaml run.steps=2")
        return None
    command = args[0] if args and args[0] == "run" else None
    path, rest = config_of(args[1:] if command else args)
    if path is None:
        print(USAGE, file=sys.stderr)
        sys.exit(2)
    try:
        driver = driver_of(path)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    return forward(DRIVERS[driver], [f"config_file={path}", *rest])


if __name__ == "__main__":
    main()
