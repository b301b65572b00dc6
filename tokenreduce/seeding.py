"""Deterministic seeds for random dst choice.

Each plan draws from a generator seeded by hashing the user's seed with where and when the
plan is made (noise level, block, grid). The partition of a block at a step therefore does not
depend on how the host batches its calls: cond and uncond in one call or in two, one area or
several, a rerun or a resumed queue all see the same partitions. Python's ``hash`` is salted
per process, so a keyed BLAKE2 digest is used instead.
"""

from __future__ import annotations

import hashlib
import struct


def derive_seed(seed: int, *parts: object) -> int:
    """A 63-bit seed from ``seed`` and any reprs-stable parts (ints, floats, strings, tuples)."""
    digest = hashlib.blake2b(digest_size=8, key=struct.pack("<q", seed & 0x7FFF_FFFF_FFFF_FFFF))
    for part in parts:
        if isinstance(part, float):
            digest.update(struct.pack("<d", part))
        else:
            digest.update(repr(part).encode())
        digest.update(b"\x1f")
    return int.from_bytes(digest.digest(), "little") & 0x7FFF_FFFF_FFFF_FFFF
