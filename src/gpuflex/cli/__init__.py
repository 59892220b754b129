"""The ``gpuflex`` command line (Typer + Rich); one module per command group.

- ``main``         the app, its groups, and the one-line error handling
- ``profile``      where the CLI finds the coordinator URL and the API token: flags, variables, named profiles
- ``coordinator``  ``coordinator serve | migrate``
- ``provider``     ``provider start | dashboard``
- ``node_wallet``  ``provider wallet | stake | unstake | withdraw`` (as the node)
- ``account``      ``account create | use | profiles``, ``whoami``, ``wallet deposit | balance``
- ``jobs``         ``submit``, ``quote``, ``jobs``, ``job show | logs | cancel | fetch | watch | report``,
                   ``offers``
- ``inputs``       a job's model directory, data and recipe file: checked here and by the coordinator's
                   check before anything large is uploaded, then uploaded
- ``watch``        the live Rich view of a running job; ``report`` its PNG loss curve and cost table
- ``ledger``       ``ledger export | verify`` (hashes, chain, balances and signatures, offline)
- ``governance``   ``governance propose | vote`` (as a provider node), ``proposals | parameters``
- ``operator``     ``operator slash`` (the operator's token), ``slashes`` (every verdict, for all)
- ``demo``         ``demo``: the whole network on this machine
- ``serve``        ``serve DIR``: a model directory behind an OpenAI-compatible API on this machine
"""
