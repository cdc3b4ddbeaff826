"""LCS's table: the lengths of the longest common subsequences of two strings' prefixes."""

from __future__ import annotations


class LcsTable:
    """The lengths LCS(i, j) of the prefixes a[:i], b[:j], one bit row per prefix of `a`
    (bit-parallel, Hyyrö): LCS(i, j) is the number of 0 bits among the first j of row i.
    The walk back is redis's, tie-breaking included, so the string and ranges are its own."""

    def __init__(self, a: bytes, b: bytes) -> None:
        self.a, self.b = a, b
        full = (1 << len(b)) - 1
        where: dict[int, int] = {}
        for j, ch in enumerate(b):
            where[ch] = where.get(ch, 0) | (1 << j)
        row, rows = full, [full]
        for ch in a:
            u = row & where.get(ch, 0)
            row = ((row + u) | (row - u)) & full
            rows.append(row)
        self.rows = rows

    def at(self, i: int, j: int) -> int:
        return j - (self.rows[i] & ((1 << j) - 1)).bit_count()

    def walk(self, min_len: int, with_len: bool) -> tuple[bytes, list]:
        a, b = self.a, self.b
        alen = len(a)
        i, j = alen, len(b)
        idx = self.at(i, j)
        out = bytearray(idx)
        matches = []
        a_start = alen  # alen: no range open
        a_end = b_start = b_end = 0
        while i > 0 and j > 0:
            emit = False
            if a[i - 1] == b[j - 1]:
                out[idx - 1] = a[i - 1]
                if a_start == alen:
                    a_start = a_end = i - 1
                    b_start = b_end = j - 1
                elif a_start == i and b_start == j:  # contiguous: extend the range backwards
                    a_start -= 1
                    b_start -= 1
                else:
                    emit = True
                if a_start == 0 or b_start == 0:
                    emit = True
                idx -= 1
                i -= 1
                j -= 1
            else:
                if self.at(i - 1, j) > self.at(i, j - 1):
                    i -= 1
                else:
                    j -= 1
                if a_start != alen:
                    emit = True
            if emit:
                length = a_end - a_start + 1
                if min_len == 0 or length >= min_len:
                    match = [[a_start, a_end], [b_start, b_end]]
                    if with_len:
                        match.append(length)
                    matches.append(match)
                a_start = alen
        return bytes(out), matches
