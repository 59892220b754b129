"""Authentication primitives shared by the coordinator and its clients.

- ``signing``  Ed25519 request signatures for nodes: canonical message, sign, verify; a node's signed
               sealing key
- ``sealing``  X25519 sealing keys (``privacy.encrypt``), nodes' and consumers', kept in a file
- ``tokens``   API and task tokens: generation and the hash the coordinator stores
"""
