"""Action classes from tool and command text."""

from __future__ import annotations

import pytest

from tenon.predict.classify import classify_action, command_key

CASES = [
    ("Bash", "python3 -m pytest tests/ -x", "test_runner"),
    ("Bash", "cd /testbed && PYTHONPATH=. pytest -q 2>&1 | tail -20", "test_runner"),
    (
        "Bash",
        "source venv/bin/activate && \\\npip install pytest && \\\npython3 -m pytest",
        "test_runner",
    ),
    ("bash", "tox -e py311", "test_runner"),
    ("bash", "npm test", "test_runner"),
    ("bash", "go test ./...", "test_runner"),
    ("bash", "cargo test --release", "test_runner"),
    ("bash", "python tests/runtests.py admin_views", "test_runner"),
    ("bash", "timeout 60 python -m unittest discover", "test_runner"),
    ("Bash", "pip install -e .", "package_install"),
    (
        "Bash",
        "python3 -m venv venv && source venv/bin/activate && pip install twisted",
        "package_install",
    ),
    ("bash", "sudo apt-get install -y libxml2", "package_install"),
    ("bash", "uv pip install numpy", "package_install"),
    ("bash", "npm install", "package_install"),
    ("bash", "python setup.py develop", "package_install"),
    ("bash", "gcc -O2 -o x x.c", "compiler"),
    ("bash", "make -j8", "compiler"),
    ("bash", "cargo build", "compiler"),
    ("bash", "tsc -p .", "compiler"),
    ("bash", "python setup.py build_ext --inplace", "compiler"),
    ("bash", "make test", "test_runner"),
    ("Bash", "python -c 'import dask; print(dask.__version__)'", "interpreter"),
    ("Bash", "python3 reproduce.py", "interpreter"),
    ("Bash", "python3 << 'EOF'\nimport os\nprint(os.getcwd())\nEOF", "interpreter"),
    ("Bash", 'grep -rn "def _parse" /testbed/sqlglot/parser.py | head -40', "search"),
    ("Bash", 'find /testbed -type f -name "*.py" | head -50', "search"),
    ("Bash", "ls -la /testbed/libp2p/", "search"),
    ("Bash", "rg foo", "search"),
    ("Grep", "Grep def array", "search"),
    ("Glob", "Glob **/*.py", "search"),
    ("Edit", "Edit /testbed/x.py", "file_edit"),
    ("Write", "Write /testbed/x.py", "file_edit"),
    ("Bash", "sed -i 's/a/b/' x.py", "file_edit"),
    ("Bash", "cat > /tmp/t.py << 'EOF'\nimport pytest\nEOF", "file_edit"),
    ("Read", "Read /testbed/x.py", "file_read"),
    ("Bash", "cat setup.py", "file_read"),
    ("Bash", "head -n 50 x.py", "file_read"),
    ("Bash", "sed -n '1,20p' x.py", "file_read"),
    ("Bash", "wc -l parser.py", "file_read"),
    ("Bash", "git diff", "vcs"),
    ("Bash", "cd /testbed && git log --oneline -5", "vcs"),
    ("Bash", "pwd", "other"),
    ("TodoWrite", "TodoWrite", "other"),
    ("WebFetch", "WebFetch https://example.com", "other"),
    ("Bash", "echo 'unbalanced", "other"),
    ("Bash", "", "other"),
]


@pytest.mark.parametrize(("tool", "command", "expected"), CASES)
def test_classify(tool, command, expected):
    assert classify_action(tool, command) == expected


@pytest.mark.parametrize(
    ("first", "second", "same"),
    [
        ("python3 -m pytest tests/", 'python3 -m pytest tests/ -v | grep -E "FAILED|ERROR"', True),
        (
            "python -m pytest tests/",
            "cd /testbed && python3.11 -m pytest tests/ 2>&1 | tail -5",
            True,
        ),
        ("/usr/bin/pytest -x -q", "pytest > out.txt", True),
        ("python -m pytest tests/", "python -m pytest tests/test_one.py", False),
        ("pip install -e .", "pip install numpy", False),
        ("Read /testbed/a.py", "Read /testbed/b.py", False),
        ("grep -rn foo src", "grep -n foo src", True),
    ],
)
def test_command_key_ignores_decoration_but_not_the_work(first, second, same):
    assert (command_key(first) == command_key(second)) is same
