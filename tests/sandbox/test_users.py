"""Users of a sandbox as its /etc/passwd and /etc/group define them (read from the overlay's
layers without following symlinks), the image's command settings, and the launcher's
build check."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tenon.errors import BackendUnavailable
from tenon.sandbox import launcher
from tenon.sandbox.users import UnknownUser, image_config, resolve_user


def layer(base: Path, name: str, passwd: str | None = None, group: str | None = None) -> Path:
    etc = base / name / "etc"
    etc.mkdir(parents=True)
    if passwd is not None:
        (etc / "passwd").write_text(passwd)
    if group is not None:
        (etc / "group").write_text(group)
    return base / name


PASSWD = ("root:x:0:0:root:/root:/bin/bash\n_apt:x:42:65534::/nonexistent:/usr/sbin/nologin\n"
          "dev:x:2000:2001::/home/dev:/bin/sh\nhuge:x:70000:70000::/:/bin/sh\n")
GROUP = "root:x:0:\ndocker:x:999:dev,user\nstaff:x:50:dev\n"


def test_users_resolve_through_the_topmost_layer_that_has_the_file(tmp_path):
    lower = layer(tmp_path, "lower", PASSWD, GROUP)
    upper = layer(tmp_path, "upper")  # no passwd of its own: the lower one counts
    layers = (upper, lower)
    default = resolve_user(layers, None)
    assert (default.uid, default.gid, default.home, default.groups) == (1000, 1000,
                                                                       "/home/user", (999, 1000))
    root = resolve_user(layers, "root")
    assert (root.uid, root.home, root.is_root) == (0, "/root", True)
    dev = resolve_user(layers, "dev")
    assert (dev.uid, dev.gid, dev.groups, dev.home) == (2000, 2001, (50, 999, 2001), "/home/dev")
    (upper / "etc" / "passwd").write_text("root:x:0:0::/root:/bin/sh\n")  # root edited it
    with pytest.raises(UnknownUser, match="unknown user 'dev'"):
        resolve_user(layers, "dev")
    with pytest.raises(UnknownUser, match="unknown user 'huge'"):  # outside 0..65535
        resolve_user((lower,), "huge")


def test_a_symlink_or_whiteout_in_the_upper_layer_is_never_followed(tmp_path):
    lower = layer(tmp_path, "lower", PASSWD)
    upper = layer(tmp_path, "upper")
    secret = tmp_path / "host-passwd"
    secret.write_text("dev:x:0:0::/:/bin/sh\n")
    (upper / "etc" / "passwd").symlink_to(secret)
    with pytest.raises(UnknownUser):
        resolve_user((upper, lower), "dev")
    assert resolve_user((upper, lower), "root").uid == 0  # built in, passwd or not
    (upper / "etc" / "passwd").unlink()
    os.mkfifo(upper / "etc" / "passwd")  # neither a regular file: never read
    with pytest.raises(UnknownUser):
        resolve_user((upper, lower), "dev")


def test_image_config_reads_docker_names_and_tolerates_absence(tmp_path):
    meta = tmp_path / "image.json"
    assert image_config(meta).env == {}
    meta.write_text(json.dumps({"config": {"Env": ["PATH=/opt/bin:/usr/bin", "A=b=c", "bad"],
                                           "WorkingDir": "/testbed"}}))
    config = image_config(meta)
    assert config.env == {"PATH": "/opt/bin:/usr/bin", "A": "b=c"}
    assert config.workdir == "/testbed"
    meta.write_text(json.dumps({"config": {"WorkingDir": "relative"}}))
    assert image_config(meta).workdir is None


def test_launcher_check_names_a_missing_or_stale_build_and_the_fix(tmp_path):
    missing = launcher.check(tmp_path / "absent")
    assert "python -m tenon.sandbox.launcher build" in missing[0]
    if launcher.check() != []:
        pytest.skip(launcher.check()[0])
    stale = tmp_path / "tenon-launch"
    shutil.copy(launcher.LAUNCHER, stale)
    (tmp_path / "tenon-launch.sha256").write_text("0" * 64 + "\n")
    with pytest.raises(BackendUnavailable, match="other sources"):
        launcher.require(stale)
