"""The web playground at /, driven by headless Chromium against the real-model server.

Needs Debian's ``chromium`` and ``chromium-driver`` packages; without them the test fails
(it never skips): ``make test`` installs them.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.real_model]

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--no-first-run")

# Counts every change to the text of the chat log, so the test can tell that the answer
# arrived in several pieces (streamed) rather than at once.
COUNT_TEXT_UPDATES = """
window.__textUpdates = 0;
new MutationObserver((records) => { window.__textUpdates += records.length; })
  .observe(document.getElementById("messages"), {characterData: true, subtree: true});
"""


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory):
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.is_file()]
    if missing:
        pytest.fail(f"the playground test needs headless Chromium, but {', '.join(missing)} is missing. "
                    "`make test` installs it (apt-get install -y chromium chromium-driver).", pytrace=False)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}")
    driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def test_chat_answer_streams_into_the_page(server_pool, browser) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    server = server_pool.get("real")
    browser.get(f"{server.url}/")
    wait = WebDriverWait(browser, 90, poll_frequency=0.05)
    # the stats poll names the model once the page talks to the server
    wait.until(lambda d: "smollm2-135m" in d.find_element(By.ID, "model-name").text)

    for field, value in (("max-tokens", "12"), ("temperature", "0")):
        element = browser.find_element(By.ID, field)
        element.clear()
        element.send_keys(value)
    browser.execute_script(COUNT_TEXT_UPDATES)
    browser.find_element(By.ID, "prompt").send_keys("What is the capital of France?")
    browser.find_element(By.ID, "send").click()

    answer = wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant"))[-1]
    wait.until(lambda d: answer.text.strip(), message="no answer text appeared")
    wait.until(lambda d: answer.get_attribute("data-state") != "streaming", message="the answer never finished")
    assert answer.get_attribute("data-state") == "done", answer.text
    assert browser.find_element(By.CSS_SELECTOR, ".msg.user").text == "What is the capital of France?"
    assert re.search(r"\w", answer.text)
    assert browser.execute_script("return window.__textUpdates") >= 2, "the answer should arrive in pieces"
    assert re.fullmatch(r"\d+(\.\d+)?", browser.find_element(By.ID, "stat-tps").text)
    assert int(browser.find_element(By.ID, "stat-answer-tokens").text) >= 2
    wait.until(lambda d: d.find_element(By.ID, "stat-kv").text.endswith("%"))
    assert browser.find_element(By.ID, "stat-running").text.isdigit()

    # a reload shows the conversation and the settings again (kept in localStorage, as
    # llama-server's page keeps its chats), and the next turn sends the restored history
    kept = browser.execute_script("return JSON.parse(localStorage.getItem('loom.chat')).history")
    assert kept[0] == {"role": "user", "content": "What is the capital of France?"} and kept[1]["content"].strip()
    assert answer.text.startswith(kept[1]["content"].strip())
    browser.refresh()
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, ".msg")) == 2)
    restored = browser.find_elements(By.CSS_SELECTOR, ".msg")
    assert [m.text for m in restored] == ["What is the capital of France?", kept[1]["content"].strip()]
    assert browser.find_element(By.ID, "max-tokens").get_attribute("value") == "12"
    assert browser.find_element(By.ID, "temperature").get_attribute("value") == "0"
    browser.execute_script("window.sent = []; const f = window.fetch; window.fetch = (u, o) => "
                           "{ if (o && o.body) window.sent.push(JSON.parse(o.body)); return f(u, o); };")
    browser.find_element(By.ID, "prompt").send_keys("And of Italy?")
    browser.find_element(By.ID, "send").click()
    sent = wait.until(lambda d: d.execute_script("return window.sent.length && window.sent[0].messages"))
    assert [m["role"] for m in sent] == ["user", "assistant", "user"] and sent[0]["content"].startswith("What is")
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant")[-1].get_attribute("data-state") == "done")
    browser.find_element(By.ID, "clear").click()   # Clear forgets it: a reload shows an empty chat
    browser.refresh()
    wait.until(lambda d: "smollm2-135m" in d.find_element(By.ID, "model-name").text)
    assert browser.find_elements(By.CSS_SELECTOR, ".msg") == []


def test_a_model_without_a_chat_template_gets_completion_mode(server_pool, browser) -> None:
    """A base model (no chat template: every chat request is a 400) is continued over
    /v1/completions instead, and the page says so."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    from conftest import STRICT_API_KEY

    server = server_pool.get("strict")         # the tiny SentencePiece llama: no chat template
    browser.get(f"{server.url}/")
    browser.execute_script(f"sessionStorage.setItem('loom.apiKey', '{STRICT_API_KEY}')")
    browser.refresh()
    wait = WebDriverWait(browser, 90, poll_frequency=0.05)
    wait.until(lambda d: "/v1/completions" in d.find_element(By.ID, "status").text)
    element = browser.find_element(By.ID, "max-tokens")
    element.clear()
    element.send_keys("8")
    browser.find_element(By.ID, "prompt").send_keys("the cat sat on")
    browser.find_element(By.ID, "send").click()
    answer = wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant"))[-1]
    wait.until(lambda d: answer.get_attribute("data-state") != "streaming", message="the answer never finished")
    assert answer.get_attribute("data-state") == "done", answer.text
    assert int(browser.find_element(By.ID, "stat-answer-tokens").text) >= 1

    # the next turn continues the text as typed: its leading spaces are kept, not trimmed away
    browser.execute_script("window.sent = []; const f = window.fetch; window.fetch = (u, o) => "
                           "{ if (o && o.body) window.sent.push(JSON.parse(o.body)); return f(u, o); };")
    browser.find_element(By.ID, "prompt").send_keys("  and then")
    browser.find_element(By.ID, "send").click()
    prompt = wait.until(lambda d: d.execute_script("return window.sent.length && window.sent[0].prompt"))
    assert prompt.startswith("the cat sat on") and prompt.endswith("  and then"), prompt
    last = wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, ".msg.assistant")) == 2 and
                      d.find_elements(By.CSS_SELECTOR, ".msg.assistant")[-1])
    wait.until(lambda d: last.get_attribute("data-state") != "streaming", message="the answer never finished")


