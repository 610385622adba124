"""A 20-second soak (bench/soak.py): mixed traffic through two data planes while engines are
killed and restarted, answer 5xx bursts, stall, and the control plane restarts. Every
request must end with an answer or a clean error: nothing lost, nothing hung."""

from __future__ import annotations

from bench.soak import Soak, parse_args


def test_soak_short_loses_nothing(tmp_path):
    args = parse_args(["--minutes", str(20 / 60), "--rate", "6", "--fault-every", "3", "--seed", "7",
                       "--deadline", "60", "--out", str(tmp_path / "soak")])
    report = Soak(args).run()
    assert report["sent"] > 0
    assert report["faults"], "no fault was injected"
    assert report["lost"] == 0, report["lost_or_hung_samples"]
    assert report["hung"] == 0, report["lost_or_hung_samples"]
    assert report["sent"] == report["succeeded"] + report["clean_error"]
    assert report["leaked_load"] == 0, report["ledgers_end"]   # every request's load released
