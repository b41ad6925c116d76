"""Named, stateless randomness: every random stream is derived from (seed, *parts).

Resuming a run bit for bit needs every random draw to be a function of *where* it happens
(seed, step, rank, purpose), never of how many draws came before it in the process. So nothing in
rewind touches torch's or numpy's global RNG: each consumer asks for a fresh generator keyed by
the parts that identify its draw, e.g. `torch_generator(seed, "dropout", step, rank)`.

The key is hashed with blake2b over an unambiguous encoding of the parts, never with Python's
`hash()` (salted per process for strings) and never by arithmetic on the seed (`seed + step`
collides across purposes).
"""

from __future__ import annotations

import hashlib
import operator

import numpy as np
import torch

# Distinguishes rewind's derivations from any other blake2b use of the same bytes.
_PERSON = b"rewind.rng.v1"
_MASK_63 = (1 << 63) - 1


def _encode_part(part: int | str) -> bytes:
    """Type tag + length + payload, so ("ab", "c") and ("a", "bc") or 1 and "1" never collide."""
    if isinstance(part, str):
        tag, payload = b"s", part.encode("utf-8")
    elif isinstance(part, bool):
        # bool is an int subclass; True == 1 would silently alias, so refuse it outright.
        raise TypeError("derive_seed parts must be int or str, got bool")
    else:
        try:
            value = operator.index(part)  # accepts numpy integers, refuses floats
        except TypeError:
            raise TypeError(f"derive_seed parts must be int or str, got {type(part).__name__}") from None
        tag, payload = b"i", str(value).encode("ascii")
    return tag + len(payload).to_bytes(4, "little") + payload


def derive_seed(seed: int, *parts: int | str) -> int:
    """A stable 63-bit seed for the stream named by (seed, *parts); the same on every machine."""
    digest = hashlib.blake2b(digest_size=8, person=_PERSON)
    digest.update(_encode_part(seed))
    for part in parts:
        digest.update(_encode_part(part))
    # 63 bits: fits a signed int64, which is what torch.Generator.manual_seed and numpy accept.
    return int.from_bytes(digest.digest(), "little") & _MASK_63


def torch_generator(seed: int, *parts: int | str, device: str | torch.device = "cpu") -> torch.Generator:
    """A torch.Generator seeded for the stream (seed, *parts), on `device` (default CPU)."""
    generator = torch.Generator(device=device)
    generator.manual_seed(derive_seed(seed, *parts))
    return generator


def numpy_rng(seed: int, *parts: int | str) -> np.random.Generator:
    """A numpy Generator (PCG64) for the stream (seed, *parts)."""
    return np.random.Generator(np.random.PCG64(derive_seed(seed, *parts)))
