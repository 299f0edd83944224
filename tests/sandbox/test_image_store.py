"""The image store and layer application, on layers and OCI layouts made here (no Docker)."""

import gzip
import hashlib
import io
import json
import os
import stat
import tarfile
import threading
from pathlib import Path

import pytest

from tenon.errors import ImageNotFound
from tenon.sandbox.images import ImageStore, image_rootfs, image_store
from tenon.sandbox.images.importer import ImageImportError, import_image, import_path
from tenon.sandbox.images.layers import LayerError, apply_layer

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="numeric ownership needs root")


def _entry(name: str, kind: bytes = tarfile.REGTYPE, data: bytes = b"", **attrs) -> tuple:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.mode = attrs.pop("mode", 0o755 if kind == tarfile.DIRTYPE else 0o644)
    info.size = len(data) if kind == tarfile.REGTYPE else 0
    for key, value in attrs.items():
        setattr(info, key, value)
    return info, data


def layer(*entries: tuple, compress: bool = False) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in entries:
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    raw = buf.getvalue()
    return gzip.compress(raw) if compress else raw


def d(name: str, **attrs) -> tuple:
    return _entry(name, tarfile.DIRTYPE, **attrs)


def f(name: str, data: bytes = b"x", **attrs) -> tuple:
    return _entry(name, tarfile.REGTYPE, data, **attrs)


def sym(name: str, target: str) -> tuple:
    return _entry(name, tarfile.SYMTYPE, linkname=target)


def apply(root: Path, *layers: bytes) -> None:
    for blob in layers:
        apply_layer(io.BytesIO(blob), root)


BOTTOM = layer(d("etc"), f("etc/keep", b"keep"), f("etc/gone", b"gone"),
               d("opq"), f("opq/old1"), d("opq/sub"), f("opq/sub/old2"),
               d("app"), f("app/a"), f("app/b"))
TOP = layer(f("etc/.wh.gone"), f("opq/.wh..wh..opq"), f("opq/new", b"new"),
            f("app/.wh.a"), f("added", b"added"))


def test_whiteouts_delete_lower_files_and_opaque_dirs_hide_lower_content(tmp_path):
    apply(tmp_path, BOTTOM, TOP)
    assert (tmp_path / "etc/keep").read_bytes() == b"keep"
    assert not (tmp_path / "etc/gone").exists()
    assert sorted(p.name for p in (tmp_path / "opq").iterdir()) == ["new"]
    assert sorted(p.name for p in (tmp_path / "app").iterdir()) == ["b"]
    assert (tmp_path / "added").read_bytes() == b"added"
    assert not list(tmp_path.rglob(".wh.*"))  # whiteout markers are never written


def test_a_later_layer_replaces_a_directory_with_a_file_and_back(tmp_path):
    apply(tmp_path, layer(d("x"), f("x/inner")), layer(f("x", b"file")))
    assert (tmp_path / "x").read_bytes() == b"file"
    apply(tmp_path, layer(d("x"), f("x/again")))
    assert (tmp_path / "x/again").exists()


def test_symlinks_resolve_inside_the_root_never_onto_the_host(tmp_path):
    host = tmp_path / "host"
    host.mkdir()
    (host / "secret").write_text("host file\n")
    root = tmp_path / "root"
    root.mkdir()
    apply(root, layer(sym("abs", str(host)), sym("rel", "../../../../" + str(host)),
                      sym("file", str(host / "secret"))),
          layer(f("abs/pwned", b"1"), f("rel/pwned2", b"2"), f("file", b"overwritten")))
    assert sorted(p.name for p in host.iterdir()) == ["secret"]
    assert (host / "secret").read_text() == "host file\n"
    # written where the sandbox sees the symlinks point: inside its own root
    assert (root / str(host).lstrip("/") / "pwned").read_bytes() == b"1"
    assert (root / str(host).lstrip("/") / "pwned2").read_bytes() == b"2"
    assert (root / "file").read_bytes() == b"overwritten"
    assert not (root / "file").is_symlink()


def test_an_entry_climbing_above_the_root_is_refused(tmp_path):
    with pytest.raises(LayerError, match="climbs above the root"):
        apply(tmp_path, layer(f("../escape")))
    assert not (tmp_path.parent / "escape").exists()


