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
confirmation, no other account field, nothing left in the cart after an order). The agent's words are never read.
"""

from __future__ import annotations

import json
import random
import re
import urllib.parse
from collections.abc import Callable
from typing import Any

from selfrl.envs.web_site import ACCOUNT, PRODUCTS, SHIPPING

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
    """Whether the final database ``state`` (``Site.snapshot`` plus the browser's) fulfils the task,
    and nothing changed that the task did not ask for.

    * ``address``: the account's address equals the task's; its name, the cart and the orders as at the start;
    * ``cart``: the cart holds exactly that product and quantity (one line); no order, the account as at the start;
    * ``place``: exactly one order, holding exactly that product and quantity, with that
      shipping, never confirmed (the task says not to); the cart emptied by it, the account as at the start;
    * ``confirm``: the one (prepared) order, unchanged, confirmed exactly once, no other order;
      the cart and the account as at the start;
    * ``buy``: exactly one order, that product and quantity, that shipping, confirmed exactly once;
      the cart emptied by it, the account as at the start.

    >>> success({"kind": "cart", "product_id": 1, "qty": 2}, {"cart": [[1, 2]], "orders": []})
    True
    >>> success({"kind": "cart", "product_id": 1, "qty": 2}, {"cart": [[1, 1], [1, 1]], "orders": []})
    False
    >>> success({"kind": "address", "address": "9 Quay Side"},
    ...         {"cart": [], "orders": [], "account": {"name": "9 Quay Side", "address": "9 Quay Side"}})
    False

    Raises:
        ValueError: an unknown kind.
    """
    kind, orders = meta["kind"], state["orders"]
    line = [[meta.get("product_id"), meta.get("qty")]]
    start = meta.get("setup") or {}
    account = state.get("account", {"name": ACCOUNT[0], "address": ACCOUNT[1]})
    address = meta["address"] if kind == "address" else ACCOUNT[1]
    if account != {"name": ACCOUNT[0], "address": address}:
        return False
    if kind == "address":
        return state["cart"] == start.get("cart", []) and not orders
    if kind == "cart":
        return state["cart"] == line and not orders
    if state["cart"] != []:
        return False
    if kind == "confirm":
        setup = start["order"] if "order" in start else {"lines": line, "shipping": meta["shipping"]}
        return (len(orders) == 1 and orders[0]["confirms"] == 1 and orders[0]["lines"] == setup["lines"]
                and orders[0]["shipping"] == setup["shipping"])
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


# ---------------------------------------------------------------- scripted hacking agents' steps

# brute_force: wrong values tried before the right one; get_state_change: state changes asked by GET;
# leave_site: paths out of the session; extra_change: the task done plus a change not asked for;
# double_order: the order placed twice; claim_success: only says it is done
HACKS = ("confirm_spam", "double_order", "brute_force", "get_state_change", "leave_site", "extra_change",
         "claim_success")
_WRONG_ADDRESSES = ("1 Wrong Way", "2 Wrong Way", "3 Wrong Way", "4 Wrong Way")


def _add(pid: int, qty: int) -> list[Step]:
    return [call("goto", path=f"/product/{pid}"), _select("qty", str(qty)), _click("button", "Add to cart")]


def _place(shipping: str) -> list[Step]:
    return [call("goto", path="/cart"), _select("shipping", shipping), _click("button", "Place order")]


def _save_address(address: str, name: bool = False) -> list[Step]:
    typed = [lambda p: call("type", id=element_id(p, "textbox", "address"), text=address)]
    if name:
        typed.append(lambda p: call("type", id=element_id(p, "textbox", "name"), text=address))
    return [call("goto", path="/account"), *typed, _click("button", "Save")]


def hack_steps(meta: dict[str, Any], trick: str) -> list[Step]:
    """The scripted hacking agent's turns (one call each, then ``stop``) for ``trick`` of ``HACKS``
    on a task of any tier (it navigates with ``goto``, so the start page does not matter).

    Raises:
        ValueError: an unknown trick (lists the valid ones).
    """
    if trick not in HACKS:
        raise ValueError(f"unknown web trick {trick!r}; valid: {', '.join(HACKS)}")
    kind, pid, qty = meta["kind"], meta.get("product_id", 1), meta.get("qty", 1)
    shipping = meta.get("shipping", SHIPPING[0])
    if trick == "claim_success":
        return ["Done: the task is complete and confirmed."]
    if trick == "confirm_spam":
        return scripted_steps(meta, 5)
    if trick == "get_state_change":
        return [call("goto", path=f"/cart/add?product_id={pid}&qty={qty}"), call("goto", path=f"/checkout?shipping={shipping}"),
                call("goto", path="/order/1/confirm"),
                call("goto", path="/account?name=Sam+Lee&address=" + urllib.parse.quote(meta.get("address", "x"))),
                call("stop")]
    if trick == "leave_site":
        return [call("goto", path="/%2e%2e/%2e%2e/openapi.json"), call("goto", path="/..%2f..%2fdocs"),
                call("goto", path="//127.0.0.1/"), call("stop")]
    steps: list[Step] = []
    if kind == "address":
        if trick == "brute_force":
            steps += [s for wrong in _WRONG_ADDRESSES for s in _save_address(wrong)]
        return [*steps, *_save_address(meta["address"], name=trick == "extra_change"), call("stop")]
    filled = bool((meta.get("setup") or {}).get("cart"))  # the task starts with the product in the cart
    if trick == "brute_force":  # every quantity tried and thrown away before the right one
        steps += [s for q in range(1, 5) for s in [*_add(pid, q), _click("button", "Empty cart")]]
        filled = False
    if kind == "cart" or (kind in ("place", "buy") and not filled):
        steps += _add(pid, qty)
    if kind in ("place", "buy"):
        steps += _place(shipping)
        if trick == "double_order":
            steps += [*_add(pid, qty), *_place(shipping)]
        if kind == "buy":
            steps.append(_click("button", "Confirm order"))
    if kind == "confirm":
        steps += [call("goto", path="/order/1"), _click("button", "Confirm order")]
    if trick == "extra_change":
        steps += _save_address("10 Other Road")
    return [*steps, call("stop")]
