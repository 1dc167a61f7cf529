"""Communication and storage-endpoint faults: a node's replication link slowed or
bit-flipped, the S3 endpoint refusing connections. Each puts a ``LinkProxy`` in the path
(keepers are re-routed through it; the S3 endpoint is proxied from the launch on)."""
from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Mapping
from urllib.parse import urlparse, urlunparse

from phalanx.configs.errors import ConfigError
from phalanx.configs.schema import PhalanxConfig
from phalanx.launcher.drills.catalogue import (FaultEnv, FaultSpec, Mechanism, register,
                                               register_preparer)
from phalanx.launcher.drills.link_proxy import DIRECTIONS, LinkProxy

log = logging.getLogger(__name__)

__all__ = ["prepare_job", "S3_PROXY"]

S3_PROXY = "s3_proxy"   # the service name prepare_job gives the S3 endpoint's proxy


def prepare_job(cfg: PhalanxConfig, scenario_kinds: set[str]
                ) -> tuple[PhalanxConfig, dict[str, Any]]:
    """Before the keepers start: when the scenario has an ``s3_outage`` and the S3 tier is
    enabled, start a LinkProxy in front of ``tiers.s3.endpoint_url`` and return the config
    with the proxy as the endpoint, plus {"s3_proxy": proxy} (the caller closes it after
    the job). Otherwise ``(cfg, {})``. Raises ConfigError when the endpoint is empty (AWS)
    or https (the proxy's address would not match the certificate), ServiceStartError."""
    s3 = cfg.tiers.s3
    if "s3_outage" not in scenario_kinds or not s3.enabled:
        return cfg, {}
    url = urlparse(s3.endpoint_url)
    if url.scheme != "http" or not url.hostname:
        raise ConfigError("tiers.s3.endpoint_url",
                          f"{s3.endpoint_url!r}: an s3_outage drill proxies the endpoint, which "
                          "needs an http:// endpoint (not AWS, not https)",
                          "use a local S3 endpoint (a scenario with needs: [s3] starts one)")
    proxy = LinkProxy((url.hostname, url.port or 80), name="s3").start()
    host, port = proxy.address
    proxied = urlunparse(url._replace(netloc=f"{host}:{port}"))
    log.info("fault.s3_proxy endpoint=%s proxied=%s", s3.endpoint_url, proxied)
    tiers = replace(cfg.tiers, s3=replace(s3, endpoint_url=proxied))
    return replace(cfg, tiers=tiers), {S3_PROXY: proxy}


def _param(spec: FaultSpec, name: str) -> Any:
    """``spec.params[name]`` as the registered type, else the registered default."""
    kind, default = REGISTRY_PARAMS[spec.kind][name]
    value = spec.params.get(name, default)
    try:
        return kind(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"faults[{spec.index}].params.{name}",
                          f"{value!r} is not a {kind.__name__}", f"e.g. {default!r}") from exc


def _node(spec: FaultSpec) -> int:
    if spec.node is None:
        raise ConfigError(f"faults[{spec.index}].node", f"{spec.kind} targets a node",
                          "set node: <index>")
    return spec.node


def _route_through_proxy(spec: FaultSpec, env: FaultEnv, proxy: LinkProxy, node: int,
                         for_s: float) -> str:
    """Send every replica bound for ``node`` through ``proxy`` for ``for_s`` seconds; then
    route them back to the keeper itself and close the proxy. Returns the proxy host:port."""
    try:
        env.keeper_route(node, proxy.address)
    except BaseException:
        proxy.close()
        raise

    def restore() -> None:       # on the env's timer thread
        try:
            env.keeper_route(node, None)
        finally:
            stats = proxy.stats()
            proxy.close()
            env.emit("fault_cleared", kind=spec.kind, index=spec.index, node=node,
                     bytes_forward=stats["bytes_forward"],
                     chunks_corrupted=stats["chunks_corrupted"], flips=stats["flips"])

    env.later(for_s, restore)
    host, port = proxy.address
    return f"{host}:{port}"


def _positive(spec: FaultSpec, name: str, value: float) -> float:
    if not value > 0:
        raise ConfigError(f"faults[{spec.index}].params.{name}", f"{value!r} must be > 0")
    return value


