"""SandboxFiles on a tmp persistent root: path mapping, confinement, ownership, limits."""

from __future__ import annotations

import io
import os
import stat
from pathlib import Path

import pytest

from tenon.service import files as files_mod
from tenon.service.files import (
    AlreadyExists,
    BadMetadata,
    EntryType,
    InvalidPath,
    IsADirectory,
    NotADirectory,
    NotFound,
    ReadOnly,
    SandboxFiles,
    TooLarge,
    go_mode_string,
)

SECRET = b"host secret\n"


def make_files(tmp_path: Path, *, image: bool = True, max_write_bytes: int = 1 << 20,
               ) -> SandboxFiles:
    """A persistent root with workspace/home/tmp, an image rootfs with /etc/passwd, and a
    host 'secret' beside them that nothing may reach."""
    root = tmp_path / "root"
    for sub in ("workspace", "home", "tmp"):
        (root / sub).mkdir(parents=True)
    image_root = tmp_path / "image"
    (image_root / "etc").mkdir(parents=True)
    (image_root / "etc" / "passwd").write_text("root:x:0:0::/root:/bin/sh\n")
    (tmp_path / "secret").write_bytes(SECRET)
    return SandboxFiles(root, image_root=image_root if image else None,
                        max_write_bytes=max_write_bytes)


def host(tmp_path: Path, sub: str, *parts: str) -> Path:
    return tmp_path.joinpath("root", sub, *parts)


# -- mapping ---------------------------------------------------------------------------


def test_persistent_paths_map_to_their_subdirectories(tmp_path: Path) -> None:
    files = make_files(tmp_path)
    files.write("/workspace/a.txt", b"w")
    files.write("/home/user/b.txt", b"h")
    files.write("/tmp/c.txt", b"t")
    files.write("rel/d.txt", b"r")
    files.write("~/e.txt", b"e")
    assert host(tmp_path, "workspace", "a.txt").read_bytes() == b"w"
    assert host(tmp_path, "home", "b.txt").read_bytes() == b"h"
    assert host(tmp_path, "tmp", "c.txt").read_bytes() == b"t"
    assert host(tmp_path, "home", "rel", "d.txt").read_bytes() == b"r"
    assert host(tmp_path, "home", "e.txt").read_bytes() == b"e"
    assert files.read("/home/user/rel/d.txt") == b"r"


def test_other_absolute_paths_are_the_read_only_image(tmp_path: Path) -> None:
    files = make_files(tmp_path)
    assert files.read("/etc/passwd").startswith(b"root:")
    assert files.stat("/etc").type is EntryType.DIR
    with pytest.raises(ReadOnly, match="/etc/passwd"):
        files.write("/etc/passwd", b"x")
    with pytest.raises(ReadOnly):
        files.make_dir("/opt/new")
    with pytest.raises(ReadOnly):
        files.remove("/etc/passwd")
    with pytest.raises(ReadOnly):
        files.rename("/etc/passwd", "/workspace/p")
    assert (tmp_path / "image" / "etc" / "passwd").exists()


def test_without_an_image_other_paths_are_not_found(tmp_path: Path) -> None:
    files = make_files(tmp_path, image=False)
    with pytest.raises(NotFound, match="/etc/passwd"):
        files.read("/etc/passwd")
    assert not files.exists("/etc")


def test_dotdot_is_collapsed_before_mapping(tmp_path: Path) -> None:
    files = make_files(tmp_path)
    # /workspace/../etc/passwd is the image's /etc/passwd, never the host's.
    assert files.read("/workspace/../etc/passwd").startswith(b"root:")
    with pytest.raises(NotFound):
        files.read("/workspace/../../../../secret")
    with pytest.raises(ReadOnly):
        files.write("/home/user/../../../secret", b"x")
    assert (tmp_path / "secret").read_bytes() == SECRET


def test_invalid_paths(tmp_path: Path) -> None:
    files = make_files(tmp_path)
    with pytest.raises(InvalidPath):
        files.stat("")
    with pytest.raises(InvalidPath):
        files.stat("/workspace/a\0b")


# -- confinement -----------------------------------------------------------------------


def test_absolute_symlink_resolves_inside_its_top(tmp_path: Path) -> None:
    files = make_files(tmp_path)
    secret = str(tmp_path / "secret")
    os.symlink(secret, host(tmp_path, "workspace", "x"))
    with pytest.raises(NotFound):
        files.read("/workspace/x")
    with pytest.raises(NotFound):  # workspace/<tmp_path>/ does not exist
        files.write("/workspace/x", b"mine")
    assert (tmp_path / "secret").read_bytes() == SECRET
    # Writing through a link to a new top-level name creates it in the workspace.
    name = f"tenon-files-test-{os.getpid()}"
    os.symlink(f"/{name}", host(tmp_path, "workspace", "y"))
    files.write("/workspace/y", b"mine")
    assert not os.path.lexists(f"/{name}")
    assert host(tmp_path, "workspace", name).read_bytes() == b"mine"


