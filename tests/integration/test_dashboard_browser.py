"""The dashboard in a real browser: headless Chromium (Debian's chromium and chromium-driver, driven by
selenium, with no network of its own) on a live local swarm's page shows the plan, the peers and the
charts, and they update without a reload; the peers table sorts; the credit leaderboard ranks, sorts and
toggles; a peer's text that looks like markup is
shown as text and never runs; the run report's HTML draws the same page from a file, with no server.

Skipped where no Chromium is installed, unless HETPEER_REQUIRE_BROWSER is set (.ci/run sets it).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from dashboard_boards import board, credit_board
from hetpeer.coordinator.web import DashboardServer
from hetpeer.peer.reach import free_port
from hetpeer.swarm import browser
from hetpeer.swarm.launcher import LocalSwarm, SwarmConfig
from hetpeer.swarm.report import Event, PeerInfo, PlanUse, RunReport, Sample, write_report

pytestmark = pytest.mark.slow
GUARD_S = 180.0  # hang guards, not timings


@pytest.fixture(scope="module")
def chrome():
    try:
        made = browser.driver()
    except browser.BrowserError as error:
        if os.environ.get("HETPEER_REQUIRE_BROWSER"):
            raise
        pytest.skip(str(error))
    yield made
    browser.close(made)


def wait_for(condition, what: str, timeout_s: float = GUARD_S):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")


def page_figures(chrome) -> dict:
    """What the page shows, read from its DOM and its plotly charts."""
    return chrome.execute_script("""
        const chart = (id) => document.getElementById(id).data || [];
        return {
          version: Number(document.body.dataset.version || -1),
          boxes: [...document.querySelectorAll('#plan-picture g[data-peer]')].map((g) => [g.dataset.peer, g.dataset.state]),
          lanes: document.querySelectorAll('#plan-picture line[data-link="lane"]').length,
          rows: [...document.querySelectorAll('#peers tbody tr')].map((tr) => [...tr.cells].map((td) => td.textContent)),
          step: document.querySelector('[data-figure="step"] .value')?.textContent,
          loss: chart('chart-loss').map((t) => t.y.filter((y) => y !== null).length),
          rate: chart('chart-rate').map((t) => t.x.length),
          plans: document.querySelectorAll('#plans tbody tr').length,
          events: [...document.querySelectorAll('#events li')].map((li) => li.dataset.kind),
          live: document.getElementById('live').textContent,
          marker: window.hetpeerMarker || null,
        };""")


def sorted_by(chrome, key: str) -> list[float]:
    """Click a column's header (as a person would, between two renders) and read that column."""
    return chrome.execute_script(f"""
        document.querySelector('#peers th[data-key="{key}"]').click();
        const at = [...document.querySelectorAll('#peers th')].findIndex((th) => th.dataset.key === "{key}");
        return [...document.querySelectorAll('#peers tbody tr')].map((tr) => Number(tr.cells[at].textContent));""")


def test_a_live_swarm_shows_its_plan_peers_and_charts_and_they_update(chrome, tmp_path):
    # Every peer in the first plan: with the swarm's default of two, a peer slow to start would join a running plan
    # that a solve keeps, and stay out of its picture (the peers table still lists it).
    config = SwarmConfig(out=tmp_path, peers=3, steps=400, heartbeat_s=1.0, coordinator_args=("--stages", "2", "--min-peers", "3"))
    with LocalSwarm(config, lambda line: None, free_port(), http_port=free_port()) as swarm:
        chrome.get(swarm.dashboard_url)
        chrome.execute_script("window.hetpeerMarker = 'same page'")  # gone if the page ever reloads
        first = wait_for(lambda: (f := page_figures(chrome))["boxes"] and f["loss"] and f["loss"][0] >= 2 and f,
                         "a plan and a loss curve on the page")
        planned = {device for device, _ in first["boxes"]}
        assert len(first["boxes"]) == 3 and len(planned) == 3  # 2 stages x 1 lane, 1 on standby: every peer drawn
        assert first["lanes"] == 1 and first["plans"] >= 1 and "plan" in first["events"] and "join" in first["events"]
        assert sorted(row[0] for row in first["rows"]) == sorted(swarm.device_ids.values())
        assert first["live"].startswith("live")
        later = wait_for(lambda: (f := page_figures(chrome))["loss"][0] > first["loss"][0] + 2 and f, "the charts to grow")
        assert later["marker"] == "same page" and later["version"] > first["version"]  # updated in place
        assert int(later["step"].replace(",", "")) > int(first["step"].replace(",", ""))
        rising = sorted_by(chrome, "tflops")
        falling = sorted_by(chrome, "tflops")  # clicked again: the other way
        assert rising == sorted(rising) and falling == sorted(rising, reverse=True)
        assert chrome.get_screenshot_as_file(str(tmp_path / "dashboard.png"))
        assert (tmp_path / "dashboard.png").stat().st_size > 20_000


