"""What each family of a ``selfrl serve`` run learned, and why not: the learning account of
``selfrl report RUN_DIR`` (:mod:`selfrl.report.serve`).

One :class:`FamilyAccount` per family of traffic (``[[families]]``, :mod:`selfrl.serve.families`;
a run without them is one family, ``all traffic``), read from the store alone:

* its served turns (``served``): rated positively (feedback > 0), negatively (feedback <= 0) or
  not at all; trained, and how many of those were rated positively; skipped, and why as the
  store records it (too old for the age rule, cut off, no reward component applied, or in an
  update that was itself skipped);
* the updates that trained on it (distinct ``served.trained_in``), and how many of them the
  champion descends from (``adapter_versions.parent``);
* its held-out tasks (``evaluations``, ids ``"<family>/<id>"``): the base's and the champion's
  k/n, the paired difference with its 95 % interval (:func:`selfrl.core.stats.paired_difference_ci`),
  and how many answers differ between the two (and from the base at any evaluated version): no
  changed answer means the updates did not move the weights for this family;

and :func:`diagnose_family` names, in the user's words, why a family is not above its base and
what to change. The counts are full scans of ``served`` and ``evaluations``: a report's work,
not a health check's (``/health`` is polled and does not carry them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from selfrl.core.stats import paired_difference_ci
from selfrl.record.store import Store

MIN_TRAINED = 32  # fewer trained turns than this: too few to move a family
MIN_POSITIVE_SHARE = 0.15  # fewer trained turns rated positively than this share: almost nothing to reinforce
ALL = ""  # the family key of a turn or task without a family (a run without [[families]]: all of them)
SKIP_WHY = ("too old", "cut off", "no reward", "update skipped")
# rows of families a client named that [[families]] does not configure (a server without them takes any
# metadata.family): the ones with the most turns get a row each, the rest are summed in one
MAX_FAMILY_ROWS = 20


@dataclass
class FamilyAccount:
    """One family's learning account (see the module docstring). Counts are turns unless named.

    Attributes:
        family: its name; :data:`ALL` for turns without one.
        served, positive, negative, unrated: served turns, and of them rated > 0, <= 0, not rated.
        trained, trained_positive: turns trained on, and of them rated > 0.
        skipped: turns skipped, by reason (:data:`SKIP_WHY`).
        updates, updates_kept: updates (versions) that trained on it; of them, in the champion's lineage.
        groups: distinct learner groups (``task_key``) among its trained turns.
        base, champion: ``(version, k, n)`` on its held-out tasks, None when not evaluated.
        difference: ``(mean, low, high)`` of champion - base per task (95 %), None without both.
        changed: held-out answers that differ between base and champion (None without both).
        first_update: the first version trained on it (None: never trained).
        before: the newest evaluated ancestor of ``first_update``: its weights before this family
            moved them (None: never trained, or no such version).
        changed_since: held-out answers that differ between ``before`` and the champion.
        moved: held-out tasks whose answer differed from ``before``'s at any evaluated version
            from ``first_update`` on (kept by the champion or not).
        evaluated: versions evaluated on its held-out tasks.
    """

    family: str
    served: int = 0
    positive: int = 0
    negative: int = 0
    unrated: int = 0
    trained: int = 0
    trained_positive: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    updates: int = 0
    updates_kept: int = 0
    groups: int = 0
    base: tuple[int, int, int] | None = None
    champion: tuple[int, int, int] | None = None
    difference: tuple[float, float, float] | None = None
    changed: int | None = None
    first_update: int | None = None
    before: int | None = None
    changed_since: int | None = None
    moved: int | None = None
    evaluated: int = 0
    others: int = 0  # families summed in this row (those past MAX_FAMILY_ROWS); 0: one family's row

    @property
    def name(self) -> str:
        if self.others:
            return f"({self.others} other families)"
        return self.family or "all traffic"

    @property
    def learned(self) -> bool:
        """The champion is above the base on its held-out tasks: the 95 % interval's low end above 0."""
        return self.difference is not None and self.difference[1] > 0


@lru_cache(maxsize=None)
def smallest_detectable(n: int) -> int:
    """The fewest held-out tasks out of ``n`` that must flip from failed to solved (none the other
    way) for the paired 95 % interval to lie above 0; ``n + 1`` when even all ``n`` cannot.

    >>> smallest_detectable(12), smallest_detectable(48)
    (4, 4)
    """
    for m in range(1, n + 1):
        if paired_difference_ci([False] * n, [True] * m + [False] * (n - m))[1] > 0:
            return m
    return n + 1