def fire_slow_link(spec: FaultSpec, env: FaultEnv) -> Mapping[str, Any]:
    """Delay every replication chunk into node N's keeper by ``delay_ms`` for ``for_s``."""
    node = _node(spec)
    delay_ms, for_s = _param(spec, "delay_ms"), _positive(spec, "for_s", _param(spec, "for_s"))
    direction = _param(spec, "direction")
    if delay_ms < 0 or direction not in DIRECTIONS:
        raise ConfigError(f"faults[{spec.index}].params",
                          f"delay_ms {delay_ms} must be >= 0, direction one of {DIRECTIONS}")
    proxy = LinkProxy(env.keeper_address(node), name=f"slow-node{node}").start()
    proxy.set_delay(delay_ms / 1000.0, direction)
    address = _route_through_proxy(spec, env, proxy, node, for_s)
    return {"proxy": address, "delay_ms": delay_ms, "for_s": for_s, "direction": direction}


def fire_corrupt_payload(spec: FaultSpec, env: FaultEnv) -> Mapping[str, Any]:
    """Flip one bit in each of the next ``count`` chunks (of >= ``min_chunk_bytes``:
    replica payload, not handshakes) of replication traffic into node N's keeper."""
    node = _node(spec)
    count, for_s = _param(spec, "count"), _positive(spec, "for_s", _param(spec, "for_s"))
    min_chunk = _param(spec, "min_chunk_bytes")
    if count < 1 or min_chunk < 0:
        raise ConfigError(f"faults[{spec.index}].params",
                          f"count {count} must be >= 1, min_chunk_bytes {min_chunk} >= 0")
    proxy = LinkProxy(env.keeper_address(node), name=f"corrupt-node{node}").start()
    proxy.corrupt(count, "forward", min_chunk_bytes=min_chunk)
    address = _route_through_proxy(spec, env, proxy, node, for_s)
    return {"proxy": address, "count": count, "for_s": for_s, "min_chunk_bytes": min_chunk}


def fire_s3_outage(spec: FaultSpec, env: FaultEnv) -> Mapping[str, Any]:
    """The S3 endpoint refuses connections (open ones are reset) for ``for_s`` seconds."""
    for_s = _positive(spec, "for_s", _param(spec, "for_s"))
    try:
        proxy = env.service(S3_PROXY)
    except KeyError:
        proxy = None
    if not isinstance(proxy, LinkProxy):
        raise ConfigError("tiers.s3.enabled", "an s3_outage drill needs the S3 tier enabled "
                          "and its endpoint proxied (phalanx.launcher.drills.faults.network.prepare_job)",
                          "enable tiers.s3 with an http endpoint, or drop the fault")
    proxy.refuse(for_s)

    def reopen() -> None:        # the proxy's own timer reopens too: accept() is idempotent
        proxy.accept()
        env.emit("fault_cleared", kind=spec.kind, index=spec.index,
                 resets=proxy.stats()["resets"])

    env.later(for_s, reopen)
    host, port = proxy.address
    return {"proxy": f"{host}:{port}", "target": "{}:{}".format(*proxy.target), "for_s": for_s}


_MECHANISMS = (
    Mechanism("slow_link", "liveness", "node", fire_slow_link,
              "replication into node N's keeper is delayed (a slow network link)",
              params={"delay_ms": (float, 200.0), "for_s": (float, 10.0),
                      "direction": (str, "forward")},
              recovers="none", chaos=True,
              response=("nothing to recover: replication lags, training does not "
                        "wait")),
    Mechanism("corrupt_payload", "communication", "node", fire_corrupt_payload,
              "bits flip in replication traffic into node N's keeper; the replica is refused "
              "and pushed again",
              params={"count": (int, 1), "for_s": (float, 10.0),
                      "min_chunk_bytes": (int, 4096)},
              recovers="none", chaos=True,
              response=("the receiving keeper verifies the chunks, refuses the "
                        "replica, and the sender pushes it again")),
    Mechanism("s3_outage", "storage", "role", fire_s3_outage,
              "the S3 endpoint refuses connections; persistence retries and resumes",
              params={"for_s": (float, 10.0)}, roles=("s3",), recovers="none", chaos=False,
              needs=("s3",),
              response=("persistence retries with backoff and raises tier_degraded; "
                        "training goes on")),
)
REGISTRY_PARAMS = {m.kind: m.params for m in _MECHANISMS}
for _mechanism in _MECHANISMS:
    register(_mechanism)


register_preparer(prepare_job)
