"""Headless Chromium for pictures of the dashboard: the run report's screenshot, the benchmark's render time.

Chromium runs with no network of its own and a fresh profile (the flags below), so it only ever talks to
the page it is given. `find_chromium` returns None where no Chromium is installed; callers say so and go on.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", "--no-first-run", "--hide-scrollbars", "--mute-audio")


class BrowserError(RuntimeError):
    """Chromium failed to take the picture."""


def find_chromium() -> str | None:
    return next((path for name in NAMES if (path := shutil.which(name)) is not None), None)


def screenshot(url: str, path: Path, width: int = 1440, height: int = 1900, wait_ms: int = 6000,
               timeout_s: float = 60.0, chromium: str | None = None) -> Path:
    """A PNG of the page at `url` after its scripts ran for `wait_ms` (of the page's own, virtual, time)."""
    chromium = chromium or find_chromium()
    if chromium is None:
        raise BrowserError(f"no Chromium found (looked for {', '.join(NAMES)})")
    path = Path(path)
    with tempfile.TemporaryDirectory(prefix="hetpeer-chromium-") as profile:
        command = [chromium, *FLAGS, f"--user-data-dir={profile}", f"--window-size={width},{height}",
                   f"--virtual-time-budget={wait_ms}", f"--screenshot={path.resolve()}", url]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise BrowserError(f"Chromium took more than {timeout_s:g} s for a screenshot of {url}") from None
        except OSError as error:  # not executable, gone since it was found
            raise BrowserError(f"cannot run {chromium}: {error.strerror or error}") from None
    if done.returncode != 0 or not path.exists():
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise BrowserError(f"Chromium could not take a screenshot of {url} (exit {done.returncode}): {last}")
    return path


def driver(width: int = 1440, height: int = 2000):
    """A selenium WebDriver on headless Chromium with the flags above (selenium and Debian's chromium-driver, or
    any chromedriver on PATH): the dashboard's browser tests and benchmark. BrowserError when either is missing."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        raise BrowserError("selenium is not installed: pip install -e '.[test]'") from None
    chromium, chromedriver = find_chromium(), shutil.which("chromedriver")
    if chromium is None or chromedriver is None:
        raise BrowserError("the browser tests need chromium and chromedriver (Debian: apt-get install chromium "
                           "chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    profile = tempfile.mkdtemp(prefix="hetpeer-chromium-")
    for flag in (*FLAGS, f"--user-data-dir={profile}", f"--window-size={width},{height}"):
        options.add_argument(flag)
    made = webdriver.Chrome(options=options, service=Service(executable_path=chromedriver))
    made.profile = profile  # removed by `close`
    return made


def close(made) -> None:
    made.quit()
    shutil.rmtree(made.profile, ignore_errors=True)
