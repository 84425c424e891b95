"""The live page in a real headless Chromium (system packages chromium + chromium-driver), driven
by Selenium: it loads, streams an answer, marks the accepted draft tokens and shows every running stream."""
import json
import re
import shutil
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select, WebDriverWait


pytestmark = pytest.mark.slow  # a real server with the default model

# Prompt lookup copies the sentence from the prompt, so drafts are accepted.
PROMPT = "Repeat exactly: the red fox jumps over the lazy dog, the red fox jumps over the lazy dog."
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def browser():
    options = webdriver.ChromeOptions()
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(flag)
    driver_path = shutil.which("chromedriver") or "/usr/bin/chromedriver"
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    yield driver
    driver.quit()


def streamed_answer(default_server) -> tuple[str, list[str]]:
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": MAX_TOKENS, "stream": True,
            "specee": {"spec_method": "prompt-lookup"}}
    text, sources = "", []
    with httpx.stream("POST", default_server.url + "/v1/chat/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line.removeprefix("data: "))
                text += chunk["choices"][0]["delta"]["content"]
                sources += [token["source"] for token in chunk["specee"]["tokens"]]
    return text, sources


def test_the_page_streams_an_answer_and_marks_draft_tokens(default_server, browser):
    browser.get(default_server.url + "/")
    assert browser.title == "specee live"
    Select(browser.find_element(By.ID, "mode")).select_by_visible_text("prompt lookup")
    tokens = browser.find_element(By.ID, "max-tokens")
    tokens.clear()
    tokens.send_keys(str(MAX_TOKENS))
    browser.find_element(By.ID, "prompt").send_keys(PROMPT)
    browser.find_element(By.ID, "send").click()
    WebDriverWait(browser, 120).until(lambda b: b.find_element(By.ID, "stats").text.startswith("done"))
    assert browser.find_element(By.ID, "error").text == ""
    answer = browser.find_element(By.CSS_SELECTOR, ".answer")
    drafts = answer.find_elements(By.CSS_SELECTOR, ".tok.draft")
    targets = answer.find_elements(By.CSS_SELECTOR, ".tok.target")
    assert drafts and targets
    text, sources = streamed_answer(default_server)  # the same request through the API: the page shows what it says
    assert browser.execute_script("return arguments[0].textContent", answer) == text
    assert [span.get_attribute("class") for span in answer.find_elements(By.CSS_SELECTOR, ".tok")] == \
        [f"tok {source}" for source in sources]
    per_pass = float(re.search(r"([\d.]+) tokens per pass", browser.find_element(By.ID, "stats").text).group(1))
    assert per_pass > 1  # accepted drafts: more than one token per target pass


def test_the_page_shows_every_running_stream(default_server, browser):
    browser.get(default_server.url + "/")
    bodies = [{"messages": [{"role": "user", "content": content}], "max_tokens": 200, "stream": True, "specee": spec}
              for content, spec in (("Write a long story about a dragon who learns to cook.", {"spec_method": "none"}),
                                    ("Count from 1 to 100, separated by commas.", {"spec_method": "prompt-lookup"}))]

    def run(body):
        with httpx.stream("POST", default_server.url + "/v1/chat/completions", json=body, timeout=120) as response:
            return sum(1 for _ in response.iter_lines())

    def rows(b):
        return [[td.text for td in tr.find_elements(By.TAG_NAME, "td")] for tr in b.find_elements(By.CSS_SELECTOR, "tr.slot")]

    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(run, body) for body in bodies]
        # The page redraws its rows as tokens arrive: a row read mid-redraw is stale, read again.
        wait = WebDriverWait(browser, 60, ignored_exceptions=(StaleElementReferenceException,))
        shown = wait.until(lambda b: (found := rows(b)) and len(found) == 2 and all(int(row[3]) > 0 for row in found)
                           and found)
        assert {row[1] for row in shown} == {"dense", "prompt-lookup"} and {row[2] for row in shown} == {"decoding"}
        assert browser.find_element(By.ID, "slots-summary").text.startswith("2 of ")
        assert all(future.result() > 0 for future in futures)
    WebDriverWait(browser, 10, ignored_exceptions=(StaleElementReferenceException,)).until(lambda b: rows(b) == [])
    assert browser.find_element(By.ID, "slots-summary").text.startswith("0 of ")
