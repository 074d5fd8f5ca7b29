"""The documentation stays true to the code and reads as documentation, not a diary.

- README.md fits one screen (under 200 lines).
- README.md and docs/ never narrate development: no "session" (an identifier that holds the word,
  such as `session_wall_time_s` or `requests.Session`, is allowed: the word must stand alone to be
  caught), no first-person narration ("I ran", "I've", "my"), no commit hashes (7-40 hex characters
  with at least one digit and one letter, standing alone).
- Every CLI flag and every config field has help text, and the generated reference lists them all
  (scripts/gen_reference.py, which `mkdocs build` runs as a hook).
- Every shell command in a fenced block of README.md and docs/ is checked: `selfrl` commands are
  parsed by the real parser, `selfrl run` commands also build and validate their whole config
  (files, flags, environment), and the cheap ones run for real (`--help`, `selfrl envs`,
  `selfrl report` and `selfrl compare` on a tiny run, `examples/show_rollouts.py`); `make` targets
  exist; `pip install` names existing extras and pinned versions; a `python` script exists and
  knows every `--flag` given to it. Any other command must carry the marker `# not run here: <why>`
  (a GPU, a cluster, a server, minutes), which the test recognises; a marked `selfrl` command is
  still parsed. Every key of a TOML block exists in the config, and every `section.field` named in
  inline code is a real field.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import re
import shlex
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
MARKER = "# not run here:"
GENERATED = {DOCS / "reference" / n for n in ("cli.md", "config.md", "registries.md")}


def _gen():
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "scripts" / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def doc_files() -> list[Path]:
    """README.md and every hand-written page of docs/ (the generated reference is checked apart)."""
    return [ROOT / "README.md"] + sorted(p for p in DOCS.rglob("*.md") if p not in GENERATED)


FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```\s*$", re.M | re.S)


def blocks(text: str) -> list[tuple[str, str]]:
    """``[(language, body)]`` of every fenced block."""
    return [(m.group(1).strip(), m.group(2)) for m in FENCE.finditer(text)]


def prose(text: str) -> str:
    """``text`` without fenced blocks and inline code spans."""
    return re.sub(r"`[^`\n]*`", " ", FENCE.sub(" ", text))


# ------------------------------------------------------------------ length and words


def test_the_readme_fits_one_screen():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) < 200, f"README.md has {len(lines)} lines; the rest belongs on the docs site"


SESSION = re.compile(r"(?<![\w.])sessions?(?![\w])", re.I)
FIRST_PERSON = re.compile(r"(?<![\w/])I(?: [a-z]|'(?:m|ve|d|ll)\b)|\b(?:my|mine|myself)\b", re.I)
HEX = re.compile(r"(?<![\w/.-])[0-9a-f]{7,40}(?![\w-])")


def looks_like_a_hash(token: str) -> bool:
    return any(c.isdigit() for c in token) and any(c.isalpha() for c in token)


def diary_words(text: str) -> list[str]:
    """Every "session", first-person narration and commit hash in ``text``, with its line."""
    found = []
    for n, line in enumerate(text.splitlines(), 1):
        found += [f"{n}: session: {line.strip()}" for _ in SESSION.finditer(line)]
        found += [f"{n}: hash {m.group()}: {line.strip()}" for m in HEX.finditer(line) if looks_like_a_hash(m.group())]
    for n, line in enumerate(prose(text).splitlines(), 1):  # narration is prose; code may name a variable I
        found += [f"first person {m.group()!r}: {line.strip()}" for m in FIRST_PERSON.finditer(line)
                  if m.group().startswith("I") or m.group().lower() in ("my", "mine", "myself")]
    return found


def test_the_diary_detector_catches_what_it_must_and_spares_identifiers():
    bad = ("The fifth session ran on another CPU.\nI ran seeds 1 and 2.\nI've measured it at a564add.\n"
           "two runs of mine\nSessions differ.")
    assert len(diary_words(bad)) == 6
    good = ("`session_wall_time_s` in report.md; `requests.Session`; a run of 2026-12-03; 128/128; "
            "I/O; the feedback route; 0x1234abcd; a 16-core machine; chatcmpl-61f813e3024646d9")
    assert diary_words(good) == []


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_diary_in_the_docs(path):
    found = diary_words(path.read_text())
    assert not found, f"{path.relative_to(ROOT)}:\n" + "\n".join(found)


def test_no_diary_in_the_generated_reference(tmp_path):
    paths = _gen().write(tmp_path)
    found = [f"{p.name}: {w}" for p in paths for w in diary_words(p.read_text())]
    assert not found, "\n".join(found)


def test_every_fence_names_its_language():
    """A block without a language would hide a command from the command check below."""
    bare = [f"{p.relative_to(ROOT)}: {body[:60]!r}" for p in doc_files()
            for lang, body in blocks(p.read_text()) if not lang]
    assert not bare, "\n".join(bare)


# ------------------------------------------------------------------ help texts and the generated reference


def test_every_cli_flag_and_config_field_has_help():
    assert _gen().missing_help() == []


def test_the_help_check_fails_on_a_field_or_flag_without_help():
    import argparse

    gen = _gen()

    @dataclasses.dataclass
    class Table:
        documented: int = 1  # what it is
        bare: int = 2
        described: int = dataclasses.field(default=3, metadata={"help": "from metadata"})

    rows = {r["key"]: r["help"] for r in gen.config_rows(Table)[0][2]}
    assert rows == {"documented": "what it is", "bare": "", "described": "from metadata"}
    p = argparse.ArgumentParser()
    p.add_argument("--with-help", help="says what")
    p.add_argument("--without-help")
    assert {r["name"]: r["help"] for r in gen.flag_rows(p)} == {"--with-help": "says what", "--without-help": ""}


def test_the_help_says_what_a_config_file_is_and_shows_the_defaults():
    """--config is a TOML file documented in docs/reference/config.md (not a source file to read);
    every flag of simulate and serve that sets a field with a default shows it."""
    from selfrl.cli import SERVE_FLAGS, SIMULATE_FLAGS, build_parser

    gen = _gen()
    subs = gen.subcommands(build_parser())
    for name in ("run", "serve", "sampler", "simulate"):
        [help_] = [a.help for a in subs[name]._actions if "--config" in a.option_strings]
        of = "run" if name == "sampler" else name  # the sampler reads a run's config
        assert help_.startswith(f"TOML config file of selfrl {of}") and "docs/reference/config.md" in help_, name
        assert ".py" not in help_ and "ServeConfig" not in help_ and "SimulateConfig" not in help_, name
    for name, flags, expected in (("simulate", SIMULATE_FLAGS, {"--seed": "(default: 0)", "--max-seconds":
                                   "(default: 3600)", "--out": "(default: runs/simulate)"}),
                                  ("serve", SERVE_FLAGS, {"--min-batch": "(default: 32)", "--val-size": "(default: 64)",
                                                          "--feedback-wait": "(default: 120)"})):
        helps = {a.option_strings[0]: a.help for a in subs[name]._actions if a.option_strings}
        for flag, shown in expected.items():
            assert helps[flag].endswith(shown), (flag, helps[flag])
        missing = [f for f in flags if "default" not in helps[f] and f not in ("--sampler",)]  # --sampler: none
        assert missing == [], name


def test_the_generated_reference_lists_every_flag_and_field():
    import argparse

    from selfrl.cli import build_parser
    from selfrl.config import RunConfig

    gen = _gen()
    cli, config = gen.cli_reference(), gen.config_reference()
    for name, sub in gen.subcommands(build_parser()).items():
        assert f"## `selfrl {name}`" in cli
        for action in sub._actions:
            for flag in [] if isinstance(action, argparse._HelpAction) else action.option_strings:
                assert f"`{flag}" in cli or f", {flag}`" in cli, (name, flag)
    for section, cls, rows in gen.config_rows(RunConfig):
        for row in rows:
            assert f"`{row['key']}`" in config, (section, row["key"])
    assert "{#selfrl-run-train}" in config and "`learning_rate` | `float` | `0.0001` | AdamW learning rate" in config


def _section_table(config: str, anchor: str) -> dict[str, str]:
    """``{key: default}`` of the table under the heading with ``{#anchor}`` of the config page."""
    text = config.split("{#" + anchor + "}", 1)[1].split("\n### ", 1)[0]
    return {m.group(1): m.group(2) for m in re.finditer(r"^\| `(\w+)` \| [^|]*(?:\\\|[^|]*)* \| `?([^|`]*)`? \|", text, re.M)}


def test_the_generated_reference_shows_the_defaults_each_command_really_uses():
    from selfrl.config import GateConfig, RunConfig
    from selfrl.config.serve import ServeConfig

    config = _gen().config_reference()
    serve_gate, run_gate = _section_table(config, "selfrl-serve-gate"), _section_table(config, "selfrl-run-gate")
    assert (ServeConfig().gate.val_size, ServeConfig().gate.eval_every) == (64, 1)  # serve's own GateConfig
    assert (GateConfig().val_size, GateConfig().eval_every) == (128, 4) == (RunConfig().gate.val_size, RunConfig().gate.eval_every)
    assert (serve_gate["val_size"], serve_gate["eval_every"]) == ("64", "1")
    assert (run_gate["val_size"], run_gate["eval_every"]) == ("128", "4")
    assert _section_table(config, "selfrl-serve-sampler")["kind"] == '"vllm"'
    assert _section_table(config, "selfrl-run-sampler")["kind"] == '"selfrl"'


# ------------------------------------------------------------------ commands in the docs


def shell_commands(path: Path) -> list[tuple[list[str], str, str]]:
    """``[(argv, marker reason or "", line)]`` for every command of every bash block of ``path``;
    ``&&``, ``;`` and ``|`` split a line into commands, and leading VAR=value pairs are dropped."""
    out = []
    for lang, body in blocks(path.read_text()):
        if lang not in ("bash", "sh", "shell"):
            continue
        for line in body.replace("\\\n", " ").splitlines():
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            reason = line.split(MARKER, 1)[1].strip() if MARKER in line else ""
            lex = shlex.shlex(line, posix=True, punctuation_chars=";&|")
            lex.whitespace_split, lex.commenters = True, "#"
            argv: list[str] = []
            for tok in list(lex) + [";"]:
                if tok in (";", "&&", "||", "|", "&"):
                    while argv and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", argv[0]):
                        argv.pop(0)
                    if argv:
                        out.append((argv, reason, line.strip()))
                    argv = []
                else:
                    argv.append(tok)
    return out


ALL_COMMANDS = [(p, argv, reason, line) for p in doc_files() for argv, reason, line in shell_commands(p)]
SETUP = {"export", "cd", ".", "source", "mkdir", "python3"}  # python3 only as `python3 -m venv`


def _id(item) -> str:
    path, argv, _, _ = item
    return f"{path.relative_to(ROOT)}:{' '.join(argv)[:60]}"


def test_the_docs_have_commands_to_check():
    programs = {argv[0] for _, argv, _, _ in ALL_COMMANDS}
    assert {"selfrl", "make", "pip", "python"} <= programs and len(ALL_COMMANDS) > 80


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, tiny_tokenizer):
    """A finished one-iteration run on a tiny model: what `selfrl report`, `selfrl compare` and
    `examples/show_rollouts.py` are run against."""
    from conftest import save_tiny_phi

    from selfrl.cli import main

    d = tmp_path_factory.mktemp("docs_run")
    model = save_tiny_phi(d / "model", tiny_tokenizer)
    argv = ["run", "--model", str(model), "--run-dir", str(d / "run"), "--iterations", "1", "--num-prompts", "2",
            "--num-generations", "2", "--val-size", "2", "--lora-r", "2"]
    assert main(argv) == 0
    return d / "run"


