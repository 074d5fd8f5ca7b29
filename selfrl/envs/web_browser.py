"""The web environment's real-browser backend: the same site, tasks and actions, in Debian's Chromium.

``[task] options = { browser = "playwright" }`` makes ``WebEnv.make_env`` return a
``PlaywrightBrowser`` instead of the text browser of ``selfrl.envs.web``. The agent sees the
same rendering and calls the same six tools; here they act on a real page:

    click(id)           locator.click()  (a link, or a button: the browser submits the form)
    type(id, text)      locator.fill(text)
    select(id, option)  locator.select_option(value=option)
    goto(path)          page.goto(site + path)
    back()              page.go_back()
    scroll(direction)   the text view moves by 25 lines, and the page by the mouse wheel

Success is still read from the site's database (``Browser.state``), never from the page.

**The observation** is built from the live DOM after the page's scripts ran (``_WALK``): a
walk in document order that yields the same elements as the text browser's HTML parser
(headings, text, links, text boxes, selects, buttons; hidden inputs and elements that are
not displayed are left out) and marks each interactive one with ``data-selfrl-id``, so an
action finds its element by id, as BrowserGym's ``bid`` attributes do. Playwright's
accessibility snapshot (``locator.aria_snapshot()``) was not used: it names a text box by
its accessible name, which is empty on this site (its labels are not tied to their inputs),
so "name" and "address" would look alike; it lists no form field names or option values;
and it gives no handle to act on one element among several of the same role and name. The
walk gives both backends the same text on the same page, ids included, so the prompts, the
worked example and the scripted agents carry over unchanged (``tests/test_web_browser.py``).

**One Chromium, one context per episode.** A single daemon thread owns Playwright's sync
API and the Chromium process (``_Driver``), so a rollout may call the tools from any thread
(Playwright's sync objects belong to the thread that made them). Each episode opens its own
``BrowserContext`` (own cookies and cache) on its own site session (own database) at its
first action, and closes it in ``close()``, which ``selfrl.rollout.agent`` calls after recording
the state; the Chromium process and Playwright's driver stop when no episode is open, so
none outlives a rollout. A browser dropped without ``close()`` is closed when it is
garbage-collected, and any left at exit are closed then.

**No call waits forever.** Playwright bounds actions and page loads (``ACTION_TIMEOUT_S``),
but not ``page.evaluate`` or a close, and a hung Chromium would hold the one thread every
episode's calls go through. A caller waits while that thread makes progress; once it has
been in one call for ``CALL_TIMEOUT_S`` (its own or an earlier caller's), the waiter gets a
``TimeoutError`` and this process's Chromium is killed, which ends the stuck call (as a
crash: the episodes open then get errors, the next one a new Chromium).

**The site only.** Every request of a context goes through a route that lets through only
the site's origin (``http://127.0.0.1:PORT``; another host, or another port on loopback, is
aborted and recorded in ``blocked``), web sockets through a second route with the same rule,
and Chromium is started
behind a dead proxy (``127.0.0.1:9``, loopback bypassed) for anything the routes miss. Chromium runs without its own sandbox (Playwright's default; it cannot start
as root with one); it only loads this site, and no model-written code runs in it.

Chromium is Debian's (``apt-get install -y chromium``), never one Playwright downloads: its
path is ``$SELFRL_CHROMIUM`` or ``chromium`` on ``PATH``.
"""

from __future__ import annotations

import atexit
import os
import queue
import re
import shutil
import signal
import threading
import time
import urllib.parse
import weakref
from collections.abc import Callable
from concurrent.futures import Future, wait
from typing import Any

from selfrl.envs.web_page import VIEW_LINES, Browser
from selfrl.envs.web_site import serve
from selfrl.core.tools import ToolError

__all__ = ["CHROMIUM_ENV", "INSTALL_HINT", "PlaywrightBrowser", "check_available", "chromium_path"]

