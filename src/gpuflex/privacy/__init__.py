"""Private data: secure aggregation, differential privacy and encryption, as pure logic.

The worker, the aggregator and the CLI call it; it imports neither them nor HTTP nor ``train``
(import-linter holds it to that). Map of the files:

- ``fixedpoint``  a delta as one flat vector; values clipped and quantized to integers mod 2^32
- ``masks``       X25519 key agreement, HKDF seeds, ChaCha20 mask expansion, Shamir shares
- ``secagg``      one round of secure aggregation: the clients' masking and the aggregator's unmasking
- ``dp``          client-level DP: L2 clipping, Gaussian noise (whole or split), the RDP accountant's ε
- ``envelope``    AES-GCM blobs under a per-job data key; the key sealed to leased nodes (HPKE)

Threat model of secure aggregation: the aggregator (honest but curious, or colluding with fewer than
``t`` clients... see ``secagg``) learns the sum of the survivors' clipped, quantized inputs and who
survived, nothing about any one input. A client that drops after sharing costs the survivors one
reconstruction of its key; more than ``n - t`` drops and the round fails. What is given up: screening
and audits of single contributions cannot see masked updates, so such jobs run among owners the
consumer admitted, each clipping its own update.
"""
