"""Content-addressed blob storage: datasets, models, pseudo-gradients, checkpoints.

- ``blobs``    the ``BlobStore`` interface, key validation, presigned URLs, and the local-directory store
- ``objects``  the same in any fsspec filesystem: S3 and S3-compatible services (which sign URLs for
               direct transfers), ``memory://``
- ``bundles``  a directory (a model's) as blobs: a manifest, files cut into parts under the blob limit
- ``fetching`` many blobs fetched a few at a time, in order (a model file's parts, a job's shards)
"""

from gpuflex.storage.blobs import BlobStore, LocalBlobStore, Presigned, sha256_hex, validate_digest
from gpuflex.storage.objects import FsspecBlobStore

__all__ = ["BlobStore", "FsspecBlobStore", "LocalBlobStore", "Presigned", "sha256_hex", "validate_digest"]
