"""Seeing a run from outside: MLflow tracking, a Prometheus endpoint, profiler traces, memory
records and the one-page run report (docs/guides/observability.md).

Every piece is off by default, and nothing here is imported until a flag turns it on: a run
without these flags imports none of mlflow, prometheus_client or the profilers.
"""
