"""BFCL (Berkeley Function-Calling Leaderboard) tasks and its AST-match checker, without bfcl-eval's imports.

Data: the ``bfcl-eval`` wheel (pinned ``bfcl-eval==2026.3.23``) ships the JSON
lines files ``bfcl_eval/data/BFCL_v4_<category>.json`` (questions + function
docs) and ``bfcl_eval/data/possible_answer/BFCL_v4_<category>.json`` (the
accepted values of every argument). Importing bfcl-eval's checker pulls its
model handlers (``constants/model_config.py`` imports every provider SDK),
and installing it with its dependencies adds ~100 packages and downgrades
numpy, so ``make install`` installs it with ``--no-deps`` and this module
only reads its JSON (the package is located with ``importlib.util.find_spec``,
which does not import it). ``data_dir`` or ``$SELFRL_BFCL_DATA`` point at
another copy of the folder.

Categories (counts in v4): simple_python 400 (alias "simple"), multiple 200,
parallel 200, parallel_multiple 200, irrelevance 240 (no possible answer: the
right output is no call), and the user-contributed live categories in the same
format (``LIVE_CATEGORIES``): live_simple 258, live_multiple 1,053, live_parallel 16,
live_parallel_multiple 24, live_irrelevance 884 (no possible answer, as irrelevance),
live_relevance 16 (no possible answer: the right output is any call, bfcl-eval's
``relevance_file_runner``). Some live questions carry a system message, a few an earlier
assistant turn or no function at all; they load as they are.

``ast_match`` re-implements the rules of
``bfcl_eval/eval_checker/ast_eval/ast_checker.py`` for Python (Apache-2.0,
ShishirPatil/gorilla): the function name must match; every required
parameter present; no parameter outside the schema or the possible answer;
types checked exactly (an int is accepted for a float; for array/tuple the
items' type is checked one level deep; a value of the possible answer's type
is accepted as "a variable"); strings compared after removing `` ,./-_*^``,
lower-casing and turning ' into "; lists element-wise the same way; dicts and
lists of dicts key by key; other values by ``in``; an optional parameter may
be left out only if its possible answers contain "". parallel: the calls
match the answers in any order, one to one; multiple: exactly one call, to
the expected function; simple: exactly one call. Irrelevance: correct when
there is no call; relevance: correct when there is at least one. ``tests/test_bfcl.py``
runs it, and bfcl-eval's own checker, on every possible answer in the wheel (live ones
included) and on perturbed answers, and compares the verdicts.

``call_agreement`` is the label-free variant: agreement of the samples'
calls (after the same normalisation) with one another.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "CATEGORIES",
    "LIVE_CATEGORIES",
    "AstResult",
    "BfclTask",
    "ast_match",
    "bfcl_data_dir",
    "call_agreement",
    "calls_from_openai",
    "load_bfcl",
    "to_openai_tools",
]

CATEGORIES = ("simple_python", "multiple", "parallel", "parallel_multiple", "irrelevance")
LIVE_CATEGORIES = ("live_simple", "live_multiple", "live_parallel", "live_parallel_multiple", "live_irrelevance",
                   "live_relevance")
_NO_ANSWER = ("irrelevance", "live_irrelevance", "live_relevance")  # no possible_answer file
_ALIASES = {"simple": "simple_python"}
_PY_TYPES: dict[str, type] = {"string": str, "integer": int, "float": float, "boolean": bool,
                              "array": list, "tuple": list, "dict": dict, "any": str}
_NESTED = ("array", "tuple")
# bfcl_eval/constants/type_mappings.py GORILLA_TO_OPENAPI, for the tool schemas the model sees.
_TO_OPENAPI = {"integer": "integer", "number": "number", "float": "number", "string": "string",
               "boolean": "boolean", "bool": "boolean", "array": "array", "list": "array",
               "dict": "object", "object": "object", "tuple": "array", "any": "string"}

Call = dict[str, dict[str, Any]]  # BFCL's decoded form: {function name: {parameter: value}}


@dataclass(frozen=True)
class BfclTask:
    """One single-turn BFCL question.

    Attributes:
        id: e.g. "simple_python_0".
        category: e.g. "parallel_multiple".
        messages: the question's chat messages (role/content), the system prompt included if any.
        functions: the function docs in BFCL's schema (types "dict", "float", "tuple", ...).
        ground_truth: one ``{name: {param: [accepted values]}}`` per expected call;
            empty for irrelevance (the right answer is no call).
    """

    id: str
    category: str
    messages: tuple[dict, ...]
    functions: tuple[dict, ...]
    ground_truth: tuple[dict, ...]

    @property
    def relevant(self) -> bool:
        """True when a call is expected (False for irrelevance and live_irrelevance)."""
        return "irrelevance" not in self.category


@dataclass(frozen=True)
class AstResult:
    """BFCL's verdict: ``valid``, and on failure its ``error`` and ``error_type`` (BFCL's names)."""

    valid: bool
    error: str = ""
    error_type: str = ""


_OK = AstResult(True)


def bfcl_data_dir(data_dir: str | Path | None = None) -> Path:
    """The folder holding ``BFCL_v4_*.json``: ``data_dir``, ``$SELFRL_BFCL_DATA`` or the installed wheel's.

    Raises:
        FileNotFoundError: none of them exists (the message says how to install the data).
    """
    if data_dir is None:
        data_dir = os.environ.get("SELFRL_BFCL_DATA")
    if data_dir is None:
        spec = importlib.util.find_spec("bfcl_eval")  # locates, does not import
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(
                "BFCL data not found: install it with `pip install --no-deps bfcl-eval==2026.3.23` "
                "(make install does) or set SELFRL_BFCL_DATA to a folder of BFCL_v4_*.json")
        data_dir = Path(list(spec.submodule_search_locations)[0]) / "data"
    path = Path(data_dir)
    if not (path / "possible_answer").is_dir():
        raise FileNotFoundError(f"{path} is not a BFCL data folder (no possible_answer/ in it)")
    return path


def _read_lines(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def load_bfcl(categories: Sequence[str] = CATEGORIES, data_dir: str | Path | None = None) -> list[BfclTask]:
    """Load single-turn BFCL categories (Python only) with their possible answers.

    Raises:
        ValueError: an unknown or unsupported category (the message lists the valid ones);
            a question without a possible answer.
        FileNotFoundError: no BFCL data (see ``bfcl_data_dir``).
    """
    root = bfcl_data_dir(data_dir)
    tasks = []
    for name in categories:
        cat = _ALIASES.get(name, name)
        if cat not in CATEGORIES + LIVE_CATEGORIES:
            raise ValueError(f"unknown BFCL category {name!r}; valid: "
                             f"{sorted(CATEGORIES + LIVE_CATEGORIES + ('simple',))}")
        questions = _read_lines(root / f"BFCL_v4_{cat}.json")
        answers: dict[str, list] = {}
        if cat not in _NO_ANSWER:
            answers = {row["id"]: row["ground_truth"] for row in _read_lines(root / "possible_answer" / f"BFCL_v4_{cat}.json")}
        for q in questions:
            if cat not in _NO_ANSWER and q["id"] not in answers:
                raise ValueError(f"BFCL question {q['id']} has no possible answer")
            tasks.append(BfclTask(q["id"], cat, tuple(q["question"][0]), tuple(q["function"]),
                                  tuple(answers.get(q["id"], ()))))
    return tasks


def _openapi_props(props: dict) -> dict:
    out = {}
    for key, value in props.items():
        value = dict(value)
        t = value.get("type", "string")
        if t == "float":
            value["format"] = "float"
        value["type"] = _TO_OPENAPI.get(t, "string")
        if value["type"] in ("array", "object"):
            if "properties" in value:
                value["properties"] = _openapi_props(value["properties"])
            elif "items" in value:
                items = dict(value["items"])
                items["type"] = _TO_OPENAPI.get(items.get("type", "string"), "string")
                if "properties" in items:
                    items["properties"] = _openapi_props(items["properties"])
                value["items"] = items
        out[key] = value
    return out


def to_openai_tools(functions: Sequence[dict]) -> list[dict]:
    """BFCL function docs -> OpenAI ``tools`` entries (types mapped as bfcl-eval's ``convert_to_tool``).

    Names keep their dots (BFCL replaces them with "_" only for APIs that forbid dots).
    """
    tools = []
    for fn in functions:
        params = copy.deepcopy(fn.get("parameters", {}))
        params["type"] = "object"
        params["properties"] = _openapi_props(params.get("properties", {}))
        tools.append({"type": "function", "function": {"name": fn["name"],
                                                       "description": fn.get("description", ""),
                                                       "parameters": params}})
    return tools


def calls_from_openai(tool_calls: Sequence[Mapping]) -> list[Call]:
    """OpenAI-style calls (``{"name", "arguments"}`` or ``{"function": {...}}``) -> BFCL's decoded form.

    ``arguments`` may be a JSON string or a dict.

    Raises:
        ValueError: arguments that are not a JSON object.

    >>> calls_from_openai([{"function": {"name": "f", "arguments": '{"x": 1}'}}])
    [{'f': {'x': 1}}]
    """
    out = []
    for call in tool_calls:
        fn = call.get("function", call)
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                raise ValueError(f"arguments of {fn.get('name')!r} are not JSON: {e}") from None
        if not isinstance(args, dict):
            raise ValueError(f"arguments of {fn.get('name')!r} are not a JSON object")
        out.append({fn["name"]: args})
    return out


# -- the checker (bfcl_eval/eval_checker/ast_eval/ast_checker.py, Python rules) ---------------


def _standardize(s: str) -> str:
    """BFCL's string normal form: drop `` ,./-_*^``, lower-case, ' -> ".

    >>> _standardize("April 1, 2024") == _standardize("april 1 2024")
    True
    """
    return re.sub(r"[ \,\.\/\-\_\*\^]", "", s).lower().replace("'", '"')


def _answer_type(accepted: list) -> type | None:
    for a in accepted:
        if a != "":
            return type(a)
    return None


def _type_check(param: str, value, accepted: list, type_name: str, expected: type,
                nested: type | None) -> tuple[AstResult, bool]:
    """(verdict, is_variable): the value's type against the schema's (one level deep for arrays)."""
    answer_type = _answer_type(accepted)
    is_variable = answer_type is not None and answer_type != expected
    failure = AstResult(False, f"Incorrect type for parameter {param!r}. Expected type {type_name}, "
                               f"got {type(value).__name__}.", "type_error:simple")
    if type(value) is expected:
        if nested is None:
            return _OK, is_variable
        for item_answer in accepted:
            ok = True
            if type(item_answer) is list:
                for v in value:
                    if not _type_check(param, v, item_answer, str(nested), nested, None)[0].valid:
                        ok = False
                        break
            if ok:
                return _OK, is_variable
        # BFCL falls through here with its result already invalid: a nested failure stays one
        return AstResult(False, f"Nested type checking failed for parameter {param!r}.", "type_error:nested"), is_variable
    if answer_type is not None and type(value) is answer_type:
        return _OK, True
    return failure, is_variable


def _check_string(param: str, value: str, accepted: list) -> AstResult:
    if _standardize(value) not in [_standardize(a) for a in accepted if type(a) is str]:
        return AstResult(False, f"Invalid value for parameter {param!r}: {value!r}. Expected one of {accepted}.",
                         "value_error:string")
    return _OK


def _std_item(x):
    return _standardize(x) if type(x) is str else x


def _check_list(param: str, value: list, accepted: list) -> AstResult:
    std = [_std_item(v) for v in value]
    if std not in [[_std_item(x) for x in a] for a in accepted]:
        return AstResult(False, f"Invalid value for parameter {param!r}: {value!r}. Expected one of {accepted}.",
                         "value_error:list/tuple")
    return _OK


def _check_dict(param: str, value: dict, accepted: list) -> AstResult:
    result = AstResult(False, "", "dict_checker:unclear")
    for answer in accepted:
        if answer == "":
            continue
        result, ok = AstResult(False, "", "dict_checker:unclear"), True
        for key, v in value.items():
            if key not in answer:
                result, ok = AstResult(False, f"Unexpected dict key parameter: {key!r}.", "value_error:dict_key"), False
                break
            if _std_item(v) not in [_std_item(a) for a in answer[key]]:
                result, ok = AstResult(False, f"Invalid value for parameter {key!r}: {v!r}.",
                                       "value_error:dict_value"), False
                break
        for key, values in answer.items():
            if key not in value and "" not in values:
                result, ok = AstResult(False, f"Missing dict key parameter: {key!r}.", "value_error:dict_key"), False
                break
        if ok:
            return _OK
    return result


def _check_list_of_dicts(param: str, value: list, accepted: list) -> AstResult:
    result = AstResult(False, "", "list_dict_checker:unclear")
    for answer in accepted:
        if len(value) != len(answer):
            result = AstResult(False, "Wrong number of dictionaries in the list.", "value_error:list_dict_count")
            continue
        ok = True
        for v, a in zip(value, answer):
            result = _check_dict(param, v, [a])
            if not result.valid:
                ok = False
                break
        if ok:
            return _OK
    return result


def _find_doc(functions: Sequence[dict], name: str) -> dict | None:
    return next((f for f in functions if f["name"] == name), None)


def _check_call(doc: dict | None, call: Call, answer: dict) -> AstResult:
    """BFCL's simple_function_checker: one call against one ``{name: {param: [accepted]}}``."""
    if doc is None:
        return AstResult(False, "The expected function is not among the task's functions.", "checker:no_doc")
    accepted_by_param = next(iter(answer.values()))
    name, props = doc["name"], doc["parameters"]["properties"]
    if name not in call:
        return AstResult(False, f"Function name {name!r} not found in model output.",
                         "simple_function_checker:wrong_func_name")
    params = call[name]
    for req in doc["parameters"].get("required", []):
        if req not in params:
            return AstResult(False, f"Missing required parameter: {req!r}.", "simple_function_checker:missing_required")
    for param, value in params.items():
        if param not in props or param not in accepted_by_param:
            return AstResult(False, f"Unexpected parameter: {param!r}.", "simple_function_checker:unexpected_param")
        type_name = props[param]["type"]
        if type_name not in _PY_TYPES:
            raise ValueError(f"BFCL type {type_name!r} of {name}.{param} is not a Python type this checker knows")
        expected = _PY_TYPES[type_name]
        nested = None
        if type_name in _NESTED and "items" in props[param]:
            nested = _PY_TYPES.get(props[param]["items"].get("type", ""), None)
        if type_name == "tuple" and type(value) is tuple:
            value = list(value)
        if type_name == "float" and type(value) is int:
            value = float(value)
        accepted = accepted_by_param[param]
        verdict, is_variable = _type_check(param, value, accepted, type_name, expected, nested)
        if not verdict.valid:
            return verdict
        if not is_variable:
            if expected is dict:
                verdict = _check_dict(param, value, accepted)
            elif expected is list and nested is dict:
                verdict = _check_list_of_dicts(param, value, accepted)
            elif expected is str:
                verdict = _check_string(param, value, accepted)
            elif expected is list:
                verdict = _check_list(param, value, accepted)
            else:
                verdict = None
            if verdict is not None:
                if not verdict.valid:
                    return verdict
                continue
        if value not in accepted:
            return AstResult(False, f"Invalid value for parameter {param!r}: {value!r}. Expected one of {accepted}.",
                             "value_error:others")
    for param, accepted in accepted_by_param.items():
        if param not in params and "" not in accepted:
            return AstResult(False, f"Optional parameter {param!r} not provided and not marked as optional.",
                             "simple_function_checker:missing_optional")
    return _OK


def _well_formed(calls) -> bool:
    """BFCL's is_function_calling_format_output: a list of one-key dicts of parameter dicts."""
    return isinstance(calls, list) and all(
        isinstance(c, dict) and len(c) == 1 and isinstance(next(iter(c.values())), dict) for c in calls)


def ast_match(task: BfclTask, calls: Sequence[Call]) -> AstResult:
    """BFCL's AST verdict for ``calls`` (the decoded form ``[{name: {param: value}}, ...]``).

    Irrelevance: valid iff there is no call; live_relevance: valid iff there is one. Otherwise
    see the module docstring.
    """
    calls = list(calls)
    if not _well_formed(calls):
        return AstResult(False, "The output is not a list of {function: {parameter: value}}.",
                         "ast_decoder:decoder_wrong_output_format")
    if not task.relevant:
        if calls:
            return AstResult(False, "Valid syntax. Successfully decode AST when it should not.",
                             "irrelevance_error:decoder_success")
        return _OK
    if task.category == "live_relevance":  # any call; its values are not checked (no possible answer)
        if not calls:
            return AstResult(False, "Invalid syntax. Failed to decode AST when it should have.",
                             "relevance_error:decoder_failed")
        return _OK
    answers = list(task.ground_truth)
    if "parallel" in task.category:
        if len(calls) != len(answers):
            return AstResult(False, "Wrong number of functions.", "parallel_function_checker_no_order:wrong_count")
        matched: set[int] = set()
        for i, answer in enumerate(answers):
            doc = _find_doc(task.functions, next(iter(answer)))
            found = None
            for j, call in enumerate(calls):
                if j not in matched and _check_call(doc, call, answer).valid:
                    found = j
                    break
            if found is None:
                return AstResult(False, f"Could not find a matching function for index {i} of possible answers.",
                                 "parallel_function_checker_no_order:cannot_find_match")
            matched.add(found)
        return _OK
    if "multiple" in task.category:
        if len(calls) != len(answers):
            return AstResult(False, "Wrong number of functions.", "multiple_function_checker:wrong_count")
        return _check_call(_find_doc(task.functions, next(iter(answers[0]))), calls[0], answers[0])
    if len(calls) != 1:
        return AstResult(False, "Wrong number of functions.", "simple_function_checker:wrong_count")
    return _check_call(task.functions[0], calls[0], answers[0])


# -- label-free ------------------------------------------------------------------------------


def _canonical_value(v):
    if isinstance(v, bool) or v is None:
        return v
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str):
        return _standardize(v)
    if isinstance(v, (list, tuple)):
        return [_canonical_value(x) for x in v]
    if isinstance(v, dict):
        return {k: _canonical_value(x) for k, x in sorted(v.items())}
    return repr(v)


