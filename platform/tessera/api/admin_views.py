"""How the admin API shows rows and policies as JSON, shared by its route modules (the shapes
are declared in api/response_models.py).

  iso          a datetime as ISO 8601 text, None as None
  policy_dict  a tenant's effective policy (services.Policy) -> response_models.Policy
  plan_dict    a plan row -> response_models.Plan
"""
from __future__ import annotations

from datetime import datetime

from tessera import services


def iso(dt: datetime | None) -> str | None:
    """`dt` as ISO 8601 text; None stays None."""
    return dt.isoformat() if dt is not None else None


def policy_dict(p: services.Policy) -> dict:
    """A tenant's effective policy: its plan's name, limits (None: unlimited) and priority classes."""
    return {"plan": p.plan, **p.limits.__dict__, "allowed_priorities": list(p.allowed_priorities),
            "default_priority": p.default_priority}


def plan_dict(plan) -> dict:
    """A plan (tessera.models.Plan): its limits, priority classes, included tokens and scheduling weight."""
    return {"name": plan.name, **{f: getattr(plan, f) for f in services.LIMIT_FIELDS},
            "allowed_priorities": list(plan.allowed_priorities), "default_priority": plan.default_priority,
            "monthly_included_tokens": plan.monthly_included_tokens, "scheduling_weight": plan.scheduling_weight}
