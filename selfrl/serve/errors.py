"""Errors of selfrl's HTTP servers (``selfrl serve``, ``selfrl sampler``): the refusal every
part of the server raises, OpenAI's error shape, the field a validation error is about,
finite numbers, and the 500 for an exception nothing else handled.

* :class:`ApiError`: a request the server refuses, with its HTTP status; raised anywhere
  below the HTTP layer (the service, its versions, a stream) and turned into OpenAI's
  error by ``selfrl.serve.app``. It lives here so that those parts import down, never
  back into the service.
* :func:`refuse` / :func:`error_param`: a validator's error that names the exact place
  (``messages[2].content[0].text``, OpenAI's notation), and pydantic's locations written so.
* :func:`array_of_objects`: a field that must be an array of JSON objects, refused naming
  the element that is not one (``input[3]``).
* :func:`finite` / :func:`finite_fields`: Python's json accepts ``NaN`` and ``Infinity``
  (and a float beyond 1e308 is an infinity); such a value is refused as "must be a finite
  number", never by a bound whose message would mislead ("less than or equal to 2").
* :func:`server_error` / :func:`add_server_error_handler`: an exception nothing else
  handled becomes a JSON 500 ``server_error`` with the exception's class and text; a
  storage fault (disk full, store locked, ...: :mod:`selfrl.record.storage_errors`) becomes a 507
  or 503 whose ``code`` names it and whose message says what to do, with ``Retry-After``;
  any other OS or SQLite error a 500 ``storage_error`` without its raw text. The
  traceback goes to the server log, never to the client (Starlette's default is a
  plain-text "Internal Server Error").
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from typing import Any

from pydantic import field_validator
from pydantic_core import PydanticCustomError

from selfrl.chat.toolcall import json_number_ok
from selfrl.core.wording import json_visible, plain


class ApiError(Exception):
    """A request the server refuses; becomes an OpenAI-style error with ``status``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def refuse(message: str, at: str = "") -> PydanticCustomError:
    """A validation error whose message is ``message`` as written (no "Value error, "
    prefix) and whose field is the validated one followed by ``at`` (``"[0].text"``), so
    that :func:`error_param` names the exact place: ``messages[2].content[0].text``."""
    return PydanticCustomError("invalid_value", "{detail}", {"detail": message, "at": at})


def error_param(loc: tuple | list, ctx: dict | None = None) -> str | None:
    """A pydantic error location in OpenAI's notation (``messages[2].content``), with the
    ``at`` a :func:`refuse` error adds; None for the whole body.

    Pydantic's tags for the member of a union it tried (``str``, ``list[...]``,
    ``function-after[...]``) are left out.

    >>> error_param(("messages", 2, "content"), {"at": "[0].text"})
    'messages[2].content[0].text'
    >>> error_param(("tools", 0, "function-after[_valid_text(), ToolDef]", "function", "parameters"))
    'tools[0].function.parameters'
    """
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" in part or part in _UNION_TAGS:
            continue
        else:
            out += ("." if out else "") + part
    out += (ctx or {}).get("at", "")
    return out or None


_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "tagged-union"}


