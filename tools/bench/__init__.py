"""rewind.tools.bench: the `rewind bench` targets, each a speed figure against a baseline measured in the same run."""