CHROMIUM_ENV = "SELFRL_CHROMIUM"
INSTALL_HINT = "pip install 'selfrl[browser]' (the playwright package) and apt-get install -y chromium"
ACTION_TIMEOUT_S = 30.0  # one click, fill or page load (Playwright's default; 10 s timed out on a loaded machine)
CALL_TIMEOUT_S = 6 * ACTION_TIMEOUT_S  # one call on the driver thread (an action opens, acts, loads and reads)
POLL_S = 0.5  # how often a waiter looks at the driver thread
SCROLL_PX = 600
DEAD_PROXY = "http://127.0.0.1:9"  # nothing listens on the discard port: non-loopback traffic fails

# The page -> {"title", "elements"} walk (see the module docstring). Roles and fields match
# selfrl.envs.web._Tree: textbox/combobox carry "name" (the field's name) and "value" (live),
# combobox "options" (value, else text), link "href" (absolute, as the browser resolved it).
_WALK = r"""
() => {
  const out = [];
  let n = 0;
  const norm = s => s.replace(/\s+/g, ' ').trim();
  for (const e of document.querySelectorAll('[data-selfrl-id]')) e.removeAttribute('data-selfrl-id');
  const mark = (el, item) => { n += 1; el.setAttribute('data-selfrl-id', String(n)); item.id = n; out.push(item); };
  const shown = el => !el.checkVisibility || el.checkVisibility({visibilityProperty: true});
  const skip = new Set(['script', 'style', 'template', 'noscript', 'head', 'label', 'option']);
  const walk = node => {
    for (const c of node.childNodes) {
      if (c.nodeType === Node.TEXT_NODE) {
        const t = norm(c.data);
        if (t) out.push({role: 'text', name: t});
        continue;
      }
      if (c.nodeType !== Node.ELEMENT_NODE) continue;
      const tag = c.tagName.toLowerCase();
      if (skip.has(tag) || !shown(c)) continue;
      if (tag === 'input') {
        const kind = (c.getAttribute('type') || 'text').toLowerCase();
        if (kind === 'hidden') continue;
        if (['submit', 'button', 'reset'].includes(kind)) mark(c, {role: 'button', name: norm(c.value)});
        else mark(c, {role: 'textbox', name: c.name || '', value: c.value});
      } else if (tag === 'textarea') {
        mark(c, {role: 'textbox', name: c.name || '', value: c.value});
      } else if (tag === 'select') {
        const options = [...c.options].map(o => o.getAttribute('value') ?? norm(o.text));
        mark(c, {role: 'combobox', name: c.name || '', options, value: options.length ? c.value : null});
      } else if (tag === 'a') {
        mark(c, {role: 'link', name: norm(c.textContent), href: c.href});
      } else if (tag === 'button') {
        mark(c, {role: 'button', name: norm(c.textContent)});
      } else if (tag === 'h1' || tag === 'h2') {
        mark(c, {role: 'heading', name: norm(c.textContent)});
      } else {
        walk(c);
      }
    }
  };
  walk(document.body || document.documentElement);
  return {title: document.title, elements: out};
}
"""


def chromium_path() -> str:
    """The Chromium to drive: ``$SELFRL_CHROMIUM``, else ``chromium`` (or ``chromium-browser``) on ``PATH``.

    Raises:
        ValueError: none found, or ``$SELFRL_CHROMIUM`` is not an executable file (names the install command).
    """
    given = os.environ.get(CHROMIUM_ENV)
    if given:
        if not (os.path.isfile(given) and os.access(given, os.X_OK)):
            raise ValueError(f"${CHROMIUM_ENV} = {given!r} is not an executable file")
        return given
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        raise ValueError(f"the playwright web backend needs Debian's Chromium, and none is on PATH: {INSTALL_HINT} "
                         f"(or point ${CHROMIUM_ENV} at a Chromium)")
    return found


def check_available() -> None:
    """Raise unless both the playwright package and a Chromium are installed.

    Raises:
        ValueError: either is missing; the message names ``INSTALL_HINT``.
    """
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError as e:
        raise ValueError(f"the playwright web backend needs the playwright package ({e}): {INSTALL_HINT}") from e
    chromium_path()


