"""The base of every config record: immutable, and an unknown key is an error, never ignored."""

from __future__ import annotations

import msgspec


class Struct(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Base of every config section: immutable, and unknown keys are an error, never ignored."""
