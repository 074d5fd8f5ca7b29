"""``selfrl run``'s entry: one run in this process (:class:`selfrl.run.loop.Runner` over
:func:`selfrl.run.setup.build_run`), or with ``distributed.address`` on Ray workers
(:func:`selfrl.run.ray.driver.run_distributed`, the only place Ray is imported)."""

from __future__ import annotations

from selfrl.config import ConfigError, RunConfig
from selfrl.run.loop import Runner
from selfrl.run.progress import PlainProgress, Progress
from selfrl.run.result import RunResult
from selfrl.run.setup import build_run


def run(cfg: RunConfig, resume: bool = False, progress: Progress | None = None) -> RunResult:
    """Run (or resume) the self-improvement loop described by ``cfg``.

    With ``resume``, the store in ``cfg.run_dir`` is reopened, the last promoted
    version is loaded into the engine, and iterations continue after the last
    one stored; no stored trajectory is touched (the optimizer state starts
    fresh). Ctrl-C stops after the current step, gates nothing new, and still
    writes the report. With ``distributed.address`` set, rollouts run on Ray workers
    (:func:`selfrl.run.ray.driver.run_distributed`); only then is Ray imported.
    With ``sampler.url`` set, a separate process samples and every version pushed
    there is proved by the swap check (:mod:`selfrl.run.sampler_sync`).

    Raises:
        FileExistsError: ``run_dir`` already holds a run and ``resume`` is False.
        FileNotFoundError: ``resume`` but there is no run to resume.
        ConfigError: ``distributed.address`` is set and Ray is not installed, or the config
            names a reward, tool, detector or loss no registry knows (before any model loads).
        ConnectionError: ``sampler.url`` cannot be reached.
        selfrl.safety.swap_check.SwapCheckError: the sampler failed a swap check; the run stopped
            after rejecting the candidate and writing its report (never raised without a sampler).
    """
    if cfg.distributed.address is not None:
        try:
            from selfrl.run.ray.driver import run_distributed
        except ModuleNotFoundError as e:
            if e.name != "ray":
                raise
            raise ConfigError("distributed.address (--ray) needs Ray: pip install -e '.[ray]'") from e
        return run_distributed(cfg, resume, progress)
    return Runner(build_run(cfg, resume), progress or PlainProgress()).run()
