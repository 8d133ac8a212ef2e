"""The one command-line entry of every driver (`python -m algorithms.<driver>`, `rayroles`).

    def main() -> None:
        driver_main(GRPOConfig, validate, run)

`driver_main` registers the driver's schema as the typed base of conf/config.yaml, refuses an
override naming an unknown key before Hydra composes, then: prepare (typed config, ms-swift
config_file applied, placement planned) -> the driver's validate (every check, before anything
starts) -> run, restarted from the newest checkpoint after a lost trainer rank
(run.max_restarts). Config, plan and placement errors exit 2 with one line naming the key and
the fix.
"""
from __future__ import annotations

import functools
import json
import logging
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import hydra
from omegaconf import DictConfig

from algorithms.config.schema import prepare, renamed
from algorithms.config.swift_keys import output_run_dir
from algorithms.records.runlog import record_event, run_dir
from orchestration.base_group import WorkerError
from orchestration.config import ConfigError, checked_command_line, register_schema
from orchestration.placement import PlacementError
from orchestration.planner import PlanError

logger = logging.getLogger(__name__)


def driver_main(schema: type, validate: Callable, run: Callable, shown: tuple = ("eval/",)) -> None:
    """Run the driver whose config class is `schema` (its DRIVER names the module) with this
    process's command line; prints the last record's metrics that start with `shown`."""
    register_schema(schema)
    sys.argv = output_run_dir(renamed(sys.argv))
    hydra_main = hydra.main(config_path="pkg://conf", config_name="config", version_base=None)
    checked_command_line(schema)(hydra_main(command(schema, validate, run, shown)))()


def command(schema: type, validate: Callable, run: Callable, shown: tuple = ("eval/",)) -> Callable:
    """The body of a driver's command on a composed config: prepare -> validate -> run (with
    restarts) in the run directory, then the record's `shown` metrics as one JSON line."""
    def main(cfg: DictConfig) -> None:
        typed, plan = prepare(cfg, schema)
        validate(typed, plan)
        record = run_with_restarts(run, typed, plan, run_dir())
        print(json.dumps({k: v for k, v in record.items() if k.startswith(shown)}))

    # Hydra names the job (and <run dir>/<job>.log) after the task function's module.
    main.__module__ = f"algorithms.{schema.DRIVER}"
    return friendly_errors(main)


def run_with_restarts(run: Callable, cfg: Any, plan: Any, out_dir: Path) -> dict:
    """`run(cfg, plan, out_dir)`; a rank lost beyond what its group replaces (a
    trainer rank, or a role's restarts used up) restarts every role from the run's newest
    checkpoint, up to run.max_restarts times."""
    left = cfg.run.max_restarts
    while True:
        try:
            return run(cfg, plan, out_dir)
        except WorkerError as e:
            if not e.lost or left <= 0:
                raise
            left -= 1
            logger.warning(f"{e.role} rank {e.rank} was lost in {e.method}(); restarting every role from the "
                           f"newest checkpoint ({left} restart(s) left)")
            record_event(out_dir, {"event": "restart", "scope": "run", "role": e.role, "rank": e.rank,
                                   "method": e.method, "error": str(e).splitlines()[0]})
            cfg = replace(cfg, run=replace(cfg.run, resume="auto"))


def friendly_errors(main: Callable) -> Callable:
    """Config, plan, data and placement errors exit 2 with one line naming the key and the fix."""
    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except (ConfigError, PlanError, PlacementError) as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)

    return wrapper
