"""Injected failures, so proxies can be tested against engines that misbehave on cue.

Each kind of fault has its own countdown, so one POST can arm a delay and an error
together (a slow failure). A count of -1 means "until cleared".
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass
class Faults:
    healthy: bool = True
    error_status: int = 500
    error_message: str = "injected fault"
    error_remaining: int = 0
    retry_after: str = ""           # sent as Retry-After with the injected error, when set
    delay_s: float = 0.0
    delay_remaining: int = 0
    omit_kv_remaining: int = 0
    compress_remaining: int = 0     # gzip JSON answers for clients that accept it
    # Every engine step takes this many times its modelled time (a GPU that throttles, a
    # noisy neighbour): the heterogeneous-fleet benchmarks slow one engine mid-run with it.
    slowdown: float = 1.0

    def apply(self, spec: dict[str, Any]) -> None:
        """Arm faults from a /sim/faults body; ValueError on a malformed body."""
        if not isinstance(spec, dict):
            raise ValueError("fault spec must be a JSON object")
        known = {"clear", "healthy", "status", "message", "retry_after", "delay_s", "omit_kv_transfer_params",
                 "compress", "count", "slowdown"}
        unknown = set(spec) - known
        if unknown:
            raise ValueError(f"unknown fault fields: {sorted(unknown)}")
        count = spec.get("count", 1)
        if type(count) is not int or count < -1:
            raise ValueError("count must be an integer >= -1")
        if spec.get("clear"):
            for f in fields(self):
                setattr(self, f.name, f.default)
        if "healthy" in spec:
            if not isinstance(spec["healthy"], bool):
                raise ValueError("healthy must be a boolean")
            self.healthy = spec["healthy"]
        if "status" in spec:
            status = spec["status"]
            if type(status) is not int or not 400 <= status <= 599:
                raise ValueError("status must be an HTTP error status (400-599)")
            message = spec.get("message", "injected fault")
            if not isinstance(message, str):
                raise ValueError("message must be a string")
            retry_after = spec.get("retry_after", "")
            if not isinstance(retry_after, (str, int)) or isinstance(retry_after, bool):
                raise ValueError("retry_after must be a string or an integer")
            self.error_status, self.error_message, self.error_remaining = status, message, count
            self.retry_after = str(retry_after)
        if "delay_s" in spec:
            delay = spec["delay_s"]
            if not isinstance(delay, (int, float)) or isinstance(delay, bool) or delay < 0:
                raise ValueError("delay_s must be a non-negative number")
            self.delay_s, self.delay_remaining = float(delay), count
        if "slowdown" in spec:
            factor = spec["slowdown"]
            if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not 0.01 <= factor <= 100:
                raise ValueError("slowdown must be a number from 0.01 to 100")
            self.slowdown = float(factor)
        if spec.get("omit_kv_transfer_params"):
            self.omit_kv_remaining = count
        if spec.get("compress"):
            self.compress_remaining = count

    def take_delay(self) -> float:
        if self.delay_remaining == 0:
            return 0.0
        if self.delay_remaining > 0:
            self.delay_remaining -= 1
        return self.delay_s

    def take_error(self) -> tuple[int, str, dict[str, str]] | None:
        """(status, message, extra headers) of the next injected error, if one is armed."""
        if self.error_remaining == 0:
            return None
        if self.error_remaining > 0:
            self.error_remaining -= 1
        return self.error_status, self.error_message, ({"Retry-After": self.retry_after} if self.retry_after else {})

    def take_compress(self) -> bool:
        if self.compress_remaining == 0:
            return False
        if self.compress_remaining > 0:
            self.compress_remaining -= 1
        return True

    def take_omit_kv(self) -> bool:
        if self.omit_kv_remaining == 0:
            return False
        if self.omit_kv_remaining > 0:
            self.omit_kv_remaining -= 1
        return True

    def snapshot(self) -> dict[str, Any]:
        return asdict(self)
