"""Every line a long-running process prints starts with its UTC time; readers take it off."""

from __future__ import annotations

import io
import logging
import time

from hetpeer import logline


def test_a_stamped_line_splits_back_into_its_time_and_text():
    before = time.time()
    line = logline.stamp("plan epoch 2 from step 41")
    when, rest = logline.split(line)
    assert rest == "plan epoch 2 from step 41"
    assert before - 0.002 <= logline.seconds(when) <= time.time() + 0.001  # to the nearest millisecond
    assert logline.seconds("2026-11-24T16:05:01.234Z") == 1795536301.234
    assert logline.at(1795536301.234) == "2026-11-24T16:05:01.234Z"


def test_lines_without_a_stamp_pass_through_unchanged():
    for line in ("step 3/20  loss 2.1", "", "2026-11-24 16:05:01 not our stamp", "[d0] step 1/3"):
        assert logline.split(line) == (None, line)
        assert logline.unstamp(line) == line


def test_a_relayed_line_keeps_its_own_time_and_names_its_source():
    line = "2026-11-24T16:05:01.234Z step 1/3  loss 5.2"
    assert logline.relabel(line, "d0") == "2026-11-24T16:05:01.234Z [d0] step 1/3  loss 5.2"
    when, rest = logline.split(logline.relabel("hetpeer join: error: bad", "d1"))
    assert when is not None and rest == "[d1] hetpeer join: error: bad"  # a line without one gets the relay's time


def test_log_records_carry_the_same_stamp():
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logline.Formatter())
    log = logging.getLogger("hetpeer.test-logline")
    log.addHandler(handler)
    try:
        log.warning("cannot reach %s", "peer3")
    finally:
        log.removeHandler(handler)
    when, rest = logline.split(stream.getvalue().rstrip("\n"))
    assert when is not None and rest == f"{logging.getLevelName(logging.WARNING)} hetpeer.test-logline: cannot reach peer3"  # hivemind renames levels
