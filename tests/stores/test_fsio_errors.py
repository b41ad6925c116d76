"""Filesystem trouble reaches the user as one line: a missing fsspec backend names the package to
install, an unknown protocol says so, and ENOSPC / EROFS / EACCES leave fsio as the OSError they are."""

from __future__ import annotations

import errno
import importlib.util
import os

import pytest

from rewind.stores import fsio
from rewind.stores.codec import LogError
from rewind.stores.eventlog import EVENTS_DIR, LOCK_NAME, EventLog, LogLockedError


@pytest.mark.parametrize(
    ("url", "package"),
    [
        ("s3://bucket/runs/a", "s3fs"),
        ("gs://bucket/runs/a", "gcsfs"),
        ("gcs://bucket/runs/a", "gcsfs"),
        ("abfs://container/runs/a", "adlfs"),
        ("az://container/runs/a", "adlfs"),
        ("simplecache::s3://bucket/runs/a", "s3fs"),
        ("sftp://host/runs/a", "paramiko"),
    ],
)
def test_a_protocol_whose_backend_is_missing_names_the_package(url, package):
    if importlib.util.find_spec(package) is not None:
        pytest.skip(f"{package} is installed here")
    with pytest.raises(fsio.FilesystemUnavailable) as info:
        fsio.filesystem(url)
    message = str(info.value)
    assert isinstance(info.value, LogError) and "\n" not in message
    assert (
        f"needs the package {package}" in message and f"pip install {package}" in message and url in message
    )


def test_an_unknown_protocol_says_so():
    with pytest.raises(fsio.FilesystemUnavailable, match=r"^nope://run: unknown protocol 'nope'$"):
        fsio.filesystem("nope://run")
    with pytest.raises(fsio.FilesystemUnavailable, match="unknown protocol 'nope'"):
        EventLog.open("nope://run", "w")


ERRNOS = [errno.ENOSPC, errno.EROFS, errno.EACCES]


def _refuse(code: int):
    def refuse(*args, **kwargs):
        raise OSError(code, os.strerror(code))

    return refuse


@pytest.mark.parametrize("code", ERRNOS, ids=errno.errorcode.get)
def test_a_refused_atomic_write_surfaces_with_its_errno_and_leaves_no_temporary(tmp_path, monkeypatch, code):
    target = fsio.filesystem(tmp_path / "file")
    target.write_atomic(b"old")
    monkeypatch.setattr(fsio, "write_all", _refuse(code))
    with pytest.raises(OSError) as info:
        target.write_atomic(b"new")
    assert info.value.errno == code
    assert os.listdir(tmp_path) == ["file"] and target.read_bytes() == b"old"


@pytest.mark.parametrize("code", ERRNOS, ids=errno.errorcode.get)
def test_an_exclusive_create_never_falls_back_on_a_refusal(tmp_path, monkeypatch, code):
    """Only 'no hard links here' falls back to O_EXCL; a full or read-only disk is not that."""
    target = fsio.filesystem(tmp_path / "file")
    monkeypatch.setattr(os, "link", _refuse(code))
    with pytest.raises(OSError) as info:
        target.create_exclusive(b"data")
    assert info.value.errno == code and os.listdir(tmp_path) == []


def test_an_exclusive_create_without_hard_links_falls_back(tmp_path, monkeypatch):
    target = fsio.filesystem(tmp_path / "file")
    monkeypatch.setattr(os, "link", _refuse(errno.EPERM))  # what vfat and some FUSE mounts say
    target.create_exclusive(b"data")
    assert target.read_bytes() == b"data" and os.listdir(tmp_path) == ["file"]
    with pytest.raises(FileExistsError):
        target.create_exclusive(b"other")


@pytest.mark.parametrize("code", [errno.EROFS, errno.EACCES], ids=errno.errorcode.get)
def test_a_lock_file_the_filesystem_refuses_is_an_os_error_not_a_locked_log(tmp_path, monkeypatch, code):
    run = tmp_path / "run"
    real_open = os.open

    def open_but_not_the_lock(path, *args, **kwargs):
        if os.fspath(path).endswith(os.path.join(EVENTS_DIR, LOCK_NAME)):
            raise OSError(code, os.strerror(code), path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_but_not_the_lock)
    with pytest.raises(OSError) as info:
        EventLog.open(run, "w")
    assert info.value.errno == code and not isinstance(info.value, LogLockedError)
