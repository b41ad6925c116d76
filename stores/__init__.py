"""rewind.stores: what a run remembers (the event log, checkpoints, caches beside them, projections)."""

# Registered on import of the package, so that every reader of a log can read older schemas.
from rewind.stores import upcasters as _upcasters  # noqa: F401
