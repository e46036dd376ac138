"""Debian's chromium driven by Selenium through Debian's chromedriver (a matched pair; no
browser download). `scripts/test.sh` installs both as root on Debian; elsewhere the browser
tests skip and say why."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = ("/usr/bin/chromium", "/usr/bin/chromium-browser")
DRIVER = ("/usr/bin/chromedriver",)
# A test run leaves the README's pictures alone (a clean tree after the suite); to redraw them,
# run the browser tests with FLEET_SCREENSHOTS=docs/screenshots.
SCREENSHOTS = Path(os.environ.get("FLEET_SCREENSHOTS")
                   or Path(tempfile.gettempdir()) / "fleet-screenshots")


def _first(paths: tuple[str, ...], name: str) -> str | None:
    return next((p for p in paths if Path(p).exists()), None) or shutil.which(name)


def browser() -> Any:
    """A headless chromium, or a skip naming what is missing."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip("selenium is not installed (scripts/install.sh installs the dev extra)")
    chromium, driver = _first(CHROMIUM, "chromium"), _first(DRIVER, "chromedriver")
    if chromium is None or driver is None:
        pytest.skip("no chromium/chromedriver: scripts/test.sh installs Debian's chromium and "
                    "chromium-driver when run as root with apt-get")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1200,860", "--force-device-scale-factor=1"):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(executable_path=driver), options=options)


def wait(driver: Any, condition: Callable[[Any], Any], timeout: float, what: str) -> Any:
    """Until `condition(driver)` is truthy (WebDriverWait's bounded poll of the page)."""
    from selenium.common.exceptions import StaleElementReferenceException, TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:  # the page redraws as the feed updates: an element gone stale is asked again
        return WebDriverWait(driver, timeout, poll_frequency=0.2,
                             ignored_exceptions=(StaleElementReferenceException,)
                             ).until(condition)
    except TimeoutException:
        raise AssertionError(f"{what} not seen within {timeout} s; page text:\n"
                             f"{driver.find_element('tag name', 'body').text[:3000]}") from None


def screenshot(driver: Any, name: str) -> Path:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{name}.png"
    driver.save_screenshot(str(path))
    return path
