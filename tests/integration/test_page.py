"""The live picture (issue 56) in a real headless browser: Debian's Chromium
driven by Playwright. The page at the dispatcher's metrics port loads with no
console error and nothing fetched from elsewhere, shows the live jobs and
workers, and changes when the load changes. It leaves its screenshot where
DPEX_PAGE_SCREENSHOT says (docs/guides/page.png is one)."""
import os
import shutil
import threading

import pytest

import dpex
from dpex.testing import test_cluster

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium (Debian's chromium package; make "
                                                          "setup installs it as root)")
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]


@pytest.fixture
def browser():
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        yield b
        b.close()


def test_the_page_shows_the_live_jobs_and_workers_and_follows_the_load(browser, tmp_path):
    with test_cluster(num_workers=2, metrics=True) as c:
        url = f"http://127.0.0.1:{c.dispatcher.metrics_port}/"
        page = browser.new_page(viewport={"width": 1200, "height": 900})
        errors, outside = [], []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("request", lambda r: outside.append(r.url) if not r.url.startswith(url) else None)
        page.goto(url)
        page.wait_for_selector("#workers tbody tr:nth-child(2)")
        assert page.locator("#jobs").inner_text() == "no live job"
        assert sorted(page.locator("#workers tbody tr td:nth-child(3)").all_inner_texts()) == ["alive", "alive"]

        # A trainer reading from storage-bound workers: its job appears, with its rate and verdict.
        spec = dpex.DatasetSpec("dpex.testing.datasets:Slow", n=100_000, delay_s=0.005)
        stop, failed = threading.Event(), []

        def train():
            try:
                with dpex.RemoteDataLoader(c.address, spec, batch_size=8, job_name="page-demo", timeout=60) as dl:
                    for _ in dl:
                        if stop.is_set():
                            break
            except Exception as e:  # noqa: BLE001 - the test's to report
                failed.append(e)
        trainer = threading.Thread(target=train)
        trainer.start()
        try:
            card = page.locator(".job", has_text="page-demo")
            card.locator(".verdict").wait_for(timeout=60_000)
            assert card.locator(".verdict").inner_text() == "storage"
            assert "--processes" in card.locator(".reason").inner_text()
            page.wait_for_function("() => parseFloat(document.querySelector('.job .rate').textContent) > 0")
            assert card.locator("svg.chart").count() == 2 and card.locator(".bar span").count() >= 2
            busy = page.locator("#workers tbody tr td:nth-child(5)").all_inner_texts()
            assert all(text.strip() != "0%" for text in busy), busy  # both workers' processes at work
            page.wait_for_function("() => document.querySelector('.job svg.chart polyline')"
                                   ".getAttribute('points').split(' ').length >= 6")  # some history drawn
            shot = os.environ.get("DPEX_PAGE_SCREENSHOT") or str(tmp_path / "page.png")
            page.screenshot(path=shot, full_page=True)
        finally:
            stop.set()
            trainer.join()
        assert not failed, failed

        # The load changes: the trainer is gone, a worker is killed; the page follows.
        c.kill_worker(0)
        page.wait_for_function("() => !document.querySelector('.job') || "
                               "[...document.querySelectorAll('#workers td:nth-child(3)')].some(t => t.textContent === 'lost')",
                               timeout=30_000)
        page.wait_for_function("() => [...document.querySelectorAll('#workers td:nth-child(3)')]"
                               ".some(t => t.textContent === 'lost')", timeout=30_000)
        page.wait_for_function("() => !document.querySelector('.verdict')", timeout=30_000)  # no live trainer
    assert errors == [] and outside == []
