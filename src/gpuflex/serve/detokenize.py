"""Output tokens to streamed text: whole characters only, and never a stop string.

A byte-level tokenizer splits a multi-byte character over several tokens, and a SentencePiece one decodes
a token differently at the start of a string than after others; so each step decodes a short window of
recent tokens twice, with and without the newest, and sends what the newest added once it ends in a whole
character (vLLM's incremental detokenization). Text that could still become a stop string is held back
until it does (the output ends before it) or cannot.

Tokens that are no valid UTF-8 (a character's first bytes, then a token that cannot end it: a sampling
model may draw them) stream as the whole output decodes, U+FFFD included, once no later token can mend
them; what is streamed is always the whole decode.

The state after a list of tokens depends only on that list, so a request resumed with the tokens already
sent starts from exactly the text its first server had sent.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

REPLACEMENT = "\ufffd"  # what decoding shows for an incomplete UTF-8 sequence
WINDOW = 6  # tokens decoded before the newest: enough context for any decoder's spacing rules


class TextStream:
    def __init__(self, decode: Callable[[list[int]], str], stop: tuple[str, ...] = ()):
        self._decode = decode
        self._stop = stop
        self.tokens: list[int] = []
        self.text = ""  # every whole character decoded so far
        self.sent = 0  # how much of it has been sent
        self.stopped = False  # a stop string appeared: the output ends at text[:sent]
        self._prefix = self._read = 0  # token offsets of the window and of what is in self.text

    def feed(self, tokens: Iterable[int]) -> None:
        """Tokens whose text was already sent (a resumed request's)."""
        for token in tokens:
            self.push(token)

    def push(self, token: int) -> str:
        """The text ``token`` lets us send now (often "", while a character or a stop string is pending)."""
        self.tokens.append(token)
        before = self._decode(self.tokens[self._prefix : self._read])
        after = self._decode(self.tokens[self._prefix :])
        if len(after) > len(before) and not after.endswith(REPLACEMENT):
            self.text += after[len(before) :]
            self._prefix, self._read = max(0, len(self.tokens) - WINDOW), len(self.tokens)
        return self._release(final=False)

    def finish(self) -> str:
        """The text held back when the output ends for another reason than a stop string."""
        if not self.stopped:
            tail = self._decode(self.tokens[self._prefix :])[
                len(self._decode(self.tokens[self._prefix : self._read])) :
            ]
            self.text += tail
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stopped:
            return ""
        hits = [i for s in self._stop if (i := self.text.find(s, self.sent)) >= 0]
        if hits:
            self.stopped = True
            end = min(hits)
        elif final:
            end = len(self.text)
        else:
            end = len(self.text) - self._held(self.text[self.sent :])
        delta = self.text[self.sent : end]
        self.sent = end
        return delta

    def _held(self, unsent: str) -> int:
        """The length of the longest end of ``unsent`` that begins a stop string."""
        for size in range(min(len(unsent), max((len(s) for s in self._stop), default=0)), 0, -1):
            if any(s.startswith(unsent[-size:]) for s in self._stop):
                return size
        return 0

    @property
    def output(self) -> str:
        """The text of the output so far, as sent."""
        return self.text[: self.sent]
