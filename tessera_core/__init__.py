"""What every part of Tessera shares: the declarative Base and sessions (`db`), the settings of
the database, object store and Celery broker (`settings`), the object store (`objectstore`), the
context built from them (`context`), the Celery configuration every worker uses (`task_queue`)
and the errors of those backing services (`errors`).

The adapter registry (adapter_registry/) and the platform (platform/tessera, billing included)
build on this package as peers; it imports neither of them, nor the engine.
"""