def test_relative_symlink_climbing_out_stays_inside(tmp_path: Path) -> None:
    files = make_files(tmp_path)
    os.symlink("../../../secret", host(tmp_path, "workspace", "up"))
    with pytest.raises(NotFound):
        files.read("/workspace/up")
    files.write("/workspace/up", b"clamped")
    assert (tmp_path / "secret").read_bytes() == SECRET
    assert host(tmp_path, "workspace", "secret").read_bytes() == b"clamped"


def test_symlink_to_root_in_an_intermediate_component(tmp_path: Path) -> None:
    files = make_files(tmp_path)
    os.symlink("/", host(tmp_path, "workspace", "d"))
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "passwd").write_bytes(SECRET)
    with pytest.raises(NotFound):
        files.read("/workspace/d/etc/passwd")
    with pytest.raises(NotFound):
        files.read("/workspace/d/../../secret")
    files.write("/workspace/d/etc/passwd", b"inside")
    assert (tmp_path / "etc" / "passwd").read_bytes() == SECRET
    assert host(tmp_path, "workspace", "etc", "passwd").read_bytes() == b"inside"
    names = [e.name for e in files.list_dir("/workspace/d")]
    assert names == ["d", "etc"]  # the workspace itself, never the host's /


def test_symlinked_parent_of_new_directories_stays_inside(tmp_path: Path) -> None:
    files = make_files(tmp_path)
    os.symlink(str(tmp_path), host(tmp_path, "home", "out"))
    with pytest.raises(NotFound):  # home/<tmp_path> does not exist
        files.make_dir("/home/user/out/new/deeper")
    os.symlink("/", host(tmp_path, "home", "slash"))
    files.make_dir("/home/user/slash/new/deeper")
    assert not (tmp_path / "new").exists()
    assert host(tmp_path, "home", "new", "deeper").is_dir()


def test_remove_and_rename_act_on_the_link_itself(tmp_path: Path) -> None:
    files = make_files(tmp_path)
    target = host(tmp_path, "workspace", "dir")
    target.mkdir()
    (target / "keep").write_bytes(b"k")
    os.symlink("dir", host(tmp_path, "workspace", "link"))
    files.rename("/workspace/link", "/workspace/moved")
    assert os.readlink(host(tmp_path, "workspace", "moved")) == "dir"
    files.remove("/workspace/moved")
    assert not os.path.lexists(host(tmp_path, "workspace", "moved"))
    assert (target / "keep").read_bytes() == b"k"


