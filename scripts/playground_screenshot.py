"""docs/playground.png: the playground of `make serve` (the default model) replaying a request half way.

    python scripts/playground_screenshot.py [OUT.png] [PROMPT]

Starts the default model's server cold (benchmarks/server_process.py), drives Debian's Chromium through
playwright (the `test` extra) to send a docstring-like prompt with drafts every 2 steps, waits (bounded)
until it is done, moves the replay slider to the last canvas's middle draft and takes the screenshot.
"""
from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.server_process import ServerProcess  # noqa: E402
from deployments.args import default_model_dir  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
PROMPT = "This module provides"


def main(out: Path, prompt: str) -> None:
    from playwright.sync_api import sync_playwright

    log = Path(tempfile.mkdtemp(prefix="playground-")) / "server.log"
    with ServerProcess(Path(__file__).resolve().parent.parent, str(default_model_dir()), ["max_model_len=512"],
                       log) as server:
        async def ready() -> None:
            async with httpx.AsyncClient() as http:
                await server.wait_ready(http, 300, {"prompt": "Return", "max_tokens": 8})

        asyncio.run(ready())
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=["--headless", "--no-sandbox", "--disable-gpu"])
            page = browser.new_page(viewport={"width": 1200, "height": 620})
            page.goto(f"{server.base}/playground")
            page.wait_for_function("document.getElementById('model').textContent.length > 0", timeout=30_000)
            for selector, value in {"#prompt": prompt, "#steps": "16", "#max_tokens": "96", "#temperature": "0",
                                    "#draft_every": "2"}.items():
                page.fill(selector, value)
            page.select_option("#policy", "low_confidence")
            page.check("#ignore_eos")   # past an EOS the model writes the next docstring (trained so)
            page.click("#go")
            page.wait_for_function("['done', 'error'].includes(document.getElementById('status').dataset.state)",
                                   timeout=120_000)
            if page.inner_text("#status") != "done":
                raise SystemExit(f"the request did not finish: {page.inner_text('#status')}")
            events = page.evaluate("window.dllmPlayground.events.map(e => e.draft ? [e.draft.canvas, e.draft.step]"
                                   " : 'tokens')")
            drafts = [e for e in events if e != "tokens"]
            if not drafts:
                raise SystemExit(f"no drafts: {events}, text {page.inner_text('#text')!r}")
            last = max(c for c, _ in drafts)   # the last canvas's middle draft: earlier ones committed
            steps = [s for c, s in drafts if c == last]
            at = events.index([last, steps[len(steps) // 2]]) + 1
            page.eval_on_selector("#replay", "(el, at) => { el.value = at; el.dispatchEvent(new Event('input')); }",
                                  at)
            page.screenshot(path=str(out), full_page=True)
            browser.close()
    print(f"wrote {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("docs/playground.png"),
         sys.argv[2] if len(sys.argv) > 2 else PROMPT)