@needs_root
def test_ownership_setuid_and_xattrs_are_kept_devices_skipped(tmp_path):
    suid = f("bin/su", b"#!/bin/sh\n", mode=0o4755, uid=0, gid=0)
    owned = f("home/u/file", b"mine", uid=1234, gid=2345, mode=0o600)
    xattr = f("cap", b"", pax_headers={"SCHILY.xattr.user.tenon": "yes"})
    dev = _entry("dev/null", tarfile.CHRTYPE, devmajor=1, devminor=3)
    apply(tmp_path, layer(d("bin"), suid, d("home"), d("home/u", uid=1234, gid=2345), owned,
                          xattr, d("dev"), dev))
    st = (tmp_path / "bin/su").stat()
    assert stat.S_IMODE(st.st_mode) == 0o4755
    st = (tmp_path / "home/u/file").stat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (1234, 2345, 0o600)
    assert (tmp_path / "home/u").stat().st_uid == 1234
    assert os.getxattr(tmp_path / "cap", "user.tenon") == b"yes"
    assert not (tmp_path / "dev/null").exists()


def _blob(layout: Path, data: bytes) -> dict:
    digest = hashlib.sha256(data).hexdigest()
    (layout / "blobs/sha256").mkdir(parents=True, exist_ok=True)
    (layout / "blobs/sha256" / digest).write_bytes(data)
    return {"digest": f"sha256:{digest}", "size": len(data)}


def oci_layout(path: Path, layers: list[bytes], *, ref: str | None = None,
               env: tuple[str, ...] = ("PATH=/usr/bin:/bin", "A=1")) -> str:
    """A minimal OCI image layout; returns the config digest (the image id)."""
    path.mkdir(parents=True)
    (path / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    config = json.dumps({"architecture": "amd64", "os": "linux",
                         "config": {"Env": list(env), "WorkingDir": "/app", "Cmd": ["sh"]},
                         "rootfs": {"type": "layers", "diff_ids": []}}).encode()
    config_desc = _blob(path, config)
    layer_descs = []
    for blob in layers:
        kind = "tar+gzip" if blob[:2] == b"\x1f\x8b" else "tar"
        layer_descs.append({"mediaType": f"application/vnd.oci.image.layer.v1.{kind}",
                            **_blob(path, blob)})
    manifest = json.dumps({"schemaVersion": 2,
                           "mediaType": "application/vnd.oci.image.manifest.v1+json",
                           "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                                      **config_desc},
                           "layers": layer_descs}).encode()
    desc = {"mediaType": "application/vnd.oci.image.manifest.v1+json", **_blob(path, manifest)}
    if ref:
        desc["annotations"] = {"org.opencontainers.image.ref.name": ref}
    (path / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [desc]}))
    return config_desc["digest"].removeprefix("sha256:")


def test_oci_layout_import_applies_layers_and_records_the_config(tmp_path):
    image_id = oci_layout(tmp_path / "oci", [BOTTOM, gzip.compress(TOP)], ref="demo:1")
    store = ImageStore(tmp_path / "store")
    stored = import_image(str(tmp_path / "oci"), store=store)
    assert stored.name == "demo:1"
    assert stored.meta.id == image_id
    assert (stored.meta.env, stored.meta.workdir, stored.meta.cmd) == (
        ["PATH=/usr/bin:/bin", "A=1"], "/app", ["sh"])
    assert stored.meta.source == f"OCI layout {tmp_path / 'oci'}"
    assert (stored.rootfs / "added").read_bytes() == b"added"
    assert not (stored.rootfs / "etc/gone").exists()
    written = json.loads((stored.rootfs.parent / "image.json").read_text())
    assert written["config"]["Env"] == ["PATH=/usr/bin:/bin", "A=1"]  # Docker's names too
    assert image_rootfs("demo:1", store.root) == stored.rootfs
    assert list((store.root / "tmp").iterdir()) == []  # staging cleaned up


def test_the_same_image_under_two_names_is_stored_once(tmp_path):
    oci_layout(tmp_path / "oci", [BOTTOM])
    store = ImageStore(tmp_path / "store")
    first = import_path(tmp_path / "oci", name="one", store=store)
    second = import_path(tmp_path / "oci", name="two:x", store=store)
    assert first.name == "one:latest"
    assert first.rootfs == second.rootfs
    assert len(list((store.root / "content").iterdir())) == 1
    assert store.names() == ["one:latest", "two:x"]


