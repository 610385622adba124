"""omni-proxy's vLLM plugin: the engine registers itself with the control plane.

Installed with the ``omni-proxy`` package, it is found through vLLM's
``vllm.general_plugins`` entry point ``omni_proxy`` (``VLLM_PLUGINS=omni_proxy`` selects it
when a deployment lists its plugins). vLLM calls :func:`register` in every process it starts
(API server, engine core, workers), several times at most once each. It does something only
when ``OMNI_CONTROLPLANE`` is set, and only in the API server process: the one that imported
vLLM's HTTP entry point (``vllm.entrypoints.launchers.api_server.entry``). There it wraps
``build_and_serve`` (older vLLM: ``vllm.entrypoints.openai.api_server.init_app_state``),
which runs once the engines have started: it learns the engine's
facts (``facts.py``: served names, bound port, block size, hashing, KV events, DP size, KV
connector and role, KV capacity, max batched tokens) and starts the registration agent
(``agent.py``) on a daemon thread. On SIGTERM/SIGINT the agent deregisters before vLLM
drains its engine (its ``engine_client.shutdown``), or, failing that, when
the server returns or at exit.

Environment: ``OMNI_CONTROLPLANE`` (host:port, comma-separated for several replicas),
``OMNI_ROLE`` (both | prefill | decode; default from the KV connector's kv_role),
``OMNI_ADVERTISE_URL``, ``OMNI_WORKER_ID``, ``OMNI_TOKEN``, ``OMNI_KV_EVENTS``,
``OMNI_KV_REPLAY`` (``none``: announce no events), ``OMNI_WEIGHT``, ``OMNI_LABELS``
(``k=v,k=v``), ``OMNI_HEARTBEAT_TTL_S``, ``OMNI_TLS_CA`` / ``OMNI_TLS_CERT`` / ``OMNI_TLS_KEY``.
"""

from __future__ import annotations

import atexit
import logging
import sys
from typing import Any

log = logging.getLogger("vllm.omni_proxy")  # under "vllm": vLLM's log handlers and format

_ENTRY = "vllm.entrypoints.launchers.api_server.entry"
# vLLM before the launchers package (e.g. the versions vLLM-Ascend pins): the API server's
# run_server_worker calls this module's init_app_state once the engine client exists.
_LEGACY = "vllm.entrypoints.openai.api_server"
_state: dict = {"patched": False, "agent": None}


def register() -> None:
    """vLLM's general-plugin hook. Never raises."""
    try:
        _register()
    except Exception:  # noqa: BLE001 - a plugin must not stop the engine
        log.exception("omni-proxy plugin: not active")


def _register() -> None:
    if _state["patched"]:
        return
    from engine_plugins.vllm_plugin.agent import Settings

    try:
        settings = Settings.from_env()
    except ValueError as exc:
        log.error("omni-proxy plugin: %s; this engine will not register", exc)
        _state["patched"] = True
        return
    if settings is None:
        return
    entry: Any = sys.modules.get(_ENTRY)   # vLLM's module: its attributes are what we patch
    if entry is None or not hasattr(entry, "build_and_serve"):
        legacy = sys.modules.get(_LEGACY)
        if legacy is not None and hasattr(legacy, "init_app_state"):
            _patch_legacy(legacy, settings)
        return                        # else an engine-core or worker process, or not `vllm serve`
    real = entry.build_and_serve
    if getattr(real, "_omni_proxy", False):
        _state["patched"] = True
        return

    async def build_and_serve(engine_client, listen_address, sock, args, *rest, **kwargs):
        # Runs once the engines are up (the KV block count is known) and the socket is
        # bound; the real one serves until the server shuts down.
        agent = None
        peer_loads = rest[0] if rest else kwargs.get("peer_loads")
        try:
            # --api-server-count > 1: every API server runs this on the same port; the
            # first one (client index 0) registers the engine.
            if not (isinstance(peer_loads, tuple) and len(peer_loads) == 2 and peer_loads[1]):
                agent = _start(settings, engine_client, args, sock)
        except Exception:  # noqa: BLE001
            log.exception("omni-proxy plugin: could not start registration")
        try:
            return await real(engine_client, listen_address, sock, args, *rest, **kwargs)
        finally:
            if agent is not None:
                import asyncio

                await asyncio.to_thread(agent.stop)

    _mark_patched(build_and_serve)
    entry.build_and_serve = build_and_serve
    _state["patched"] = True
    log.info("omni-proxy plugin: will register with %s once the server is up", ",".join(settings.controlplanes))


def _mark_patched(wrapper: Any) -> None:
    """Tag our wrapper (a function attribute), so loading the plugin twice patches once."""
    wrapper._omni_proxy = True


def _patch_legacy(module, settings) -> None:
    real = module.init_app_state
    if getattr(real, "_omni_proxy", False):
        _state["patched"] = True
        return

    async def init_app_state(engine_client, *rest, **kwargs):
        result = await real(engine_client, *rest, **kwargs)
        try:
            values = [*rest, *kwargs.values()]
            config = next((v for v in values if hasattr(v, "cache_config")), None)
            args = next((v for v in values if hasattr(v, "port") and hasattr(v, "host")), None)
            _start(settings, engine_client, args, None, vllm_config=config)
        except Exception:  # noqa: BLE001
            log.exception("omni-proxy plugin: could not start registration")
        return result

    _mark_patched(init_app_state)
    module.init_app_state = init_app_state
    _state["patched"] = True
    log.info("omni-proxy plugin: will register with %s once the server is up", ",".join(settings.controlplanes))


def _start(settings, engine_client, args, sock, *, vllm_config=None):
    from engine_plugins.vllm_plugin.agent import Agent
    from engine_plugins.vllm_plugin.facts import facts_from_vllm

    if _state["agent"] is not None:
        return None
    facts = facts_from_vllm(vllm_config or getattr(engine_client, "vllm_config", None), args, sock)
    agent = Agent(settings, facts).start()
    _state["agent"] = agent
    atexit.register(agent.stop)
    # SIGTERM/SIGINT: vLLM's API server stops its engine client first (draining in-flight
    # requests for --shutdown-timeout), then the HTTP server. Leave the fleet before that, so
    # that no new request is placed here while the engine drains.
    real_shutdown = getattr(engine_client, "shutdown", None)
    if callable(real_shutdown):
        def shutdown(*a, **k):
            agent.stop()
            return real_shutdown(*a, **k)
        try:
            engine_client.shutdown = shutdown
        except (AttributeError, TypeError):
            pass
    return agent
