"""Observability: Prometheus metrics (metrics.py), OpenTelemetry request traces (tracing.py),
per-tenant SLO objectives and status (slo.py), the Prometheus rule generator (rules.py) and the
Grafana dashboard (dashboards.py)."""
