"""The web environment's page model: a text browser over the local site's HTTP pages.

Each trajectory gets its own :class:`Browser` on its own site session
(``selfrl.envs.web_site``). A page is parsed into elements (:class:`_Tree`: headings,
text, links, text boxes, selects, buttons, with their forms) and rendered one element per
line, the interactive ones with ids (:func:`render`); the view shows ``VIEW_LINES`` lines.
The seven actions (``click``, ``type``, ``select``, ``goto``, ``back``, ``scroll``, ``stop``)
are the browser's tools; under a grammar, :meth:`Browser.turn_tools` narrows them to the page
shown. The environment around it (tasks, scoring, detectors, scripted agents) is
:mod:`selfrl.envs.web`; a real Chromium behind the same tools is :mod:`selfrl.envs.web_browser`.
"""

from __future__ import annotations

import re
import urllib.error
import urllib.parse
import urllib.request
from html.parser import HTMLParser
from typing import Any

from selfrl.envs.web_site import serve
from selfrl.core.tools import Tool, ToolError

__all__ = ["VIEW_LINES", "Browser", "render"]

VIEW_LINES = 30
HTTP_TIMEOUT_S = 10.0
TOP_PAGES = ("/", "/products", "/cart", "/orders", "/account")  # goto's paths under a page grammar
MAX_TYPED = 60  # characters a text box takes under a page grammar
_SITE_PATH = re.compile(r"^(/[A-Za-z0-9_-]+)*/?$")  # goto's path part: plain segments (no '..', '%2e', '//')


