"""The coordinator: a stateless HTTP service; every bit of state is in the database.

- ``settings``    typed configuration, read once (``GPUFLEX_`` environment variables)
- ``db``          SQLAlchemy models and the engine/session factory
- ``migrate``     Alembic migrations (``gpuflex coordinator migrate``)
- ``services/``   one module per noun: accounts, registry, liveness, market, jobs, deployments,
                  deployment_keys, leases, rounds, ledger, governance, …
- ``routes/``     thin FastAPI routers: parse, call a service, return a protocol model
- ``auth``        request authentication: API tokens, node signatures, task tokens, deployment keys
- ``gateway``     the OpenAI routes' backend over deployments (``routes/openai.py`` mounted under /v1)
- ``relay``       this process's line to the deployment replicas connected to it: requests down, events up
- ``broker``      relays of several coordinator processes joined through PostgreSQL LISTEN/NOTIFY
- ``app``         the app factory, error handlers, body-size limits and the background reaper
- ``heartbeats``  group commit of heartbeats: one writer thread, one transaction per batch
- ``metrics``     Prometheus metrics (one registry per app) and the request-latency middleware
- ``web/``        the dashboard: server-rendered pages, sign-in, the live job view
"""
