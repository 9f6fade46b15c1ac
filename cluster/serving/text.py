"""Output text: token ids to text deltas, incrementally, with text-level stop strings.

Tokens are detokenized incrementally and the output is truncated before the first stop string; text that might
be the start of a stop string is held back until it is known not to be.
"""

from __future__ import annotations

# The window of prompt tokens the incremental detokenizer decodes in front of the output, so a first output
# token's leading space (SentencePiece) or merged bytes render as they would inside the full text.
DETOKENIZE_PREFIX_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"  # what a tokenizer decodes an incomplete UTF-8 byte sequence to


class TextAssembler:
    """Turns output token ids into text deltas, incrementally, and applies stop strings.

    `decode(ids) -> str` is the tokenizer's decode (special tokens skipped). Each `push(ids)` returns the new
    text that is safe to send: complete characters only (no trailing U+FFFD from a split UTF-8 sequence) and
    not the longest tail that is the beginning of a stop string (it is held back). Once a stop string
    appears, `stopped` is True, the text is cut before it, and later pushes return "". `flush()` returns
    what was held back when the output ends without a stop.
    """

    def __init__(self, decode, prompt_ids: list[int], stop: tuple[str, ...] = ()):
        self._decode = decode
        self._ids = list(prompt_ids[-DETOKENIZE_PREFIX_TOKENS:])
        self._prefix_offset = 0  # ids[prefix_offset:read_offset] is the context already rendered
        self._read_offset = len(self._ids)
        self._stop = tuple(stop)
        self._longest_stop = max((len(s) for s in self._stop), default=0)
        self.text = ""  # all decoded output so far (cut at the stop string once stopped)
        self._sent = 0  # characters of `text` already returned
        self.stopped = False

    def push(self, token_ids: list[int]) -> str:
        if self.stopped or not token_ids:
            return ""
        self._ids.extend(token_ids)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) > len(prefix) and not full.endswith(REPLACEMENT_CHAR):
            self.text += full[len(prefix) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
        if self._stop:
            # A stop string can only start in the unsent tail or the held-back characters before it.
            start = max(0, self._sent - self._longest_stop + 1)
            hits = [i for i in (self.text.find(s, start) for s in self._stop) if i >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                self.stopped = True
                return self._take(len(self.text))
        return self._take(len(self.text) - self._stop_prefix_len())

    def _stop_prefix_len(self) -> int:
        """Length of the longest unsent tail of `text` that begins some stop string."""
        for k in range(min(self._longest_stop - 1, len(self.text) - self._sent), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self._stop):
                return k
        return 0

    def flush(self) -> str:
        return self._take(len(self.text))

    def _take(self, end: int) -> str:
        delta = self.text[self._sent : end]
        self._sent = max(self._sent, end)
        return delta
