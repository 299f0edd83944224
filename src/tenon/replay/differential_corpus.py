"""The differential corpus: scripted agent runs made of real commands.

Every output is deterministic: no timestamps, pids or random values are printed, git's
dates are fixed, and the wheel the pip and venv runs install is built here, byte for
byte the same each time, and written into the workspace by the run's first action.
Boundaries resident-only by design name the fragment the check's reason must contain:
a live server ("process") and a file left in /dev/shm ("/dev/shm").
"""

from __future__ import annotations

import base64
import hashlib
import io
import zipfile

from tenon.replay.differential_script import Script, Step

WHEEL_NAME = "tenonprobe-1.0-py3-none-any.whl"
WHEEL_PATH = f"/workspace/dist/{WHEEL_NAME}"
_ZIP_DATE = (1980, 1, 1, 0, 0, 0)
_FIXED_DATES = ("GIT_AUTHOR_DATE=2024-01-01T00:00:00Z "
                "GIT_COMMITTER_DATE=2024-01-01T00:00:00Z")
_PIP = "python3 -m pip --disable-pip-version-check --no-input"
_PORT = 8765


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"sha256={digest}"


def probe_wheel() -> bytes:
    """A minimal pure-Python wheel (METADATA, WHEEL, RECORD), the same bytes every call."""
    dist_info = "tenonprobe-1.0.dist-info"
    files = {
        "tenonprobe/__init__.py": b'def hello():\n    return "hello from tenonprobe 1.0"\n',
        f"{dist_info}/METADATA": b"Metadata-Version: 2.1\nName: tenonprobe\nVersion: 1.0\n",
        f"{dist_info}/WHEEL": (b"Wheel-Version: 1.0\nGenerator: tenon\n"
                               b"Root-Is-Purelib: true\nTag: py3-none-any\n"),
    }
    record = "".join(f"{path},{_record_hash(data)},{len(data)}\n" for path, data in files.items())
    files[f"{dist_info}/RECORD"] = (record + f"{dist_info}/RECORD,,\n").encode()
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as wheel:
        for path, data in files.items():
            info = zipfile.ZipInfo(path, date_time=_ZIP_DATE)
            info.external_attr = 0o644 << 16
            wheel.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
    return buffer.getvalue()


def write_wheel_step() -> Step:
    """An action that writes `probe_wheel()` to WHEEL_PATH and prints its digest."""
    encoded = base64.b64encode(probe_wheel()).decode()
    return Step(
        "mkdir -p /workspace/dist && python3 -c 'import base64, sys; "
        "open(sys.argv[1], \"wb\").write(base64.b64decode(sys.argv[2]))' "
        f"{WHEEL_PATH} {encoded} && sha256sum {WHEEL_PATH}")


def git_script() -> Script:
    commit = f"{_FIXED_DATES} git commit -q"
    return Script("git", (
        Step("git config --global user.name 'Ada Agent' && "
             "git config --global user.email ada@example.com && "
             "git config --global init.defaultBranch main && cat ~/.gitconfig"),
        Step("git init -q repo && cd repo && printf 'hello\\n' > README && git add README && "
             f"{commit} -m first && git log --format='%H %an <%ae> %s'"),
        Step("cd repo && printf 'more\\n' >> README && git status --porcelain && "
             "git diff --stat"),
        Step(f"cd repo && {commit} -am second && git log --format='%H %s' && "
             "git config --global --get user.name && git rev-list --count HEAD"),
        Step("cd repo && git fsck --no-progress 2>&1; git show --stat --format='%s' HEAD~1"),
    ))


def pip_user_script() -> Script:
    return Script("pip-user", (
        write_wheel_step(),
        Step(f"PIP_BREAK_SYSTEM_PACKAGES=1 {_PIP} install --user --no-index "
             f"--no-warn-script-location -q {WHEEL_PATH} && echo installed", timeout_s=120),
        Step("python3 -c 'import tenonprobe; print(tenonprobe.hello(), tenonprobe.__file__)'"),
        Step(f"{_PIP} list --user 2>&1 | grep -i tenonprobe; "
             f"{_PIP} show tenonprobe | grep -E '^(Name|Version|Location):'"),
    ))


def venv_script() -> Script:
    venv = "/workspace/venv"
    return Script("venv", (
        write_wheel_step(),
        Step(f"python3 -m venv {venv} && {venv}/bin/python -c 'import sys; print(sys.prefix)'",
             timeout_s=120),
        Step(f"{venv}/bin/python -m pip --disable-pip-version-check install -q --no-index "
             f"{WHEEL_PATH} && echo installed", timeout_s=120),
        Step(f". {venv}/bin/activate && python -c 'import sys, tenonprobe; "
             "print(tenonprobe.hello(), sys.prefix, tenonprobe.__file__)' && "
             "command -v python pip"),
        Step("python3 -c 'import tenonprobe' 2>/dev/null; echo system python import exit $?"),
    ))


