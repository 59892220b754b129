"""Private data: secure aggregation, differential privacy and encryption, as pure logic.

The worker, the aggregator and the CLI call it; it imports neither them nor HTTP nor ``train``
(import-linter holds it to that), and does no I/O. Map of the files:

- ``fixedpoint``  a delta as one flat vector; values quantized to integers mod 2^32, or on a shared
                  grid mod 2^k (a narrow ring for compressed updates)
- ``masks``       X25519 key agreement, HKDF seeds, ChaCha20 mask expansion, Shamir shares
- ``secagg``      one round of secure aggregation: the clients' masking and the aggregator's unmasking
- ``mailbox``     the relay's rules for its messages: who posts and reads what, when an attempt is final
- ``dp``          client-level DP: L2 clipping, Gaussian noise (whole or split), the RDP accountant's ε
- ``envelope``    AES-GCM blobs under a per-job data key; the key sealed to leased nodes (HPKE)

Threat model. The aggregator learns the sum of the survivors' clipped, quantized updates and which
clients survived, nothing about any one update, as long as it follows the protocol or, if it lies about
who dropped, colludes with no client: a client reveals one of its two secrets per peer, never both, and
``t > n/2`` keeps two conflicting survivor sets from each gathering ``t`` answers. Against an aggregator
colluding with clients the bound is fewer than ``t`` of them and needs SecAgg's signed consistency
round, which the network layer must add. A client that drops after sharing costs one key
reconstruction; more than ``n - t`` drops and the round fails. Given up: commitments, audits and robust
aggregation cannot see a masked update, so such jobs run among owners the consumer admitted, each
clipping (and, with DP, noising) its own update.
"""