def run_config(args):
    """The RunConfig a parsed `selfrl run` command builds (as the CLI does), validated."""
    from selfrl.cli import RUN_FLAGS
    from selfrl.envs import load_run_config

    overrides = {key: getattr(args, flag[2:].replace("-", "_")) for flag, (key, _, _) in RUN_FLAGS.items()}
    overrides["task.source"] = args.env if args.env is not None else args.task
    overrides["train.gradient_checkpointing"] = args.gradient_checkpointing
    overrides["warm_start.enabled"] = args.warm_start
    overrides["async_rollouts"] = args.async_rollouts
    config = None if args.config is None else ROOT / args.config
    return load_run_config(config, overrides)


def check_selfrl(argv, reason, tiny_run, tmp_path, capsys):
    from selfrl.cli import build_parser, main

    args_ = argv[1:]
    if "--help" in args_ or "-h" in args_:
        with pytest.raises(SystemExit) as e:
            main(args_)
        assert e.value.code == 0 and "usage: selfrl" in capsys.readouterr().out
        return
    try:
        args = build_parser().parse_args(args_)
    except SystemExit as e:
        pytest.fail(f"the parser refuses {' '.join(argv)}: {capsys.readouterr().err}")
        raise AssertionError from e
    if getattr(args, "config", None) and not reason:  # a marked command may name the user's own file
        assert (ROOT / args.config).is_file(), f"no such config file: {args.config}"
    if args.command == "envs":
        assert main(args_) == 0 and "arithmetic" in capsys.readouterr().out
    elif args.command == "report" and not reason:
        assert main(["report", str(tiny_run), "--out", str(tmp_path / "rep")]) == 0
        assert (tmp_path / "rep" / "report.md").exists()
    elif args.command == "compare" and not reason:
        assert main(["compare", str(tiny_run), str(tiny_run), "--out", str(tmp_path / "cmp")]) == 0
    elif args.command == "run" and not args.resume and "GPU" not in reason and "network" not in reason:
        cfg = run_config(args)  # files, flags and the environment's own defaults, all checked
        assert cfg.iterations >= 1