def _json_type(v: Any) -> str:
    """The JSON name of a decoded value's type (for error messages)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, (int, float)):
        return "a number"
    return {str: "a string", list: "an array", dict: "an object"}.get(type(v), type(v).__name__)


def array_of_objects(v: Any, array: str, item: str) -> list:
    """``v`` unchanged when it is a JSON array of objects (a list of dicts).

    Raises:
        pydantic_core.PydanticCustomError: a :func:`refuse` error, ``"{array}, got <v's JSON
            type>"`` when ``v`` is no array, or ``"{item}, got <its JSON type>"`` at ``[k]`` for
            the first element ``k`` that is no object.

    >>> array_of_objects([{}], "x must be an array", "an x item must be an object")
    [{}]
    """
    if not isinstance(v, list):
        raise refuse(f"{array}, got {_json_type(v)}")
    for k, x in enumerate(v):
        if not isinstance(x, dict):
            raise refuse(f"{item}, got {_json_type(x)}", f"[{k}]")
    return v


def finite(name: str, v: Any) -> Any:
    """``v`` unchanged unless it is NaN or an infinity (JSON ``NaN``/``Infinity``, which
    Python's json accepts, a float beyond 1e308, or such a string): then a :func:`refuse`
    error saying so, before any bound is checked (a bound's message would mislead)."""
    x = None
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        x = float(v) if isinstance(v, float) else None
    elif isinstance(v, str):
        try:
            x = float(v)
        except ValueError:
            return v  # not a number at all: pydantic's own message says so
    if x is not None and not math.isfinite(x):
        raise refuse(f"{name} must be a finite number, got {v!r}")
    return v


def _key_step(key: str) -> str:
    r"""One key of a path: ``.key``, or the key as a JSON string in brackets when it is empty,
    holds what would read as another step or an escape (``.``, ``[``, ``]``, ``"``, ``\``,
    blank space), or does not read as itself (:func:`selfrl.core.wording.plain`: an invisible or
    combining character, each escaped), so that the path names one key: ``x-default`` stays
    ``.x-default``, ``a.b`` is ``["a.b"]``, a zero-width space ``["\u200b"]``."""
    simple = key and plain(key) and not any(c in '.[]"\\' or c.isspace() for c in key)
    return f".{key}" if simple else f"[{json_visible(key)}]"


def non_finite_path(value: Any, path: str = "") -> str | None:
    """The path (``.a.b[2]``) of the first number in the JSON ``value`` that JSON cannot carry
    (``NaN``, an infinity: Python's json reads ``NaN``, ``Infinity`` and ``1e400`` as such; an
    integer beyond a double's range, which a reader holding numbers as doubles takes as one), or None.
    A key that is not a plain name is written as a JSON string in brackets (``["a.b"]``).

    >>> non_finite_path({"a": [1, {"b": float("nan")}]}), non_finite_path({"a": 1e308})
    ('.a[1].b', None)
    >>> non_finite_path({"a.b[0]": float("inf")}), non_finite_path({"": [float("nan")]})
    ('["a.b[0]"]', '[""][0]')
    """
    if isinstance(value, (int, float)) and not isinstance(value, bool) and not json_number_ok(value):
        return path or "."
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        found = non_finite_path(v)  # the step to ``v`` is written only on the way back from a find
        if found is not None:
            step = _key_step(str(k)) if isinstance(value, dict) else f"[{k}]"
            return path + step + ("" if found == "." else found)
    return None


def finite_json(name: str, v: Any) -> Any:
    """``v`` unchanged unless a number in it is NaN or an infinity: then a :func:`refuse` error
    naming where, since the value would reach the model's prompt and the stored trajectory, and no
    strict JSON reader takes it back."""
    where = non_finite_path(v)
    if where is not None:
        raise refuse(f"{name}{'' if where == '.' else where} is not a finite number (NaN and infinities are not "
                     "JSON): send a finite number, or leave the keyword out")
    return v


def finite_fields(*names: str):
    """A before-validator that applies :func:`finite` to each of ``names``."""
    def check(cls, v, info):
        return finite(info.field_name, v)
    return field_validator(*names, mode="before")(check)



# what a field of each pydantic type error takes, in JSON's words
_WANTED = {"bool_type": "true or false (a JSON boolean)", "int_type": "an integer", "float_type": "a number",
           "string_type": "a string", "list_type": "an array", "dict_type": "a JSON object",
           "model_type": "a JSON object", "model_attributes_type": "a JSON object"}
JSON_BODY = "the body must be a JSON object sent with Content-Type: application/json"


def _got(v: Any) -> str:
    """What a client sent, for a type error's message: the JSON type, with the value when it is
    short (a number, a boolean, a string of up to 20 characters) and finite."""
    if isinstance(v, bool):
        return f"the boolean {str(v).lower()}"
    if isinstance(v, (int, float)) and math.isfinite(v):
        return f"the number {v!r}"
    if isinstance(v, str) and len(v) <= 20:
        return f"the string {json.dumps(v)}"
    return _json_type(v)


def validation_message(errors: list[dict], skip: int = 1, typed: bool = True) -> tuple[str, str | None]:
    """``(message, param)`` for the first of FastAPI's request validation errors: the field in
    OpenAI's notation (:func:`error_param`; the first ``skip`` parts of its location, FastAPI's
    ``"body"``, are left out) and a message that says what is wrong there: a value of the wrong
    type is "``<field>`` must be <the type it takes>, got <what came>"; a body that is no JSON
    object, or was sent without ``Content-Type: application/json`` (``curl -d`` sends a form
    type), says so: ``typed`` False, the request sent no ``Content-Type`` header at all. A
    non-finite input value is never echoed (JSON cannot carry NaN back).

    >>> validation_message([{"type": "bool_type", "loc": ("body", "corrected"), "input": "yes"}])
    ('corrected must be true or false (a JSON boolean), got the string "yes"', 'corrected')
    >>> validation_message([{"type": "extra_forbidden", "loc": ("body", "service_tier"), "input": "auto"}])[0][:70]
    'unrecognized request argument supplied: service_tier (selfrl serve doe'
    >>> validation_message([{"type": "model_attributes_type", "loc": ("body",), "input": b"{}"}])[0]
    'the body must be a JSON object sent with Content-Type: application/json; it came with another content type'
    >>> validation_message([{"type": "model_attributes_type", "loc": ("body",), "input": b"{}"}], typed=False)[0]
    'the body must be a JSON object sent with Content-Type: application/json; it came with no Content-Type header'
    """
    first = errors[0] if errors else {}
    where = error_param(first.get("loc", ())[skip:], first.get("ctx"))
    msg = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    kind, got = first.get("type"), first.get("input")
    if kind == "json_invalid":
        return f"the body is not valid JSON: {first.get('ctx', {}).get('error', msg)}", None
    if kind == "missing" and where is None:
        return JSON_BODY + "; it came empty", None
    if kind == "extra_forbidden":
        return (f"unrecognized request argument supplied: {where} (selfrl serve does not take it, or cannot honour "
                "it: remove it; docs/reference/http-api.md lists what each route takes)"), where
    if kind in _WANTED and where is None:
        if isinstance(got, (bytes, bytearray)):  # not decoded: the content type was not JSON
            return JSON_BODY + ("; it came with another content type" if typed else
                                "; it came with no Content-Type header"), None
        return f"{JSON_BODY}; it is {_json_type(got)}", None
    union = any(isinstance(p, str) and ("[" in p or p in _UNION_TAGS) for p in first.get("loc", ()))
    if kind in _WANTED and not union:  # (a member of a union takes other types too: pydantic's message)
        return f"{where} must be {_WANTED[kind]}, got {_got(got)}", where
    return msg + (f" (at {where})" if where else ""), where


def server_error(e: BaseException, classify: Callable[[BaseException], Any] | None = None
                 ) -> tuple[int, dict[str, Any], dict[str, str]]:
    """``(status, body, headers)`` of the answer to an exception no other handler took.

    Args:
        e: the exception.
        classify: ``classify(e)``, a :class:`selfrl.record.storage_errors.StorageFault` or None
            (default :func:`selfrl.record.storage_errors.classify`; a server passes its own, which
            also records the fault for ``/health``).

    Returns:
        a storage fault: its status (507 or 503), ``server_error`` with the fault's kind as
        ``code``, a ``Retry-After`` header, and ``x-should-retry`` (the ``openai`` client's:
        "false" unless the fault is transient, a lock); another OS or SQLite error: 500
        ``storage_error`` naming only its class; anything else: 500 ``internal_error`` with
        its class and text.
    """
    from selfrl.record.storage_errors import classify as storage_fault, is_storage_error

    fault = (classify or storage_fault)(e)
    if fault is not None:
        body = error_body(f"the server cannot record this request now: {fault.message}. Retry after "
                          f"{fault.retry_after_s} s: the server recovers by itself once it can write again",
                          "server_error", None, fault.kind.value)
        # x-should-retry: the openai client's own header; without "false" it would sleep Retry-After
        # (30 s) twice before raising, for a fault that waits for an operator
        return fault.status, body, {"Retry-After": str(fault.retry_after_s),
                                    "x-should-retry": "true" if fault.transient else "false"}
    if is_storage_error(e):
        return 500, error_body(f"internal server error: a storage error ({type(e).__name__}); the server log has "
                               "its details", "server_error", None, "storage_error"), {}
    message = f"internal server error: {type(e).__name__}: {e}"[:2000]
    return 500, error_body(message, "server_error", None, "internal_error"), {}


def add_server_error_handler(app, log: logging.Logger,
                             classify: Callable[[BaseException], Any] | None = None) -> None:
    """Answer an exception no other handler took as :func:`server_error` does (``classify``
    is passed on), and log it: with its traceback, except a storage fault (INFO, one line:
    ``classify`` logs where a fault begins and ends).

    OS, SQLite and storage-fault errors get a handler of their own: Starlette re-raises what
    the catch-all ``Exception`` handler answered (uvicorn then logs a traceback), which a
    full disk would do for every request."""
    import sqlite3

    from fastapi import Request
    from fastapi.responses import JSONResponse

    from selfrl.record.storage_errors import StorageFaultError

    async def answer(request: Request, e: Exception):
        status, body, headers = server_error(e, classify)
        if status == 500:
            log.error("%s %s failed", request.method, request.url.path, exc_info=e)
        else:
            log.info("%s %s: %s (%s: %s)", request.method, request.url.path, body["error"]["code"],
                     type(e).__name__, e)
        return JSONResponse(body, status_code=status, headers=headers)

    for kind in (OSError, sqlite3.Error, StorageFaultError, Exception):
        app.add_exception_handler(kind, answer)
