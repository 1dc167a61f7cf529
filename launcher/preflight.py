"""What ``phalanx launch`` checks before it starts anything (etcd, Ray, keepers, workers):
the entrypoint's function exists, and the CPUs asked of the embedded Ray fit this machine.
Reads only: the user's code is parsed, never imported; nothing is started."""
from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from phalanx.configs.errors import ConfigError
from phalanx.configs.schema import PhalanxConfig
from phalanx.runtime.worker.entrypoint import check_entrypoint, resolve_path

# Ray CPUs are logical: a virtual node may offer more than the machine has (the shipped
# drills and benchmarks use up to 4x), but not so many that the CPU budget stops meaning
# anything and every worker ends up time-sliced on a few cores.
CPU_OVERCOMMIT = 8


def check_before_start(cfg: PhalanxConfig, base_dir: Path, source: str = "",
                       overrides: Sequence[str] = (),
                       env: Mapping[str, str] | None = None) -> str:
    """Run every check; returns the entrypoint resolved against ``base_dir``. Raises
    ``ConfigError`` located where the failing key was set: ``--set`` (``overrides``),
    ``PHALANX_SET`` (in ``env``, default ``os.environ``) or ``source`` (the config file)."""
    try:
        check_cpu_budget(cfg)
        entrypoint = resolve_path(cfg.job.entrypoint, base_dir)
        check_entrypoint(entrypoint, cfg.job.entrypoint)
    except ConfigError as exc:
        raise exc.located(_set_in(exc.key, source, overrides, env), None) from None
    return entrypoint


def _set_in(key: str, source: str, overrides: Sequence[str],
            env: Mapping[str, str] | None) -> str:
    """Where ``key`` got its value: the last of the file, PHALANX_SET and --set wins."""
    from phalanx.configs.overrides import ENV_VAR, SET_SOURCE

    if any(o.partition("=")[0].strip() == key for o in overrides):
        return SET_SOURCE
    text = (os.environ if env is None else env).get(ENV_VAR, "")
    if any(part.partition("=")[0].strip() == key for part in text.split(";")):
        return ENV_VAR
    return source


def check_cpu_budget(cfg: PhalanxConfig, cores: int | None = None) -> None:
    """Refuse ``ray.cpus_per_node`` above ``CPU_OVERCOMMIT`` x this machine's cores when
    phalanx starts its own Ray (``ray.address`` empty): its virtual nodes share this
    machine. A cluster that is joined has its own capacity, not checked here."""
    cores = os.cpu_count() if cores is None else cores
    if cfg.ray.address or not cores:
        return
    bound = CPU_OVERCOMMIT * cores
    per_node = cfg.ray.cpus_per_node
    if per_node <= bound:
        return
    spare_cpus = cfg.spares.resources.get("CPU", cfg.job.cpus_per_worker)
    need = cfg.job.world_size * cfg.job.cpus_per_worker + cfg.spares.count * spare_cpus
    enough = need / cfg.ray.virtual_nodes
    raise ConfigError(
        "ray.cpus_per_node", f"{per_node:g} logical CPUs per virtual node is more than "
        f"{CPU_OVERCOMMIT} x the {cores} CPU cores of this machine ({bound}), which all "
        f"{cfg.ray.virtual_nodes} virtual nodes of the embedded Ray share",
        f"lower ray.cpus_per_node: the job's workers and spares need {enough:g} per node "
        f"({need:g} in all); or set ray.address to join a Ray cluster sized for the job")
