"""The front door: the chat page at ``GET /`` in real browsers (Chromium driven by selenium; Firefox over WebDriver
BiDi, which it speaks itself), and ``/docs`` and ``/redoc`` served without a CDN.

The browser tests need Debian's ``chromium``, ``chromium-driver`` and ``firefox-esr`` (``.ci/run`` installs them);
without them they skip, except under CI (``CI`` set), where a missing browser fails."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time

import pytest
from _server_util import start_server, wait_pool_empty
from server_stages import slow_steps

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
KEY = "sk-page-test"


def _same_origin_assets(html: str, base: str) -> list[str]:
    """Every script, stylesheet and image the HTML names; fails on one from another origin."""
    refs = re.findall(r'(?:src|href)\s*=\s*["\']([^"\']+)["\']', html)
    for ref in refs:
        assert not re.match(r"^(https?:)?//", ref) or ref.startswith(base), f"loaded from elsewhere: {ref}"
    return refs


@pytest.mark.parametrize("path", ["/docs", "/redoc"])
def test_api_docs_load_nothing_from_elsewhere(demo_server, path):
    with demo_server.client() as client:
        page = client.get(path)
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        assets = [a for a in _same_origin_assets(page.text, demo_server.url) if a.endswith((".js", ".css"))]
        assert assets, "the page names its script"
        for asset in assets:
            resp = client.get(asset)
            assert resp.status_code == 200 and len(resp.content) > 10_000, asset  # the real bundle, served here


def test_the_chat_page_is_served_at_the_root(demo_server):
    with demo_server.client() as client:
        page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert 'id="prompt"' in page.text and "/v1/chat/completions" in page.text
    assert all(ref.startswith("data:") for ref in _same_origin_assets(page.text, demo_server.url))  # all inline


# ---- in the browser ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser():
    if not (CHROMIUM and DRIVER):
        if os.environ.get("CI"):
            pytest.fail("CI must run the browser tests: apt-get install -y chromium chromium-driver")
        pytest.skip("no chromium / chromedriver (apt-get install -y chromium chromium-driver)")
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1100,900"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    driver.set_script_timeout(30)
    yield driver
    driver.quit()


def wait_for(predicate, timeout: float = 30.0, what: str = "the page", driver=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = predicate()
        if got:
            return got
        time.sleep(0.02)
    shown = ""
    if driver is not None:
        shown = driver.execute_script("return document.getElementById('messages').innerText + ' | error: ' + "
                                      "document.getElementById('error').innerText")
    raise AssertionError(f"timed out waiting for {what}; the page shows: {shown}")


def open_page(driver, url: str) -> None:
    driver.get(url + "/")
    wait_for(lambda: driver.execute_script("return document.getElementById('model').options.length > 0 "
                                           "|| document.getElementById('error').textContent !== ''"),
             what="the model list or an error")


def ask(driver, text: str) -> int:
    """Type ``text`` and press Enter; returns how many replies the page held before."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    before = replies(driver)
    box = driver.find_element(By.ID, "prompt")
    box.clear()
    box.send_keys(text, Keys.ENTER)
    return before


def replies(driver) -> int:
    return driver.execute_script("return document.querySelectorAll('.reply').length")


def answer(driver, before: int) -> tuple[str, str]:
    """(text, stats) of the reply after the ``before`` ones, once it is complete."""
    wait_for(lambda: driver.execute_script(
        "const r = document.querySelectorAll('.reply'); return r.length > arguments[0] && "
        "r[r.length - 1].dataset.done === 'true'", before), what="the reply", driver=driver)
    return last_reply(driver)


def last_reply(driver) -> tuple[str, str]:
    return tuple(driver.execute_script(
        "const r = [...document.querySelectorAll('.reply')].pop();"
        "return r ? [r.querySelector('.bubble').textContent, r.querySelector('.stats').textContent] : ['', ''];"))


def set_control(driver, element_id: str, value: str) -> None:
    driver.execute_script("const e = document.getElementById(arguments[0]); e.value = arguments[1];"
                          "e.dispatchEvent(new Event('change'));", element_id, value)