def check_make(argv):
    makefile = (ROOT / "Makefile").read_text()
    for target in (a for a in argv[1:] if "=" not in a):
        assert re.search(rf"^{re.escape(target)}:", makefile, re.M), f"no make target {target!r}"


def check_pip(argv):
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pins = (ROOT / "pyproject.toml").read_text() + (ROOT / "Makefile").read_text()
    assert argv[1] == "install", argv
    for arg in argv[2:]:
        if arg.startswith("-") and not arg.startswith(("-e", "--no-deps", "-q")):
            pytest.fail(f"unexpected pip option {arg}")
        m = re.fullmatch(r"(?:\.|selfrl)\[([\w,-]+)\]", arg)
        if m:
            unknown = set(m.group(1).split(",")) - set(extras)
            assert not unknown, f"no such extra {unknown}"
        elif "==" in arg:
            assert arg in pins, f"{arg} is not the version pinned in pyproject.toml or the Makefile"


def _flags_known(script: Path) -> str:
    """The source of ``script`` and of the modules beside it that it imports (a shared parser)."""
    text = script.read_text()
    for node in ast.walk(ast.parse(text)):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
        for name in names:
            sibling = script.parent / f"{name.split('.')[0]}.py"
            if sibling.is_file() and sibling != script:
                text += sibling.read_text()
    return text


