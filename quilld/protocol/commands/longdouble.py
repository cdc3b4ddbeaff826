"""INCRBYFLOAT's numbers: x87 80-bit long doubles, as redis computes them.

redis parses with strtold, adds in long double and prints "%.17Lf" with the trailing zeros
cut (util.c: string2ld, ld2string LD_STR_HUMAN). A double would answer differently (10.5 +
0.1 is "10.6" there, 10.59999999999999964 here), so the values are exact fractions rounded
as the x87 format rounds: 64-bit significand, nearest-even, exponents -16382..16383, with
subnormals below. Errors carry redis's text.
"""

from __future__ import annotations

import re
from fractions import Fraction

from quilld.errors import CommandError

MAX_LONG_DOUBLE_CHARS = 5 * 1024  # redis's limit on a float's text, value or increment
NOT_FLOAT = CommandError("value is not a valid float")
_NAN_INF = CommandError("increment would produce NaN or Infinity")
ZERO = Fraction(0)
_INF = float("inf")
_EMIN, _EMAX = -16382, 16383
_DECIMAL = re.compile(rb"([+-]?)(\d*)(?:\.(\d*))?(?:[eE]([+-]?\d+))?")
_HEX = re.compile(rb"([+-]?)0[xX]([0-9a-fA-F]*)(?:\.([0-9a-fA-F]*))?(?:[pP]([+-]?\d+))?")
_SPECIAL = re.compile(rb"([+-]?)(inf|infinity|nan(?:\([0-9A-Za-z_]*\))?)", re.IGNORECASE)
_CHUNK_DIGITS = 4000  # under Python's limit on one int <-> decimal text conversion (4300)


def _int_of(digits: bytes) -> int:
    value = 0
    for i in range(0, len(digits), _CHUNK_DIGITS):
        piece = digits[i:i + _CHUNK_DIGITS]
        value = value * 10 ** len(piece) + int(piece)
    return value


def _text_of(n: int) -> bytes:
    parts = []
    while n >= 10 ** _CHUNK_DIGITS:
        n, low = divmod(n, 10 ** _CHUNK_DIGITS)
        parts.append(b"%0*d" % (_CHUNK_DIGITS, low))
    parts.append(b"%d" % n)
    return b"".join(reversed(parts))


def _to_long_double(x: Fraction) -> Fraction | float:
    """`x` rounded to the nearest x87 long double (ties to even); +-inf past the largest."""
    if not x:
        return ZERO
    p, q = abs(x.numerator), x.denominator
    e = p.bit_length() - q.bit_length()  # 2**e <= p/q < 2**(e+1) once adjusted
    if (p << -e if e < 0 else p) < (q << e if e > 0 else q):
        e -= 1
    shift = 63 - max(e, _EMIN)  # significand m = x * 2**shift, 64 bits (fewer when subnormal)
    num, den = (p << shift, q) if shift >= 0 else (p, q << -shift)
    m, r = divmod(num, den)
    if 2 * r > den or (2 * r == den and m & 1):
        m += 1
    if m >> 64:
        m >>= 1
        shift -= 1
    if 63 - shift > _EMAX:
        return _INF if x > 0 else -_INF
    value = Fraction(m, 1 << shift) if shift >= 0 else Fraction(m << -shift)
    return value if x > 0 else -value


def parse_long_double(raw) -> Fraction | float:
    """A float's text as strtold reads it, under redis's string2ld rules (no blanks, nothing
    after it, not NaN, not out of range, at most MAX_LONG_DOUBLE_CHARS); ERR otherwise."""
    raw = bytes(raw)
    if not raw or len(raw) >= MAX_LONG_DOUBLE_CHARS:
        raise NOT_FLOAT
    m = _SPECIAL.fullmatch(raw)
    if m:
        if m.group(2)[:1] in (b"n", b"N"):
            raise NOT_FLOAT
        return -_INF if m.group(1) == b"-" else _INF
    hexa = _HEX.fullmatch(raw)
    m = hexa or _DECIMAL.fullmatch(raw)
    if not m:
        raise NOT_FLOAT
    sign, whole, frac, exp = m.groups()
    frac = frac or b""
    if not whole and not frac:
        raise NOT_FLOAT
    digits = (whole + frac).lstrip(b"0")
    if not digits:
        return ZERO
    mantissa = int(digits, 16) if hexa else _int_of(digits)
    if hexa:
        base, power = 2, int(exp or b"0") - 4 * len(frac)
        low = high = mantissa.bit_length() + power  # 2**(high-1) <= value < 2**high
        low -= 1
    else:
        base, power = 10, int(exp or b"0") - len(frac)
        high = (len(digits) + power) * 3.3219281  # log2 of 10**(len+power), above the value
        low = high - 3.3219281
    if low > _EMAX + 1:
        raise NOT_FLOAT  # ERANGE, HUGE_VAL
    if high < _EMIN - 66:
        raise NOT_FLOAT  # ERANGE, below half the smallest subnormal: zero
    exact = Fraction(mantissa) * (Fraction(base) ** power)
    value = _to_long_double(exact)
    if value in (_INF, -_INF) or not value:
        raise NOT_FLOAT
    return -value if sign == b"-" else value


def add_long_double(a, b) -> Fraction:
    if a.__class__ is float or b.__class__ is float:  # an infinity: the sum is one, or NaN
        raise _NAN_INF
    value = _to_long_double(a + b)
    if value.__class__ is float:
        raise _NAN_INF
    return value


def format_long_double(value: Fraction) -> bytes:
    """"%.17Lf" (glibc: exact, ties to even), trailing zeros and point cut, "-0" as "0"."""
    a = abs(value) * 10 ** 17
    q, r = divmod(a.numerator, a.denominator)
    if 2 * r > a.denominator or (2 * r == a.denominator and q & 1):
        q += 1
    digits = _text_of(q).rjust(18, b"0")
    text = (digits[:-17] + b"." + digits[-17:]).rstrip(b"0").rstrip(b".")
    if value < 0 and text != b"0":
        text = b"-" + text
    return text