class _Tree(HTMLParser):
    """HTML -> elements: headings, text, links, text boxes, selects, buttons (with their forms)."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.elements: list[dict[str, Any]] = []
        self.forms: list[dict[str, Any]] = []
        self._form: dict[str, Any] | None = None
        self._open: dict[str, Any] | None = None  # a, button, h1, title, option, label, p/li text
        self._select: dict[str, Any] | None = None
        self.title = ""

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "form":
            self._form = {"action": a.get("action", ""), "method": a.get("method", "get").lower(), "fields": []}
            self.forms.append(self._form)
        elif tag == "input":
            kind = a.get("type", "text")
            el = {"role": "hidden" if kind == "hidden" else "textbox", "name": a.get("name", ""),
                  "value": a.get("value", ""), "form": self._form}
            if self._form is not None:
                self._form["fields"].append(el)
            if kind != "hidden":
                self.elements.append(el)
        elif tag == "select":
            self._select = {"role": "combobox", "name": a.get("name", ""), "options": [], "value": None,
                            "form": self._form}
            if self._form is not None:
                self._form["fields"].append(self._select)
            self.elements.append(self._select)
        elif tag in ("a", "button", "h1", "h2", "title", "option", "label", "p", "li"):
            self._open = {"tag": tag, "href": a.get("href"), "value": a.get("value"), "text": ""}

    def handle_data(self, data):
        if self._open is not None:
            self._open["text"] += data
        elif data.strip():
            self.elements.append({"role": "text", "name": data.strip()})

    def handle_endtag(self, tag):
        o = self._open
        if tag == "form":
            self._form = None
        elif tag == "select":
            self._select = None
        elif o is not None and tag == o["tag"]:
            text = " ".join(o["text"].split())
            self._open = None
            if tag == "title":
                self.title = text
            elif tag == "option" and self._select is not None:
                self._select["options"].append(o["value"] or text)
                if self._select["value"] is None:
                    self._select["value"] = o["value"] or text
            elif tag == "a":
                self.elements.append({"role": "link", "name": text, "href": o["href"]})
            elif tag == "button":
                self.elements.append({"role": "button", "name": text, "form": self._form})
            elif tag in ("h1", "h2"):
                self.elements.append({"role": "heading", "name": text})
            elif text and tag != "label":
                self.elements.append({"role": "text", "name": text})


def render(elements: list[dict[str, Any]]) -> list[str]:
    """One line per element; interactive ones carry their id (``el["id"]``).

    >>> render([{"role": "link", "name": "Cart", "id": 1}, {"role": "text", "name": "$8.99"}])
    ["[1] link 'Cart'", "    text '$8.99'"]
    """
    out = []
    for el in elements:
        if el["role"] == "text":
            out.append(f"    text {el['name']!r}")
        elif el["role"] == "heading":
            out.append(f"[{el['id']}] heading {el['name']!r}")
        elif el["role"] == "combobox":
            out.append(f"[{el['id']}] combobox {el['name']!r} value={el['value']!r} options: "
                       + ", ".join(el["options"]))
        elif el["role"] == "textbox":
            out.append(f"[{el['id']}] textbox {el['name']!r} value={el['value']!r}")
        else:
            out.append(f"[{el['id']}] {el['role']} {el['name']!r}")
    return out


class Browser:
    """One trajectory's text browser on its own site session, and the tools that drive it.

    ``start``: the path the episode starts on; ``setup``: the session's start state
    (``Site.prepare``'s ``cart`` and ``order``); ``page_ids``: under a grammar
    (``rollout.constrain``), offer only the ids of the page shown (``turn_tools``).
    """

    demonstration: list[dict[str, str]] | None = None  # set below

    def __init__(self, start: str = "/", setup: dict[str, Any] | None = None, page_ids: bool = False):
        self.site, url = serve()
        self.sid = self.site.new_session()
        self.site.prepare(self.sid, **(setup or {}))
        self.base = f"{url}/s/{self.sid}"
        self.history: list[str] = []
        self.offset = 0
        self.stopped = False
        self.page_ids = page_ids
        self._load(start, record=False)
        self.tools = self._make_tools()

    def _make_tools(self) -> list[Tool]:
        """The seven actions, bound to this browser's methods (a backend overrides the methods)."""
        return [
            Tool("click", "click the element with this id (a link or a button)",
                 {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]},
                 self.click, {"id": 2}),
            Tool("type", "type text into the text box with this id (replacing its value)",
                 {"type": "object", "properties": {"id": {"type": "integer"}, "text": {"type": "string"}},
                  "required": ["id", "text"]}, self.type, {"id": 3, "text": "mug"}),
            Tool("select", "choose an option of the select box with this id",
                 {"type": "object", "properties": {"id": {"type": "integer"}, "option": {"type": "string"}},
                  "required": ["id", "option"]}, self.select, {"id": 4, "option": "2"}),
            Tool("goto", "open a page of the site by its path, e.g. /cart",
                 {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
                 self.goto, {"path": "/products"}),
            Tool("back", "go back to the previous page", {"type": "object", "properties": {}}, self.back, {}),
            Tool("scroll", "scroll the page: up or down",
                 {"type": "object", "properties": {"direction": {"type": "string", "enum": ["up", "down"]}},
                  "required": ["direction"]}, self.scroll, {"direction": "down"}),
            Tool("stop", "end the episode: call it when the task is done", {"type": "object", "properties": {}},
                 self.stop, {}),
        ]

    # -- page loading -------------------------------------------------------------------------

    def _fetch(self, url: str, data: dict[str, str] | None = None) -> tuple[str, str]:
        body = urllib.parse.urlencode(data).encode() if data is not None else None
        try:
            with urllib.request.urlopen(urllib.request.Request(url, data=body), timeout=HTTP_TIMEOUT_S) as r:
                return r.geturl(), r.read().decode()
        except urllib.error.HTTPError as e:
            return url, e.read().decode()

    def _show(self, final_url: str, text: str) -> None:
        tree = _Tree()
        tree.feed(text)
        n = 0
        for el in tree.elements:
            if el["role"] != "text":
                n += 1
                el["id"] = n
        self.path = final_url[len(self.base):] or "/"
        self.title, self.elements, self.offset = tree.title, tree.elements, 0

    def _load(self, path: str, record: bool = True, data: dict[str, str] | None = None) -> None:
        if record:
            self.history.append(self.path)
        self._show(*self._fetch(self.base + path, data))

    def observation(self) -> str:
        """The current page as text: its path and title, then the visible lines of the tree."""
        lines = render(self.elements)
        view = lines[self.offset:self.offset + VIEW_LINES]
        more = f"\n[{len(lines) - self.offset - len(view)} more lines: scroll down]" \
            if self.offset + len(view) < len(lines) else ""
        return f"page: {self.path}  ({self.title})\n" + "\n".join(view) + more

    def _element(self, id: int, roles: tuple[str, ...]) -> dict[str, Any]:
        el = next((e for e in self.elements if e.get("id") == id), None)
        if el is None or el["role"] not in roles:
            raise ToolError(f"no {' or '.join(roles)} with id {id} on this page")
        return el

    # -- tools ----------------------------------------------------------------------------------

    def click(self, id: int) -> str:
        el = self._element(id, ("link", "button"))
        if el["role"] == "link":
            href = el["href"] or ""
            if not href.startswith(f"/s/{self.sid}"):
                raise ToolError("that link leaves the site")
            self._load(href[len(f"/s/{self.sid}"):] or "/")
        else:
            form = el["form"]
            if form is None:
                raise ToolError("this button does nothing")
            fields = {f["name"]: f["value"] or "" for f in form["fields"] if f["name"]}
            action = form["action"][len(f"/s/{self.sid}"):] or "/"
            if form["method"] == "post":
                self._load(action, data=fields)
            else:
                self._load(action + "?" + urllib.parse.urlencode(fields))
        return self.observation()

    def type(self, id: int, text: str) -> str:
        self._element(id, ("textbox",))["value"] = str(text)
        return self.observation()

    def select(self, id: int, option: str) -> str:
        el = self._element(id, ("combobox",))
        if str(option) not in el["options"]:
            raise ToolError(f"no option {option!r}; options: {', '.join(el['options'])}")
        el["value"] = str(option)
        return self.observation()

    def goto(self, path: str) -> str:
        if not isinstance(path, str) or not _SITE_PATH.match(path.partition("?")[0]) or ".." in path:
            raise ToolError("give a path on this site, e.g. /products")
        self._load(path)
        return self.observation()

    def back(self) -> str:
        if not self.history:
            raise ToolError("no previous page")
        self._show(*self._fetch(self.base + self.history.pop()))
        return self.observation()

    def scroll(self, direction: str) -> str:
        if direction not in ("up", "down"):
            raise ToolError("direction is up or down")
        step = VIEW_LINES - 5
        total = len(self.elements)
        self.offset = max(0, min(self.offset + (step if direction == "down" else -step), max(total - 1, 0)))
        return self.observation()

    def stop(self) -> str:
        self.stopped = True
        return "stopped"

    # -- EnvState hooks ---------------------------------------------------------------------------

    def is_completed(self) -> bool:
        return self.stopped

    def turn_tools(self) -> list[Tool] | None:
        """With ``page_ids``, the tools as a grammar should offer them on the page shown: ``click``
        takes only its links' and buttons' ids, ``type`` its text boxes' (and at most
        ``MAX_TYPED`` characters), ``select`` one of its select boxes with one of that box's
        options, ``goto`` one of the site's top pages (``TOP_PAGES``); a tool with nothing to act
        on, and ``back`` without history, is left out. None without ``page_ids`` (offer ``tools`` as they are).
        The calls still go to ``tools``, which check everything again."""
        if not self.page_ids:
            return None
        by_role: dict[str, list[dict[str, Any]]] = {}
        for el in self.elements:
            by_role.setdefault(el["role"], []).append(el)
        clickable = [e["id"] for e in by_role.get("link", []) + by_role.get("button", [])]
        boxes = [e["id"] for e in by_role.get("textbox", [])]
        narrowed = {
            "click": {"type": "object", "properties": {"id": {"enum": sorted(clickable)}}, "required": ["id"]},
            "type": {"type": "object", "properties": {"id": {"enum": boxes},
                                                      "text": {"type": "string", "maxLength": MAX_TYPED}},
                     "required": ["id", "text"]},
            "goto": {"type": "object", "properties": {"path": {"enum": list(TOP_PAGES)}}, "required": ["path"]},
            "select": {"anyOf": [{"type": "object", "properties": {"id": {"const": e["id"]},
                                                                    "option": {"enum": e["options"]}},
                                  "required": ["id", "option"]} for e in by_role.get("combobox", [])]},
        }
        empty = {"click": not clickable, "type": not boxes, "select": not by_role.get("combobox"),
                 "back": not self.history}
        return [Tool(t.name, t.description, narrowed.get(t.name, t.parameters), t.fn, t.example_arguments)
                for t in self.tools if not empty.get(t.name, False)]

    def state(self) -> dict[str, Any]:
        """The session's database (``Site.snapshot``), the path last shown and the pages visited."""
        return {**self.site.snapshot(self.sid), "path": self.path, "pages": len(self.history) + 1}

    def close(self) -> None:
        """End this browser's site session (its database is closed; ``state()`` reads it no more).
        Idempotent; ``selfrl.rollout.agent`` calls it once the state is recorded."""
        self.site.end_session(self.sid)
