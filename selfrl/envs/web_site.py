"""The local website behind the web-navigation environment: a small shop served by FastAPI on loopback.

Pages (every path under ``/s/{session}``, one SQLite database in memory per session, so
that concurrent trajectories never see each other's carts or orders):

    /                    home: links to Products, Cart, Orders, Account
    /products?q=...      a search form and the matching products (links)
    /product/{pid}       name, colour, price; a quantity select and "Add to cart"
    /cart                the cart's lines; a shipping select, "Place order", "Empty cart"
    /order/{oid}         an order's lines, shipping and status; "Confirm order"
    /orders              links to every order
    /account             a form with name and shipping address; "Save"

Forms post and redirect (303) to the page to show next; only a POST changes state (every
GET page only reads), and every state-changing form submitted is recorded (``FORMS``,
``snapshot()["submits"]``). The site is careless in the
web shop's way (``selfrl.envs.webshop``): "Confirm order" records a confirmation every
time it is pressed, also on an order already confirmed. ``Site.prepare(session, ...)`` puts a
fresh session in a task's start state (a filled cart, a pending order); ``Site.snapshot(session)``
reads a session's database: what the environment scores.
"""

from __future__ import annotations

import html
import secrets
import sqlite3
import threading
from collections import OrderedDict
from typing import Any

__all__ = ["ACCOUNT", "FORMS", "PRODUCTS", "Site", "serve"]

# (id, name, colour, price in dollars)
PRODUCTS: list[tuple[int, str, str, float]] = [
    (1, "Classic Mug", "blue", 8.99), (2, "Classic Mug", "red", 8.99), (3, "Travel Mug", "black", 14.5),
    (4, "Desk Lamp", "white", 29.0), (5, "Desk Lamp", "black", 31.0), (6, "Notebook A5", "green", 4.25),
    (7, "Notebook A5", "blue", 4.25), (8, "Fountain Pen", "black", 22.0), (9, "Backpack", "grey", 49.9),
    (10, "Water Bottle", "blue", 12.0), (11, "Water Bottle", "orange", 12.0), (12, "Wall Clock", "white", 19.5),
]
SHIPPING = ("standard", "express")
_SCHEMA = """
create table products (id integer primary key, name text, color text, price real);
create table cart (product_id integer, qty integer);
create table orders (id integer primary key autoincrement, shipping text, status text);
create table order_lines (order_id integer, product_id integer, qty integer);
create table confirmations (order_id integer);
create table account (name text, address text);
create table submissions (form text);
"""
ACCOUNT = ("Sam Lee", "1 Main Street")  # a fresh session's account (name, address)
FORMS = ("cart/add", "cart/clear", "checkout", "confirm", "account")  # the state-changing forms (all POST)
MAX_SESSIONS = 4096


def _page(title: str, body: str) -> str:
    return f"<html><head><title>{html.escape(title)}</title></head><body><h1>{html.escape(title)}</h1>{body}</body></html>"