def test_a_peers_text_that_looks_like_markup_is_shown_as_text(chrome):
    hostile = board()  # peer s calls its device "<img src=x onerror=alert(1)>"
    server = DashboardServer(lambda: hostile).start()
    chrome.get_log("browser")  # what pages before this one logged
    try:
        chrome.get(server.url)
        wait_for(lambda: chrome.execute_script("return document.body.dataset.rendered"), "the first render")
        shown = chrome.execute_script("""
            const rows = [...document.querySelectorAll('#peers tbody tr')];
            const s = rows.find((tr) => tr.cells[0].textContent === 's');
            return {cell: [...s.cells].map((td) => td.textContent), images: document.querySelectorAll('img').length,
                    missing: document.querySelector('#plan-picture g[data-peer="f"]').dataset.state};""")
        assert "<img src=x onerror=alert(1)>" in shown["cell"] and shown["images"] == 0
        assert shown["missing"] == "missing"  # a planned peer with no fresh record is drawn as such
        assert chrome.execute_script("return typeof window.alertCalled") == "undefined"
        logs = [entry["message"] for entry in chrome.get_log("browser") if entry["level"] == "SEVERE"]
        assert not logs, logs  # no script error, and nothing the security policy had to block
    finally:
        server.shutdown()


def credit_rows(chrome, click: str | None = None) -> list[list[str]]:
    """Click a header (`th[data-key=...]`) or a toggle (`[data-credit-...]`) of the leaderboard, then read its rows."""
    return chrome.execute_script("""
        if (arguments[0]) document.querySelector('#credit-panel ' + arguments[0]).click();
        return [...document.querySelectorAll('#credit tbody tr')].map((tr) => [...tr.cells].map((td) => td.textContent));""", click)


def test_the_credit_leaderboard_ranks_sorts_and_toggles(chrome):
    server = DashboardServer(lambda: board(credit=credit_board())).start()
    try:
        chrome.get(server.url + "?once")
        wait_for(lambda: chrome.execute_script("return document.body.dataset.rendered"), "the first render")
        rows = credit_rows(chrome)
        assert [(r[0], r[1], r[2], r[3]) for r in rows] == [("1", "ann", "red", "9,000"), ("2", "bob", "red", "5,000"),
                                                            ("3", "evesuspect", "-", "1,000")]  # the suspect is marked
        assert chrome.execute_script("return document.querySelectorAll('#credit tr[data-suspect]').length") == 1
        assert [r[1] for r in credit_rows(chrome, 'th[data-key="name"]')] == ["ann", "bob", "evesuspect"]
        assert [r[1] for r in credit_rows(chrome, 'th[data-key="name"]')] == ["evesuspect", "bob", "ann"]  # the other way
        assert [r[0] for r in credit_rows(chrome, 'th[data-key="rank"]')] == ["1", "2", "3"]
        hour = credit_rows(chrome, '[data-credit-span="hour"]')  # the last hour ranks them the other way round
        assert [(r[0], r[1], r[3]) for r in hour] == [("1", "evesuspect", "3,000"), ("2", "bob", "1,000"), ("3", "ann", "100")]
        teams = credit_rows(chrome, '[data-credit-rows="teams"]')
        assert [(r[1], r[2], r[3]) for r in teams] == [("red", "2", "1,100")]
        assert chrome.execute_script("return document.getElementById('credit-csv').getAttribute('href')") == "api/credit.csv"
    finally:
        server.shutdown()


def test_the_run_reports_html_draws_the_page_from_a_file(chrome, tmp_path):
    samples = [Sample(1.0 + i, i, 5.0 - i / 10, 100.0 + i, 1 if i < 5 else 2, 4.8 if i == 4 else None) for i in range(10)]
    plans = [PlanUse(1, 0, 0.5, [(0, 2, ["p0"]), (2, 4, ["p1"])], ["p2"], predicted_step_s=0.8),
             PlanUse(2, 5, 6.0, [(0, 4, ["p0"])], ["p1", "p2"], predicted_step_s=1.1)]
    peers = [PeerInfo(f"p{i}", 1.0 + i, None, 0.5, "cpu") for i in range(3)]
    run = RunReport("file", "tiny", 10, 11.0, peers, plans, samples, [Event(3.0, "peer p2 killed")])
    html = write_report(run, tmp_path)["html"]
    chrome.get(Path(html).as_uri())
    wait_for(lambda: chrome.execute_script("return document.body.dataset.rendered"), "the report's page")
    figures = page_figures(chrome)
    assert figures["loss"] == [10, 1] and figures["rate"] == [10]  # loss, validation loss; tokens/s
    assert [device for device, _ in figures["boxes"]] == ["p0", "p1", "p2"] and figures["plans"] == 2
    assert chrome.execute_script("return document.querySelectorAll('#chart-loss .shapelayer path').length") == 1  # one switch
    assert figures["live"] == "run report"
    assert chrome.execute_script("return document.getElementById('credit-panel').hidden")  # a run has no ledger
