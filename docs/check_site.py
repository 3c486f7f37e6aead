"""Open the built book in headless Chromium and check that it works offline.

Run by ``make docs-check`` (part of ``make test``). It builds the site
strictly into a temporary directory, serves it on 127.0.0.1 from a thread, and
drives Debian's ``/usr/bin/chromium`` over the DevTools protocol (on a pipe:
no port, no extra package). For every page it checks that:

- the page rendered: its title and a phrase from its text are in the DOM;
- every mermaid diagram drew: Material replaces each ``pre.mermaid`` with a
  ``div.mermaid`` whose (closed) shadow root holds the ``<svg>``; the DOM is
  read with ``pierce`` so closed shadow roots are visible;
- no request left localhost: every URL the page asked for (Network domain
  events) is on 127.0.0.1 or data:, and the resolver maps every other host to
  nothing anyway (``--host-resolver-rules``).

Exit status 0 when all pages pass.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import http.server
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any
from urllib.parse import urlparse

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")

# page -> (a phrase its text must contain, number of mermaid diagrams it holds)
PAGES: dict[str, tuple[str, int]] = {
    "": ("tracevllm", 0),
    "chapters/map/": ("two processes", 1),
    "chapters/entry/": ("ROUTER", 1),
    "chapters/engine-core/": ("run_busy_loop", 1),
    "chapters/scheduling/": ("token budget", 0),
    "chapters/kv-cache/": ("prefix", 0),
    "chapters/input-preparation/": ("slot_mapping", 0),
    "chapters/model-execution/": ("logits_indices", 0),
    "chapters/paged-attention/": ("block_table", 0),
    "chapters/sampling/": ("stop string", 0),
    "chapters/tracing/": ("spans.jsonl", 0),
    "chapters/pytorch-to-triton/": ("online softmax", 0),
    "reference/vllm-map/": ("scheduler.py", 0),
    "reference/source/tracevllm/core/sched/scheduler.py/": ("def schedule", 0),
}


class Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


class DevTools:
    """Chrome DevTools protocol over --remote-debugging-pipe (fds 3 and 4)."""

    def __init__(self, user_data_dir: str) -> None:
        to_chrome_r, self._to_chrome = os.pipe()
        self._from_chrome, from_chrome_w = os.pipe()
        # The child must see the pipes as fds 3 (its input) and 4 (its output).
        # Moved out of the way first, in case a pipe end already is fd 3 or 4.

        def child_fds() -> None:
            r = fcntl.fcntl(to_chrome_r, fcntl.F_DUPFD, 10)
            w = fcntl.fcntl(from_chrome_w, fcntl.F_DUPFD, 10)
            os.dup2(r, 3)
            os.dup2(w, 4)

        self.proc = subprocess.Popen(
            [
                CHROMIUM,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--disable-extensions",
                "--disable-default-apps",
                "--no-first-run",
                "--no-default-browser-check",
                "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
                f"--user-data-dir={user_data_dir}",
                "--remote-debugging-pipe",
                "about:blank",
            ],
            preexec_fn=child_fds,
            close_fds=False,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._buf = b""
        self._id = 0
        self.events: list[dict[str, Any]] = []

    def _read_message(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while b"\0" not in self._buf:
            if time.monotonic() > deadline:
                raise TimeoutError("no answer from Chromium")
            chunk = os.read(self._from_chrome, 1 << 16)
            if not chunk:
                raise RuntimeError("Chromium closed the DevTools pipe")
            self._buf += chunk
        raw, self._buf = self._buf.split(b"\0", 1)
        return json.loads(raw)

    def send(
        self, method: str, params: dict[str, Any] | None = None, session: str | None = None
    ) -> dict[str, Any]:
        self._id += 1
        msg: dict[str, Any] = {"id": self._id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._to_chrome, json.dumps(msg).encode() + b"\0")
        while True:
            reply = self._read_message(30)
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_for(self, method: str, session: str, timeout: float = 15) -> None:
        deadline = time.monotonic() + timeout
        while True:
            for i, ev in enumerate(self.events):
                if ev.get("method") == method and ev.get("sessionId") == session:
                    del self.events[i]
                    return
            self.events.append(self._read_message(max(deadline - time.monotonic(), 0.1)))

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.send("Browser.close")
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _svg_in_mermaid(node: dict[str, Any], inside: bool = False) -> int:
    """Number of mermaid hosts whose subtree (shadow roots included) holds an <svg>."""
    classes = ""
    attrs = node.get("attributes") or []
    for k, v in zip(attrs[::2], attrs[1::2]):
        if k == "class":
            classes = v
    is_host = node.get("nodeName") == "DIV" and "mermaid" in classes.split()
    kids = list(node.get("children") or []) + list(node.get("shadowRoots") or [])
    if is_host:
        return int(any(_has_svg(k) for k in kids))
    return sum(_svg_in_mermaid(k) for k in kids)


def _has_svg(node: dict[str, Any]) -> bool:
    if node.get("nodeName", "").lower() == "svg":
        return True
    kids = list(node.get("children") or []) + list(node.get("shadowRoots") or [])
    return any(_has_svg(k) for k in kids)


def check_page(dt: DevTools, base: str, path: str, phrase: str, diagrams: int) -> list[str]:
    target = dt.send("Target.createTarget", {"url": "about:blank"})["targetId"]
    session = dt.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
    for domain in ("Page", "Network", "Runtime", "DOM"):
        dt.send(f"{domain}.enable", session=session)
    dt.events.clear()
    dt.send("Page.navigate", {"url": base + path}, session=session)
    dt.wait_for("Page.loadEventFired", session)
    problems: list[str] = []
    # Mermaid draws after load, asynchronously: poll for the diagrams.
    deadline = time.monotonic() + 15
    drawn = 0
    while True:
        doc = dt.send("DOM.getDocument", {"depth": -1, "pierce": True}, session=session)
        drawn = _svg_in_mermaid(doc["root"])
        if drawn >= diagrams or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    if drawn < diagrams:
        problems.append(f"{drawn}/{diagrams} mermaid diagrams drew")
    text = dt.send(
        "Runtime.evaluate",
        {"expression": "document.body.innerText", "returnByValue": True},
        session=session,
    )["result"].get("value", "")
    if phrase.lower() not in text.lower():
        problems.append(f"text {phrase!r} not on the page")
    for ev in dt.events:
        if ev.get("method") != "Network.requestWillBeSent" or ev.get("sessionId") != session:
            continue
        url = ev["params"]["request"]["url"]
        parsed = urlparse(url)
        if parsed.scheme in ("data", "blob", "about"):
            continue
        if parsed.hostname != "127.0.0.1":
            problems.append(f"request left localhost: {url}")
    dt.send("Target.closeTarget", {"targetId": target})
    return problems


def main() -> int:
    if not os.path.exists(CHROMIUM):
        print(f"{CHROMIUM} not found: run `make setup-browser` (apt-get install chromium)")
        return 2
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        site = os.path.join(tmp, "site")
        subprocess.run(
            [os.path.join(ROOT, ".venv", "bin", "mkdocs"), "build", "--strict", "-q", "-d", site],
            cwd=ROOT,
            check=True,
        )
        print(f"mkdocs build --strict: {time.monotonic() - t0:.1f} s")
        handler = functools.partial(Quiet, directory=site)
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        base = f"http://127.0.0.1:{server.server_address[1]}/"
        dt = DevTools(os.path.join(tmp, "chromium-profile"))
        failures = 0
        try:
            for path, (phrase, diagrams) in PAGES.items():
                problems = check_page(dt, base, path, phrase, diagrams)
                status = "ok" if not problems else "FAIL: " + "; ".join(problems)
                print(f"  /{path:<50} {status}")
                failures += bool(problems)
        finally:
            dt.close()
            server.shutdown()
    print(f"{len(PAGES) - failures}/{len(PAGES)} pages ok in {time.monotonic() - t0:.1f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
