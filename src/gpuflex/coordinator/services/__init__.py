"""The coordinator's services, one noun each. Functions take a session and ``now``; routes own transactions.

Dependencies run one way: ``ledger`` <- ``accounts``; ``market`` <- ``leases`` <- ``jobs`` <- ``rounds``;
``jobs`` <- ``deployments`` (a job row of kind deployment) -> ``deployment_keys``;
``ledger`` <- ``governance`` (proposals, votes, and the parameters in force) <- ``liveness`` (the heartbeat
rules, stretched to the fleet) <- ``registry``.
"""
