"""Operators' changes that must outlive a control-plane restart, and the removal fence.

With the memory store, a restart used to forget every drain, weight, added and removed
worker without a word. :class:`AdminState` keeps them in a small JSON file (``[state]
file``), written atomically (a temporary file in the same directory, fsync, ``os.replace``,
then fsync of the directory) after each change, and read back at start:

* ``overrides``: id -> the weight and drain flag an operator set; applied whenever that
  worker (re)appears, from the config, a plugin's registration or the discovery file, so a
  re-registering engine never resets them;
* ``added``: workers an operator added (``omni-ctl add``), with every field;
* ``removed``: workers an operator removed (``omni-ctl remove``). A removed worker is
  *fenced*: the next heartbeat of its engine plugin is answered known=false and the
  registration that follows (the same running engine: the same owner key) is refused, so it
  cannot undo the removal; a new engine process (a restart, a new key) or ``omni-ctl add``
  is the deliberate way back. A configured worker stays out after a restart.

The fence is kept in memory without a file too; only its survival needs one. Without a
file (and with the memory store) the control plane says at start, and in every admin
answer, that these changes are lost at restart.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from controlplane.workers import Role, WorkerSpec

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
# The WorkerSpec fields an added worker is written with (source, TTL: always "admin", none).
_SPEC_FIELDS = ("url", "role", "model", "weight", "draining", "bootstrap_port", "labels", "kv_events",
                "kv_replay", "dp_size")


def spec_to_json(spec: WorkerSpec) -> dict[str, Any]:
    out = {name: getattr(spec, name) for name in _SPEC_FIELDS}
    out["role"] = spec.role.value
    out["labels"] = dict(spec.labels)
    return out


def spec_from_json(worker_id: str, data: dict[str, Any]) -> WorkerSpec:
    return WorkerSpec(id=worker_id, url=str(data["url"]), role=Role.parse(str(data.get("role", "both"))),
                      model=str(data.get("model", "")), weight=float(data.get("weight", 1.0)),
                      draining=bool(data.get("draining", False)), source="admin",
                      bootstrap_port=int(data.get("bootstrap_port", 0)),
                      labels={str(k): str(v) for k, v in dict(data.get("labels") or {}).items()},
                      kv_events=str(data.get("kv_events", "")), kv_replay=str(data.get("kv_replay", "")),
                      dp_size=int(data.get("dp_size", 1)))


@dataclass
class AdminState:
    path: str = ""                                      # "": kept in memory only
    overrides: dict[str, dict[str, Any]] = field(default_factory=dict)
    added: dict[str, dict[str, Any]] = field(default_factory=dict)
    removed: dict[str, dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def load(cls, path: str) -> AdminState:
        """The file's state; a missing file is an empty state (first start). A file that
        cannot be read or parsed is an error naming ``state.file``: starting without it would
        silently undo the operators' changes."""
        state = cls(path=path)
        if not path:
            return state
        try:
            text = Path(path).read_text()
        except FileNotFoundError:
            directory = Path(path).parent
            if not directory.is_dir() or not os.access(directory, os.W_OK):
                raise ValueError(f"state.file: cannot write {path}: directory {directory} "
                                 f"{'is not writable' if directory.is_dir() else 'does not exist'}") from None
            return state
        except OSError as exc:
            raise ValueError(f"state.file: cannot read {path}: {exc.strerror}") from None
        try:
            data = json.loads(text)
            if not isinstance(data, dict) or data.get("version") != FORMAT_VERSION:
                raise ValueError(f"not an omni-proxy state file (version {FORMAT_VERSION})")
            state.overrides = {str(k): dict(v) for k, v in dict(data.get("overrides") or {}).items()}
            state.added = {str(k): dict(v) for k, v in dict(data.get("added") or {}).items()}
            state.removed = {str(k): dict(v) for k, v in dict(data.get("removed") or {}).items()}
            for wid, spec in state.added.items():
                spec_from_json(wid, spec)     # every added worker must be whole
        except (ValueError, TypeError, KeyError) as exc:
            raise ValueError(f"state.file: {path} is not a valid state file: {exc}") from None
        return state

    @property
    def persistent(self) -> bool:
        return bool(self.path)

    # -- what operators did ------------------------------------------------------------
    def set_override(self, spec: WorkerSpec) -> None:
        """The operator's weight and drain flag for this worker, as they are now."""
        self.overrides[spec.id] = {"weight": spec.weight, "draining": spec.draining}
        if spec.id in self.added:
            self.added[spec.id].update(weight=spec.weight, draining=spec.draining)

    def note_added(self, spec: WorkerSpec) -> list[str]:
        """An operator added (or replaced) ``spec``; the fences it lifts (its id, its URL)."""
        lifted = [wid for wid, gone in self.removed.items()
                  if wid == spec.id or gone.get("url", "").lower() == spec.url.lower()]
        for wid in lifted:
            del self.removed[wid]
        self.added[spec.id] = spec_to_json(spec)
        self.set_override(spec)
        return lifted

    def note_removed(self, spec: WorkerSpec) -> None:
        self.added.pop(spec.id, None)
        self.overrides.pop(spec.id, None)
        # owner_key: the SHA-256 of the registration's owner key (controlplane/ownership.py),
        # kept so the same running engine (the same key) is refused and a new one is not.
        self.removed[spec.id] = {"url": spec.url, "source": spec.source, "at": time.time(),
                                 "owner_key": getattr(spec, "owner_key", "")}

    def lift(self, worker_id: str) -> None:
        """The fence on this id ends (an operator added it, or a new engine registered it)."""
        self.removed.pop(worker_id, None)

    # -- what the control plane asks ---------------------------------------------------
    def fenced(self, worker_id: str, url: str, owner_key_hash: str) -> tuple[str, str]:
        """(the fenced id, why this registration is refused) when an operator removed this id
        or URL and the registration comes from the same running engine (its owner key); else
        ("", ""). A registration with another key is a new engine process: a restart, the
        deliberate way back (as is ``omni-ctl add``)."""
        low = url.lower()
        gone = self.removed.get(worker_id)
        if gone is None:
            worker_id, gone = next(((wid, g) for wid, g in self.removed.items()
                                    if g.get("url", "").lower() == low), ("", None))
        if gone is None or not gone.get("owner_key"):
            return "", ""              # not removed, or not a registration (config, admin, file)
        if gone["owner_key"] != owner_key_hash:
            return worker_id, ""
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(gone.get("at", 0)))
        return worker_id, (f"worker {worker_id} ({gone.get('url', '?')}) was removed by an operator at {when} "
                           f"(omni-ctl remove): this engine's registrations are refused until it restarts "
                           f"(a new registration) or an operator adds it again (omni-ctl add)")

    def override(self, worker_id: str) -> dict[str, Any]:
        return self.overrides.get(worker_id, {})

    # -- the file ----------------------------------------------------------------------
    def save(self) -> None:
        """Write the file atomically: readers (and a crash) see the old file or the new one."""
        if not self.path:
            return
        path = Path(self.path)
        data = json.dumps({"version": FORMAT_VERSION, "overrides": self.overrides, "added": self.added,
                           "removed": self.removed}, indent=1, sort_keys=True)
        directory = path.parent if str(path.parent) else Path(".")
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        try:
            dir_fd = os.open(directory, os.O_RDONLY)
        except OSError:
            return
        try:
            os.fsync(dir_fd)
        except OSError:
            pass
        finally:
            os.close(dir_fd)

    def describe(self) -> str:
        """Where operators' changes are kept, for admin answers and the start-up log."""
        return f"file {self.path}" if self.path else ""
