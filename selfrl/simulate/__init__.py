"""Simulated users for ``selfrl serve``: ``selfrl simulate`` (docs/guides/simulate.md).

Many users, from several environments, talk to a running server through the OpenAI API as
unchanged clients do; they run the environments' tools, judge the answers with the
environments' verifiers plus noise, and rate, correct or stay silent, seconds to days later
on a simulated clock. Some are hostile. One seed fixes all of it.

- :mod:`selfrl.simulate.clock`: simulated time (:class:`FakeClock`, :class:`ScaledClock`).
- :mod:`selfrl.simulate.schedule`: phases of families and the arrivals.
- :mod:`selfrl.simulate.users`: each conversation's plan, the users' verdicts and reactions.
- :mod:`selfrl.simulate.families`: an environment's tasks, tools and verifier on the client side.
- :mod:`selfrl.simulate.client`: the HTTP side (the ``openai`` client, ``httpx``).
- :mod:`selfrl.simulate.simulator`: the loop (:class:`Simulator`).
- :mod:`selfrl.simulate.summary`: the summary of what was sent and seen.
- :mod:`selfrl.simulate.main`: the command.

It imports environments and the layers below them, never the server or the learner.
"""

from selfrl.simulate.clock import FakeClock, ScaledClock  # noqa: F401
from selfrl.simulate.simulator import Simulator  # noqa: F401
