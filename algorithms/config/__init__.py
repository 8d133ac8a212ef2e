"""The configuration every driver shares, and its checks.

schema.py (the typed sections with their one default each: `DriverConfig`, `LoopConfig`;
`prepare` types a composed config, applies an ms-swift config_file and plans the placement),
swift_keys.py and swift_values.py (ms-swift's keys and how each value becomes ours),
checks.py (every shared check, one style: `require(ok, key, value, problem, fix)`, run by each
driver's validate before anything starts). Each driver's own section sits in its own file.
"""
