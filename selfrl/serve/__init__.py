"""``selfrl serve``: an OpenAI-compatible server that records every request as a
trajectory, takes user feedback as reward, trains in the background and hot-swaps
validated adapter versions under load.

- :mod:`selfrl.serve.main`: the entry (the policy loaded, the service built, uvicorn).
- :mod:`selfrl.serve.app`: the routes (parse, authenticate, format; nothing decided there).
- :mod:`selfrl.serve.service`: the service the routes talk to, composed of
  :mod:`~selfrl.serve.turns` (request to prompt, jobs, recorded response),
  :mod:`~selfrl.serve.served_version` (which version serves, pin, rollback),
  :mod:`~selfrl.serve.batcher` and the learner.
- :mod:`selfrl.serve.protocol`, :mod:`selfrl.serve.completion`, :mod:`selfrl.serve.responses`,
  :mod:`selfrl.serve.streaming`, :mod:`selfrl.serve.logprobs`, :mod:`selfrl.serve.structured`:
  the OpenAI wire formats both ways.
- :mod:`selfrl.serve.feedback`, :mod:`selfrl.serve.background`: user feedback as reward, and
  the learner that trains on served turns (through :mod:`selfrl.run.cycle`, as ``selfrl run``);
  :mod:`selfrl.serve.families`: a held-out set per family of traffic, none forgotten.
- :mod:`selfrl.serve.logfile`: ``RUN_DIR/serve.log``, rotated by size.
- :mod:`selfrl.serve.replica`, :mod:`selfrl.serve.disconnect`, :mod:`selfrl.serve.limits`,
  :mod:`selfrl.serve.health`, :mod:`selfrl.serve.errors`: replicas, clients that leave, limits,
  storage health and the errors every part raises.
- :mod:`selfrl.serve.sampler_app`, :mod:`selfrl.serve.sampler_main`: ``selfrl sampler``, the
  policy as a remote sampling backend over HTTP.
"""
