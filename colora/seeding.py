"""Derived seeds: every random draw in colora names its purpose, so runs are reproducible and
independent streams never share a seed. Library code never touches a global RNG."""

from __future__ import annotations

import hashlib


def derive_seed(run_seed: int, *parts: object) -> int:
    """A 63-bit seed from the run seed and a path of names, e.g. (seed, "math", 3, "prompts").

    sha256 over the repr of the parts: stable across processes and Python versions (unlike
    `hash()`, which is salted per process for strings).
    """
    h = hashlib.sha256(repr((int(run_seed),) + tuple(parts)).encode())
    return int.from_bytes(h.digest()[:8], "little") >> 1