def family_accounts(store: Store) -> list[FamilyAccount]:
    """The learning account of every family of the serve run in ``store``: the configured
    ``[[families]]`` (of the newest session) in their order, then any other family a turn names (the most
    turns first);
    turns without a family as their own row (``all traffic`` when no family is configured). Of the
    families not configured, the :data:`MAX_FAMILY_ROWS` with the most turns have a row each and the
    others are summed in one last row (its ``others`` counts them)."""
    conn = store.conn
    runs = store.runs()
    config = (runs[-1]["config"].get("serve") or {}) if runs else {}
    names = [f["name"] for f in config.get("families") or [] if isinstance(f, dict) and "name" in f]
    accounts: dict[str, FamilyAccount] = {n: FamilyAccount(n) for n in names}
    unconfigured = sorted(((n, f) for f, n in conn.execute("SELECT family, COUNT(*) FROM served GROUP BY 1")
                           if f and f not in accounts), key=lambda x: (-x[0], x[1]))
    accounts.update((f, FamilyAccount(f)) for _, f in unconfigured[:MAX_FAMILY_ROWS])  # the most turns first
    summed = {f for _, f in unconfigured[MAX_FAMILY_ROWS:]}
    other = FamilyAccount(ALL, others=len(summed))
    counted: dict[int, set[int]] = {}  # id(account) -> versions counted in its updates

    def acc(family: str | None) -> FamilyAccount:
        if family in summed:
            return other
        key = family or ALL
        return accounts.setdefault(key, FamilyAccount(key))

    for family, status, rating, n in conn.execute(
            "SELECT family, status, CASE WHEN feedback IS NULL THEN 0 WHEN feedback > 0 THEN 1 ELSE -1 END, COUNT(*)"
            " FROM served GROUP BY 1, 2, 3"):
        a = acc(family)
        a.served += n
        a.positive += n if rating == 1 else 0
        a.negative += n if rating == -1 else 0
        a.unrated += n if rating == 0 else 0
        a.trained += n if status == "trained" else 0
        a.trained_positive += n if status == "trained" and rating == 1 else 0
    lineage = champion_lineage(store)
    for family, version, n in conn.execute(
            "SELECT family, trained_in, COUNT(*) FROM served WHERE status = 'trained' GROUP BY 1, 2"):
        if version is None:
            continue
        a = acc(family)
        if version in counted.setdefault(id(a), set()):  # the summed row: one update of several of its families
            continue
        counted[id(a)].add(version)
        a.updates += 1
        a.updates_kept += version in lineage
        a.first_update = version if a.first_update is None else min(a.first_update, version)
    for family, groups in conn.execute(
            "SELECT family, COUNT(DISTINCT group_key) FROM served WHERE status = 'trained' GROUP BY 1"):
        acc(family).groups += groups
    for family, why, n in conn.execute(
            "SELECT s.family, CASE WHEN json_extract(t.data_json, '$.error') IS NOT NULL THEN 'cut off'"
            " WHEN json_extract(t.data_json, '$.reward_details.user_feedback.age.outcome') = 'too_old' THEN 'too old'"
            " WHEN t.reward IS NULL THEN 'no reward' ELSE 'update skipped' END, COUNT(*)"
            " FROM served s JOIN trajectories t ON t.id = s.trajectory_id WHERE s.status = 'skipped' GROUP BY 1, 2"):
        a = acc(family)
        a.skipped[why] = a.skipped.get(why, 0) + n
    held_out(store, accounts, set(names), lineage[0] if lineage else None)
    return list(accounts.values()) + ([other] if summed else [])


def champion_lineage(store: Store) -> list[int]:
    """The champion (the newest base or promoted version) and its ancestors, newest first; [] without versions."""
    champ = store.latest_promoted()
    parents = {v["version"]: v["parent"] for v in store.versions()}
    out, v = [], None if champ is None else champ["version"]
    while v is not None and v not in out:
        out.append(v)
        v = parents.get(v)
    return out


