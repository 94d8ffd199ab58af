"""Observability: Prometheus metrics (metrics.py), per-tenant SLO objectives and status (slo.py),
the Prometheus rule generator (rules.py) and the Grafana dashboard (dashboards.py)."""
