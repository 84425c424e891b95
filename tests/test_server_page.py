"""The live page in a real headless Chromium (system packages chromium + chromium-driver), driven
by Selenium: it loads, streams an answer and marks the accepted draft tokens."""
import json
import re
import shutil

import httpx
import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
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
