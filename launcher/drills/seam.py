"""The one door from the job core into drills (an import-linter contract keeps it the only
one): a job whose config turns drills on (``drills.enabled``, or a ``drills.scenario``) opens
one ``JobDrills``; every other job has none and carries no drill machinery at all, in the
launcher or in its workers."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from phalanx.configs.schema import PhalanxConfig
from phalanx.launcher.drills.catalogue import prepare_job
from phalanx.launcher.drills.env import JobFaultEnv
from phalanx.launcher.drills.injector import Deferred, Injector, gate_steps
from phalanx.launcher.drills.scenario import Scenario, load_scenario


class JobDrills:
    """A drilled job's scenario and the services its faults act through (e.g. a proxy in
    front of S3 for an ``s3_outage``). Owned by the launcher's exit stack: ``close()``."""

    def __init__(self, scenario: Scenario | None, services: dict[str, Any]) -> None:
        self.scenario = scenario
        self.services = services

    @classmethod
    def open(cls, cfg: PhalanxConfig) -> tuple[PhalanxConfig, JobDrills | None]:
        """The config the job runs with (a scenario's services may rewrite endpoints) and its
        drills, or None when the config does not turn drills on."""
        if not cfg.drills.active:
            return cfg, None
        scenario = load_scenario(cfg.drills.scenario) if cfg.drills.scenario else None
        services: dict[str, Any] = {}
        if scenario is not None:
            cfg, services = prepare_job(cfg, {spec.kind for spec in scenario.faults})
        return cfg, cls(scenario, services)

    def gate_steps(self) -> tuple[int, ...]:
        """The steps the scenario's faults are due at: every rank is held before running
        one until its faults fired (``phalanx.runtime.worker.drill_hooks``)."""
        return gate_steps(self.scenario)

    def injector(self, cfg: PhalanxConfig, run_path: Path, slots: dict[int, Any],
                 coordinator: Any, job_services: Any,
                 remove_node: Callable[[int], None]) -> Injector:
        """Fires the scenario's faults, and faults ``phalanx drill inject`` sends."""
        deferred = Deferred()
        env = JobFaultEnv(cfg, run_path, slots, coordinator, job_services, coordinator.pool,
                          remove_node, deferred, self.services)
        return Injector(self.scenario, env, job_services.membership, deferred)

    def close(self) -> None:
        for service in self.services.values():
            service.close()