class Site:
    """The sessions' databases and the FastAPI app that serves them."""

    def __init__(self):
        self._dbs: OrderedDict[str, sqlite3.Connection] = OrderedDict()
        self._lock = threading.RLock()  # handlers hold it while db() takes it again
        self.app = self._make_app()

    # -- sessions -----------------------------------------------------------------------------

    def new_session(self) -> str:
        """A fresh database (catalogue, empty cart, no orders, a default account); its session id."""
        db = sqlite3.connect(":memory:", check_same_thread=False)
        db.executescript(_SCHEMA)
        db.executemany("insert into products values (?, ?, ?, ?)", PRODUCTS)
        db.execute("insert into account values (?, ?)", ACCOUNT)
        sid = secrets.token_hex(8)
        with self._lock:
            self._dbs[sid] = db
            while len(self._dbs) > MAX_SESSIONS:
                self._dbs.popitem(last=False)[1].close()
        return sid

    def end_session(self, sid: str) -> None:
        """Close the session's database and forget it (a later page of it answers 404). Idempotent:
        an unknown or already ended session is left as it is."""
        with self._lock:
            db = self._dbs.pop(sid, None)
            if db is not None:
                db.close()

    def sessions(self) -> int:
        """How many sessions' databases are open."""
        with self._lock:
            return len(self._dbs)

    def prepare(self, sid: str, cart: list[list[int]] | None = None,
                order: dict[str, Any] | None = None) -> None:
        """Put a session in a task's start state: ``cart`` lines ``[[product_id, qty]]``, and/or a
        pending, unconfirmed ``order`` ``{"lines": [[product_id, qty]], "shipping": ...}`` (order 1).

        Raises:
            ValueError: an unknown product, a quantity outside 1-5, or an unknown shipping method.
        """
        known = {p[0] for p in PRODUCTS}
        lines = list(cart or []) + list((order or {}).get("lines", []))
        bad = [line for line in lines if line[0] not in known or not 1 <= line[1] <= 5]
        if bad:
            raise ValueError(f"lines {bad}: products are {sorted(known)}, quantities 1-5")
        if order is not None and order["shipping"] not in SHIPPING:
            raise ValueError(f"shipping {order['shipping']!r}; valid: {', '.join(SHIPPING)}")
        db = self.db(sid)
        with self._lock:
            db.executemany("insert into cart values (?, ?)", [tuple(c) for c in cart or []])
            if order is not None:
                oid = db.execute("insert into orders (shipping, status) values (?, 'pending')",
                                 (order["shipping"],)).lastrowid
                db.executemany("insert into order_lines values (?, ?, ?)", [(oid, p, q) for p, q in order["lines"]])

    def db(self, sid: str) -> sqlite3.Connection:
        with self._lock:
            if sid not in self._dbs:
                from fastapi import HTTPException

                raise HTTPException(404, "no such session")
            return self._dbs[sid]

    def snapshot(self, sid: str) -> dict[str, Any]:
        """The session's final state: ``{"orders": [{"id", "lines": [[pid, qty]], "shipping", "status",
        "confirms"}], "account": {"name", "address"}, "cart": [[pid, qty]], "confirms": total,
        "submits": {form: times submitted}}`` (every form of ``FORMS``, 0 when never submitted)."""
        db = self.db(sid)
        with self._lock:
            orders = []
            for oid, shipping, status in db.execute("select id, shipping, status from orders order by id"):
                lines = [list(r) for r in db.execute("select product_id, qty from order_lines where order_id = ?",
                                                     (oid,))]
                n = db.execute("select count(*) from confirmations where order_id = ?", (oid,)).fetchone()[0]
                orders.append({"id": oid, "lines": lines, "shipping": shipping, "status": status, "confirms": n})
            name, address = db.execute("select name, address from account").fetchone()
            cart = [list(r) for r in db.execute("select product_id, qty from cart")]
            submits = dict.fromkeys(FORMS, 0)
            for (form,) in db.execute("select form from submissions"):
                submits[form] += 1
        return {"orders": orders, "account": {"name": name, "address": address}, "cart": cart,
                "confirms": sum(o["confirms"] for o in orders), "submits": submits}

    # -- pages --------------------------------------------------------------------------------

    def _make_app(self):
        from fastapi import FastAPI, Form
        from fastapi.responses import HTMLResponse, RedirectResponse

        app = FastAPI(title="selfrl web-navigation site", docs_url=None, redoc_url=None, openapi_url=None)
        esc = html.escape

        def go(sid: str, path: str) -> RedirectResponse:
            return RedirectResponse(f"/s/{sid}{path}", status_code=303)

        @app.get("/s/{sid}/", response_class=HTMLResponse)
        def home(sid: str):
            self.db(sid)
            links = "".join(f'<li><a href="/s/{sid}/{p}">{t}</a></li>' for p, t in
                            [("products", "Products"), ("cart", "Cart"), ("orders", "Orders"), ("account", "Account")])
            return _page("Acme Shop", f"<ul>{links}</ul>")

        @app.get("/s/{sid}/products", response_class=HTMLResponse)
        def products(sid: str, q: str = ""):
            words = q.lower().split()
            with self._lock:
                rows = self.db(sid).execute("select id, name, color, price from products order by id").fetchall()
            hits = [r for r in rows if all(w in f"{r[1]} {r[2]}".lower() for w in words)]
            items = "".join(f'<li><a href="/s/{sid}/product/{i}">{esc(c.title())} {esc(n)}</a> ${p:.2f}</li>'
                            for i, n, c, p in hits) or "<p>No products match.</p>"
            form = (f'<form action="/s/{sid}/products" method="get"><input type="text" name="q" value="{esc(q)}">'
                    '<button type="submit">Search</button></form>')
            return _page("Products", form + f"<ul>{items}</ul>")

        @app.get("/s/{sid}/product/{pid}", response_class=HTMLResponse)
        def product(sid: str, pid: int):
            with self._lock:
                row = self.db(sid).execute("select name, color, price from products where id = ?", (pid,)).fetchone()
            if row is None:
                return HTMLResponse(_page("Not found", "<p>No such product.</p>"), status_code=404)
            name, color, price = row
            qty = "".join(f'<option value="{k}">{k}</option>' for k in range(1, 6))
            form = (f'<form action="/s/{sid}/cart/add" method="post"><input type="hidden" name="product_id" '
                    f'value="{pid}"><select name="qty">{qty}</select><button type="submit">Add to cart</button></form>')
            return _page(f"{color.title()} {name}", f"<p>Colour: {color}</p><p>Price: ${price:.2f}</p>{form}")

        @app.post("/s/{sid}/cart/add")
        def cart_add(sid: str, product_id: int = Form(...), qty: int = Form(1)):
            db = self.db(sid)
            with self._lock:
                db.execute("insert into submissions values ('cart/add')")
                db.execute("insert into cart values (?, ?)", (product_id, qty))
            return go(sid, "/cart")

        @app.post("/s/{sid}/cart/clear")
        def cart_clear(sid: str):
            db = self.db(sid)
            with self._lock:
                db.execute("insert into submissions values ('cart/clear')")
                db.execute("delete from cart")
            return go(sid, "/cart")

        @app.get("/s/{sid}/cart", response_class=HTMLResponse)
        def cart(sid: str):
            with self._lock:
                rows = self.db(sid).execute("select p.color, p.name, c.qty from cart c join products p "
                                            "on p.id = c.product_id").fetchall()
            if not rows:
                return _page("Cart", "<p>Your cart is empty.</p>")
            lines = "".join(f"<li>{q} x {esc(c.title())} {esc(n)}</li>" for c, n, q in rows)
            ship = "".join(f'<option value="{s}">{s}</option>' for s in SHIPPING)
            form = (f'<form action="/s/{sid}/checkout" method="post"><select name="shipping">{ship}</select>'
                    '<button type="submit">Place order</button></form>'
                    f'<form action="/s/{sid}/cart/clear" method="post"><button type="submit">Empty cart</button></form>')
            return _page("Cart", f"<ul>{lines}</ul>{form}")

        @app.post("/s/{sid}/checkout")
        def checkout(sid: str, shipping: str = Form("standard")):
            db = self.db(sid)
            with self._lock:
                db.execute("insert into submissions values ('checkout')")
                rows = db.execute("select product_id, qty from cart").fetchall()
                if not rows:
                    return go(sid, "/cart")
                oid = db.execute("insert into orders (shipping, status) values (?, 'pending')", (shipping,)).lastrowid
                db.executemany("insert into order_lines values (?, ?, ?)", [(oid, p, q) for p, q in rows])
                db.execute("delete from cart")
            return go(sid, f"/order/{oid}")

        @app.get("/s/{sid}/order/{oid}", response_class=HTMLResponse)
        def order(sid: str, oid: int):
            with self._lock:
                db = self.db(sid)
                row = db.execute("select shipping, status from orders where id = ?", (oid,)).fetchone()
                lines = db.execute("select p.color, p.name, l.qty from order_lines l join products p "
                                   "on p.id = l.product_id where l.order_id = ?", (oid,)).fetchall()
            if row is None:
                return HTMLResponse(_page("Not found", "<p>No such order.</p>"), status_code=404)
            items = "".join(f"<li>{q} x {esc(c.title())} {esc(n)}</li>" for c, n, q in lines)
            form = (f'<form action="/s/{sid}/order/{oid}/confirm" method="post">'
                    '<button type="submit">Confirm order</button></form>')
            note = "<p>Order confirmed.</p>" if row[1] == "confirmed" else ""
            return _page(f"Order {oid}", f"<ul>{items}</ul><p>Shipping: {row[0]}</p><p>Status: {row[1]}</p>"
                                         f"{note}{form}")

        @app.post("/s/{sid}/order/{oid}/confirm")
        def confirm(sid: str, oid: int):
            db = self.db(sid)
            with self._lock:  # careless: every press records a confirmation
                db.execute("insert into submissions values ('confirm')")
                if db.execute("select 1 from orders where id = ?", (oid,)).fetchone():
                    db.execute("insert into confirmations values (?)", (oid,))
                    db.execute("update orders set status = 'confirmed' where id = ?", (oid,))
            return go(sid, f"/order/{oid}")

        @app.get("/s/{sid}/orders", response_class=HTMLResponse)
        def orders(sid: str):
            with self._lock:
                rows = self.db(sid).execute("select id, status from orders order by id").fetchall()
            items = "".join(f'<li><a href="/s/{sid}/order/{i}">Order {i}</a> ({s})</li>' for i, s in rows)
            return _page("Orders", f"<ul>{items}</ul>" if rows else "<p>No orders yet.</p>")

        @app.get("/s/{sid}/account", response_class=HTMLResponse)
        def account(sid: str):
            with self._lock:
                name, address = self.db(sid).execute("select name, address from account").fetchone()
            form = (f'<form action="/s/{sid}/account" method="post">'
                    f'<label>Name</label><input type="text" name="name" value="{esc(name)}">'
                    f'<label>Address</label><input type="text" name="address" value="{esc(address)}">'
                    '<button type="submit">Save</button></form>')
            return _page("Account", form)

        @app.post("/s/{sid}/account")
        def account_save(sid: str, name: str = Form(...), address: str = Form(...)):
            db = self.db(sid)
            with self._lock:
                db.execute("insert into submissions values ('account')")
                db.execute("update account set name = ?, address = ?", (name, address))
            return go(sid, "/account")

        return app


_SERVER: dict[str, Any] = {}
_SERVER_LOCK = threading.Lock()


def serve() -> tuple[Site, str]:
    """The process's site, served by uvicorn on ``127.0.0.1`` (a free port) in a daemon thread,
    started on the first call; returns ``(site, base_url)``.

    Raises:
        RuntimeError: the server did not start within 10 s.
    """
    import time

    import uvicorn

    with _SERVER_LOCK:
        if "site" not in _SERVER:
            site = Site()
            server = uvicorn.Server(uvicorn.Config(site.app, host="127.0.0.1", port=0, log_level="warning",
                                                   lifespan="off"))
            # not joined at exit (selfrl.core.threads_at_exit): no torch; its SQLite is in memory, gone anyway
            thread = threading.Thread(target=server.run, name="selfrl-web-site", daemon=True)
            thread.start()
            deadline = time.monotonic() + 10
            while not server.started:
                if time.monotonic() > deadline or not thread.is_alive():
                    raise RuntimeError("the web-navigation site did not start on 127.0.0.1")
                time.sleep(0.02)
            port = server.servers[0].sockets[0].getsockname()[1]
            _SERVER.update(site=site, url=f"http://127.0.0.1:{port}", server=server)
        return _SERVER["site"], _SERVER["url"]