def check_python(argv, tiny_run, tmp_path):
    if argv[1] == "-m":
        assert argv[2] == "venv" or importlib.util.find_spec(argv[2]) is not None, argv
        return
    script = ROOT / argv[1]
    assert script.is_file(), f"no such script {argv[1]}"
    known = _flags_known(script)
    for flag in (a.split("=")[0] for a in argv[2:] if a.startswith("--")):
        assert f'"{flag}"' in known, f"{argv[1]} has no flag {flag}"
    if argv[1] == "examples/show_rollouts.py":
        import subprocess

        out = subprocess.run([sys.executable, str(script), str(tiny_run), *argv[3:]], capture_output=True, text=True,
                             env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=300)
        assert out.returncode == 0 and "rewards:" in out.stdout, out.stderr


@pytest.mark.parametrize("item", ALL_COMMANDS, ids=_id)
def test_a_command_in_the_docs_is_real(item, tiny_run, tmp_path, capsys, monkeypatch):
    path, argv, reason, line = item
    monkeypatch.syspath_prepend(str(ROOT))  # `PYTHONPATH=. selfrl ...`: the examples import as a package
    program = argv[0].removeprefix(".venv/bin/")
    if program == "selfrl":
        check_selfrl(argv, reason, tiny_run, tmp_path, capsys)
    elif program == "make":
        check_make(argv)
    elif program == "pip":
        check_pip(argv)
    elif program in ("python", "python3") and (argv[1:2] != ["-c"]):
        check_python(argv, tiny_run, tmp_path)
    elif program not in SETUP:
        assert reason, f"{path.relative_to(ROOT)}: `{line}` is neither checked nor marked `{MARKER} <why>`"


# ------------------------------------------------------------------ config keys


def _config_classes():
    from selfrl.config import RunConfig
    from selfrl.config.serve import ServeConfig
    from selfrl.config.simulate import SimulateConfig

    return RunConfig, ServeConfig, SimulateConfig


