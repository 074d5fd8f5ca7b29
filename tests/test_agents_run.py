"""Many agents into one learner, end to end: ``[[agents]]`` in a run config, each agent's
tasks routed to its own environment, per-agent held-out sets and gates, and the conflict
report (ledger event, iteration line, ``selfrl report``).

The tiny random model cannot solve arithmetic, so the two agents' verifiers are defined
on *change*: both use chain_sum tasks, the "answer" is the greedy completion's token ids,
and each agent remembers the first answer it sees for a held-out task (the base model's, as the base is validated first). Agent ``change`` counts
an answer as solved when it differs from the base's, agent ``keep`` when it equals it. So
the base scores 0 on ``change`` and 1 on ``keep``, and any update that moves greedy answers
helps ``change`` and hurts ``keep``: the two pull in opposite directions, by construction.
Training rewards come from the ``long`` test reward below.
"""

import pytest
from conftest import save_tiny_phi

from selfrl.cli import main
from selfrl.config import AgentConfig, ConfigError, load_config
from selfrl.envs.agents import AgentsEnv, agent_of, agent_results, tag, untag
from selfrl.envs.arithmetic import ReasoningGymEnv
from selfrl.record.store import Store


def long(traj, ctx):
    """Test reward: the share of the two turns' 24-token limit used (the base's greedy answer is
    an immediate EOS, so this moves it)."""
    return traj.num_completion_tokens / 24


class _MemoEnv(ReasoningGymEnv):
    keep = True

    def __init__(self, **options):
        super().__init__("chain_sum", options)
        self.base: dict[str, str] = {}  # held-out task id -> the first (base) answer seen

    def trajectory_answer(self, traj):  # the greedy completion, as token ids (the text is often empty)
        return ",".join(map(str, traj.token_ids[traj.prompt_len:]))

    def correct(self, task, answer):
        first = self.base.setdefault(task.id, answer)
        return (answer == first) == self.keep


class KeepEnv(_MemoEnv):
    keep = True


class ChangeEnv(_MemoEnv):
    keep = False


def test_agents_tables_parse_and_are_checked(tmp_path):
    toml = tmp_path / "a.toml"
    toml.write_text('[[agents]]\nname = "math"\nsource = "chain_sum"\ntolerance = 0.05\nval_size = 3\n'
                    '[[agents]]\nname = "big"\nsource = "chain_sum"\noptions = { min_digits = 3, max_digits = 3 }\n')
    cfg = load_config(toml)
    assert [(a.name, a.tolerance, a.val_size, a.options) for a in cfg.agents] == [
        ("math", 0.05, 3, {}), ("big", None, None, {"min_digits": 3, "max_digits": 3})]
    # round trip through the stored config.json (resume)
    assert load_config(None, None, cfg.to_dict()).agents == cfg.agents
    with pytest.raises(ConfigError, match="per_agent' is not offered: several agents train one shared adapter"):
        load_config(toml, {"agent_adapters": "per_agent"})
    with pytest.raises(ConfigError, match="agent_adapters must be one of 'shared'"):
        load_config(toml, {"agent_adapters": "both"})
    with pytest.raises(ConfigError, match="agent names must be unique"):
        load_config(None, None, {"agents": [{"name": "a"}, {"name": "a"}]})
    with pytest.raises(ConfigError, match=r"agents\[0\] \(x/y\).name must be a non-empty name without '/'"):
        load_config(None, None, {"agents": [{"name": "x/y"}]})
    with pytest.raises(ConfigError, match="task.options does not apply with"):
        load_config(None, {"task.options": {"min_terms": 2}}, {"agents": [{"name": "a"}]})
    with pytest.raises(ConfigError, match=r"unknown key 'agents\[0\].tolernce' \(did you mean 'tolerance'\?\); valid: name, num_train"):
        load_config(None, None, {"agents": [{"name": "a", "tolernce": 0.1}]})
    with pytest.raises(ConfigError, match=r"agents must be an array of tables \(\[\[agents\]\]\)"):
        load_config(None, None, {"agents": {"name": "a"}})


