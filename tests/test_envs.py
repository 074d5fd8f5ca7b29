"""The environment API: registry, dotted paths, entry points, aliases, config layering, `selfrl envs`."""

from __future__ import annotations

import importlib.metadata
import sys
import types

import pytest

from selfrl.config import ConfigError
from selfrl.envs import Env, available_envs, describe_envs, get_env, get_task_source, load_run_config, register_env
from selfrl.envs.arithmetic import CHAIN_SUM_SMALL, ReasoningGymEnv
from selfrl.envs.rewards import get_preset
from selfrl.core.tasks import Task


def test_builtin_environments_are_listed_one_line_each(capsys):
    from selfrl.cli import main

    assert main(["envs"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split()[0] for line in lines] == ["arithmetic", "code", "function_calling", "swe", "web", "webshop"]
    assert "chain_sum" in lines[0] and "basic_arithmetic" in lines[0]  # aliases on their environment's line


def test_arithmetic_alias_keeps_the_task_ids_of_older_runs():
    old = get_task_source("chain_sum")  # the name before environments existed
    new = get_env("arithmetic")
    assert isinstance(old, ReasoningGymEnv) and old.config == CHAIN_SUM_SMALL == new.config
    assert [t.id for t in old.sample(5, 3)] == [t.id for t in new.sample(5, 3)]
    assert new.sample(1, 3)[0].source == "chain_sum"


def test_unknown_name_lists_the_valid_ones():
    with pytest.raises(ValueError) as err:
        get_env("no_such_env")
    for name in ("arithmetic", "code", "function_calling", "webshop", "rg:<dataset>", "package.module:Name"):
        assert name in str(err.value)
    with pytest.raises(ValueError, match="cannot load environment 'no_such_module:X'"):
        get_env("no_such_module:X")
    with pytest.raises(ValueError, match="already registered"):
        register_env("webshop", ReasoningGymEnv)


class _Echo(Env):
    name = "echo"
    description = "echo the word"
    config_defaults = {"rollout.tools": [], "rollout.max_turns": 1, "gate.val_size": 3}

    def sample(self, n, seed):
        return [Task.make(self.name, f"say {w}", w) for w in ("a", "b", "c", "d", "e", "f")[:n]]

    def score(self, task, answer):
        return float(answer == task.answer)


def test_dotted_path_and_entry_point_load_a_third_party_env(monkeypatch):
    mod = types.ModuleType("thirdparty_envs")
    mod.Echo = _Echo
    monkeypatch.setitem(sys.modules, "thirdparty_envs", mod)
    assert isinstance(get_env("thirdparty_envs:Echo"), _Echo)
    ep = importlib.metadata.EntryPoint("echo", "thirdparty_envs:Echo", "selfrl.envs")
    real = importlib.metadata.entry_points
    monkeypatch.setattr(importlib.metadata, "entry_points",
                        lambda **kw: [ep] if kw.get("group") == "selfrl.envs" else real(**kw))
    assert isinstance(get_env("echo"), _Echo) and "echo" in available_envs()
    assert ("echo", "entry point thirdparty_envs:Echo") in describe_envs()
    mod.NotEnv = lambda: object()
    with pytest.raises(ValueError, match="not a selfrl.envs.Env"):
        get_env("thirdparty_envs:NotEnv")


class _NeedsPath(_Echo):
    def __init__(self, path, *, level=1, mode):
        super().__init__()


def test_a_dotted_env_missing_required_options_is_one_line_that_names_them(monkeypatch):
    mod = types.ModuleType("thirdparty_needs")
    mod.Needs = _NeedsPath
    monkeypatch.setitem(sys.modules, "thirdparty_needs", mod)
    with pytest.raises(ValueError, match=r"needs the option\(s\) 'path', 'mode': set them in the options of \[task\] "
                       r"in the config file \(--config\), e\.g\. options = \{ path = \.\.\., mode = \.\.\. \}"):
        get_env("thirdparty_needs:Needs")
    with pytest.raises(ValueError, match=r"needs the option\(s\) 'mode':"):
        get_env("thirdparty_needs:Needs", path="p")
    assert isinstance(get_env("thirdparty_needs:Needs", path="p", mode="m"), _NeedsPath)


def test_env_defaults_sit_under_file_and_flags(monkeypatch, tmp_path):
    mod = types.ModuleType("thirdparty_envs")
    mod.Echo = _Echo
    monkeypatch.setitem(sys.modules, "thirdparty_envs", mod)
    cfg = load_run_config(None, {"task.source": "thirdparty_envs:Echo"})
    assert (cfg.rollout.tools, cfg.rollout.max_turns, cfg.gate.val_size) == ([], 1, 3)
    toml = tmp_path / "c.toml"
    toml.write_text('[task]\nsource = "thirdparty_envs:Echo"\n[rollout]\nmax_turns = 4\n')
    cfg = load_run_config(toml, {"gate.val_size": 5})
    assert (cfg.rollout.max_turns, cfg.gate.val_size, cfg.rollout.tools) == (4, 5, [])  # file, flag, env default
    assert load_run_config(None, {"task.source": "chain_sum"}).rollout.tools == ["calculator"]  # unchanged defaults
    code = load_run_config(None, {"task.source": "code"})
    assert (code.preset, code.rollout.tools) == ("code", ["run_python"])
    with pytest.raises(ConfigError, match="unknown environment 'nope'"):
        load_run_config(None, {"task.source": "nope"})


def test_split_is_disjoint_for_every_builtin_env():
    for name, (n_train, n_val) in {"arithmetic": (50, 20), "webshop": (20, 8), "code": (100, 48),
                                   "function_calling": (200, 50)}.items():
        train, val = get_env(name).split(n_train, n_val, 1000, 2000)
        assert len(val) == n_val and not {t.id for t in train} & {t.id for t in val}, name
    with pytest.raises(ValueError) as err:
        get_env("code").split(150, 48, 0, 0)
    assert str(err.value) == ("code: 150 training + 48 held-out problems exceed the 164 there are in the humaneval "
                              "tier; lower task.num_train or gate.val_size (with task.num_train = 150, gate.val_size "
                              "can be at most 14)")
    train, val = get_env("code").split(150, 14, 0, 0)  # the limit it names is accepted
    assert (len(train), len(val)) == (150, 14)


def test_tasks_module_imports_no_environment():
    import ast
    from pathlib import Path

    import selfrl.core.tasks

    tree = ast.parse(Path(selfrl.core.tasks.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | {
        a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not any(m and m.startswith("selfrl.envs") for m in imported) and "reasoning_gym" not in imported


@pytest.mark.parametrize("env", ["code", "function_calling"])
def test_selfrl_run_env_works_end_to_end_on_a_tiny_model(env, tmp_path, tiny_tokenizer, capsys):
    """`selfrl run --env code|function_calling` with the environment's own defaults: tools, preset,
    splits, sandboxed scoring; one iteration on a tiny model."""
    from conftest import save_tiny_phi

    from selfrl.cli import main
    from selfrl.record.store import Store

    model = save_tiny_phi(tmp_path / "model", tiny_tokenizer)
    args = ["run", "--env", env, "--model", str(model), "--run-dir", str(tmp_path / "r"), "--iterations", "1",
            "--num-prompts", "2", "--num-generations", "2", "--val-size", "3", "--lora-r", "4"]
    assert main(args) == 0, capsys.readouterr().err
    with Store(tmp_path / "r" / "selfrl.db") as store:
        trajs = store.trajectories()
        events = [e["kind"] for e in store.events()]
    preset = {"code": "code", "function_calling": "function_calling"}[env]
    assert len(trajs) == 4 and all(set(t.rewards) == set(get_preset(preset)) for t in trajs)
    assert "preflight" in events
    if env == "function_calling":
        assert all(t.env_state is not None and "calls" in t.env_state for t in trajs)


def test_env_and_task_flags_agree_or_are_refused(capsys):
    from selfrl.cli import main

    assert main(["run", "--env", "code", "--task", "chain_sum"]) == 2
    assert "--env code and --task chain_sum disagree" in capsys.readouterr().err


def test_a_builtin_environment_that_fails_to_import_is_named_and_the_others_load():
    import subprocess
    import sys

    # a fresh interpreter where importing the web environment fails (as a missing dependency would)
    code = """
import sys
sys.modules["selfrl.envs.web"] = None
from selfrl.envs import describe_envs, get_env
from selfrl.envs.builtin import load_builtin_envs
failed = load_builtin_envs()
assert list(failed) == ["web"] and "ModuleNotFoundError" in failed["web"], failed
assert get_env("webshop").name == "webshop" and get_env("chain_sum").name == "chain_sum"
try:
    get_env("web")
except ValueError as e:
    print(e)
print(dict(describe_envs())["web"])
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    error, listed = out.stdout.strip().splitlines()
    assert error.startswith("the built-in environment 'web' failed to import: ModuleNotFoundError") and "others loaded" in error
    assert listed.startswith("did not load: ModuleNotFoundError")


def test_selfrl_envs_imports_the_named_modules_first(monkeypatch, capsys):
    from pathlib import Path

    from selfrl.cli import main
    from selfrl.envs import registry
    from selfrl.envs.rewards import PRESET_DOCS, PRESETS, REWARD_FUNCS
    from selfrl.safety.detectors import TRAJECTORY_DETECTORS

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))  # the repository root: examples/
    try:
        assert main(["envs", "examples.guess_env"]) == 0
        assert any(line.split()[0] == "guess" for line in capsys.readouterr().out.splitlines())
        assert main(["envs", "no_such_module_here"]) == 2
        assert "cannot import 'no_such_module_here'" in capsys.readouterr().err
    finally:  # what the example registers on import, gone again (tests/test_docs_environments.py imports it too)
        for table, key in ((registry._REGISTRY, "guess"), (TRAJECTORY_DETECTORS, "guess_spray"),
                           (REWARD_FUNCS, "guess_economy"), (PRESETS, "guess"), (PRESET_DOCS, "guess")):
            table.pop(key, None)
        sys.modules.pop("examples.guess_env", None)


def test_selfrl_envs_refuses_a_dotted_name_whose_attribute_is_missing(monkeypatch, capsys):
    from pathlib import Path

    from selfrl.cli import main
    from selfrl.envs import registry
    from selfrl.envs.rewards import PRESET_DOCS, PRESETS, REWARD_FUNCS
    from selfrl.safety.detectors import TRAJECTORY_DETECTORS

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))
    try:
        assert main(["envs", "examples.guess_env:Nope"]) == 2
        err = capsys.readouterr().err.strip()
        assert err == ("selfrl: error: 'examples.guess_env:Nope': examples.guess_env.Nope does not exist; name an "
                       "Env class or factory defined in examples.guess_env, or give the module alone "
                       "(selfrl envs examples.guess_env)")
        assert main(["envs", "examples.guess_env:LOW"]) == 2  # a number, not a factory
        assert "examples.guess_env.LOW is not a class or factory" in capsys.readouterr().err
        assert main(["envs", "examples.guess_env:GuessEnv"]) == 0
        assert any(line.split()[0] == "guess" for line in capsys.readouterr().out.splitlines())
    finally:
        for table, key in ((registry._REGISTRY, "guess"), (TRAJECTORY_DETECTORS, "guess_spray"),
                           (REWARD_FUNCS, "guess_economy"), (PRESETS, "guess"), (PRESET_DOCS, "guess")):
            table.pop(key, None)
        sys.modules.pop("examples.guess_env", None)


def _forwards(**options):  # a factory whose signature hides what it needs: the check cannot see 'path'
    return _NeedsPath(**options)


def _by_position(path, /):
    return _Echo()


@pytest.fixture
def needy_envs(monkeypatch):
    mod = types.ModuleType("needy_envs")
    mod.Needs, mod.forwards, mod.by_position = _NeedsPath, _forwards, _by_position
    monkeypatch.setitem(sys.modules, "needy_envs", mod)


def test_an_env_that_refuses_its_arguments_is_a_value_error_naming_the_table(needy_envs):
    from selfrl.envs.agents import AgentsEnv
    from selfrl.config import AgentConfig

    with pytest.raises(ValueError, match=r"environment 'needy_envs:forwards' cannot be built with the options given "
                       r"\(none\): TypeError: .*'path'.*; set the options it takes in the options of \[task\]"):
        get_env("needy_envs:forwards")
    with pytest.raises(ValueError, match=r"cannot be built with the options given \(path\): TypeError: .*'mode'"):
        get_env("needy_envs:forwards", path="p")
    with pytest.raises(ValueError, match=r"takes 'path' by position only, which options cannot give"):
        get_env("needy_envs:by_position")
    with pytest.raises(ValueError, match=r"agent a: .* needs the option\(s\) 'path', 'mode': set them in the "
                       r"options of \[\[agents\]\] 'a' in the config file"):
        AgentsEnv([AgentConfig(name="a", source="needy_envs:Needs")])


@pytest.mark.parametrize("source, expected", [
    ("needy_envs:Needs", "needs the option(s) 'path', 'mode': set them in the options of {table} in the config file"),
    ("needy_envs:forwards", "cannot be built with the options given (none): TypeError:"),
])
def test_every_command_that_builds_an_env_refuses_missing_arguments_in_one_line(
        needy_envs, source, expected, tmp_path, capsys, monkeypatch):
    """selfrl run --env, selfrl serve --task and serve's [[families]]: exit 2, one line that names
    the table to set the options in; nothing loads."""
    from selfrl.cli import main

    loaded = []
    monkeypatch.setattr("selfrl.model.load.build_policy", lambda cfg: loaded.append(cfg))  # must not be reached
    toml = tmp_path / "families.toml"
    toml.write_text(f'[[families]]\nname = "fam"\nsource = "{source}"\n')
    for args, table in ((["run", "--env", source, "--run-dir", str(tmp_path / "r")], "[task]"),
                        (["serve", "--task", source, "--run-dir", str(tmp_path / "s")], "[task]"),
                        (["serve", "--config", str(toml), "--run-dir", str(tmp_path / "s")], "[[families]] 'fam'")):
        assert main(args) == 2, args
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("selfrl: error: "), err
        assert expected.format(table=table) in err, (args, err)
        assert table in err, (args, err)
    assert loaded == [] and not (tmp_path / "r").exists()
