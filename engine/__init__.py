"""rewind.engine."""
