"""rewind.states."""
