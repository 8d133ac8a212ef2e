"""Where roles run, and how the driver calls them; the only package that imports Ray. It imports
no role or algorithm module (it receives role classes). Its modules by job:

* Placement, pure (no Ray): plan_types.py (role names, the keys of both ms-swift forms, Plan,
  RolePlan, PlanError), config.py (the typed placement/cluster/backend/weight_sync sections and
  their checks), planner.py (`make_plan`, the Megatron-Ray form), device_groups.py (the
  Swift-Ray form), plan.py (`python -m orchestration.plan`: print or try a layout).
* Starting: cluster.py (start or join Ray), placement.py (placement groups), launch.py
  (`start_roles`: a worker group per role on either backend), cleanup.py (leftovers of killed runs).
* Calling: base_group.py (the call API both backends share), dispatch.py (slice/execute/collect),
  worker_group.py, rank_process.py and transport.py (Ray ranks), local.py (ranks in this process),
  decorators.py (ms-swift's @worker/@function front end).
* weight_sync.py: trainer weights to the other groups.

docs/placement.md describes the placement forms and the cluster; docs/ARCHITECTURE.md how a step uses them.
"""