def test_concurrent_imports_of_one_image_leave_one_content_dir(tmp_path):
    oci_layout(tmp_path / "oci", [BOTTOM, TOP])
    store = ImageStore(tmp_path / "store")
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            import_path(tmp_path / "oci", name=f"n{i}", store=store)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(list((store.root / "content").iterdir())) == 1
    assert {store.get(f"n{i}").meta.id for i in range(4)} == {store.get("n0").meta.id}
    assert list((store.root / "tmp").iterdir()) == []


def test_docker_save_archive_made_by_hand_imports(tmp_path):
    config = json.dumps({"config": {"Env": ["X=1"], "User": "1000"}}).encode()
    cid = hashlib.sha256(config).hexdigest()
    archive = tmp_path / "img.tar"
    files = {f"{cid}.json": config, "l1/layer.tar": BOTTOM, "l2/layer.tar": TOP,
             "manifest.json": json.dumps([{"Config": f"{cid}.json", "RepoTags": ["saved:2"],
                                           "Layers": ["l1/layer.tar", "l2/layer.tar"]}]).encode()}
    with tarfile.open(archive, "w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    stored = import_image(str(archive), store=ImageStore(tmp_path / "store"))
    assert (stored.name, stored.meta.id, stored.meta.user) == ("saved:2", cid, "1000")
    assert sorted(p.name for p in (stored.rootfs / "app").iterdir()) == ["b"]


def test_bad_sources_are_one_line_errors(tmp_path):
    store = ImageStore(tmp_path / "store")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ImageImportError, match="neither a docker save archive"):
        import_image(str(tmp_path / "empty"), store=store)
    (tmp_path / "junk.tar").write_bytes(b"not a tar")
    with pytest.raises(ImageImportError, match="not a tar archive"):
        import_image(str(tmp_path / "junk.tar"), store=store)
    oci_layout(tmp_path / "noref", [BOTTOM])
    with pytest.raises(ImageImportError, match="--name"):
        import_image(str(tmp_path / "noref"), store=store)
    with pytest.raises(ImageImportError, match="does not exist"):
        import_image("./nowhere.tar", store=store)


def test_unknown_image_names_the_images_there_are(tmp_path):
    oci_layout(tmp_path / "oci", [BOTTOM])
    store = ImageStore(tmp_path / "store")
    import_path(tmp_path / "oci", name="have:1", store=store)
    with pytest.raises(ImageNotFound, match=r"unknown image 'nope:latest'.*have:1") as info:
        store.get("nope")
    assert isinstance(info.value, LookupError)
    assert "\n" not in str(info.value)
    with pytest.raises(ImageNotFound, match="invalid image name"):
        store.get("../../etc")


def test_rm_keeps_shared_content_and_trashes_the_last_name_until_prune(tmp_path):
    oci_layout(tmp_path / "oci", [BOTTOM])
    store = ImageStore(tmp_path / "store")
    a = import_path(tmp_path / "oci", name="a:1", store=store)
    import_path(tmp_path / "oci", name="b:1", store=store)
    held = os.open(a.rootfs / "etc/keep", os.O_RDONLY)  # a sandbox still reading the image
    try:
        assert store.remove("a:1") == []  # b:1 still names the content
        assert a.rootfs.exists()
        assert store.remove("b:1") == [a.meta.id]
        assert store.names() == []
        assert not a.rootfs.exists()  # moved, not deleted: open files stay readable
        assert os.pread(held, 4, 0) == b"keep"
        assert len(list((store.root / "trash").iterdir())) == 1
        assert store.prune() == [a.meta.id]
        assert list((store.root / "trash").iterdir()) == []
    finally:
        os.close(held)
    with pytest.raises(ImageNotFound, match="unknown image 'a:1'"):
        store.remove("a:1")


def test_a_state_dir_without_images_uses_the_default_store(tmp_path, monkeypatch):
    oci_layout(tmp_path / "oci", [BOTTOM])
    store = ImageStore(tmp_path / "images")
    import_path(tmp_path / "oci", name="x:1", store=store)
    monkeypatch.setenv("TENON_IMAGE_DIR", str(store.root))
    state = tmp_path / "serve"
    state.mkdir()
    assert image_store(state).root == store.root
    assert image_rootfs("x:1", state) == store.get("x:1").rootfs
    assert image_store(store.root).root == store.root
    assert image_store(tmp_path).root == store.root  # a state dir holding images/
