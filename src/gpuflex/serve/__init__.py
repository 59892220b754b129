"""Inference: the engine a provider's server task runs, and the check of what it served.

Map of the files (data flows down this list):

- ``model``        a ``save_pretrained`` directory loaded once; prompts and chat messages as token ids
- ``engine``       continuous batching on a background thread: prefill, KV-cache decoding, streamed events
- ``sampling``     ``SamplingParams``; each draw seeded by (seed, output position): resumable, replayable
- ``detokenize``   output tokens to streamed text: whole characters only, stop strings never sent
- ``fingerprint``  TOPLOC-style proofs: each 32 tokens' top-k hidden values as a polynomial, 258 bytes
- ``verify``       one prefill on the verifier's model checks the fingerprints and the sampling: a ``Finding``
- ``backend``      what the OpenAI routes need from whatever serves a model; ``LocalBackend``: one engine
- ``cheats``       dishonest providers (smaller or quantized models, other temperatures, foreign tokens,
                   altered prompts): the tests and the benchmark check that ``verify`` catches each

It imports neither the client, the coordinator, the agent nor the training runtime (an import-linter
contract): the server task and the gateway's verifier build on it, and the OpenAI routes
(``gpuflex.coordinator.routes.openai``) serve through ``backend``.
"""
