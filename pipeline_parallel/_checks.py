"""Argument checks shared by the public entry points, so each bad value gets one kind of message; and the text
helpers those messages share (`plural`, the UTF-8 checks)."""

from __future__ import annotations

import math
import numbers
import re

# What in a str is no UTF-8: undecodable bytes of a command line or file name (surrogateescape), unpaired
# surrogate escapes of JSON. Neither a tokenizer nor a TOML file takes them.
SURROGATES = re.compile("[\ud800-\udfff]")


def is_int(value) -> bool:
    """Whether `value` is an integer (numpy's too), not a bool."""
    return type(value) is int or (isinstance(value, numbers.Integral) and not isinstance(value, bool))


def plural(count: int, noun: str) -> str:
    """`count` and `noun`, with an s where count is not 1: "1 stage", "2 stages"."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def is_utf8(text: str) -> bool:
    """Whether `text` can be written as UTF-8 (holds none of `SURROGATES`)."""
    return SURROGATES.search(text) is None


def _real(value) -> float | None:
    """`value` as a float if it is a real number (numpy's, or a one-element tensor's), else None."""
    if isinstance(value, (bool, str, bytes)):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def check_int(name: str, value, minimum: int = 1, hint: str = "") -> int:
    """`value` as an int if it is an integer (numpy's too, not a bool) of at least `minimum`, else a
    ValueError naming `name`."""
    if not is_int(value) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}{hint}, got {value!r}")
    return int(value)


def check_seed(name: str, value, hint: str = "") -> int:
    """`value` as an int if it is an integer from 0 to 2**63 - 1, the seeds torch's generators take, else a
    ValueError naming `name`."""
    if not is_int(value) or not 0 <= value < 2**63:
        raise ValueError(f"{name} must be an integer from 0 to 2**63 - 1{hint}, got {value!r}")
    return int(value)


def check_bool(name: str, value) -> bool:
    """`value` if it is a bool, else a ValueError naming `name` (a string such as "no" would count as true)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def check_nonnegative(name: str, value, allow_inf: bool = False, hint: str = "") -> float:
    """`value` as a float if it is a finite real number >= 0 (numpy's or a 0-d tensor's too), else a
    ValueError naming `name`; with `allow_inf`, infinity is taken too."""
    real = _real(value)
    if real is None or not real >= 0 or (real == math.inf and not allow_inf):
        raise ValueError(f"{name} must be a {'' if allow_inf else 'finite '}number >= 0{hint}, got {value!r}")
    return real


def check_positive(name: str, value, allow_inf: bool = False, hint: str = "") -> float:
    """`value` as a float if it is a finite real number > 0 (numpy's too), else a ValueError naming `name`.

    With `allow_inf`, infinity is taken too (where it means "no bound"); `hint` says what values mean.
    """
    real = _real(value)
    if real is None or not real > 0 or (real == math.inf and not allow_inf):
        raise ValueError(f"{name} must be a {'' if allow_inf else 'finite '}number > 0{hint}, got {value!r}")
    return real