def unknown_keys(table: dict, cls, where: str = "") -> list[str]:
    """Keys of ``table`` (a parsed TOML block) that ``cls`` does not have, with their path."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    bad = []
    for key, value in table.items():
        f = fields.get(key)
        if f is None:
            bad.append(where + key)
            continue
        item = f.metadata.get("table_of")
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if item is not None:
            for i, v in enumerate(value):
                bad += unknown_keys(v, item, f"{where}{key}[{i}].")
        elif dataclasses.is_dataclass(default):
            bad += unknown_keys(value, type(default), f"{where}{key}.")
    return bad


TOML_BLOCKS = [(p, body) for p in doc_files() for lang, body in blocks(p.read_text())
               if lang == "toml" and not body.startswith(("[project", "--8<--"))]


@pytest.mark.parametrize("item", TOML_BLOCKS, ids=lambda i: f"{i[0].relative_to(ROOT)}:{i[1][:30]}")
def test_every_key_of_a_toml_block_exists(item):
    path, body = item
    table = tomllib.loads(body)
    problems = [unknown_keys(table, cls) for cls in _config_classes()]
    assert min(problems, key=len) == [], f"{path.relative_to(ROOT)}: unknown keys {min(problems, key=len)}"


def test_every_section_field_named_in_the_prose_exists():
    sections = {}
    for cls in _config_classes():
        for f in dataclasses.fields(cls):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            if dataclasses.is_dataclass(default):
                sections.setdefault(f.name, set()).update(g.name for g in dataclasses.fields(default))
    missing = []
    for path in doc_files():
        for span in re.findall(r"`([a-z_]+)\.([a-z_0-9]+)`", path.read_text()):
            if span[0] in sections and span[1] not in sections[span[0]]:
                missing.append(f"{path.relative_to(ROOT)}: {'.'.join(span)}")
    assert not missing, "\n".join(missing)


DOC_PATH = re.compile(r"\bdocs/[A-Za-z0-9_./-]+\.md\b")


def _doc_paths_named_in_code() -> list[tuple[str, str]]:
    """``(file, docs/....md)`` for every docs page named in code, configs, scripts and the Makefile
    (error messages and docstrings send users there)."""
    files = [p for d in ("selfrl", "scripts", "configs", "examples", "benchmarks") for p in (ROOT / d).rglob("*")
             if p.suffix in (".py", ".toml") and "swe-repos" not in p.parts] + [ROOT / "Makefile"]
    return sorted({(str(f.relative_to(ROOT)), m) for f in files for m in DOC_PATH.findall(f.read_text())})


def _generated_pages() -> set[str]:
    """The reference pages ``scripts/gen_reference.py`` writes at build time (gitignored, so absent
    from a clean clone until ``make docs``)."""
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "scripts" / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return {f"docs/reference/{name}" for name in module.PAGES}


def test_help_that_names_a_generated_page_says_how_to_make_it():
    """A fresh clone lacks the generated pages until ``make docs``: every help text of the
    console script that points at one says so."""
    from selfrl.cli import build_parser

    gen, pages = _gen(), _generated_pages()
    helps = [a.help or "" for sub in gen.subcommands(build_parser()).values() for a in sub._actions]
    naming = [h for h in helps if any(page in h for page in pages)]
    assert len(naming) >= 4  # --config of run, serve, sampler and simulate
    assert [h for h in naming if "make docs" not in h] == []


def test_the_generated_reference_pages_are_ignored_by_git():
    ignored = set((ROOT / ".gitignore").read_text().split())
    assert _generated_pages() == {"docs/reference/cli.md", "docs/reference/config.md", "docs/reference/registries.md"}
    assert _generated_pages() <= ignored


def test_every_docs_page_named_in_the_code_exists():
    named = _doc_paths_named_in_code()
    assert len(named) > 10  # the scan reads the tree (selfrl names dozens of pages)
    generated = _generated_pages()
    missing = [f"{where}: {page}" for where, page in named
               if page not in generated and not (ROOT / page).is_file()]
    assert not missing, "pages named in the code that the docs do not have:\n" + "\n".join(missing)


@pytest.mark.parametrize("page", ["README.md", "docs/get-started/install.md"])
def test_the_extras_table_lists_every_extra_of_pyproject(page):
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    assert {"serve", "simulate", "browser", "bench"} <= extras  # the scan reads the real pyproject
    listed = set(re.findall(r"^\| `([\w-]+)` \|", (ROOT / page).read_text(), re.M))
    assert extras - listed == set(), f"{page}'s table of extras leaves out {sorted(extras - listed)}"
    assert listed & extras == extras
