"""``derive_seed``: the one way a component turns the run's seed into its own random stream."""

from __future__ import annotations

import hashlib


def derive_seed(base: int, *salts: str | int) -> int:
    """A 63-bit seed for one named use of the run's seed ``base``, e.g. ``derive_seed(seed, "refill", step, round)``.

    Distinct salts give unrelated streams (a rank, an epoch, a resampling round), and the same inputs give the
    same seed in every process and Python version (BLAKE2b of the text, not ``hash()``), so a resumed run redraws
    exactly what the interrupted one drew.
    """
    text = "/".join(str(part) for part in (base, *salts)).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1
