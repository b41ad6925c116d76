"""`python -m rewind ...` and `torchrun ... -m rewind ...`: the `rewind` command."""

from rewind.tools.cli import entry

if __name__ == "__main__":
    entry()
