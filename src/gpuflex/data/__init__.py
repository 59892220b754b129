"""Datasets, tokenized and sharded: what a job trains on, prepared once on the consumer's machine.

Pure of HTTP: it reads and writes files (on any fsspec URL) and never imports the client, the
coordinator or the agent; ``train`` and the CLI use it. Map of the files (data flows down the list):

- ``sources``    documents from text files, JSON Lines, Parquet, Arrow and ``datasets`` directories
- ``tokenizer``  documents to ids: a Hugging Face ``tokenizers`` tokenizer, or bytes; EOS after each
- ``manifest``   the manifest (strict model, its own hash); ``load_manifest`` checks every shard
- ``shards``     fixed-size shards of raw little-endian ids, hashed as written; the validation split
- ``prepare``    ``gpuflex data prepare``'s pipeline: read, encode and write overlapped on threads
- ``cache``      a worker's cache of shards and model files: by sha256, a size limit, LRU eviction, pins
- ``fetch``      a task's shards, opened on first use: from a directory, or fetched by hash through the cache
- ``assign``     which shards each worker trains on, and its reproducible batches (torch, when drawn)
- ``fit``        whether a manifest fits a job: tokenizer vs recipe and model, tokens vs workers x block

Nothing is imported eagerly: ``gpuflex data prepare`` never loads torch, nor does a check of a fit.
"""