def held_out(store: Store, accounts: dict[str, FamilyAccount], names: set[str], champion: int | None) -> None:
    """Fill each account's held-out fields from ``evaluations`` (a task's family: the part of its id
    before ``/`` when families are configured, else :data:`ALL`)."""
    answers: dict[str, dict[int, dict[str, tuple[bool, Any]]]] = {}
    for version, task_id, correct, answer in store.conn.execute(
            "SELECT version, task_id, correct, answer FROM evaluations ORDER BY version, task_id"):
        family = task_id.partition("/")[0] if names else ALL
        if names and family not in names:
            continue
        answers.setdefault(family, {}).setdefault(version, {})[task_id] = (bool(correct), answer)
    versions = store.versions()
    parents = {v["version"]: v["parent"] for v in versions}
    base = next((v["version"] for v in versions if v["status"] == "base"), 0)
    for family, by_version in answers.items():
        a = accounts.setdefault(family, FamilyAccount(family))
        a.evaluated = len(by_version)
        b, c = by_version.get(base), by_version.get(champion) if champion is not None else None
        if b:
            a.base = (base, sum(ok for ok, _ in b.values()), len(b))
        if c:
            a.champion = (champion, sum(ok for ok, _ in c.values()), len(c))
        if b and c:
            tasks = sorted(set(b) & set(c))
            a.difference = paired_difference_ci([b[t][0] for t in tasks], [c[t][0] for t in tasks])
            a.changed = sum(b[t][1] != c[t][1] for t in tasks)
        if a.first_update is None:
            continue
        v = parents.get(a.first_update)
        while v is not None and v not in by_version:
            v = parents.get(v)
        if v is None:
            continue
        ref = by_version[v]
        a.before = v
        if c:
            a.changed_since = sum(ref[t][1] != c[t][1] for t in ref if t in c)
        later = [ev for version, ev in by_version.items() if version >= a.first_update]
        a.moved = sum(any(t in ev and ev[t][1] != ref[t][1] for ev in later) for t in ref)


def diagnose_family(a: FamilyAccount, learning_rate: float | None = None) -> str:
    """Why family ``a`` is not above its base, with what to change; or that it learned.

    ``learning_rate``: the configured ``train.learning_rate`` (named in the advice when given).
    Returns one line of text, without a final period: ``learned: ...``, ``not above its base: `` and
    the causes that apply (too few trained turns, almost no positive feedback, turns aged out, no
    candidate promoted, held-out answers unchanged, nothing solved, held out too small to show the
    gain, held-out fell) separated by ``;``, or why there is no verdict.
    """
    if a.base is None or a.champion is None:
        where = "no held-out set" if not a.evaluated else "the base or the champion was not evaluated on it"
        head = f"no held-out verdict ({where})"
        return head + ("" if a.trained else f"; {never_trained(a)}")
    (_, kb, n), (cv, kc, _) = a.base, a.champion
    mean, low, high = a.difference
    if a.learned:
        return f"learned: {kb}/{n} -> {kc}/{n}, {mean:+.3f} [{low:+.3f}, {high:+.3f}], the interval above 0"
    if kb == n:
        return f"the base already solves all {n} held-out tasks: nothing left to show on this set (a harder held-out set)"
    causes = []
    if not a.trained:
        causes.append(never_trained(a))
    elif a.trained < MIN_TRAINED:
        causes.append(f"too few trained turns ({a.trained}, under {MIN_TRAINED}): rate more of this family's answers "
                      "(POST /v1/feedback) or wait for more traffic")
    if a.trained and a.trained_positive < MIN_POSITIVE_SHARE * a.trained:
        group = (" in one group (its turns share one task_key), so the baseline is the family's mean reward and "
                 "almost every turn is pushed down" if a.groups == 1 else "")
        causes.append(f"almost no positive feedback: {a.trained_positive} of its {a.trained} trained turns "
                      f"({a.trained_positive / a.trained:.0%}) were rated positively{group}; rate good answers too, "
                      "or correct the bad ones with the right answer (correction / correction_tool_calls) and set "
                      "learner.learn_from_corrections, so that there is something to reinforce")
    old = a.skipped.get("too old", 0)
    if a.trained and old >= a.trained:
        causes.append(f"{old} of its turns aged out before an update took them (more than it trained on): the "
                      "learner is behind its traffic or the ratings come late; raise learner.max_feedback_age_versions "
                      "or learner.max_batch, or rate sooner")
    if cv == a.base[0]:
        causes.append("no candidate was promoted: the base still serves (the versions table and the events say what "
                      "became of each candidate: rejected, rolled back, or not yet decided)")
    elif (a.changed_since if a.before is not None else a.changed) == 0:
        ref = ("the base did" if a.before in (None, a.base[0])
               else f"v{a.before} did before this family's first update")
        moved = (f"{a.moved} answered differently at some candidate in between, none kept" if a.moved
                 else f"nor did any of the {a.evaluated} evaluated versions answer differently")
        lr = f" (train.learning_rate = {learning_rate:g})" if learning_rate is not None else " (train.learning_rate)"
        task_key = ", or task_key groups of the same task" if a.groups <= 1 else ""
        causes.append(f"held-out answers unchanged: the champion (v{cv}) answers all {n} held-out tasks as {ref} "
                      f"({moved}), so the updates did not move this family; more rated turns, a higher learning "
                      f"rate{lr}{task_key}")
    if kb == kc == 0:
        causes.append(f"no held-out task solved by the base or the champion (0/{n}): the tasks may be beyond the "
                      "model; an easier subset, a worked example, or a partial-credit reward")
    if mean > 0 and low <= 0:
        m = smallest_detectable(n)
        causes.append(f"held out too small to show this gain: n = {n}, {mean:+.3f} [{low:+.3f}, {high:+.3f}]; the "
                      f"smallest gain it can show is {m} of {n} tasks ({m / n:+.3f}): a larger val_size")
    if high < 0:
        causes.append(f"held-out fell ({mean:+.3f} [{low:+.3f}, {high:+.3f}]): the champion forgot some of it; "
                      "a lower tolerance for this family keeps such a candidate out")
    if not causes:
        causes.append(f"no cause in the store ({kb}/{n} -> {kc}/{n}, {mean:+.3f} [{low:+.3f}, {high:+.3f}]): "
                      "let it run longer, or rate more of this family's answers")
    return "not above its base: " + "; ".join(causes)


