"""What an ms-swift plugin file imports, under this project's name: change its line
`from swift.rewards import ORM, orms` (and `swift.rollout...`'s `MultiTurnScheduler, multi_turns,
Env, envs`) to `from algorithms.plugins import ORM, orms, ...` and name the file in a
config_file's `external_plugins`. Every class it registers in `orms` is a reward function for
`reward_funcs` (GRPO) and `orm_model` (distill), called as `instance(completions, **columns)`
with the rows' dataset columns. `multi_turns` and `envs` are declared for multi-turn rollouts,
which nothing here runs yet. The registries live in roles/plugins.py, where the ORM role reads
them in its own process.
"""
from roles.plugins import ORM, Env, MultiTurnScheduler, PluginError, envs, load_plugin, multi_turns, orms

__all__ = ["ORM", "orms", "MultiTurnScheduler", "multi_turns", "Env", "envs", "load_plugin", "PluginError"]
