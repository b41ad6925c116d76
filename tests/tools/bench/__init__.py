"""Tests of rewind.tools.bench."""
