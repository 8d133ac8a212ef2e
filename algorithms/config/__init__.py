"""The configuration every driver shares, and its checks.

schema.py (the typed sections with their one default each: `DriverConfig`, `LoopConfig`;
`prepare` types a composed config, applies an ms-swift config_file and plans the placement),
swift_keys.py and swift_values.py (ms-swift's keys and how each value becomes ours),
checks.py (every shared check, run by each driver's validate before anything starts; the engine
backends' in engine_checks.py), all in one style: rules.py's `require(ok, key, value, problem, fix)`. Each driver's own section sits in its own file.
"""
