"""Whole-number helpers of the plan space: powers of two, prime factors, divisors.

Pure Python, imported by planner/space.py and planner/axis_rules.py (each axis's degree rule).
"""
from __future__ import annotations


def powers_of_two_up_to(n: int) -> list[int]:
    out, p = [], 1
    while p <= n:
        out.append(p)
        p *= 2
    return out


def prime_factors(n: int) -> dict[int, int]:
    """{prime: exponent} of ``n >= 1`` by trial division (2, then odd numbers): at most
    sqrt(n) / 2 divisions, so instant for any global batch the CLI admits (core.cli_types)."""
    out: dict[int, int] = {}
    p = 2
    while p * p <= n:
        while n % p == 0:
            out[p] = out.get(p, 0) + 1
            n //= p
        p += 1 if p == 2 else 2
    if n > 1:
        out[n] = out.get(n, 0) + 1
    return out


def divisors(n: int) -> list[int]:
    """Every divisor of ``n`` in increasing order, built from its prime factors."""
    if n < 1:
        return []
    out = [1]
    for p, e in prime_factors(n).items():
        out = [d * p ** k for d in out for k in range(e + 1)]
    return sorted(out)