def test_removing_a_tree_never_follows_symlinks_out(tmp_path: Path) -> None:
    files = make_files(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_bytes(b"p")
    tree = host(tmp_path, "workspace", "tree")
    (tree / "sub").mkdir(parents=True)
    os.symlink(str(outside), tree / "sub" / "escape")
    files.remove("/workspace/tree")
    assert not tree.exists()
    assert (outside / "precious").read_bytes() == b"p"


def test_symlink_swapped_in_after_the_check_is_resolved_inside(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sandbox replaces a checked directory by a symlink to / between the parent
    directories being made and the file being opened: the open resolves it again in root."""
    files = make_files(tmp_path)
    (tmp_path / "etc").mkdir()
    victim = tmp_path / "etc" / "passwd"
    victim.write_bytes(SECRET)
    real_create = files_mod.SandboxFiles._create_file

    def swap_then_create(self: SandboxFiles, top: int, loc: object, owner: os.stat_result,
                         ) -> int:
        d = host(tmp_path, "workspace", "d")
        os.rename(d, host(tmp_path, "workspace", "d.old"))
        os.symlink(str(tmp_path), d)
        return real_create(self, top, loc, owner)  # type: ignore[arg-type]

    host(tmp_path, "workspace", "d", "etc").mkdir(parents=True)
    monkeypatch.setattr(files_mod.SandboxFiles, "_create_file", swap_then_create)
    with pytest.raises(NotFound):  # d now leads to workspace/<tmp_path>, which has no etc/
        files.write("/workspace/d/etc/passwd", b"attack")
    assert victim.read_bytes() == SECRET


def test_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    files = make_files(tmp_path)
    os.mkfifo(host(tmp_path, "tmp", "pipe"))
    with pytest.raises(InvalidPath, match="not a regular file"):
        files.read("/tmp/pipe")
    with pytest.raises(InvalidPath):
        files.write("/tmp/pipe", b"x")
    assert files.stat("/tmp/pipe").type is EntryType.OTHER


# -- operations ------------------------------------------------------------------------


def test_stat_describes_files_dirs_and_symlinks_like_envd(tmp_path: Path) -> None:
    files = make_files(tmp_path)
    files.write("/workspace/f.txt", b"hello")
    os.symlink("f.txt", host(tmp_path, "workspace", "l"))
    os.symlink("nowhere", host(tmp_path, "workspace", "dangling"))
    f = files.stat("/workspace/f.txt")
    assert (f.name, f.path, f.type, f.size, f.mode, f.permissions) == (
        "f.txt", "/workspace/f.txt", EntryType.FILE, 5, 0o644, "-rw-r--r--")
    assert f.modified_ns == os.stat(host(tmp_path, "workspace", "f.txt")).st_mtime_ns
    assert f.symlink_target is None
    d = files.stat("/workspace")
    assert (d.name, d.type) == ("workspace", EntryType.DIR)
    link = files.stat("/workspace/l")
    assert (link.type, link.is_symlink, link.symlink_target) == (
        EntryType.FILE, True, "/workspace/f.txt")
    assert link.permissions == "Lrwxrwxrwx"
    assert link.mode == 0o644
    dangling = files.stat("/workspace/dangling")
    assert dangling.type is EntryType.OTHER
    assert dangling.is_symlink


def test_stat_under_a_file_is_not_found_and_odd_names_are_printable(tmp_path: Path) -> None:
    files = make_files(tmp_path)
    files.write("/workspace/f", b"")
    assert not files.exists("/workspace/f/under")
    with pytest.raises(NotFound):
        files.stat("/workspace/f/under")
    os.mkdir(os.path.join(bytes(host(tmp_path, "workspace")), b"bad\xffname"))
    names = [e.name for e in files.list_dir("/workspace")]
    assert names == ["bad\ufffdname", "f"]


def test_go_mode_strings() -> None:
    assert go_mode_string(stat.S_IFDIR | 0o755) == "drwxr-xr-x"
    assert go_mode_string(stat.S_IFDIR | stat.S_ISVTX | 0o777) == "dtrwxrwxrwx"
    assert go_mode_string(stat.S_IFREG | stat.S_ISUID | 0o755) == "urwxr-xr-x"
    assert go_mode_string(stat.S_IFCHR | 0o666) == "Dcrw-rw-rw-"
    assert go_mode_string(stat.S_IFIFO | 0o600) == "prw-------"


def test_list_dir_depth_and_order(tmp_path: Path) -> None:
    files = make_files(tmp_path)
    for path in ("/workspace/b/c/d.txt", "/workspace/a.txt", "/workspace/b/e.txt"):
        files.write(path, b"x")
    one = [e.path for e in files.list_dir("/workspace")]
    assert one == ["/workspace/a.txt", "/workspace/b"]
    three = [e.path for e in files.list_dir("/workspace", depth=3)]
    assert three == ["/workspace/a.txt", "/workspace/b", "/workspace/b/c",
                     "/workspace/b/c/d.txt", "/workspace/b/e.txt"]
    with pytest.raises(NotADirectory):
        files.list_dir("/workspace/a.txt")
    with pytest.raises(NotFound):
        files.list_dir("/workspace/missing")


def test_list_dir_bounds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files = make_files(tmp_path)
    files.make_dir("/workspace/a/b/c/d")
    monkeypatch.setattr(files_mod, "MAX_LIST_DEPTH", 2)
    assert [e.path for e in files.list_dir("/workspace", depth=10)] == [
        "/workspace/a", "/workspace/a/b"]
    monkeypatch.setattr(files_mod, "MAX_LIST_DEPTH", 128)
    monkeypatch.setattr(files_mod, "MAX_LIST_ENTRIES", 3)
    assert len(files.list_dir("/workspace", depth=2)) == 2
    with pytest.raises(TooLarge, match="more than 3 entries"):
        files.list_dir("/workspace", depth=4)


def test_list_dir_through_a_symlink_shows_requested_paths(tmp_path: Path) -> None:
    files = make_files(tmp_path)
    files.write("/workspace/real/f", b"x")
    os.symlink("real", host(tmp_path, "workspace", "alias"))
    assert [e.path for e in files.list_dir("alias/../../../workspace/alias")] == [
        "/workspace/alias/f"]


def test_make_dir_reports_existing_and_non_directories(tmp_path: Path) -> None:
    files = make_files(tmp_path)
    entry = files.make_dir("/workspace/a/b")
    assert entry.type is EntryType.DIR
    assert entry.path == "/workspace/a/b"
    assert stat.S_IMODE(os.stat(host(tmp_path, "workspace", "a")).st_mode) == 0o755
    with pytest.raises(AlreadyExists, match="/workspace/a/b"):
        files.make_dir("/workspace/a/b")
    files.write("/workspace/f", b"")
    with pytest.raises(NotADirectory):
        files.make_dir("/workspace/f")
    with pytest.raises(NotADirectory):
        files.make_dir("/workspace/f/sub")


def test_write_read_and_overwrite(tmp_path: Path) -> None:
    files = make_files(tmp_path)
    entry = files.write("/tmp/deep/new/file.bin", b"one")
    assert (entry.path, entry.type, entry.size) == ("/tmp/deep/new/file.bin", EntryType.FILE, 3)
    host(tmp_path, "tmp", "deep", "new", "file.bin").chmod(0o600)
    files.write("/tmp/deep/new/file.bin", io.BytesIO(b"two"))
    assert files.read("/tmp/deep/new/file.bin") == b"two"
    assert stat.S_IMODE(os.stat(host(tmp_path, "tmp", "deep", "new", "file.bin")).st_mode) \
        == 0o600  # an existing file keeps its mode
    with pytest.raises(IsADirectory):
        files.write("/tmp/deep", b"x")
    with pytest.raises(IsADirectory):
        files.read("/tmp/deep")
    with pytest.raises(NotADirectory):
        files.write("/tmp/deep/new/file.bin/under", b"x")


def test_write_from_a_file_object_starts_at_its_position(tmp_path: Path) -> None:
    files = make_files(tmp_path)
    data = io.BytesIO(b"skip:" + b"z" * 200_000)
    data.seek(5)
    files.write("/workspace/big", data)
    assert files.read("/workspace/big") == b"z" * 200_000


def test_too_large_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    files = make_files(tmp_path, max_write_bytes=10)
    with pytest.raises(TooLarge, match="/workspace/new/f"):
        files.write("/workspace/new/f", b"x" * 11)
    with pytest.raises(TooLarge):
        files.write("/workspace/new/f", io.BytesIO(b"x" * 11))
    assert not host(tmp_path, "workspace", "new").exists()
    files.write("/workspace/new/f", b"x" * 10)


def test_rename_moves_between_mounts_and_makes_parents(tmp_path: Path) -> None:
    files = make_files(tmp_path)
    files.write("/workspace/a", b"a")
    entry = files.rename("/workspace/a", "/tmp/x/y/b")
    assert entry.path == "/tmp/x/y/b"
    assert host(tmp_path, "tmp", "x", "y", "b").read_bytes() == b"a"
    with pytest.raises(NotFound, match="/workspace/a"):
        files.rename("/workspace/a", "/workspace/c")
    assert not host(tmp_path, "workspace", "c").exists()


def test_remove_files_and_trees(tmp_path: Path) -> None:
    files = make_files(tmp_path)
    files.write("/home/user/t/u/v", b"x")
    files.remove("/home/user/t")
    assert not host(tmp_path, "home", "t").exists()
    with pytest.raises(NotFound):
        files.remove("/home/user/t")
    with pytest.raises(InvalidPath):
        files.remove("/home/user")
    assert host(tmp_path, "home").is_dir()


@pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")
def test_new_entries_take_the_owner_of_their_top(tmp_path: Path) -> None:
    files = make_files(tmp_path)
    uid = 1_700_065_000
    os.chown(host(tmp_path, "workspace"), uid, uid)
    files.write("/workspace/n/f", b"x")
    files.make_dir("/workspace/m")
    for sub in (("n",), ("n", "f"), ("m",)):
        st = os.stat(host(tmp_path, "workspace", *sub))
        assert (st.st_uid, st.st_gid) == (uid, uid)
    assert files.stat("/workspace/n/f").owner == "user"
    # An existing file keeps its owner; the home top still belongs to root.
    files.write("/home/user/r", b"x")
    assert os.stat(host(tmp_path, "home", "r")).st_uid == 0
    assert files.stat("/home/user/r").owner == "root"


def test_metadata_is_stored_as_user_e2b_xattrs_and_replaced_as_a_set(tmp_path: Path) -> None:
    files = make_files(tmp_path)
    entry = files.write("/workspace/m", b"x", {"Owner": "ann", "stage": "draft"})
    assert entry.metadata == {"owner": "ann", "stage": "draft"}
    where = host(tmp_path, "workspace", "m")
    assert os.getxattr(where, "user.e2b.owner") == b"ann"
    files.write("/workspace/m", b"y", {"stage": "final"})
    assert files.stat("/workspace/m").metadata == {"stage": "final"}
    files.write("/workspace/m", b"z")  # no metadata: the set stays
    assert [e.metadata for e in files.list_dir("/workspace")] == [{"stage": "final"}]
    with pytest.raises(BadMetadata):
        files.write("/workspace/n", b"x", {"bad key": "v"})
    assert not host(tmp_path, "workspace", "n").exists()