def test_agents_env_splits_per_agent_and_routes_each_task_to_its_environment():
    agents = [AgentConfig("small", "chain_sum", {"min_digits": 1, "max_digits": 1}, tolerance=0.3, val_size=2),
              AgentConfig("big", "chain_sum", {"min_digits": 4, "max_digits": 4}, num_train=5)]
    env = AgentsEnv(agents)
    train, val = env.split(3, 4, 1000, 2000)
    assert [agent_of(t.id) for t in train] == ["small", "big"] * 3 + ["big"] * 2  # round-robin, big has 5
    assert [agent_of(t.id) for t in val] == ["small"] * 2 + ["big"] * 4
    assert env.tolerance == {"small": 0.3, "big": 0.02}  # big: gate.tolerance
    big = val[2]
    inner = untag(big)
    assert tag("big", inner) == big and big.metadata["agent"] == "big" and "agent" not in inner.metadata
    assert inner == env.envs["big"].split(5, 4, 1000, 2000)[1][0]  # the agent's own task, id unchanged
    assert env.correct(big, big.answer) and not env.correct(big, "-1")
    assert agent_results([(val[0].id, True, "1"), (big.id, False, None)]) == {"small": {val[0].id: True},
                                                                               "big": {big.id: False}}
    with pytest.raises(ValueError, match="unknown agent 'other'"):
        env.correct(tag("other", inner), "1")
    with pytest.raises(ValueError, match="names no agent"):
        env.correct(inner, "1")
    with pytest.raises(ValueError, match="agent bad: unknown environment"):
        AgentsEnv([AgentConfig("bad", "no_such_env")])


@pytest.fixture(scope="module")
def short_model(tmp_path_factory, tiny_tokenizer):
    from selfrl.envs.rewards import REWARD_FUNCS

    mp = pytest.MonkeyPatch()
    mp.setitem(REWARD_FUNCS, "long", long)
    yield save_tiny_phi(tmp_path_factory.mktemp("model"), tiny_tokenizer)
    mp.undo()


CONFIG = """
iterations = 2
num_prompts = 4
num_generations = 3
engine = "reference"
reward_weights = {{ long = 1.0 }}
run_dir = "{run_dir}"
[model]
name = "{model}"
device = "cpu"
[lora]
r = 4
lora_alpha = 64
[rollout]
max_new_tokens = 12
max_turns = 2
temperature = 0.7
[train]
learning_rate = 5e-2
micro_batch_size = 6
[gate]
eval_every = 2
val_size = 4
tolerance = 1.0   # the whole held-out set's gate lets anything through: the agents' gates decide
[collapse]
enabled = false
[task]
num_train = 20
[[agents]]
name = "change"
source = "test_agents_run:ChangeEnv"
tolerance = 0.1
[[agents]]
name = "keep"
source = "test_agents_run:KeepEnv"
tolerance = {keep_tolerance}
"""


