"""The simulator: the network's own market, lease, liveness and pricing functions driven by a
discrete-event simulation of many nodes (``gpuflex sim``).

Nothing here decides what the network would: placement is ``market.placement.place_job``,
reliability ``market.reputation``, when a dead node is noticed ``market.liveness``, what a lease
costs ``ledger.metering`` at ``market.pricing.lease_price``, how long a round takes
``market.pricing.round_seconds``. The simulator supplies the world (nodes, sessions, links, jobs)
and keeps it fast enough for a million nodes: node state in arrays, an index of candidates per
requirement class, no heartbeat simulated one by one, one event per stretch of unchanged rounds.
It may use ``market``, ``ledger`` and ``protocol``; never the coordinator or its database.

- ``scenario``   the YAML world: GPU mix, prices, regions, links, sessions, jobs, cloud baseline
                 (strict: an unknown key is an error naming it); ``scenarios/*.yaml`` ship with
                 their sources
- ``population`` the nodes, one numpy array per attribute; session and absence lengths
- ``index``      free nodes per requirement class in the market's rank order: the few candidates
                 a placement needs
- ``engine``     the event loop: sessions, crashes, job arrivals, placement passes, leases, rounds
- ``bandwidth``  aggregator bandwidth by model size from ``bench/diloco_vs_ddp.py``'s measurements
- ``dataplane``  the bytes the job mix moves: what the object store serves and is written, what the
                 coordinator carries with and without direct transfers, control traffic
- ``report``     ``report.json`` and the PNG plots
"""
