"""rewind.tools."""
