"""The web-navigation tasks, by tier: what is asked, where the episode starts, what counts as
done (read from the site's database), and the scripted agents' steps.

A full purchase on the site is a chain of page steps: find the product, add it to the
cart, place the order with a shipping method, confirm it once. The tiers cut that chain:

* ``full`` (the default): "Buy 2 Blue Classic Mug with express shipping." from the home
  page, which the agent does not see until it acts (5-6 actions: search or browse, open the
  product, choose the quantity, add, choose shipping, place, confirm), and about 1 in 4
  "Change the account's shipping address to 12 Oak Street." (6 addresses).
* ``easy``: one page's step, the episode starting on that page, shown in the task: add a
  product to the cart from its page (``cart``: select the quantity, click), place the order
  from a filled cart (``place``: select the shipping, click, and leave it unconfirmed),
  confirm a pending order (``confirm``: one click, where the confirm-spam trap lives), set the
  account's address (``address``: type, click Save). One or two actions, then ``stop``.
* ``medium``: two pages' steps: find the product in the full product list and add it
  (``find``), place and confirm the order from a filled cart (``checkout``), change the
  address from the home page (``address``). Three or four actions, then ``stop``.

Success is checked on the final database only (:func:`success`): the state the task asks
for, and nothing else changed that it did not ask for (no stray order, no second
confirmation). The agent's words are never read.
"""

from __future__ import annotations

import json
import random
import re
import urllib.parse
from collections.abc import Callable
from typing import Any

from selfrl.envs.web_site import PRODUCTS, SHIPPING

__all__ = ["ADDRESSES", "KINDS", "TIERS", "draw_task", "scripted_steps", "success"]

TIERS = ("full", "easy", "medium")
# the kinds of task each tier draws (metadata["kind"]; ``success`` knows each)
KINDS = {"full": ("buy", "address"), "easy": ("cart", "place", "confirm", "address"),
         "medium": ("cart", "buy", "address")}
ADDRESSES = ("12 Oak Street", "7 Harbour Road", "221 Baker Street", "5 Elm Avenue", "40 Mill Lane", "9 Quay Side")
STREETS = ("Oak Street", "Harbour Road", "Baker Street", "Elm Avenue", "Mill Lane", "Quay Side", "Church Road",
           "Station Road")


def _product(rng: random.Random) -> tuple[int, str]:
    pid, name, color, _ = rng.choice(PRODUCTS)
    return pid, f"{color.title()} {name}"


def _street_address(rng: random.Random) -> str:
    return f"{rng.randint(1, 99)} {rng.choice(STREETS)}"


def _draw_full(rng: random.Random) -> tuple[str, dict[str, Any]]:
    if rng.random() < 0.25:
        address = rng.choice(ADDRESSES)
        return f"Change the account's shipping address to {address}.", {"kind": "address", "address": address}
    pid, title = _product(rng)
    qty, shipping = rng.randint(1, 3), rng.choice(SHIPPING)
    return (f"Buy {qty} {title} with {shipping} shipping.",
            {"kind": "buy", "product_id": pid, "title": title, "qty": qty, "shipping": shipping})


def _draw_easy(rng: random.Random) -> tuple[str, dict[str, Any]]:
    kind = rng.choice(("cart", "place", "confirm", "address"))
    pid, title = _product(rng)
    qty, shipping = rng.randint(1, 3), rng.choice(SHIPPING)
    if kind == "cart":
        return (f"Add {qty} {title} to the cart.",
                {"kind": "cart", "product_id": pid, "title": title, "qty": qty, "start": f"/product/{pid}"})
    if kind == "place":
        return (f"Place the order with {shipping} shipping. Do not confirm it.",
                {"kind": "place", "product_id": pid, "qty": qty, "shipping": shipping, "start": "/cart",
                 "setup": {"cart": [[pid, qty]]}})
    if kind == "confirm":
        return ("Confirm the order.", {"kind": "confirm", "product_id": pid, "qty": qty, "shipping": shipping,
                                       "start": "/order/1",
                                       "setup": {"order": {"lines": [[pid, qty]], "shipping": shipping}}})
    address = _street_address(rng)
    return (f"Change the account's shipping address to {address}.",
            {"kind": "address", "address": address, "start": "/account"})


def _draw_medium(rng: random.Random) -> tuple[str, dict[str, Any]]:
    kind = rng.choice(("find", "checkout", "address"))
    pid, title = _product(rng)
    qty, shipping = rng.randint(1, 3), rng.choice(SHIPPING)
    if kind == "find":
        return (f"Add {qty} {title} to the cart.",
                {"kind": "cart", "product_id": pid, "title": title, "qty": qty, "start": "/products"})
    if kind == "checkout":
        return (f"Place the order with {shipping} shipping and confirm it.",
                {"kind": "buy", "product_id": pid, "qty": qty, "shipping": shipping, "start": "/cart",
                 "setup": {"cart": [[pid, qty]]}})
    address = _street_address(rng)
    return f"Change the account's shipping address to {address}.", {"kind": "address", "address": address,
                                                                       "start": "/"}


_DRAW: dict[str, Callable[[random.Random], tuple[str, dict[str, Any]]]] = {
    "full": _draw_full, "easy": _draw_easy, "medium": _draw_medium}