def _canonical_calls(calls: Sequence[Call]) -> str:
    items = [json.dumps({name: _canonical_value(args) for name, args in c.items()}, sort_keys=True)
             for c in calls]
    return "\n".join(sorted(items))  # parallel calls count in any order


def call_agreement(samples: Sequence[Sequence[Call] | None]) -> list[float]:
    """Label-free function-calling reward: the share of the other samples that made the same calls.

    Calls are compared after BFCL's normalisation (strings as in the checker,
    ints as floats, argument order and call order ignored). None marks a
    sample whose output could not be parsed: it scores 0 and matches nothing.
    An empty list (no call) is an answer like any other, so that irrelevance
    questions can agree on declining.

    How it is gamed: a group that always declines, or always makes the same
    generic call, agrees perfectly. Pair it with a format component and
    watch the share of empty answers.

    Raises:
        ValueError: fewer than 2 samples.

    >>> a = [{"f": {"x": 1, "s": "New York"}}]
    >>> b = [{"f": {"s": "new york", "x": 1.0}}]
    >>> call_agreement([a, b, [{"f": {"x": 2}}], None])
    [0.3333333333333333, 0.3333333333333333, 0.0, 0.0]
    """
    n = len(samples)
    if n < 2:
        raise ValueError(f"agreement needs at least 2 samples, got {n}")
    keys = [None if s is None else _canonical_calls(s) for s in samples]
    counts = Counter(k for k in keys if k is not None)
    return [0.0 if k is None else (counts[k] - 1) / (n - 1) for k in keys]