def never_trained(a: FamilyAccount) -> str:
    """Why a family has no trained turn, from its skip reasons and ratings."""
    if not a.served:
        return "never trained: no turn of this family was served (clients send metadata.family)"
    ranked = sorted(a.skipped.items(), key=lambda x: -x[1])
    why = ", ".join(f"{n} {w}" for w, n in ranked)
    fix = NEVER_TRAINED_FIX.get(ranked[0][0] if ranked else "no reward", NEVER_TRAINED_FIX["no reward"])
    return f"never trained: none of its {a.served} turns was trained on" + (f" (skipped: {why})" if why else "") + fix


NEVER_TRAINED_FIX = {  # by the most frequent skip reason
    "no reward": "; rate its answers (POST /v1/feedback) soon after they are served",
    "too old": "; its ratings came after the learner had moved on: rate sooner, or raise "
               "learner.max_feedback_age_versions",
    "update skipped": "; the updates its turns were in were skipped (the events say why, e.g. no group had reward "
                      "spread): rate good answers as well as bad ones, so that a group's rewards differ",
    "cut off": "; its clients disconnected before the answers were finished: raise the clients' timeouts",
}


def families_section(store: Store) -> list[str]:
    """The ``## Learning per family`` section of the serving report: the table of
    :func:`family_accounts` and a diagnosis line per family; [] when no turn and no held-out set."""
    accounts = [a for a in family_accounts(store) if a.served or a.evaluated]
    if not accounts:
        return []
    runs = store.runs()
    lr = ((runs[-1]["config"].get("serve") or {}).get("train") or {}).get("learning_rate") if runs else None
    lines = ["## Learning per family", "",
             "| family | served | rated + / - / none | trained (rated +) | skipped | updates (in the champion) "
             "| held-out base -> champion | difference, 95% CI | answers changed |",
             "|---|---|---|---|---|---|---|---|---|"]
    for a in accounts:
        skipped = sum(a.skipped.values())
        why = ", ".join(f"{n} {w}" for w, n in sorted(a.skipped.items(), key=lambda x: -x[1]))
        held = "not evaluated" if a.base is None or a.champion is None else (
            f"{a.base[1]}/{a.base[2]} -> {a.champion[1]}/{a.champion[2]} (v{a.champion[0]})")
        diff = "" if a.difference is None else "{:+.3f} [{:+.3f}, {:+.3f}]".format(*a.difference)
        changed = "" if a.changed is None else f"{a.changed} of {a.champion[2]}" + (
            f" ({a.changed_since} since v{a.before}, before its first update)"
            if a.changed_since is not None and a.before != a.base[0] else "")
        lines.append(f"| {a.name} | {a.served} | {a.positive} / {a.negative} / {a.unrated} | {a.trained} "
                     f"({a.trained_positive}) | {skipped}{f': {why}' if why else ''} | {a.updates} ({a.updates_kept}) "
                     f"| {held} | {diff} | {changed} |")
    summed = next((a for a in accounts if a.others), None)
    if summed is not None:
        lines += ["", f"The {MAX_FAMILY_ROWS} families not in [[families]] with the most turns have a row each; the "
                  f"other {summed.others} (metadata.family as clients sent it) are summed in the last row. Configure "
                  "the families you mean to watch in [[families]]: each then has its row and its held-out set."]
    lines += ["", "Diagnosis:", ""]
    lines += [f"- **{a.name}**: {diagnose_family(a, lr if isinstance(lr, (int, float)) else None)}." for a in accounts]
    return lines + [""]
