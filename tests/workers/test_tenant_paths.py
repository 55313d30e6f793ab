"""workers/drivers/tenant_paths.py: what the agent opens in a folder a tenant writes is never a
link's target, and trees are walked and removed without leaving them.

Each test runs twice: through openat2(2), and through the component-by-component fallback of
kernels without it."""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from workers.drivers import tenant_paths
from workers.drivers.tenant_paths import UnsafePath

OTHER_UID = 54_321  # no account's: a file "someone else" made


@pytest.fixture(params=["openat2", "by components"], autouse=True)
def resolution(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setattr(tenant_paths, "openat2_missing", request.param == "by components")
    return str(request.param)


@pytest.fixture
def folder(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    """A tenant's folder, and the agent's descriptor of it."""
    path = tmp_path / "tenant"
    path.mkdir()
    fd = tenant_paths.open_folder(path)
    yield path, fd
    os.close(fd)


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    """A root-only file of the host, outside the tenant's folder."""
    (tmp_path / "host").mkdir(mode=0o700)
    path = tmp_path / "host" / "secret"
    path.write_text("12345\n")
    path.chmod(0o600)
    return path


def test_a_symlink_is_never_followed_last_or_on_the_way(folder: tuple[Path, int], secret: Path) -> None:
    path, fd = folder
    (path / "link").symlink_to(secret)
    (path / "dir-link").symlink_to(secret.parent)
    for name in ("link", "dir-link/secret"):
        with pytest.raises(OSError) as raised:
            tenant_paths.open_beneath(fd, name, os.O_RDONLY)
        assert raised.value.errno == errno.ELOOP
    # O_PATH | O_NOFOLLOW opens a final link itself (openat2's rule): ``require`` refuses it.
    link = tenant_paths.open_beneath(fd, "link", os.O_PATH | os.O_NOFOLLOW)
    try:
        with pytest.raises(UnsafePath, match="is a symlink, not a socket"):
            tenant_paths.require(link, "app.sock", stat.S_IFSOCK)
    finally:
        os.close(link)


@pytest.mark.parametrize("name", ["../host/secret", "/etc/passwd", "sub/../../host/secret"])
def test_nothing_outside_the_folder_is_reached(folder: tuple[Path, int], secret: Path, name: str) -> None:
    path, fd = folder
    (path / "sub").mkdir()
    with pytest.raises(OSError) as raised:
        tenant_paths.open_beneath(fd, name, os.O_RDONLY)
    assert raised.value.errno == errno.EXDEV


def test_a_proc_root_link_and_another_mount_are_not_entered() -> None:
    """``/proc/<pid>/root`` (how the review reached another tenant's app) is a magic link;
    /proc is another mount than /."""
    proc_self = os.open(f"/proc/{os.getpid()}", os.O_PATH | os.O_DIRECTORY)
    root = os.open("/", os.O_PATH | os.O_DIRECTORY)
    try:
        with pytest.raises(OSError) as magic:
            tenant_paths.open_beneath(proc_self, "root/etc/passwd", os.O_RDONLY)
        assert magic.value.errno == errno.ELOOP
        with pytest.raises(OSError) as mount:
            tenant_paths.open_beneath(root, "proc/version", os.O_RDONLY)
        assert mount.value.errno == errno.EXDEV
    finally:
        os.close(proc_self)
        os.close(root)


def test_read_file_takes_only_a_single_named_file_of_its_owner(
    folder: tuple[Path, int], secret: Path
) -> None:
    path, fd = folder
    me = os.geteuid()
    (path / "pid").write_text("42\n")
    assert tenant_paths.read_file(fd, "pid", "pid file", owner=me, limit=32) == b"42\n"
    (path / "pid").unlink()
    (path / "pid").symlink_to(secret)
    with pytest.raises(OSError):
        tenant_paths.read_file(fd, "pid", "pid file", owner=me, limit=32)
    (path / "pid").unlink()
    os.mkfifo(path / "pid")  # waited on forever by a plain open: nobody writes it
    with pytest.raises(UnsafePath, match="is a FIFO, not a file"):
        tenant_paths.read_file(fd, "pid", "pid file", owner=me, limit=32)
    (path / "pid").unlink()
    os.link(secret, path / "pid")  # a second name of a file the tenant may not read
    with pytest.raises(UnsafePath, match="2 names"):
        tenant_paths.read_file(fd, "pid", "pid file", owner=me, limit=32)


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can give a file to another uid")
def test_read_file_refuses_another_owners_file(folder: tuple[Path, int]) -> None:
    path, fd = folder
    (path / "pid").write_text("42\n")
    os.chown(path / "pid", OTHER_UID, OTHER_UID)
    with pytest.raises(UnsafePath, match=f"belongs to uid {OTHER_UID}"):
        tenant_paths.read_file(fd, "pid", "pid file", owner=0, limit=32)


def test_connecting_through_the_descriptor_reaches_the_inode_that_was_checked(
    folder: tuple[Path, int],
) -> None:
    """The kernel behaviour ``app_socket.connect`` relies on: ``connect("/proc/self/fd/N")``
    of an ``O_PATH`` descriptor reaches that socket's listener, even once its name has been
    given to another socket."""
    path, fd = folder
    with socket.socket(socket.AF_UNIX) as checked, socket.socket(socket.AF_UNIX) as swapped:
        checked.bind(str(path / "app.sock"))
        checked.listen()
        app = tenant_paths.open_beneath(fd, "app.sock", os.O_PATH | os.O_NOFOLLOW)
        tenant_paths.require(app, "app.sock", stat.S_IFSOCK, owner=os.geteuid(), single_link=True)
        (path / "app.sock").unlink()
        swapped.bind(str(path / "app.sock"))
        swapped.listen()
        swapped.setblocking(False)
        with socket.socket(socket.AF_UNIX) as client:
            client.connect(f"/proc/self/fd/{app}")
            os.close(app)
            accepted, _ = checked.accept()
            accepted.close()
        with pytest.raises(BlockingIOError):
            swapped.accept()


def make_deep(top: int, depth: int, name: str) -> None:
    """``depth`` nested folders of ``name`` below ``top``, a file in the deepest: made through
    descriptors, since its path is longer than any path the kernel takes."""
    here = os.dup(top)
    for _ in range(depth):
        os.mkdir(name, dir_fd=here)
        step = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=here)
        os.close(here)
        here = step
    fd = os.open("bottom", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=here)
    os.write(fd, b"x" * 5000)
    os.close(fd)
    os.close(here)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_walk_goes_deeper_than_any_path_with_one_descriptor(folder: tuple[Path, int], secret: Path) -> None:
    path, fd = folder
    make_deep(fd, 300, "d" * 40)  # 12,300 bytes of path: three times PATH_MAX
    (path / "host").symlink_to(secret.parent)  # not entered: the secret is not among the entries
    os.mkfifo(path / "fifo")  # listed, never opened
    before = open_fds()
    most = 0
    names = []
    for _, name, info in tenant_paths.walk(fd):
        most = max(most, open_fds() - before)
        if info is not None:
            names.append(name)
    assert names.count("d" * 40) == 300 and "bottom" in names
    assert {"host", "fifo"} <= set(names) and "secret" not in names
    assert most <= 2  # the walk's own descriptor, and the listing's while it reads
    assert open_fds() == before


def test_a_folder_moved_while_walked_ends_the_walk(folder: tuple[Path, int], tmp_path: Path) -> None:
    """The tenant moves the folder the walk is in out of the tree: going back up through
    ``..`` would then walk wherever it went."""
    path, fd = folder
    (path / "a" / "b").mkdir(parents=True)
    (path / "a" / "b" / "f").write_text("x")
    with pytest.raises(tenant_paths.TreeMoved):
        for _, name, _ in tenant_paths.walk(fd):
            if name == "f":
                (path / "a" / "b").rename(tmp_path / "elsewhere")


def test_remove_tree_removes_links_not_their_targets(tmp_path: Path, secret: Path) -> None:
    parent = tmp_path / "apps"
    stale = parent / "alloc"
    (stale / "deep" / "er").mkdir(parents=True)
    (stale / "deep" / "er" / "f").write_text("x")
    (stale / "host-dir").symlink_to(secret.parent)
    (stale / "deep" / "host-file").symlink_to(secret)
    os.mkfifo(stale / "fifo")
    os.link(secret, stale / "hard")
    assert tenant_paths.remove_tree(parent, "alloc")
    assert not stale.exists() and secret.read_text() == "12345\n"
    # Its own name a link to a host folder: the link goes, the folder stays.
    (parent / "alloc").symlink_to(secret.parent)
    assert tenant_paths.remove_tree(parent, "alloc")
    assert not (parent / "alloc").is_symlink() and secret.exists()
    assert tenant_paths.remove_tree(parent, "alloc")  # gone already
    with contextlib.suppress(FileNotFoundError):
        secret.unlink()