def files_script() -> Script:
    return Script("cache-tmp-shm", (
        Step("mkdir -p ~/.cache/agent && echo cached > ~/.cache/agent/value && "
             "echo draft > /tmp/draft.txt && echo $HOME"),
        Step("cat ~/.cache/agent/value /tmp/draft.txt && echo shared > /dev/shm/note",
             resident_because="/dev/shm"),
        Step("cat /dev/shm/note && rm /dev/shm/note && echo more >> /tmp/draft.txt"),
        Step("cat ~/.cache/agent/value /tmp/draft.txt; ls -A /dev/shm; "
             "stat -c '%n %s %a' ~/.cache/agent/value /tmp/draft.txt"),
    ))


def sqlite_script() -> Script:
    insert = ("import sqlite3; c = sqlite3.connect(\"notes.db\"); "
              "c.execute(\"insert into notes(body) values (?)\", (\"third\",)); c.commit(); "
              "print(c.execute(\"select id, body from notes order by id\").fetchall())")
    return Script("sqlite", (
        Step("sqlite3 notes.db 'pragma journal_mode=wal; "
             "create table notes(id integer primary key, body text); "
             "insert into notes(body) values (\"first\"), (\"second\");' && "
             "sqlite3 notes.db 'select count(*) from notes'"),
        Step(f"python3 -c '{insert}'"),
        Step("sqlite3 notes.db 'pragma integrity_check; select group_concat(body) from notes;'"
             " && ls"),
    ))


def server_script() -> Script:
    url = f"http://127.0.0.1:{_PORT}/index.html"
    wait_up = ("import time, urllib.request\n"
               "for _ in range(200):\n"
               "    try:\n"
               f"        urllib.request.urlopen('{url}', timeout=1); print('up'); break\n"
               "    except OSError: time.sleep(0.05)\n"
               "else: print('never came up')\n")
    fetch = (f"import urllib.request; r = urllib.request.urlopen('{url}'); "
             "print(r.status, r.read().decode(), end='')")
    return Script("server", (
        Step("mkdir -p www && echo 'served from the workspace' > www/index.html && "
             f"(cd www && nohup python3 -m http.server {_PORT} --bind 127.0.0.1 "
             "> /tmp/server.log 2>&1 & echo $! > /tmp/server.pid) && "
             f"python3 -c \"{wait_up}\"", resident_because="process"),
        Step(f"python3 -c \"{fetch}\"", resident_because="process"),
        Step("echo updated >> www/index.html && " f"python3 -c \"{fetch}\"",
             resident_because="process"),
        Step("pid=$(cat /tmp/server.pid); kill $pid; i=0; "
             "while kill -0 $pid 2>/dev/null && [ $i -lt 200 ]; do sleep 0.05; i=$((i+1)); "
             "done; kill -0 $pid 2>/dev/null && echo still running || echo stopped"),
        Step("python3 -c \"import socket; s = socket.socket(); "
             f"print('port free:', s.connect_ex(('127.0.0.1', {_PORT})) != 0)\"; "
             "cat www/index.html"),
    ))


def failure_script() -> Script:
    return Script("failures", (
        Step("ls /nonexistent", expect_exit=2),
        Step("python3 -c 'raise SystemExit(\"boom\")'", expect_exit=1),
        # Long enough that the echo runs before the kill even on a loaded host; `exec`, so
        # no shell outlives sleep to print "Killed" when the kill reaches sleep first.
        Step("echo before the timeout; exec sleep 60", timeout_s=5, expect_exit=None,
             expect_timed_out=True),
        Step("sh -c 'exit 7'; echo previous exit $?; echo after > /tmp/after.txt"),
        Step("cat /tmp/after.txt && false", expect_exit=1),
    ))


DEB_PATH = "/workspace/dist/tenon-hello_1.0_all.deb"


def build_deb_step() -> Step:
    """An action (as the default user) that builds a tiny Debian package with dpkg-deb: a
    script at /usr/bin/tenon-hello, installed below only by root."""
    control = ("Package: tenon-hello\\nVersion: 1.0\\nArchitecture: all\\n"
               "Maintainer: Tenon <tenon@example.com>\\nDescription: differential probe\\n")
    return Step(
        "rm -rf /tmp/deb && mkdir -p /tmp/deb/DEBIAN /tmp/deb/usr/bin /workspace/dist && "
        f"printf '{control}' > /tmp/deb/DEBIAN/control && "
        "printf '#!/bin/sh\\necho hello from a package\\n' > /tmp/deb/usr/bin/tenon-hello && "
        "chmod 0755 /tmp/deb/usr/bin/tenon-hello && "
        "SOURCE_DATE_EPOCH=0 dpkg-deb --root-owner-group -Zgzip --build /tmp/deb "
        f"{DEB_PATH} >/dev/null && rm -rf /tmp/deb && ls {DEB_PATH}")