class _Driver:
    """A daemon thread that owns Playwright and the shared Chromium; runs every browser call.

    ``run(fn)`` runs ``fn()`` on that thread and returns its result (or raises its exception).
    ``open_context()`` starts Playwright and Chromium on the first open episode;
    ``close_context()`` stops both when the last one closes.
    """

    def __init__(self):
        self._jobs: queue.Queue[tuple[Callable[[], Any], Future]] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._pw = None
        self.browser = None
        self.open = 0  # contexts open now
        self.busy: tuple[Future, float] | None = None  # the call running now and when it started (monotonic s)
        self._killed_for: Future | None = None  # the stuck call whose Chromium was killed

    def _loop(self) -> None:
        while True:
            fn, fut = self._jobs.get()
            if fut.set_running_or_notify_cancel():
                self.busy = (fut, time.monotonic())
                try:
                    fut.set_result(fn())
                except BaseException as e:  # handed to the caller, who re-raises it
                    fut.set_exception(e)
                finally:
                    self.busy = None
            del fn, fut  # an idle thread must not keep the last job's browser alive (its finalizer)

    def submit(self, fn: Callable[[], Any]) -> Future:
        with self._lock:
            if self._thread is None:
                # not joined at exit (selfrl.core.threads_at_exit): Playwright only, no torch, no store
                self._thread = threading.Thread(target=self._loop, name="selfrl-chromium", daemon=True)
                self._thread.start()
        fut: Future = Future()
        self._jobs.put((fn, fut))
        return fut

    def run(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` on the driver thread: its result, or its exception.

        Raises:
            TimeoutError: the driver thread has been in one call (``fn``, or one queued before
                it) for ``CALL_TIMEOUT_S``; ``fn`` does not run later, and Chromium is killed.
        """
        if threading.current_thread() is self._thread:
            return fn()
        fut = self.submit(fn)
        while not wait([fut], timeout=POLL_S).done:
            busy = self.busy
            if busy is None or time.monotonic() - busy[1] < CALL_TIMEOUT_S:
                continue
            if busy[0] is fut or fut.cancel():  # else it has just started, the stuck call over: wait on
                self._unstick(busy[0])
                raise TimeoutError(f"the browser did not answer: one call has run for over {CALL_TIMEOUT_S:g} s "
                                   f"({'this one' if busy[0] is fut else 'an earlier one'}); Chromium was killed")
        return fut.result()

    def _unstick(self, stuck: Future) -> None:
        """Kill this process's Chromium once per stuck call: the call then fails as after a crash."""
        if self._killed_for is stuck:
            return
        self._killed_for = stuck
        for pid in _chromium_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:  # gone already
                pass

    # -- on the driver thread ---------------------------------------------------------------

    def open_context(self, origin: str, blocked: list[str]):
        """A new context whose requests reach only ``origin`` (``http://127.0.0.1:PORT``); the others
        are aborted and their URLs appended to ``blocked``."""
        from playwright.sync_api import Error, sync_playwright

        for attempt in range(2):
            if self.browser is not None and not self.browser.is_connected():  # it crashed, or was killed
                self.stop()
            if self.browser is None:
                self._pw = sync_playwright().start()
                try:
                    self.browser = self._pw.chromium.launch(
                        executable_path=chromium_path(), headless=True,
                        proxy={"server": DEAD_PROXY, "bypass": "127.0.0.1"},
                        args=["--disable-features=BackForwardCache", "--no-first-run", "--disable-extensions"])
                except BaseException:
                    self._pw.stop()
                    self._pw = None
                    raise
            try:
                ctx = self.browser.new_context(service_workers="block")
                break
            except Error:  # Chromium died before Playwright saw it go (is_connected was still true): once more
                if attempt:
                    raise
                self.stop()
        self.open += 1
        ctx.set_default_timeout(ACTION_TIMEOUT_S * 1000)
        ctx.set_default_navigation_timeout(ACTION_TIMEOUT_S * 1000)

        def only_the_site(route, request):
            u = urllib.parse.urlsplit(request.url)
            if f"{u.scheme}://{u.netloc}" == origin:
                route.continue_()
            else:
                blocked.append(request.url)
                route.abort("blockedbyclient")

        ctx.route("**/*", only_the_site)

        def sockets_only_to_the_site(ws):  # web sockets bypass routes; they have their own
            u = urllib.parse.urlsplit(ws.url)
            if f"{'http' if u.scheme == 'ws' else u.scheme}://{u.netloc}" == origin:
                ws.connect_to_server()
            else:
                blocked.append(ws.url)
                ws.close()

        ctx.route_web_socket(re.compile(".*"), sockets_only_to_the_site)
        return ctx

    def close_context(self, ctx) -> None:
        from playwright.sync_api import Error

        try:
            ctx.close()
        except Error:  # its browser is gone already (crashed, or stopped at exit): nothing left to close
            pass
        self.open = max(self.open - 1, 0)
        if self.open == 0 and self.browser is not None:
            self.stop()

    def stop(self) -> None:
        """Close Chromium and Playwright's driver (also with contexts still open: at exit, or after a crash)."""
        from playwright.sync_api import Error

        browser, pw, self.browser, self._pw = self.browser, self._pw, None, None
        try:
            if browser is not None:
                browser.close()
        except Error:  # it had crashed
            pass
        finally:
            if pw is not None:
                pw.stop()


def _chromium_pids() -> list[int]:
    """Process ids of this process's descendants whose name has ``chrom`` in it (from ``/proc``;
    none where there is no ``/proc``)."""
    children: dict[int, list[int]] = {}
    names: dict[int, str] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:  # it exited meanwhile
            continue
        name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        names[int(entry)] = name
        children.setdefault(int(rest[1]), []).append(int(entry))
    out, todo = [], [os.getpid()]
    while todo:
        for child in children.get(todo.pop(), []):
            todo.append(child)
            if "chrom" in names[child]:
                out.append(child)
    return out


_DRIVER = _Driver()


@atexit.register
def _stop_at_exit() -> None:
    if _DRIVER.browser is not None:
        _DRIVER.submit(_DRIVER.stop).result(timeout=30)


class _Episode:
    """One episode's context and page, on the driver thread (kept apart from ``PlaywrightBrowser``
    and never referring to it, so that a dropped browser is collected and its finalizer runs)."""

    def __init__(self, origin: str, base: str, start: str = "/"):
        self.origin, self.base, self.start = origin, base, start
        self.ctx = None
        self.page = None
        self.closed = False
        self.blocked: list[str] = []  # URLs the route refused

    def act(self, what: str, fn: Callable[[Any], None]) -> tuple[dict[str, Any], str | None]:
        """Open the page at the first call, run ``fn(page)``, wait for the page to load and read it.

        Returns:
            ``(page, error)``: ``page`` is ``{"path", "title", "elements"}`` as shown after the action;
            ``error`` the message for the model when the action failed (a Playwright error, or a
            ``ToolError`` raised by ``fn``), else None.

        Raises:
            ToolError: the episode is closed.
        """
        from playwright.sync_api import Error

        if self.page is None:
            if self.closed:
                raise ToolError("this browser is closed")
            self.ctx = _DRIVER.open_context(self.origin, self.blocked)
            self.page = self.ctx.new_page()
            self.page.goto(self.base + self.start)
        error = None
        try:
            fn(self.page)
            self.page.wait_for_load_state()
        except ToolError as e:
            error = str(e)
        except Error as e:
            error = f"the browser could not {what}: {str(e).splitlines()[0]}"
        tree = self.page.evaluate(_WALK)
        url = self.page.url
        path = (url[len(self.base):] or "/") if url.startswith(self.base) else url
        return {"path": path, "title": tree["title"], "elements": tree["elements"]}, error

    def release(self) -> None:
        self.closed = True
        if self.ctx is not None:
            ctx, self.ctx, self.page = self.ctx, None, None
            _DRIVER.close_context(ctx)


def _release_later(episode: _Episode) -> None:  # a finalizer: may run on any thread, must not wait
    if episode.ctx is not None:
        _DRIVER.submit(episode.release)


class PlaywrightBrowser(Browser):
    """One episode's page in Chromium on its own site session; the tools of ``Browser``, acted out.

    Attributes:
        blocked: URLs of requests refused because they left the site (``origin``, on ``127.0.0.1``).
    """

    def __init__(self, start: str = "/", setup: dict[str, Any] | None = None, page_ids: bool = False):
        check_available()
        self.site, url = serve()
        self.sid = self.site.new_session()
        self.site.prepare(self.sid, **(setup or {}))
        self.origin, self.base = url, f"{url}/s/{self.sid}"
        self.history: list[str] = []
        self.stopped, self.page_ids = False, page_ids
        self.path, self.title, self.elements, self.offset = start, "", [], 0
        self._episode = _Episode(self.origin, self.base, start)
        self._finalizer = weakref.finalize(self, _release_later, self._episode)
        self.tools = self._make_tools()

    @property
    def blocked(self) -> list[str]:
        return self._episode.blocked

    def _do(self, what: str, fn: Callable[[Any], None]) -> str:
        """Run ``fn(page)`` in the browser (``_Episode.act``; ``fn`` must not refer to ``self``) and show
        the page it leaves; returns the observation.

        Raises:
            ToolError: the action failed (the page shown is then the one it left), or the browser is closed.
        """
        episode = self._episode
        page, error = _DRIVER.run(lambda: episode.act(what, fn))
        self.path, self.title, self.elements, self.offset = page["path"], page["title"], page["elements"], 0
        if error is not None:
            raise ToolError(error)
        return self.observation()

    def _navigate(self, what: str, fn: Callable[[Any], None]) -> str:
        before = self.path
        out = self._do(what, fn)
        self.history.append(before)
        return out

    # -- tools ------------------------------------------------------------------------------------

    def click(self, id: int) -> str:
        el = self._element(id, ("link", "button"))
        if el["role"] == "link" and not (el["href"] or "").startswith(self.base):
            raise ToolError("that link leaves the site")
        return self._navigate(f"click {id}", lambda p: p.locator(f'[data-selfrl-id="{id}"]').click())

    def type(self, id: int, text: str) -> str:
        self._element(id, ("textbox",))
        return self._do(f"type into {id}", lambda p: p.locator(f'[data-selfrl-id="{id}"]').fill(str(text)))

    def select(self, id: int, option: str) -> str:
        el = self._element(id, ("combobox",))
        if str(option) not in el["options"]:
            raise ToolError(f"no option {option!r}; options: {', '.join(el['options'])}")
        return self._do(f"select in {id}",
                        lambda p: p.locator(f'[data-selfrl-id="{id}"]').select_option(value=str(option)))

    def goto(self, path: str) -> str:
        if not isinstance(path, str) or not path.startswith("/") or "//" in path or ".." in path:
            raise ToolError("give a path on this site, e.g. /products")
        url = self.base + path
        return self._navigate(f"open {path}", lambda p: p.goto(url))

    def back(self) -> str:
        base = self.base

        def go_back(page) -> None:
            page.go_back()
            if not page.url.startswith(base):  # before the site: the blank page a new tab opens on
                page.go_forward()
                raise ToolError("no previous page")

        out = self._do("go back", go_back)
        if self.history:
            self.history.pop()
        return out

    def scroll(self, direction: str) -> str:
        if direction not in ("up", "down"):
            raise ToolError("direction is up or down")
        offset = self.offset
        self._do("scroll", lambda p: p.mouse.wheel(0, SCROLL_PX if direction == "down" else -SCROLL_PX))
        step = VIEW_LINES - 5  # the text view, as Browser.scroll (the read above reset it)
        self.offset = max(0, min(offset + (step if direction == "down" else -step), max(len(self.elements) - 1, 0)))
        return self.observation()

    # -- lifecycle ----------------------------------------------------------------------------------

    def observation(self) -> str:
        """As ``Browser.observation``; the page is opened on the first call."""
        if self._episode.page is None and not self._episode.closed:
            self._do("open the site", lambda p: None)
        return super().observation()

    def close(self) -> None:
        """Close this episode's context (and Chromium, if it was the last open one) and end its
        site session. Idempotent."""
        if self._finalizer.detach() is not None:
            _DRIVER.run(self._episode.release)
        self.site.end_session(self.sid)