def test_a_candidate_that_helps_one_agent_and_hurts_another_is_not_promoted(tmp_path, short_model, capsys):
    toml = tmp_path / "agents.toml"
    toml.write_text(CONFIG.format(run_dir=tmp_path / "run", model=short_model, keep_tolerance=0.1))
    assert main(["run", "--config", str(toml)]) == 0
    err = capsys.readouterr().err

    store = Store(tmp_path / "run" / "selfrl.db")
    [cand_row] = [v for v in store.versions() if v["version"] == 2]  # two updates, validated once
    base, cand = agent_results(store.evaluation(0)), agent_results(store.evaluation(2))
    assert sum(base["change"].values()) == 0 and all(base["keep"].values())  # the construction: 0 and 1
    lost = sorted(t for t, ok in cand["keep"].items() if not ok)
    gained = sum(cand["change"].values())
    assert lost and gained == len(lost)  # the update moved answers: change gained what keep lost
    assert cand_row["status"] == "rejected"
    drop = len(lost) / 4
    [conflict] = [e for e in store.events() if e["kind"] == "agent_conflict"]
    d = conflict["data"]
    assert (d["agent"], d["version"], d["champion"]) == ("keep", 2, 0)
    assert d["drop"] == pytest.approx(drop) and d["tolerance"] == 0.1 and d["lost_tasks"] == lost
    [reject] = [e for e in store.events() if e["kind"] == "reject"]
    assert "agent keep: held-out" in reject["message"] and "agent change" not in reject["message"]
    # the no-forgetting rule's numbers (selfrl.safety.families): the reject event's data names the
    # agent, its reference version, the paired difference with its interval, and the lost tasks
    [agent] = reject["data"]["agents"]
    assert (agent["family"], agent["reference_version"], agent["lost_tasks"]) == ("keep", 0, lost)
    assert agent["paired_difference"] == pytest.approx(-drop) and agent["paired_interval"][1] <= 1.0
    assert agent["reference_interval"][1] == 1.0 and "paired difference" in reject["message"]
    # per-agent held-out success logged, the shared adapter trained on both agents' groups
    val = {m["name"]: m["value"] for m in store.metrics() if m["name"].startswith("val/")}
    assert val["val/keep"] == pytest.approx(1 - drop) and val["val/change"] == pytest.approx(drop)
    assert {agent_of(t.task_id) for t in store.trajectories()} == {"change", "keep"}
    store.close()
    # the iteration line names the agent that lost, by how much, and its tasks
    text = " ".join(w for w in err.split() if not w.startswith("progress.py:"))  # rich wraps the lines
    assert "iteration 1: version 2 rejected: agent keep: held-out" in text
    assert f"(down {drop:.3f}); lost tasks {lost[0]}" in text
    assert main(["report", str(tmp_path / "run")]) == 0
    report = (tmp_path / "run" / "report.md").read_text()
    assert "## Agents" in report and f"agent **keep** fell from 1.000 to {1 - drop:.3f}" in report
    assert f"paired difference {-drop:+.3f} (95% CI" in report
    assert lost[0] in report and "agent **change**" not in report

    # the same run with keep's tolerance above its loss: promoted
    toml.write_text(CONFIG.format(run_dir=tmp_path / "run2", model=short_model, keep_tolerance=1.0))
    assert main(["run", "--config", str(toml)]) == 0
    with Store(tmp_path / "run2" / "selfrl.db") as store:
        assert [v["status"] for v in store.versions() if v["version"] == 2] == ["promoted"]
        assert not [e for e in store.events() if e["kind"] == "agent_conflict"]


def test_a_held_out_set_larger_than_the_environment_is_refused_before_the_model_loads(tmp_path, capsys, monkeypatch):
    """1-term, 1-digit chain sums are 10 distinct tasks: ``selfrl run`` says so and names the setting to
    lower, as ``selfrl serve`` does, before the model loads and without leaving a run directory behind."""
    loaded = []
    monkeypatch.setattr("selfrl.run.setup.build_policy", lambda cfg: loaded.append(cfg))  # must not be reached
    ten = "options = { min_terms = 1, max_terms = 1, max_digits = 1 }\n"
    toml = tmp_path / "run.toml"
    for table, key in ((f'[task]\nsource = "chain_sum"\n{ten}[gate]\nval_size = 20\n', "gate.val_size = 20"),
                       (f'[[agents]]\nname = "wide"\nsource = "chain_sum"\n[[agents]]\nname = "ten"\nsource = '
                        f'"chain_sum"\n{ten}val_size = 12\n', "agents[1] (ten).val_size = 12"),
                       (f'[gate]\nval_size = 11\n[[agents]]\nname = "ten"\nsource = "chain_sum"\n{ten}',
                        "agents[0] (ten) takes gate.val_size = 11")):
        toml.write_text(f'run_dir = "{tmp_path / "run"}"\n{table}')
        assert main(["run", "--config", str(toml)]) == 2
        err = capsys.readouterr().err.strip()
        assert err == (f"selfrl: error: {key}, but environment 'chain_sum' gives only 10 distinct tasks "
                       "(sampled until no new one came): lower it to at most 10")
        assert loaded == [] and not (tmp_path / "run").exists()
