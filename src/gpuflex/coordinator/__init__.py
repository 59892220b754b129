"""The coordinator: a stateless HTTP service; every bit of state is in the database.

- ``settings``    typed configuration, read once (``GPUFLEX_`` environment variables)
- ``db``          SQLAlchemy models and the engine/session factory
- ``migrate``     Alembic migrations (``gpuflex coordinator migrate``)
- ``services/``   one module per noun: accounts, registry, liveness, market, jobs, leases, rounds, ledger,
                  governance, …
- ``routes/``     thin FastAPI routers: parse, call a service, return a protocol model
- ``auth``        request authentication: API tokens, node signatures, task tokens
- ``app``         the app factory, error handlers, body-size limits and the background reaper
- ``heartbeats``  group commit of heartbeats: one writer thread, one transaction per batch
- ``metrics``     Prometheus metrics (one registry per app) and the request-latency middleware
- ``web/``        the dashboard: server-rendered pages, sign-in, the live job view
"""