def apt_root_script() -> Script:
    """A package installed by root with apt-get from a local .deb: its files in /usr and its
    record in dpkg's database (/var/lib/dpkg) live in the writable root's upper layer."""
    return Script("apt-root", (
        build_deb_step(),
        Step(f"apt-get install -y -q {DEB_PATH} >/tmp/apt.log 2>&1 || cat /tmp/apt.log; "
             "rm -f /tmp/apt.log; dpkg-query -W -f='${Status} ${Version}\\n' tenon-hello",
             user="root", timeout_s=120),
        Step("tenon-hello && ls -l /usr/bin/tenon-hello | cut -d' ' -f1,3,4 && "
             "dpkg -L tenon-hello | grep bin/"),
        Step("apt-get remove -y -q tenon-hello >/dev/null 2>&1; "
             "command -v tenon-hello || echo removed", user="root", timeout_s=120),
        Step("command -v tenon-hello || echo still removed; "
             "dpkg-query -W -f='${Status}\\n' tenon-hello 2>&1 | head -1"),
    ))


def pip_root_script() -> Script:
    """A package installed by root into the system site-packages (/usr/local/lib)."""
    return Script("pip-root", (
        write_wheel_step(),
        Step(f"PIP_BREAK_SYSTEM_PACKAGES=1 {_PIP} install --no-index -q "
             f"--root-user-action=ignore {WHEEL_PATH} && echo installed",
             user="root", timeout_s=120),
        Step("python3 -c 'import tenonprobe; print(tenonprobe.hello(), tenonprobe.__file__)'"),
        Step(f"{_PIP} show tenonprobe | grep -E '^(Name|Version|Location):'; "
             "touch /usr/local/lib/probe 2>&1 | sed 's/^.*: //'"),
    ))


def etc_root_script() -> Script:
    """Edits as root to the image's /etc: an appended line, a new user with its home, a
    deleted file (an overlay whiteout) and a directory replaced (an opaque directory)."""
    return Script("etc-root", (
        Step("echo '10.9.8.7 tenon-probe' >> /etc/hosts && useradd -m -u 2001 -s /bin/sh alice && "
             "rm /etc/debian_version && rm -rf /etc/apt/apt.conf.d && "
             "mkdir /etc/apt/apt.conf.d && echo 'APT::Quiet \"1\";' > "
             "/etc/apt/apt.conf.d/99tenon && echo edited", user="root"),
        Step("getent hosts tenon-probe; id alice; stat -c '%U %a' /home/alice; "
             "test -e /etc/debian_version || echo debian_version gone; "
             "ls /etc/apt/apt.conf.d; echo probe > /home/alice/x 2>&1 | sed 's/^.*: //'"),
        Step("echo 'x' >> /etc/hosts 2>&1 | sed 's/^.*: //'; tail -1 /etc/hosts"),
        Step("userdel -r alice 2>/dev/null; id alice 2>&1 | sed 's/^.*: //'; ls /home",
             user="root"),
    ))


def testbed_script() -> Script:
    """A repository at /testbed (outside the persistent directories), as SWE-bench images
    have it: made by root, handed to the user, edited and committed across teardowns."""
    commit = f"{_FIXED_DATES} git -c user.name=Ada -c user.email=ada@example.com commit -q"
    return Script("testbed", (
        Step("mkdir /testbed && chown 1000:1000 /testbed && stat -c '%u %a' /testbed",
             user="root"),
        Step("cd /testbed && git init -q -b main && printf 'def f():\\n    return 1\\n' > "
             f"mod.py && git add mod.py && {commit} -m first && git log --format=%s"),
        Step("cd /testbed && sed -i 's/return 1/return 2/' mod.py && git diff --stat && "
             "python3 -c 'import mod; print(mod.f())'"),
        Step(f"cd /testbed && {commit} -am fix && git log --format=%s && git status --porcelain"
             " && git fsck --no-progress 2>&1 | head -3"),
    ))


def corpus() -> list[Script]:
    return [git_script(), pip_user_script(), venv_script(), files_script(), sqlite_script(),
            server_script(), failure_script(), apt_root_script(), pip_root_script(),
            etc_root_script(), testbed_script()]