def test_clear_settings_and_failed_turns(server_pool, browser) -> None:
    """Clear during an answer leaves nothing of that conversation for the next request; a
    setting out of its range is refused with a message (the text stays to send); a turn whose
    answer failed is marked unsent, left out, and offered again; Enter that confirms an input
    method's candidate sends nothing."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    server = server_pool.get("real")
    browser.get(f"{server.url}/")
    browser.execute_script("localStorage.clear()")   # no conversation kept from an earlier test
    browser.refresh()
    wait = WebDriverWait(browser, 90, poll_frequency=0.05)
    wait.until(lambda d: "smollm2-135m" in d.find_element(By.ID, "model-name").text)
    browser.execute_script("window.sent = []; const f = window.fetch; window.fetch = (u, o) => "
                           "{ if (o && o.body) window.sent.push(JSON.parse(o.body)); return f(u, o); };")

    def setting(field: str, value: str) -> None:
        element = browser.find_element(By.ID, field)
        element.clear()
        element.send_keys(value)

    def send(text: str) -> None:
        browser.find_element(By.ID, "prompt").send_keys(text)
        browser.find_element(By.ID, "send").click()

    setting("max-tokens", "400")
    send("Tell me a long story about a cat.")
    wait.until(lambda d: any(m.text.strip() for m in d.find_elements(By.CSS_SELECTOR, ".msg.assistant")))
    browser.find_element(By.ID, "clear").click()
    wait.until(lambda d: not d.find_element(By.ID, "stop").is_enabled())
    setting("max-tokens", "3")
    send("fresh start")
    wait.until(lambda d: len(d.execute_script("return window.sent")) == 2)
    assert browser.execute_script("return window.sent[1].messages") == [{"role": "user", "content": "fresh start"}]
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant")[-1].get_attribute("data-state") == "done")

    setting("max-tokens", "-5")
    send("not yet")
    assert "Max tokens" in browser.find_element(By.ID, "status").text
    assert browser.find_element(By.ID, "prompt").get_attribute("value") == "not yet"
    assert len(browser.execute_script("return window.sent")) == 2
    browser.find_element(By.ID, "prompt").clear()
    setting("max-tokens", "3")

    browser.execute_script(   # the next answer fails (a 503 from a server going away)
        "const g = window.fetch; window.fetch = (u, o) => { if (!o || !o.body) return g(u, o); "
        "window.fetch = g; window.sent.push(JSON.parse(o.body)); "
        "return Promise.resolve(new Response(JSON.stringify({error: {message: 'server going away'}}), "
        "{status: 503})); };")
    send("My name is Zed.")
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.user.unsent"))
    assert browser.find_element(By.ID, "prompt").get_attribute("value") == "My name is Zed."
    assert "server going away" in browser.find_element(By.ID, "status").text
    browser.find_element(By.ID, "prompt").clear()
    send("What is my name?")
    wait.until(lambda d: len(d.execute_script("return window.sent")) == 4)
    messages = browser.execute_script("return window.sent[3].messages")
    assert "My name is Zed." not in [m["content"] for m in messages] and messages[-1]["content"] == "What is my name?"
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant")[-1].get_attribute("data-state") == "done")

    # max tokens past the context's room: the server's 400 says how much fits, and the page asks for that
    setting("max-tokens", "8190")
    send("hi")
    wait.until(lambda d: "max tokens cut to" in d.find_elements(By.CSS_SELECTOR, ".msg.user")[-1].text)
    browser.find_element(By.ID, "stop").click()
    wait.until(lambda d: not d.find_element(By.ID, "stop").is_enabled())
    retried = browser.execute_script("return window.sent.slice(-2).map(b => b.max_tokens)")
    assert retried[0] == 8190 and 0 < retried[1] < 8190

    browser.find_element(By.ID, "prompt").send_keys("にほんご")
    browser.execute_script("document.getElementById('prompt').dispatchEvent(new KeyboardEvent('keydown', "
                           "{key: 'Enter', keyCode: 229, isComposing: true, bubbles: true}))")
    assert len(browser.execute_script("return window.sent")) == 6
