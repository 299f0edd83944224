import asyncio

import pytest

from tenon.clock import FakeClock
from tenon.errors import ConfigError
from tenon.units import GIB, MIB, parse_duration, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [("3GiB", 3 * GIB), ("512MiB", 512 * MIB), ("1.5GB", 1_500_000_000), ("4096", 4096)],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["-1GiB", "3 furlongs", "", "GiB"])
def test_parse_size_rejects_bad_input_naming_it(text):
    with pytest.raises(ConfigError, match="--budget"):
        parse_size(text, what="--budget")


def test_parse_duration():
    assert parse_duration("250ms") == pytest.approx(0.25)
    assert parse_duration("2m") == 120.0
    with pytest.raises(ConfigError):
        parse_duration("-3s")


async def test_fake_clock_wakes_sleepers_in_deadline_order():
    clock = FakeClock()
    woke: list[tuple[str, float]] = []

    async def sleeper(name: str, seconds: float) -> None:
        await clock.sleep(seconds)
        woke.append((name, clock.now()))

    tasks = [asyncio.create_task(sleeper("late", 5)), asyncio.create_task(sleeper("early", 1))]
    await asyncio.sleep(0)
    clock.advance(0.5)
    await asyncio.sleep(0)
    assert woke == []
    while clock.advance_to_next():  # noqa: ASYNC110 (driving a fake clock)
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    assert woke == [("early", 1.0), ("late", 5.0)]
    with pytest.raises(ValueError, match="backwards"):
        clock.advance(-1)
