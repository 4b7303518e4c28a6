"""The n-gram proposer's index (prompt lookup): where each n-gram of a sequence last ended
(kiln.engine.speculation.speculation)."""

from __future__ import annotations


class NgramIndex:
    """Where each n-gram (n_min <= n <= n_max) of a token sequence last ended before the sequence's newest token."""

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        self.tokens: list[int] = []
        self.ends: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(n_min, n_max + 1)}

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            size = len(self.tokens)
            for n, ends in self.ends.items():  # the n-gram ending here is now followed by `token`
                if size >= n:
                    ends[tuple(self.tokens[size - n :])] = size
            self.tokens.append(token)

    def propose(self, k: int) -> list[int]:
        """Up to `k` tokens that followed the latest earlier occurrence of the longest suffix found (n >= n_min)."""
        size = len(self.tokens)
        for n in range(min(self.n_max, size), self.n_min - 1, -1):
            end = self.ends[n].get(tuple(self.tokens[size - n :]))
            if end is not None:
                return self.tokens[end : end + k]
        return []
