"""`asynccache.cli.progress`: messages written while a bar is shown land on lines of
their own, with tqdm and with the fallback counter; nothing is drawn off a terminal.

A terminal is emulated: a stream that says it is one, and `tty_screen.screen`, which
applies carriage returns and erase-line the way a terminal does, so "glued to the bar"
is what the test would see on a screen.
"""

from __future__ import annotations

import io
import logging
import sys
from collections.abc import Iterator

import pytest

from asynccache.cli import progress as progress_module
from asynccache.cli.progress import Progress
from tty_screen import screen


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(params=["tqdm", "counter"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    if request.param == "counter":
        monkeypatch.setattr(progress_module, "tqdm_available", lambda: False)
    else:
        pytest.importorskip("tqdm")
    yield request.param


def test_a_message_during_a_bar_is_a_line_of_its_own(backend: str) -> None:
    term = Terminal()
    with Progress(3000, "warm", unit="item", file=term) as bar:
        bar.update(512)
        bar.write("asynccache warm: item 1234 failed: ValueError: broken", file=term)
        bar.update(10)
    lines = screen(term.getvalue())
    assert "asynccache warm: item 1234 failed: ValueError: broken" in lines
    assert not any("item" in line and "warm:" in line and "failed" in line
                   and not line.startswith("asynccache warm") for line in lines)
    assert lines[-1] == ""  # the bar was cleared when it closed


def test_print_and_logging_during_a_bar_go_through_it(backend: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    monkeypatch.setattr(sys, "stdout", term)
    logger = logging.getLogger("asynccache.test-progress")
    handler = logging.StreamHandler(term)
    logger.addHandler(handler)
    logger.propagate = False
    try:
        with Progress(100, "bench core", unit="run") as bar:
            bar.update(40)
            assert sys.stderr is not term  # routed while the bar is shown
            print("a line on stderr", file=sys.stderr)
            print("a line on stdout")
            logger.warning("a log record")
            sys.stderr.write("half a ")
            sys.stderr.write("line\n")
            bar.update(1)
        assert sys.stderr is term and sys.stdout is term  # restored
        assert handler.stream is term
    finally:
        logger.removeHandler(handler)
    lines = screen(term.getvalue())
    for expected in ("a line on stderr", "a line on stdout", "a log record", "half a line"):
        assert expected in lines, (expected, lines)


def test_status_shows_the_repetition(backend: str) -> None:
    term = Terminal()
    with Progress(10, "core 4 KiB", unit="run", file=term) as bar:
        bar.rep(0, 7)
        bar.update()
        bar.rep(3, 7)
        bar.update()
        drawn = term.getvalue()
    assert "warm-up" in drawn and "rep 3/7" in drawn and "core 4 KiB" in drawn


def test_nothing_is_drawn_off_a_terminal_or_when_disabled() -> None:
    log = io.StringIO()  # not a terminal
    with Progress(10, "core", file=log) as bar:
        bar.update(5)
        bar.describe("core 4 KiB")
        bar.write("a message", file=log)
    assert log.getvalue() == "a message\n"
    term = Terminal()
    with Progress(10, "core", file=term, enabled=False) as bar:
        bar.update(5)
    assert term.getvalue() == ""


def test_log_stages_write_one_line_per_stage_off_a_terminal() -> None:
    log = io.StringIO()
    with Progress(10, "latency", file=log, log_stages=True) as bar:
        bar.describe("latency redis 4 KiB")
        bar.describe("latency redis 4 KiB")  # unchanged: no new line
        bar.update(3)
        bar.rep(2, 5)
        bar.describe("latency redis sweeps")
    assert log.getvalue().splitlines() == [
        "latency...", "latency redis 4 KiB...", "latency redis sweeps..."]
    quiet = io.StringIO()
    with Progress(10, "latency", file=quiet, log_stages=True, enabled=False) as bar:
        bar.describe("latency redis 4 KiB")
    assert quiet.getvalue() == ""
