"""Progress bars: live in a terminal; elsewhere silent for short steps and a line every half
minute for long ones (never a long silence in a log)."""

from __future__ import annotations

import io

from hydra_ensembles import progress


def test_outside_a_terminal_a_bar_waits_then_updates_every_half_minute(monkeypatch):
    log = io.StringIO()  # not a terminal
    monkeypatch.setattr(progress.sys, "stderr", log)
    bar = progress.progress_bar(range(3), desc="step", file=log)
    assert bar.delay == progress.QUIET_DELAY and bar.mininterval == progress.QUIET_DELAY
    assert list(bar) == [0, 1, 2] and log.getvalue() == ""  # a short step leaves nothing
    import tqdm.std

    now = [0.0]
    monkeypatch.setattr(tqdm.std, "time", lambda: now[0])  # tqdm's clock, advanced by hand
    bar = progress.progress_bar(total=3, desc="long step", file=log)
    bar.update(1)
    bar.set_postfix(loss="0.5")  # an explicit refresh waits for the delay too
    assert log.getvalue() == ""  # not yet: 0 s
    now[0] = 31.0
    bar.update(1)
    assert "long step" in log.getvalue()  # shown once it ran past the delay
    shown = log.getvalue()
    now[0] = 40.0
    bar.update(1)
    assert log.getvalue() == shown  # 9 s later: no new line yet


def test_a_disabled_bar_says_nothing(capsys):
    assert list(progress.progress_bar(range(2), enabled=False)) == [0, 1]
    assert capsys.readouterr().err == ""
