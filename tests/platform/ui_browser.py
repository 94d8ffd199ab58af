"""What the admin web UI's browser tests share: Debian's Chromium (headless, driven by Playwright),
a context on the app, a page whose script errors are kept, the keyboard sign-in, and screenshots
of the page (at 1280 and 390 px wide, in test-artifacts/ui-screenshots/)."""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.requirements import CHROMIUM

from .conftest import ADMIN_TOKEN

try:
    from playwright import sync_api
except ImportError:  # the needs_chromium fixture says what is missing
    sync_api = None

ROOT = Path(__file__).resolve().parents[2]
PIRATE = ROOT / "platform" / "tessera" / "demo_adapters" / "pirate"
SHOTS = ROOT / "test-artifacts" / "ui-screenshots"
WIDE, NARROW = {"width": 1280, "height": 900}, {"width": 390, "height": 844}


@pytest.fixture(scope="module", name="browser")
def chromium_browser():
    """The "browser" fixture: Chromium for the module's tests (they use needs_chromium first)."""
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), headless=True)
        yield b
        b.close()


@contextmanager
def browser_context(browser, platform, **options):
    """A context on the app at the wide viewport (options: browser.new_context's)."""
    ctx = browser.new_context(base_url=platform.url, viewport=WIDE, **options)
    ctx.set_default_timeout(60_000)  # a busy 2-core machine; waits end as soon as the page is there
    try:
        yield ctx
    finally:
        ctx.close()


def watched_page(context) -> tuple[object, list[str]]:
    """A new page, and the list its uncaught exceptions and the errors its scripts log go to (a
    resource that failed to load is not one: refused requests are expected)."""
    script_errors: list[str] = []
    page = context.new_page()
    page.on("pageerror", lambda e: script_errors.append(str(e)))
    page.on("console", lambda m: script_errors.append(m.text)
            if m.type == "error" and not m.text.startswith("Failed to load resource") else None)
    return page, script_errors


def sign_in_on_the_way(page, path: str) -> None:
    """Opens path without a session and signs in, keyboard only, on the sign-in page it is sent to."""
    page.goto(path)
    page.wait_for_url("**/admin/login?next=**")
    sync_api.expect(page.get_by_label("Admin password")).to_be_focused()  # the page puts the focus there
    page.keyboard.type(ADMIN_TOKEN)
    page.keyboard.press("Enter")


def keep_texts(page, selector: str) -> None:
    """From now on, every text the element at selector shows is kept (seen_texts reads them):
    passing states a wait could miss."""
    page.evaluate("""(selector) => {
        window.__seen = [];
        const box = document.querySelector(selector);
        new MutationObserver(() => window.__seen.push(box.textContent)).observe(box, {childList: true, subtree: true});
    }""", selector)


def seen_texts(page) -> list[str]:
    """The texts kept since keep_texts, in order."""
    return page.evaluate("window.__seen")


@contextmanager
def evidence(page, name: str):
    """On a failure, keep what the page showed (screenshot + text) next to the other screenshots."""
    try:
        yield
    except BaseException:
        SHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SHOTS / f"FAILED-{name}.png"), full_page=True)
        print(f"the page at {page.url} showed:\n{page.locator('body').inner_text()}")
        raise


def shot(page, name: str) -> None:
    """Screenshots of the page as it is, at 1280 and at 390 px wide."""
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.wait_for_load_state("networkidle")
    page.evaluate("document.getElementById('toasts')?.replaceChildren()")  # passing messages
    for size, tag in ((WIDE, "1280"), (NARROW, "390")):
        page.set_viewport_size(size)
        page.wait_for_timeout(150)  # let charts re-lay themselves out; not an assertion
        page.screenshot(path=str(SHOTS / f"{name}-{tag}.png"), full_page=True)
    page.set_viewport_size(WIDE)
