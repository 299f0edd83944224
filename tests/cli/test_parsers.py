"""The parsers behind the CLI's options: sizes, seconds, rates, settings, output paths."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from tenon.cli.bench import MAX_SUBMISSIONS, parse_qps, parse_seconds, parse_settings
from tenon.cli.errors import (
    describe_validation,
    one_line,
    require_writable_dir,
    require_writable_file,
    write_text,
)
from tenon.errors import ConfigError
from tenon.policy.config import PolicyConfig
from tenon.units import GIB, MAX_SIZE_BYTES, parse_size


@pytest.mark.parametrize(("text", "expected"), [
    ("3GiB", 3 * GIB),
    ("1.1GB", 1_100_000_000),  # exact: float arithmetic gives 1100000000.0000002
    ("0.5KiB", 512),
    ("8589934591GiB", 8589934591 * GIB),  # just under 8 EiB
    (str(MAX_SIZE_BYTES), MAX_SIZE_BYTES),
    (0, 0),
])
def test_parse_size_is_exact_up_to_int64(text, expected) -> None:
    assert parse_size(text, what="--budget") == expected


@pytest.mark.parametrize(("text", "match"), [
    (str(MAX_SIZE_BYTES + 1), "64-bit"),
    ("8589934592GiB", "64-bit"),  # exactly 8 EiB, one byte past the largest int64
    ("1" + "0" * 400 + "GiB", "64-bit"),  # float() of this is inf
    ("9" * 5000, "too many digits"),  # past Python's int conversion limit
    (MAX_SIZE_BYTES + 1, "64-bit"),
    ("-1MiB", "negative"),
    ("3 parsecs", "unknown unit"),
    ("lots", "cannot parse"),
])
def test_parse_size_rejects_with_the_option_named(text, match) -> None:
    with pytest.raises(ConfigError, match=match) as caught:
        parse_size(text, what="--budget")
    assert str(caught.value).startswith("--budget: ")
    assert len(str(caught.value)) < 200  # a huge input is shortened, not echoed whole


def test_parse_seconds_accepts_a_week_and_no_more() -> None:
    assert parse_seconds("10s", what="--window") == 10.0
    assert parse_seconds("2.5", what="--window") == 2.5
    assert parse_seconds("604800s", what="--window") == 604800.0
    for text, match in [("604801", "at most"), ("inf", "finite"), ("nan", "finite"),
                        ("0s", "positive"), ("-3", "positive"), ("soon", "expected")]:
        with pytest.raises(ConfigError, match=f"^--window: .*{match}"):
            parse_seconds(text, what="--window")


def test_parse_qps_one_rate_or_a_list() -> None:
    assert parse_qps(None) == []
    assert parse_qps("16") == [16.0]
    assert parse_qps("8, 16,") == [8.0, 16.0]
    assert parse_qps(str(MAX_SUBMISSIONS)) == [float(MAX_SUBMISSIONS)]
    for text, match in [("abc", "'abc'"), ("1,abc", "'abc'"), (",", "expected a rate"),
                        ("inf", "finite"), ("0", "positive"),
                        (str(MAX_SUBMISSIONS * 10), "at most")]:
        with pytest.raises(ConfigError, match=f"--qps: .*{match}"):
            parse_qps(text)


def test_parse_settings_names_the_setting() -> None:
    assert parse_settings(["red_fraction=0.5", "admission_window_bytes=1GiB"]) == {
        "red_fraction": 0.5, "admission_window_bytes": GIB}
    with pytest.raises(ConfigError, match="^--set red_fraction: must be a finite number"):
        parse_settings(["red_fraction=inf"])
    with pytest.raises(ConfigError, match="^--set nope: unknown setting$"):
        parse_settings(["nope=1"])
    with pytest.raises(ConfigError, match="^--set admission_window_bytes: .*64-bit"):
        parse_settings(["admission_window_bytes=99999999TiB"])
    with pytest.raises(ConfigError, match="key=value"):
        parse_settings(["red_fraction"])


def test_describe_validation_is_one_line_per_model_naming_flags() -> None:
    with pytest.raises(ValidationError) as caught:
        PolicyConfig.model_validate({"red_fraction": "abc", "nope": 1})
    text = describe_validation(caught.value, {"red_fraction": "--red"}, prefix="--set ")
    assert "\n" not in text
    assert "--red: input should be a valid number" in text
    assert "--set nope: unknown setting" in text


def test_one_line_joins_lines() -> None:
    assert one_line("first\n\n  second  \n") == "first; second"


def test_output_paths_are_checked_before_work(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    run_dir = require_writable_dir(tmp_path / "new" / "run", what="--out")
    assert run_dir.is_dir()
    assert list(run_dir.iterdir()) == []  # the probe file is gone
    assert require_writable_file(tmp_path / "out" / "r.json", what="--json").parent.is_dir()
    with pytest.raises(ConfigError, match="^--out: .*a-file is not a directory$"):
        require_writable_dir(blocker, what="--out")
    with pytest.raises(ConfigError, match="^--out: cannot write to .*Not a directory"):
        require_writable_dir(blocker / "run", what="--out")
    with pytest.raises(ConfigError, match="^--json: .* is a directory"):
        require_writable_file(tmp_path, what="--json")
    with pytest.raises(ConfigError, match="^--json: cannot write .*a-file/r.json"):
        write_text(blocker / "r.json", "{}", what="--json")
