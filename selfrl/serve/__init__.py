"""``selfrl serve``: an OpenAI-compatible server that records every request as a
trajectory, takes user feedback as reward, trains in the background and hot-swaps
validated adapter versions under load. See ``selfrl.serve.app`` for the routes."""
