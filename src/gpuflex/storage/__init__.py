"""Content-addressed blob storage: datasets, models, pseudo-gradients, checkpoints.

- ``blobs``  the ``BlobStore`` interface, key validation, and the local-directory store
"""

from gpuflex.storage.blobs import BlobStore, LocalBlobStore, sha256_hex, validate_digest

__all__ = ["BlobStore", "LocalBlobStore", "sha256_hex", "validate_digest"]
