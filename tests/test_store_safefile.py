"""How the file store opens and makes its files (sessionpin/store/safefile.py, issue 20), with
real files: links planted at its names (at open and while it runs), files of another user,
a directory every user may write, umask 000."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from sessionpin.store import StoreError
from sessionpin.store.file import FileStore
from sessionpin.store.safefile import UnsafeFile, check_dir, make_dirs, open_file

ROOT = Path(__file__).resolve().parent.parent
OTHER_UID = 65534          # nobody
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="making a file of another user needs root")


def child(code: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=60)


def names(path: Path) -> dict[str, Path]:
    return {"database": path, "wal": path.with_name(path.name + "-wal"),
            "copy": path.with_name(path.name + ".copy"), "lock": path.with_name(path.name + ".lock")}


def a_store(tmp_path) -> Path:
    path = tmp_path / "store" / "state.db"
    s = FileStore(path)
    s.set("a", "1", durable=True)
    s.close()
    return path


def test_a_link_in_place_of_the_copy_while_running_gets_no_write(tmp_path):
    """Issue 20: three durable writes after the journal (the second copy then) was replaced by
    a link appended their lines to the link's target. Now nothing reaches the target: a write
    that meets the link fails (nothing written); the repair refuses the link, never follows it."""
    path = tmp_path / "state.db"
    target = tmp_path / "victim"
    target.write_bytes(b"precious\n")
    s = FileStore(path)
    try:
        s.set("before", "1", durable=True)
        journal = names(path)["copy"]
        journal.unlink()
        journal.symlink_to(target)
        refused = 0
        for i in range(3):
            try:
                s.set(f"after{i}", "1", durable=True)
            except StoreError as e:
                refused += 1
                assert "symbolic link" in str(e) or "copy" in str(e), e
        assert target.read_bytes() == b"precious\n"
        assert refused or not journal.is_symlink()
    finally:
        s.close()
    assert target.read_bytes() == b"precious\n"


@pytest.mark.parametrize("which", ["database", "wal", "copy", "lock"])
def test_a_link_at_a_store_file_s_name_is_refused_at_open(tmp_path, which):
    path = a_store(tmp_path)
    target = tmp_path / "victim"
    target.write_bytes(b"precious\n")
    target.chmod(0o644)                 # (whatever the umask: the check below is that nothing changed it)
    f = names(path)[which]
    if f.exists():
        f.unlink()
    f.symlink_to(target)
    with pytest.raises(StoreError, match="symbolic link"):
        FileStore(path).close()
    assert target.read_bytes() == b"precious\n" and stat.S_IMODE(target.stat().st_mode) == 0o644


@needs_root
@pytest.mark.parametrize("which", ["database", "copy", "lock"])
def test_a_store_file_of_another_user_is_refused_with_a_clear_line(tmp_path, which):
    path = a_store(tmp_path)
    f = names(path)[which]
    if not f.exists():
        f.touch(mode=0o600)
    os.chown(f, OTHER_UID, OTHER_UID)
    with pytest.raises(StoreError) as e:
        FileStore(path).close()
    assert f"store file {f} is owned by another user (uid {OTHER_UID}" in str(e.value)
    assert os.stat(f).st_uid == OTHER_UID


@needs_root
def test_a_store_directory_of_another_user_is_refused(tmp_path):
    d = tmp_path / "theirs"
    d.mkdir(mode=0o755)
    os.chown(d, OTHER_UID, OTHER_UID)
    with pytest.raises(UnsafeFile, match="is owned by another user"):
        FileStore(d / "state.db").close()
    assert not (d / "state.db").exists()


def test_a_directory_every_user_may_write_is_refused_unless_sticky(tmp_path):
    open_to_all = tmp_path / "open"
    open_to_all.mkdir()
    os.chmod(open_to_all, 0o777)
    with pytest.raises(UnsafeFile, match="may be written by every user"):
        FileStore(open_to_all / "state.db").close()
    assert not (open_to_all / "state.db").exists()
    os.chmod(open_to_all, 0o1777)        # like /tmp: others cannot rename or delete our files
    FileStore(open_to_all / "state.db").close()
    group = tmp_path / "group"           # a user private group's directory (umask 002)
    group.mkdir()
    os.chmod(group, 0o775)
    check_dir(group)


UMASK_0 = r"""
import os, sys, stat
os.umask(0)
from pathlib import Path
from sessionpin.store.file import FileStore
path = Path(sys.argv[1])
s = FileStore(path)
s.set("a", "1", durable=True)
for p in (path.parents[2], path.parents[1], path.parent):
    print(p.name, oct(stat.S_IMODE(p.stat().st_mode)))
for name in ("state.db", "state.db-wal", "state.db-shm", "state.db.copy", "state.db.lock"):
    print(name, oct(stat.S_IMODE((path.parent / name).stat().st_mode)))
s.close()
"""


def test_under_umask_000_every_directory_made_is_0700_and_every_file_0600(tmp_path):
    out = child(UMASK_0, str(tmp_path / "a" / "b" / "c" / "state.db"))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["a", "0o700", "b", "0o700", "c", "0o700",
                                  "state.db", "0o600", "state.db-wal", "0o600", "state.db-shm", "0o600",
                                  "state.db.copy", "0o600", "state.db.lock", "0o600"]


def test_a_fifo_in_place_of_the_copy_is_refused_not_waited_on(tmp_path):
    path = a_store(tmp_path)
    j = names(path)["copy"]
    j.unlink()
    os.mkfifo(j)
    out = child("import sys\nfrom sessionpin.store.file import FileStore\nFileStore(sys.argv[1]).close()", str(path))
    assert out.returncode != 0 and "is not a regular file" in out.stderr


def test_open_file_makes_an_existing_file_of_ours_0600_through_its_descriptor(tmp_path):
    f = tmp_path / "f"
    f.write_bytes(b"")
    os.chmod(f, 0o666)
    os.close(open_file(f, os.O_RDONLY))
    assert stat.S_IMODE(f.stat().st_mode) == 0o600
    link = tmp_path / "link"
    link.symlink_to(f)
    with pytest.raises(UnsafeFile, match="symbolic link"):
        open_file(link, os.O_RDWR)


def test_make_dirs_makes_each_missing_parent_0700_whatever_the_umask(tmp_path):
    old = os.umask(0o777)
    try:
        made = make_dirs(tmp_path / "x" / "y")
    finally:
        os.umask(old)
    assert made == [tmp_path / "x", tmp_path / "x" / "y"]
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o700 for p in made)