def test_a_prompt_streams_its_answer_in(browser, demo_server):
    open_page(browser, demo_server.url)
    # every resource the page loaded came from this server
    urls = browser.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    assert urls and all(u.startswith(demo_server.url) for u in urls), urls
    text, stats = answer(browser, ask(browser, "5+414="))
    assert text == "419"
    assert re.search(r"\d+ tokens", stats) and "TTFT" in stats and "tier balanced" in stats and "cost" in stats
    # slowed steps: the text is seen growing, one token after another
    with slow_steps(demo_server, 0.15):
        before = ask(browser, "copy:abcdefgh=")
        seen = set()
        while not browser.execute_script("const r = document.querySelectorAll('.reply');"
                                         "return r.length > arguments[0] && r[r.length - 1].dataset.done === 'true'",
                                         before):
            seen.add(last_reply(browser)[0] if replies(browser) > before else "")
            time.sleep(0.02)
    final = last_reply(browser)[0]
    assert final == "abcdefgh"
    partial = {s for s in seen if s and s != final}
    assert len(partial) >= 3 and all(final.startswith(s) for s in partial), seen
    wait_pool_empty(demo_server.engine)


def test_stop_aborts_the_reply_on_the_server(browser, demo_server):
    open_page(browser, demo_server.url)
    engine = demo_server.engine
    with slow_steps(demo_server, 0.8):  # 9 tokens: about 7 s if nothing stops it
        before = ask(browser, "copy:abcdefgh=")
        wait_for(lambda: replies(browser) > before and len(last_reply(browser)[0]) >= 2, what="the first tokens",
                 driver=browser)
        assert engine.requests, "the request is in flight on the server"
        browser.find_element("id", "stop").click()
        t0 = time.monotonic()
        wait_pool_empty(engine, timeout=5)
        stopped_after = time.monotonic() - t0
    text, stats = answer(browser, before)
    assert "stopped" in stats and 2 <= len(text) < len("abcdefgh") and "abcdefgh".startswith(text)
    assert stopped_after < 3, "the server ran on after Stop"


def test_switching_the_tier_changes_the_tier_used(browser, demo_server):
    open_page(browser, demo_server.url)
    tiers = browser.execute_script("return [...document.getElementById('tier').options].map(o => o.value)")
    assert {"fast", "balanced", "deep", "max"} <= set(tiers)
    set_control(browser, "tier", "fast")
    _, stats = answer(browser, ask(browser, "3+4="))
    assert "tier fast" in stats
    set_control(browser, "tier", "")
    wait_pool_empty(demo_server.engine)


def test_a_phone_width_window_needs_no_sideways_scroll(browser, demo_server):
    browser.set_window_size(390, 844)
    try:
        open_page(browser, demo_server.url)
        assert browser.execute_script("return document.documentElement.scrollWidth <= window.innerWidth")
        assert browser.find_element("id", "send").is_displayed() and browser.find_element("id", "prompt").is_displayed()
    finally:
        browser.set_window_size(1100, 900)


@pytest.fixture(scope="module")
def keyed_server():
    digest = hashlib.sha256(KEY.encode()).hexdigest()
    live = start_server([f"+tenants.page.api_key_sha256=['{digest}']"])
    yield live
    live.stop()


def test_a_server_with_keys_asks_for_one_and_a_bad_key_is_shown(browser, keyed_server):
    open_page(browser, keyed_server.url)
    assert browser.find_element("id", "key-row").is_displayed()
    assert "needs an API key" in browser.find_element("id", "error").text
    set_control(browser, "api-key", "sk-wrong")
    ask(browser, "1+2=")
    wait_for(lambda: "invalid API key" in browser.find_element("id", "error").text, what="the key error")
    set_control(browser, "api-key", KEY)  # the right key: the models load and a prompt is answered
    wait_for(lambda: browser.execute_script("return document.getElementById('model').options.length > 0"),
             what="the model list")
    text, _ = answer(browser, ask(browser, "5+414="))
    assert text == "419" and browser.find_element("id", "error").text == ""
    wait_pool_empty(keyed_server.engine)


