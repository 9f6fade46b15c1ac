"""Matching core of the suffix drafter (SuffixDecoding, Oliaro et al. 2024): a suffix automaton over a token
stream, appendable online at O(max_depth) per token at worst, that finds the longest earlier match of the
context's recent tokens and counts what followed it (structure: docs/architecture.md, "Drafters").

Terms. The **stream** is what an index covers: a request's prompt + committed output (`SuffixIndex`), or a
unit's recent finished outputs separated by `SEPARATOR` (`SuffixCache`, in `suffix_propose`). The **pattern** is
the context's last m ≤ max_depth tokens (while drafting, of the context followed by the draft). An
**occurrence** is an end position e of the pattern with a continuation stream[e + 1]; the one that ends the
request's own stream never counts, nor one followed by `SEPARATOR` or a cache segment's end. The **match
length** L is the longest m whose pattern has an occurrence (0: no match, no draft); the **continuation
counts** give, per token c, the occurrences followed by c.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

SEPARATOR = -1  # ends each sequence in a cache segment; never a context token, so no match spans two outputs
_NONE = 0  # "no transition": the root (state 0) is never a transition's target


@dataclass(frozen=True)
class Match:
    """The longest pattern with an occurrence: its length L (0: none) and its continuation counts."""

    length: int
    counts: dict[int, int]


class SuffixIndex:
    """Suffix automaton over one token stream, appendable online, with occurrence counts (see module doc).

    Nothing is global: dropping the object frees everything. Only committed tokens are appended; there is no
    rollback.
    """

    def __init__(self, max_depth: int = 32):
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        self.max_depth = max_depth
        self._tokens = array("i")
        # Per state; state 0 is the root (the empty string).
        self._length = array("i", [0])  # longest string of the state
        self._link = array("i", [-1])  # suffix link: state of the longest suffix outside this state
        self._count = array("i", [0])  # occurrences (end positions); exact while shortest string ≤ max_depth+1
        self._last_end = array("i", [-1])  # latest end position (same exactness)
        self._tok = array("i", [0])  # first transition's token
        self._to = array("i", [_NONE])  # first transition's target
        self._more: dict[int, dict[int, int]] = {}  # state → {token: target} for further transitions
        self._last = 0  # state of the whole stream
        self._window = 0  # state of the stream's last min(len, max_depth + 1) tokens
        self._window_len = 0

    def __len__(self) -> int:
        return len(self._tokens)

    def tail(self, k: int) -> list[int]:
        """The last k tokens of the stream (all of them when shorter)."""
        return self._tokens[max(0, len(self._tokens) - k):].tolist()

    def _get(self, state: int, token: int) -> int:
        if self._to[state] != _NONE and self._tok[state] == token:
            return self._to[state]
        more = self._more.get(state)
        return more.get(token, _NONE) if more else _NONE

    def _put(self, state: int, token: int, target: int) -> None:
        if self._to[state] == _NONE or self._tok[state] == token:
            self._tok[state] = token
            self._to[state] = target
        else:
            self._more.setdefault(state, {})[token] = target

    def children(self, state: int) -> Iterable[tuple[int, int]]:
        """(token, state) of each transition out of `state`, `SEPARATOR` ones included."""
        if self._to[state] != _NONE:
            yield self._tok[state], self._to[state]
        more = self._more.get(state)
        if more:
            yield from more.items()

    def extend(self, tokens: Iterable[int]) -> None:
        """Append tokens (each ≥ 0) to the stream."""
        tokens = [int(t) for t in tokens]
        if tokens and min(tokens) < 0:
            raise ValueError(f"tokens must be >= 0, got {min(tokens)}")
        self._append(tokens)

    def _append(self, tokens: list[int]) -> None:
        length, link, count, last_end = self._length, self._link, self._count, self._last_end
        tok, to, get, put = self._tok, self._to, self._get, self._put
        window_cap = self.max_depth + 1
        for c in tokens:
            pos = len(self._tokens)
            self._tokens.append(c)
            # Standard online construction: a state for the new stream, transitions from the suffixes lacking c.
            cur = len(length)
            length.append(length[self._last] + 1)
            link.append(0)
            count.append(0)
            last_end.append(pos)
            tok.append(0)
            to.append(_NONE)
            p = self._last
            while p != -1 and get(p, c) == _NONE:
                put(p, c, cur)
                p = link[p]
            split = clone = -1
            if p != -1:
                q = get(p, c)
                if length[p] + 1 == length[q]:
                    link[cur] = q
                else:  # q's strings of length ≤ len(p)+1 move to a clone that also ends at pos
                    clone = len(length)
                    length.append(length[p] + 1)
                    link.append(link[q])
                    count.append(count[q])
                    last_end.append(last_end[q])
                    tok.append(tok[q])
                    to.append(to[q])
                    if q in self._more:
                        self._more[clone] = dict(self._more[q])
                    while p != -1 and get(p, c) == q:
                        put(p, c, clone)
                        p = link[p]
                    link[q] = link[cur] = clone
                    split = q
            self._last = cur
            # Move the window to the new (max_depth+1)-suffix: old window string + c, minus its first token.
            window, window_len = self._window, self._window_len
            if window == split and window_len <= length[clone]:
                window = clone
            window, window_len = get(window, c), window_len + 1
            if window_len > window_cap:
                if length[link[window]] >= window_cap:
                    window = link[window]
                window_len = window_cap
            self._window, self._window_len = window, window_len
            # pos is a new end position of every suffix; states of suffixes longer than max_depth+1 are skipped.
            state = window
            while state > 0:
                count[state] += 1
                last_end[state] = pos
                state = link[state]

    # A cursor (state, matched) is the longest suffix (≤ max_depth) of some token sequence that occurs in this
    # stream: `matched` tokens long, in `state`. Drafting advances it one token at a time (matching statistics).

    def _own_cursor(self) -> tuple[int, int]:
        """The cursor of the stream's own suffix (it trivially occurs: at the end)."""
        if self._window_len > self.max_depth:
            return self._capped(self._window), self.max_depth
        return self._window, self._window_len

    def _cursor(self, pattern: Sequence[int]) -> tuple[int, int]:
        """The cursor of `pattern`'s longest suffix occurring in this stream."""
        state = matched = 0
        for c in pattern[max(0, len(pattern) - self.max_depth):]:
            state, matched = self._advance(state, matched, c)
        return state, matched

    def _advance(self, state: int, matched: int, token: int) -> tuple[int, int]:
        """The cursor after appending `token` to the sequence: shorten it until it can be extended by `token`."""
        get, link = self._get, self._link
        while state > 0 and get(state, token) == _NONE:
            state = link[state]
            matched = self._length[state]
        nxt = get(state, token)
        if nxt == _NONE:
            return 0, 0
        if matched + 1 > self.max_depth:
            return self._capped(nxt), self.max_depth
        return nxt, matched + 1

    def _capped(self, state: int) -> int:
        """The state of the max_depth-token suffix of a string of max_depth + 1 tokens in `state`."""
        return self._link[state] if self._length[self._link[state]] >= self.max_depth else state

    def _at_length(self, state: int, length: int) -> int:
        """The state holding the `length`-token suffix of the strings in `state` (all longer than that)."""
        while self._length[self._link[state]] >= length:
            state = self._link[state]
        return state

    def _has_continuation(self, state: int) -> bool:
        return any(token != SEPARATOR for token, _ in self.children(state))

    def _continued(self, state: int, matched: int) -> tuple[int, int]:
        """Shorten the cursor (follow suffix links) until its suffix has an occurrence with a continuation."""
        while state > 0 and not self._has_continuation(state):
            state = self._link[state]
            matched = self._length[state]
        return state, matched if state > 0 else 0

    def _counts(self, state: int) -> dict[int, int]:
        return {token: self._count[child] for token, child in self.children(state) if token != SEPARATOR}

    def _best_continuation(self, state: int) -> tuple[int, int, int]:
        """(token, N_token, N): the most frequent continuation of the state's strings (ties: the latest), its
        count and the total; (-1, 0, 0) without one."""
        count, last_end = self._count, self._last_end
        best, best_key, total = -1, (0, -1), 0
        if self._to[state] != _NONE and self._tok[state] != SEPARATOR:
            child = self._to[state]
            best, best_key, total = self._tok[state], (count[child], last_end[child]), count[child]
        more = self._more.get(state)
        if more:
            for token, child in more.items():
                if token != SEPARATOR:
                    total += count[child]
                    key = (count[child], last_end[child])
                    if key > best_key:
                        best, best_key = token, key
        return best, best_key[0], total

    def match(self, pattern: Sequence[int] | None = None) -> Match:
        """The longest match and its continuation counts: of the stream's own suffix (an earlier occurrence),
        or, given `pattern`, of the pattern's suffix anywhere in this stream."""
        state, length = self._continued(*(self._own_cursor() if pattern is None else self._cursor(pattern)))
        return Match(length, self._counts(state) if length else {})
