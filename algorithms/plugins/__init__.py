"""What an ms-swift plugin file imports, under this project's name: change its line
`from swift.rewards import ORM, orms` (and `swift.rollout...`'s `MultiTurnScheduler, multi_turns,
Env, envs`) to `from algorithms.plugins import ORM, orms, ...` and name the file in a
config_file's `external_plugins`. Every class it registers in `orms` is a reward function for
`reward_funcs` (GRPO) and `orm_model` (distill), called as `instance(completions, **columns)`
with the rows' dataset columns; every class in `multi_turns` a `multi_turn_scheduler`, in `envs`
a `gym_env`, and every function in `tools` a tool of the `tools` scheduler (docs/multi_turn.md).
The registries live in roles/plugins.py, where the roles read them in their own processes.
"""
from roles.plugins import (ORM, Env, GymEnv, MultiTurnScheduler, PluginError, envs, load_plugin, multi_turns, orms,
                           tools)

__all__ = ["ORM", "orms", "MultiTurnScheduler", "multi_turns", "Env", "GymEnv", "envs", "tools", "load_plugin",
           "PluginError"]