def test_screenshot_of_the_page(browser, demo_server, tmp_path):
    """The page after one exchange, as docs/images/chat-page.png shows it (written to the test's folder; set
    LITELLM_PIPELINE_SCREENSHOT to a path to write it there)."""
    open_page(browser, demo_server.url)
    answer(browser, ask(browser, "rev:stressed="))
    path = os.environ.get("LITELLM_PIPELINE_SCREENSHOT") or str(tmp_path / "chat-page.png")
    assert browser.save_screenshot(path)
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    wait_pool_empty(demo_server.engine)



# ---- in Firefox, over WebDriver BiDi (Firefox speaks it itself: no geckodriver) -----------------------------

FIREFOX = shutil.which("firefox-esr") or shutil.which("firefox")


class Bidi:
    """The few WebDriver BiDi commands the Firefox tests need, over Firefox's own remote agent."""

    def __init__(self, port: int):
        import websocket  # websocket-client, a dependency of selenium

        deadline = time.monotonic() + 60
        while True:
            try:
                self.ws = websocket.create_connection(f"ws://127.0.0.1:{port}/session", timeout=60,
                                                      suppress_origin=True)
                break
            except OSError:
                assert time.monotonic() < deadline, "Firefox's remote agent did not start"
                time.sleep(0.2)
        self.n = 0
        self.call("session.new", capabilities={})
        self.context = self.call("browsingContext.getTree")["contexts"][0]["context"]

    def call(self, method: str, **params):
        self.n += 1
        self.ws.send(json.dumps({"id": self.n, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == self.n:
                assert msg.get("type") != "error", msg
                return msg["result"]

    def open(self, url: str) -> None:
        self.call("browsingContext.navigate", context=self.context, url=url, wait="complete")

    def js(self, expression: str):
        result = self.call("script.evaluate", expression=expression, target={"context": self.context},
                           awaitPromise=True)["result"]
        if result.get("type") == "array":
            return [v.get("value") for v in result["value"]]
        return result.get("value")


@pytest.fixture(scope="module")
def firefox(tmp_path_factory):
    if not FIREFOX:
        if os.environ.get("CI"):
            pytest.fail("CI must run the Firefox tests: apt-get install -y firefox-esr")
        pytest.skip("no firefox (apt-get install -y firefox-esr)")
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([FIREFOX, "--headless", "--no-remote", "--profile", str(tmp_path_factory.mktemp("ff")),
                             f"--remote-debugging-port={port}"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        bidi = Bidi(port)
        yield bidi
        bidi.call("session.end")
    finally:
        proc.terminate()
        proc.wait(30)


# sends a prompt as the composer does (Enter submits the form) and waits for the reply to complete
FF_ASK = """(async () => {
  while (!document.getElementById('model').options.length) await new Promise(f => setTimeout(f, 20));
  const before = document.querySelectorAll('.reply').length;
  document.getElementById('prompt').value = %s;
  document.getElementById('composer').requestSubmit();
  %s
  for (let i = 0; i < 600; i++) {
    const r = document.querySelectorAll('.reply');
    if (r.length > before && r[r.length - 1].dataset.done)
      return [r[r.length - 1].querySelector('.bubble').textContent, r[r.length - 1].querySelector('.stats').textContent];
    await new Promise(f => setTimeout(f, 50));
  }
  return ['timeout', ''];
})()"""
# Stop once two characters have arrived
FF_STOP = """for (let i = 0; i < 600; i++) {
    const r = document.querySelectorAll('.reply');
    if (r.length > before && r[r.length - 1].querySelector('.bubble').textContent.length >= 2) break;
    await new Promise(f => setTimeout(f, 20));
  }
  document.getElementById('stop').click();"""


def test_firefox_streams_an_answer_and_stops_a_reply(firefox, demo_server):
    firefox.open(demo_server.url + "/")
    text, stats = firefox.js(FF_ASK % (json.dumps("5+414="), ""))
    assert text == "419" and "tier balanced" in stats and "TTFT" in stats
    with slow_steps(demo_server, 0.8):
        text, stats = firefox.js(FF_ASK % (json.dumps("copy:abcdefgh="), FF_STOP))
        wait_pool_empty(demo_server.engine, timeout=5)
    assert "stopped" in stats and 2 <= len(text) < len("abcdefgh") and "abcdefgh".startswith(text)
    assert firefox.js("document.documentElement.scrollWidth <= window.innerWidth")
