"""The algorithms: one driver per file at the top, the rooms they are built from below.

    grpo.py gkd.py sft.py distill.py   drivers: the algorithm's section, its loop, its validate,
                                       a one-line main (`python -m algorithms.grpo +experiment=...`)
    cli.py                             the `rayroles` command (an ms-swift YAML picks its driver)
    data/                              tasks, a user's files, prompt rendering, answer checking
    objectives/                        losses, advantages, rewards: what a step optimises
    records/                           run log, trackers, plots, checkpoints: what a run writes
    config/                            the shared schema, ms-swift's key tables, every shared check
    runtime/                           the loop's frame, turn-taking, weight sync, generation ahead,
                                       the driver entry

Imports run down this list's rooms only (data lowest, runtime highest; tests/test_layout.py
holds it); docs/ARCHITECTURE.md draws the whole project.
"""
