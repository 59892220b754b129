"""Authentication primitives shared by the coordinator and its clients.

- ``signing``  Ed25519 request signatures for nodes: canonical message, sign, verify
- ``tokens``   API and task tokens: generation and the hash the coordinator stores
"""