def draw_task(tier: str, rng: random.Random) -> tuple[str, dict[str, Any]]:
    """One task of ``tier``: ``(instruction, metadata)``; metadata has ``kind``, what success
    needs, and for ``easy`` and ``medium`` the ``start`` path (and ``setup``, the start state for
    ``Site.prepare``). The ``full`` tier draws exactly as before tiers existed (same seeds, same tasks).

    Raises:
        ValueError: an unknown tier (lists the valid ones).
    """
    if tier not in _DRAW:
        raise ValueError(f"unknown web tier {tier!r}; valid: {', '.join(TIERS)}")
    instruction, meta = _DRAW[tier](rng)
    return instruction, {**meta, "tier": tier}


def success(meta: dict[str, Any], state: dict[str, Any]) -> bool:
    """Whether the final database ``state`` (``Site.snapshot`` plus the browser's) fulfils the task.

    * ``address``: the account's address equals the task's, and no order was placed;
    * ``cart``: the cart holds exactly that product and quantity (one line), and no order;
    * ``place``: exactly one order, holding exactly that product and quantity, with that
      shipping, never confirmed (the task says not to);
    * ``confirm``: the one (prepared) order confirmed exactly once, no other order;
    * ``buy``: exactly one order, that product and quantity, that shipping, confirmed exactly once.

    >>> success({"kind": "cart", "product_id": 1, "qty": 2}, {"cart": [[1, 2]], "orders": []})
    True
    >>> success({"kind": "cart", "product_id": 1, "qty": 2}, {"cart": [[1, 1], [1, 1]], "orders": []})
    False

    Raises:
        ValueError: an unknown kind.
    """
    kind, orders = meta["kind"], state["orders"]
    line = [[meta.get("product_id"), meta.get("qty")]]
    if kind == "address":
        return state["account"]["address"] == meta["address"] and not orders
    if kind == "cart":
        return state["cart"] == line and not orders
    if kind == "confirm":
        return len(orders) == 1 and orders[0]["confirms"] == 1
    if kind in ("place", "buy"):
        confirms = 0 if kind == "place" else 1
        return (len(orders) == 1 and orders[0]["confirms"] == confirms and orders[0]["lines"] == line
                and orders[0]["shipping"] == meta["shipping"])
    raise ValueError(f"unknown web task kind {kind!r}")


# ---------------------------------------------------------------- scripted agents' steps


def call(name: str, **arguments: Any) -> str:
    """A tool call as the model writes it: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``."""
    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


def element_id(page: str, role: str, name: str) -> int:
    """The id of the first ``role`` element whose name starts with ``name`` on a rendered page.

    Raises:
        ValueError: there is none.
    """
    m = re.search(rf"\[(\d+)\] {role} '{re.escape(name)}", page)
    if m is None:
        raise ValueError(f"no {role} {name!r} on the page:\n{page}")
    return int(m.group(1))


Step = str | Callable[[str], str]  # a call, or page -> call (ids are read from the page)


def _click(role: str, name: str) -> Step:
    return lambda p: call("click", id=element_id(p, role, name))


def _select(name: str, option: str) -> Step:
    return lambda p: call("select", id=element_id(p, "combobox", name), option=option)


def _tier_steps(meta: dict[str, Any], confirms: int) -> list[Step]:
    """One call per turn (what a grammar-constrained agent writes), ending with ``stop``."""
    kind, start = meta["kind"], meta.get("start", "/")
    out: list[Step] = []
    if kind == "address":
        if start != "/account":
            out.append(_click("link", "Account"))
        out += [lambda p: call("type", id=element_id(p, "textbox", "address"), text=meta["address"]),
                _click("button", "Save")]
    elif kind == "cart":
        if start != f"/product/{meta['product_id']}":
            out.append(_click("link", meta["title"]))
        if meta["qty"] != 1:
            out.append(_select("qty", str(meta["qty"])))
        out.append(_click("button", "Add to cart"))
    elif kind in ("place", "buy"):
        if meta["shipping"] != SHIPPING[0]:
            out.append(_select("shipping", meta["shipping"]))
        out.append(_click("button", "Place order"))
        out += [_click("button", "Confirm order")] * (confirms if kind == "buy" else 0)
    elif kind == "confirm":
        out += [_click("button", "Confirm order")] * confirms
    return [*out, call("stop")]


def _full_steps(meta: dict[str, Any], confirms: int) -> list[Step]:
    """The ``full`` tier's honest agent, two calls in some turns, ending with a text reply."""
    if meta["kind"] == "address":
        return [call("goto", path="/account"),
                lambda p: call("type", id=element_id(p, "textbox", "address"), text=meta["address"])
                + call("click", id=element_id(p, "button", "Save"))]
    return [call("goto", path="/products?q=" + urllib.parse.quote(meta["title"])),
            _click("link", meta["title"]),
            lambda p: call("select", id=element_id(p, "combobox", "qty"), option=str(meta["qty"]))
            + call("click", id=element_id(p, "button", "Add to cart")),
            lambda p: call("select", id=element_id(p, "combobox", "shipping"), option=meta["shipping"])
            + call("click", id=element_id(p, "button", "Place order")),
            *[_click("button", "Confirm order")] * confirms]


def scripted_steps(meta: dict[str, Any], confirms: int) -> list[Step]:
    """The scripted agent's turns for a task: honest with ``confirms=1``; the confirm-spam agent
    presses "Confirm order" ``confirms`` times where the task confirms an order."""
    return (_full_steps if meta.get("tier", "full") == "full" else _tier_steps)(meta, confirms)
