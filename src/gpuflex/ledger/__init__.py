"""The ledger's pure core: accounts, the hash-chained journal, metering and settlement arithmetic.

Money is integer micro-credits (``gpuflex.protocol.money``); nothing here does I/O or reads a
clock, so the coordinator (which stores entries) and the simulator call the very same functions.

- ``accounts``    account names (``consumer:<id>``, ``escrow:<job>``, ``stake:<node>``, ``held:<job>/<node>``,
                  ``world`` ...) and who may go negative
- ``journal``     entries, their hash chain, validation, balances, verification (with the
                  coordinator's public key: every entry's Ed25519 signature of its hash too)
- ``export``      the journal on the wire (``LedgerExport``: entries, signatures, public key) and
                  verifying an export offline, against the key it names or one you pin
- ``metering``    lease seconds x price -> micro-credits, rounded down
- ``settlement``  one entry's postings that empty a job's escrow into providers, fees and refund
- ``governance``  the parameters stake may change, their ranges, and the stake-weighted tally
"""

from gpuflex.ledger.accounts import (
    PLATFORM_FEES,
    SLASHED,
    WORLD,
    consumer,
    escrow,
    held,
    may_go_negative,
    provider,
    stake,
)
from gpuflex.ledger.journal import (
    GENESIS_HASH,
    RECORD_KINDS,
    ChainReport,
    Entry,
    balances,
    check_funds,
    entry_hash,
    make_entry,
    signed_message,
    verify_chain,
)
from gpuflex.ledger.metering import lease_cost_micro
from gpuflex.ledger.settlement import settle_job

__all__ = [
    "GENESIS_HASH",
    "PLATFORM_FEES",
    "RECORD_KINDS",
    "SLASHED",
    "WORLD",
    "ChainReport",
    "Entry",
    "balances",
    "check_funds",
    "consumer",
    "entry_hash",
    "escrow",
    "held",
    "lease_cost_micro",
    "make_entry",
    "may_go_negative",
    "provider",
    "settle_job",
    "signed_message",
    "stake",
    "verify_chain",
]
