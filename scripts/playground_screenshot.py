"""A screenshot of the gateway's playground page (`/`) after a few requests: docs/playground.png.

    .venv/bin/python scripts/playground_screenshot.py [--model DIR] [--out docs/playground.png]

Runs the same stack as tests/e2e/test_playground.py (a real gateway in front of the fake scheduler,
which replays a scripted reply token by token; the model directory is only read for its
tokenizer), drives headless Chromium (Debian's `chromium` + `chromium-driver`) through a few
streamed requests so the status view's plot has a shape, and saves the window.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "e2e")]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from test_playground import (  # noqa: E402 (after the path set-up)
    fill,
    find_browser,
    model_listed,
    playground_stack,
    start_browser,
    text_of,
    wait_for,
)

from services.common.config import default_model_path  # noqa: E402

PROMPT = "What is the capital of France, and what is it known for?"
SYSTEM = "You are a concise assistant."
REPLY = ("The capital of France is Paris. It lies on the Seine in the north of the country and is known for "
         "the Eiffel Tower, the Louvre, its cafés and its food, and as a centre of art, fashion and science "
         "for centuries.")


def send(driver, max_tokens: int) -> None:
    fill(driver, "max-tokens", str(max_tokens))
    driver.find_element("id", "send").click()
    wait_for(lambda: text_of(driver, "chat-state").startswith("finished"), timeout_s=60, what="the reply")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=default_model_path(), help="HF model directory (its tokenizer)")
    parser.add_argument("--out", default=str(ROOT / "docs" / "playground.png"))
    args = parser.parse_args()
    if find_browser() is None:
        print("chromium / chromedriver not found (apt-get install chromium chromium-driver)", file=sys.stderr)
        return 1
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with playground_stack(args.model, reply=REPLY, step_delay_s=0.03) as stack:
        driver = start_browser(1280, 880)
        try:
            driver.get(f"{stack.gateway.url}/?poll_ms=500&window_s=30")
            wait_for(lambda: model_listed(driver), what="the model list")
            fill(driver, "system-prompt", SYSTEM)
            fill(driver, "temperature", "0.7")
            fill(driver, "prompt", PROMPT)
            for max_tokens in (24, 48):  # earlier requests: the plot's first bumps
                send(driver, max_tokens)
                time.sleep(2)
            send(driver, 256)
            time.sleep(1.2)  # a poll or two after the end: the plot comes back down
            driver.save_screenshot(str(out))
        finally:
            driver.quit()
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
