"""Each agent's (``[[agents]]``) and family's (``[[families]]``) own rollout settings
(``rollout = {...}``): its trajectories run under them, in training and validation, beside
another agent's under ``[rollout]``; a key that cannot differ per task, or a bad value, is
refused when the config is checked."""

import copy
import re

import pytest
import torch

from selfrl.config import AgentConfig, ConfigError, FamilyConfig, RolloutConfig, load_config
from selfrl.core.tools import resolve_tools
from selfrl.engines.reference import Engine
from selfrl.envs.agents import AgentsEnv, untag
from selfrl.rollout.agent import rollout
from serving import tiny_serve_config

CONSTRAINED = {"constrain": "tool_call", "max_turns": 1, "stop_at_tool_call": True}


def by_agent(trajs):
    out = {}
    for t in trajs:
        out.setdefault(t.task_id.partition("/")[0], []).append(t)
    return out


def test_agents_roll_out_under_their_own_settings_in_one_batch(tiny_tokenizer, tiny_model_factory):
    """The batched path (reference engine): the constrained agent's rows sample under the
    tool-call grammar, stop at one turn, and the free agent's rows under none, in one rollout."""
    env = AgentsEnv([AgentConfig("fc", "chain_sum", rollout=dict(CONSTRAINED)), AgentConfig("math", "chain_sum")])
    train, _ = env.split(4, 2, 0, 1)
    assert train[0].metadata["rollout"] == CONSTRAINED and "rollout" not in train[1].metadata
    assert "rollout" not in untag(train[0]).metadata  # the agent's environment never sees the tag
    cfg = RolloutConfig(max_turns=3, max_new_tokens=12, temperature=1.0)
    torch.manual_seed(0)
    model = tiny_model_factory(eos_bias=-5.0)  # rarely ends a turn: the free rows run to their token limit
    trajs = rollout(Engine(model, tiny_tokenizer), train, [t.id for t in train], resolve_tools(cfg.tools), cfg,
                    env_factory=env.make_env)
    rows = by_agent(trajs)
    assert len(rows["fc"]) == 4 and len(rows["math"]) == 4
    for t in rows["fc"]:
        assert t.num_turns == 1 and [c["kind"] for c in t.constraints] == ["tool_call"]
        assert t.constraints[0]["start"] == t.prompt_len
    assert all(t.constraints == [] for t in rows["math"])


def serve_config(tmp_path):
    cfg = tiny_serve_config(tmp_path / "run")
    cfg.rollout.max_turns = 2
    cfg.families = [FamilyConfig("fc", "chain_sum", rollout=dict(CONSTRAINED)), FamilyConfig("arith", "chain_sum")]
    return cfg


def test_serve_validates_each_family_under_its_own_settings(tiny_tokenizer, tiny_model_factory, tmp_path,
                                                           monkeypatch):
    """The gate's validation of version 0 (the slot engine's pipelined path, as selfrl serve
    runs it): the constrained family's trajectories record the grammar, the other's none."""
    import selfrl.safety.gate as gate
    from selfrl.serve.service import Service

    seen = []

    def spy(*args, **kwargs):
        trajs = rollout(*args, **kwargs)
        seen.extend(trajs)
        return trajs

    monkeypatch.setattr(gate, "rollout", spy)
    cfg = serve_config(tmp_path)
    cfg.engine = "slots"
    model = tiny_model_factory(lora=True, eos_bias=-5.0)
    service = Service(model, tiny_tokenizer, cfg.validate(), learner_model=copy.deepcopy(model))
    try:
        service.learner.ensure_champion_validated()
    finally:
        service.close()
    rows = by_agent(seen)
    assert len(rows["fc"]) == 4 and len(rows["arith"]) == 4
    for t in rows["fc"]:
        assert t.num_turns == 1 and [c["kind"] for c in t.constraints] == ["tool_call"]
    assert all(t.constraints == [] for t in rows["arith"])


@pytest.mark.parametrize("own, message", [
    ({"constrain": "json"}, "families[0] (fc).rollout.constrain must be one of 'none', 'tool_call', got 'json'"),
    ({"max_turns": 0}, "families[0] (fc).rollout.max_turns must be >= 1"),
    ({"stop_at_tool_call": "yes"}, "families[0] (fc).rollout.stop_at_tool_call must be true or false"),
    ({"temperature": 0.5}, "families[0] (fc).rollout.temperature cannot differ per agent or family"),
])
def test_a_bad_family_rollout_setting_is_refused(tmp_path, own, message):
    cfg = serve_config(tmp_path)
    cfg.families[0].rollout = own
    with pytest.raises(ConfigError, match=re.escape(message)):
        cfg.validate()


def test_agents_rollout_tables_parse_and_are_checked(tmp_path):
    toml = tmp_path / "a.toml"
    toml.write_text('[[agents]]\nname = "fc"\nsource = "chain_sum"\n'
                    'rollout = { constrain = "tool_call", max_turns = 1, stop_at_tool_call = true }\n'
                    '[[agents]]\nname = "math"\nsource = "chain_sum"\n')
    cfg = load_config(toml)
    assert [a.rollout for a in cfg.agents] == [CONSTRAINED, {}]
    toml.write_text('[[agents]]\nname = "fc"\nsource = "chain_sum"\nrollout = { constrain = "grammar" }\n')
    with pytest.raises(ConfigError, match=re.escape("agents[0] (fc).rollout.constrain must be one of 'none', "
                                                    "'tool_call', got 'grammar'")):
        load_config(toml)
    toml.write_text('[[agents]]\nname = "fc"\nsource = "chain_sum"\nrollout = { max_new_tokens = 8 }\n')
    with pytest.raises(ConfigError, match=r"max_new_tokens cannot differ per agent or family .* the keys that can: "
                                          r"constrain, max_turns"):
        load_config(toml)


