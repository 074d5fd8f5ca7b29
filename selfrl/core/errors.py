"""The error of a setting that cannot be honoured, raised on any floor and said in one line.

:class:`ConfigError` is raised by the config's own checks (:mod:`selfrl.config`), by the
checks that need a registry or the model (``selfrl.run.setup.check_names``,
``selfrl.model.fit``), and caught by the console script, which prints it and exits with
code 2. It lives on the bottom floor so that each of those raises the one class.
"""


class ConfigError(ValueError):
    """An invalid configuration value or key; the message names it."""
