"""Writing a trunk file removes what a killed writer left in trunks/ (rewind's temporaries, by their exact
names: rewind.stores.temporaries), and never a file of someone else's that merely contains `.tmp-`."""

from __future__ import annotations

import hashlib

from rewind.stores.trunks import TrunkStore


def test_writing_a_trunk_removes_only_rewinds_own_temporaries(tmp_path):
    trunks = tmp_path / "trunks"
    trunks.mkdir()
    left = trunks / f".{'a' * 64}.safetensors.tmp-123-0123abcd"  # what fsio's write_atomic names
    left.write_bytes(b"half written")
    theirs = [trunks / "notes.tmp-keep", trunks / f"{'b' * 64}.safetensors.tmp-backup"]
    for path in theirs:
        path.write_text("someone's")
    data = b"trunk bytes"
    digest = hashlib.sha256(data).hexdigest()
    TrunkStore(tmp_path).write(data, digest)
    assert (trunks / f"{digest}.safetensors").read_bytes() == data
    assert not left.exists()
    assert all(path.read_text() == "someone's" for path in theirs)