def test_an_agent_constrained_with_a_remote_sampler_is_refused(tmp_path):
    toml = tmp_path / "a.toml"
    toml.write_text('[sampler]\nurl = "http://127.0.0.1:9"\n[[agents]]\nname = "fc"\nsource = "chain_sum"\n'
                    'rollout = { constrain = "tool_call" }\n')
    with pytest.raises(ConfigError, match=re.escape("agents[0] (fc).rollout.constrain = 'tool_call' needs the "
                                                    "in-process engine's grammar constraints")):
        load_config(toml)


def test_an_agent_with_an_unknown_tool_is_refused():
    with pytest.raises(ValueError, match="agent fc: rollout.tools: .*unknown tool 'abacus'"):
        AgentsEnv([AgentConfig("fc", "chain_sum", rollout={"tools": ["abacus"]})])


VALID_KEYS = "constrain, max_turns, stop_at_tool_call, system_prompt, tools, demonstration"


@pytest.mark.parametrize("own, message", [
    ({"max_turn": 1}, f"unknown key 'max_turn' in families[0] (fc).rollout; valid keys: {VALID_KEYS}"),
    ({"tool": ["calculator"], "sytem_prompt": "x"},
     f"unknown keys 'sytem_prompt', 'tool' in families[0] (fc).rollout; valid keys: {VALID_KEYS}"),
    ({"max_new_tokens": 8}, "families[0] (fc).rollout.max_new_tokens cannot differ per agent or family (one value "
                            f"for every trajectory of a batch); the keys that can: {VALID_KEYS}"),
    ({"tools_prompt": "json"}, "families[0] (fc).rollout.tools_prompt cannot differ per agent or family (one value "
                               f"for every trajectory of a batch); the keys that can: {VALID_KEYS}"),
])
def test_an_unknown_key_in_a_family_rollout_table_is_named_with_its_table(tmp_path, own, message):
    cfg = serve_config(tmp_path)
    cfg.families[0].rollout = own
    with pytest.raises(ConfigError) as err:
        cfg.validate()
    assert str(err.value) == message


def test_an_unknown_key_in_an_agent_rollout_table_is_named_with_its_table(tmp_path):
    toml = tmp_path / "a.toml"
    toml.write_text('[[agents]]\nname = "fc"\nsource = "chain_sum"\nrollout = { max_turn = 1 }\n')
    with pytest.raises(ConfigError) as err:
        load_config(toml)
    assert str(err.value) == f"unknown key 'max_turn' in agents[0] (fc).rollout; valid keys: {VALID_KEYS}"


def test_an_unknown_tool_of_a_family_is_refused_before_the_model_loads(tmp_path, capsys, monkeypatch):
    from selfrl.serve import main

    toml = tmp_path / "serve.toml"
    toml.write_text('[[families]]\nname = "web"\nsource = "web"\noptions = { tier = "easy" }\n'
                    'rollout = { tools = ["abacus"] }\n')
    loaded = []
    monkeypatch.setattr("selfrl.model.load.build_policy", lambda cfg: loaded.append(cfg))  # must not be reached
    code = main.serve(str(toml), {"run_dir": str(tmp_path / "run")}, None)
    err = capsys.readouterr().err.strip()
    assert code == 2 and loaded == [] and len(err.splitlines()) == 1
    assert err.startswith("selfrl: error: families[0] (web).rollout.tools: unknown tool 'abacus'; available tools: ")
    assert "calculator" in err.split("available tools: ")[1].split(", ")


def test_an_unknown_tool_of_an_agent_is_refused_with_the_names_check(tmp_path):
    from selfrl.run.setup import check_names

    toml = tmp_path / "a.toml"
    toml.write_text('[[agents]]\nname = "fc"\nsource = "chain_sum"\nrollout = { tools = ["calculator", "abacus"] }\n')
    with pytest.raises(ConfigError) as err:
        check_names(load_config(toml))  # build_run calls it before anything is created or loaded
    assert str(err.value).startswith("agents[0] (fc).rollout.tools: unknown tool 'abacus'; available tools: ")
    toml.write_text('[[agents]]\nname = "fc"\nsource = "chain_sum"\nrollout = { tools = ["calculator"] }\n')
    assert check_names(load_config(toml)) is None


@pytest.mark.parametrize("cls, why", [
    (FamilyConfig, "it names the metrics family/<name>/... and val/<name>"),
    (AgentConfig, "it names the metric val/<name> and prefixes the task ids, <name>/<id>"),
])
def test_a_family_or_agent_name_is_at_most_64_characters(cls, why):
    cls("f" * 64).check("t.")
    with pytest.raises(ConfigError) as err:
        cls("f" * 65).check("t.")
    assert str(err.value) == f"t.name must be at most 64 characters ({why}), got 65: shorten it"


def test_serve_refuses_a_family_name_longer_than_the_simulator_sends(tmp_path):
    from selfrl.serve.main import load_serve_config

    toml = tmp_path / "serve.toml"
    toml.write_text(f'[[families]]\nname = "{"w" * 65}"\nsource = "chain_sum"\n')
    with pytest.raises(ConfigError, match=re.escape(f"families[0] ({'w' * 65}).name must be at most 64 characters")):
        load_serve_config(str(toml), {})
