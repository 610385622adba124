"""Engines without the plugin: a watched discovery file.

``[discovery] file = "workers.toml"`` (or ``--discovery-file``) names a TOML file of
``[[workers]]`` tables with the same keys as the config's. The control plane reads it at
start and again whenever its modification time or size changes (checked every
``interval_s``, 1 s). Workers it lists get source ``file``: new entries are added, changed
entries updated, entries that disappear removed. Workers from the config, the registry or
an operator's ``omni-ctl add`` are never touched: an entry whose id (or URL and role)
belongs to one of them is skipped. A bad entry is one log line and skipped; a file that
does not parse (or is missing) leaves the file's workers as they are.

Like every other new worker, one from the file gets placements only once its first health
check passes. An operator's drain or weight change to a file worker holds until its entry
in the file changes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import tomllib
from typing import Any

from controlplane.config import WorkerSpec as ConfigWorker
from controlplane.registry import WorkerRegistry, worker_id_for
from controlplane.workers import normalize_url

log = logging.getLogger(__name__)

SOURCE = "file"


def _entry_key(w: ConfigWorker) -> tuple:
    return (w.url, w.role, w.model, w.weight, w.bootstrap_port, tuple(sorted(w.labels.items())), w.kv_events,
            w.kv_replay, w.dp_size)


class DiscoveryFile:
    def __init__(self, path: str, registry: WorkerRegistry, *, interval_s: float = 1.0) -> None:
        self.path = path
        self.registry = registry
        self.interval_s = interval_s
        self._stamp: tuple[int, int] | None = None
        self._applied: dict[str, tuple] = {}    # worker id -> the entry last applied
        self._missing_logged = False
        self._task: asyncio.Task | None = None
        self.loads = 0          # successful reads (for tests and logs)

    async def start(self) -> None:
        await self.sync()
        self._task = asyncio.create_task(self._watch(), name="discovery-file")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.sync()
            except Exception:   # noqa: BLE001 - a bug here must not stop watching for good
                log.exception("discovery file %s: re-reading failed", self.path)

    def _changed(self) -> bool:
        try:
            st = os.stat(self.path)
        except OSError as exc:
            if not self._missing_logged:
                log.warning("discovery file %s: cannot read it (%s); its workers stay as they are",
                            self.path, exc.strerror or exc)
                self._missing_logged = True
            self._stamp = None
            return False
        self._missing_logged = False
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp == self._stamp:
            return False
        self._stamp = stamp
        return True

    async def sync(self, force: bool = False) -> bool:
        """Re-read the file if it changed; True when it was read and applied."""
        if not self._changed() and not force:
            return False
        entries = self._read()
        if entries is None:
            return False
        await self._apply(entries)
        self.loads += 1
        return True

    def _read(self) -> dict[str, ConfigWorker] | None:
        try:
            with open(self.path, "rb") as f:
                data = tomllib.load(f)
        except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            log.error("discovery file %s: not read (%s); its workers stay as they are", self.path, exc)
            return None
        unknown = [k for k in data if k != "workers"]
        if unknown:
            log.warning("discovery file %s: ignoring keys %s (only [[workers]] tables are read)", self.path,
                        ", ".join(map(repr, unknown)))
        workers: Any = data.get("workers", [])
        if not isinstance(workers, list):
            log.error("discovery file %s: workers must be a list of [[workers]] tables; not applied", self.path)
            return None
        out: dict[str, ConfigWorker] = {}
        urls: dict[tuple[str, str], str] = {}
        for i, raw in enumerate(workers):
            where = f"{self.path}: workers[{i}]"
            try:
                w = ConfigWorker.from_dict(raw, where)
            except ValueError as exc:
                log.error("discovery file: skipped: %s", exc)
                continue
            wid = w.id or worker_id_for(normalize_url(w.url), w.role)   # as for config workers
            key = (normalize_url(w.url).lower(), w.role.value)
            if wid in out or key in urls:
                log.error("discovery file: skipped: %s duplicates %s (id %s)", where,
                          urls.get(key, "an earlier entry"), wid)
                continue
            urls[key] = where
            w.id = wid
            out[wid] = w
        return out

    async def _apply(self, entries: dict[str, ConfigWorker]) -> None:
        fleet = self.registry.fleet
        others = {(s.url.lower(), s.role.value): s.id for s in fleet.specs() if s.source != SOURCE}
        # gone from the file
        for spec in fleet.specs():
            if spec.source == SOURCE and spec.id not in entries:
                await self.registry.remove(spec.id)
                self._applied.pop(spec.id, None)
                log.info("discovery file: worker %s removed (no longer listed)", spec.id)
        added = updated = 0
        for wid, w in entries.items():
            existing = fleet.get(wid)
            if existing is not None and existing.source != SOURCE:
                log.error("discovery file: skipped: worker id %s belongs to a %s worker", wid, existing.source)
                continue
            other = others.get((normalize_url(w.url).lower(), w.role.value))
            if other is not None and other != wid:
                log.error("discovery file: skipped: %s (%s) is already worker %s", w.url, w.role.value, other)
                continue
            key = _entry_key(w)
            if existing is not None and self._applied.get(wid) == key:
                continue
            # New here: an operator's weight for it (before a restart) wins; a changed entry: the file's.
            await self.registry.add(url=w.url, role=w.role, model=w.model, worker_id=wid,
                                    weight=w.weight if existing is not None else None, default_weight=w.weight,
                                    labels=w.labels, bootstrap_port=w.bootstrap_port, source=SOURCE,
                                    kv_events=w.kv_events, kv_replay=w.kv_replay, dp_size=w.dp_size)
            self._applied[wid] = key
            if existing is None:
                added += 1
            else:
                updated += 1
                log.info("discovery file: worker %s updated", wid)
        if added or updated:
            log.info("discovery file %s: %d workers added, %d updated", self.path, added, updated)
