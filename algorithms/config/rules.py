"""The vocabulary of the drivers' config checks: `require` refuses one key as one ConfigError
(`config key 'X'=V <problem>. Fix: <what to set>`), `require_all` a section's fields against
rules (predicate, what the value must be), `require_roles` a placement without a role a driver
needs; and the rules the checks share."""
from __future__ import annotations

import math
from typing import Any

from orchestration.config import ConfigError
from orchestration.planner import Plan


def require(ok: bool, key: str, value: Any, problem: str, fix: str) -> None:
    """Refuse config key `key` (its value `value`) unless `ok`."""
    if not ok:
        raise ConfigError(f"config key '{key}'={value!r} {problem}. Fix: {fix}")


def require_all(section: Any, prefix: str, rules: dict[str, tuple]) -> None:
    """`rules`: {field: (predicate, what the value must be)}, checked on `section`'s fields; a
    float must also be finite (nan and inf pass no comparison a run can rely on)."""
    for name, (ok, want) in rules.items():
        value = getattr(section, name)
        finite = not isinstance(value, float) or math.isfinite(value)
        must = " ".join(w for w in ("a finite number" if not finite or not want else "", want) if w)
        require(finite and ok(value), f"{prefix}.{name}", value, f"must be {must}",
                f"set {prefix}.{name} to {'a value ' + want if want else 'a finite number'}")


def require_roles(plan: Plan, needed: tuple, driver: str, fix: str) -> None:
    """The placement plans every role of `needed` (a tuple of alternatives counts once)."""
    missing = [r if isinstance(r, str) else "/".join(r) for r in needed
               if not ({r} if isinstance(r, str) else set(r)) & set(plan.roles)]
    if missing:
        raise ConfigError(f"config key 'placement' plans roles {sorted(plan.roles)}; {driver} also needs "
                          f"{missing}. Fix: {fix}")


POSITIVE, NON_NEGATIVE = (lambda v: v > 0, "> 0"), (lambda v: v >= 0, ">= 0")
AT_LEAST_1 = (lambda v: v >= 1, ">= 1")
FRACTION = (lambda v: 0.0 <= v <= 1.0, "in [0, 1]")
ANY_NUMBER = (lambda v: True, "")  # any finite number
UNSET_OR_AT_LEAST_1 = (lambda v: v is None or v >= 1, ">= 1 (or null)")
# Seeds reach torch.manual_seed and vLLM, which take unsigned 64-bit values.
SEED = (lambda v: 0 <= v < 2**63, "in [0, 2**63)")
