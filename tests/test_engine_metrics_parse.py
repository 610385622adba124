"""The control plane's scan of engine /metrics agrees with prometheus_client's full parser.

``parse_engine_metrics`` picks the few samples placement needs with one regex; the
reference here is what it replaced: prometheus_client's parser over the whole page.
"""

from __future__ import annotations

import aiohttp
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from controlplane.health import parse_engine_metrics


def reference(text: str) -> tuple[int, int, float, float, float]:
    running = waiting = -1
    hits = queries = -1.0
    kv_total, kv_n = 0.0, 0
    for family in text_string_to_metric_families(text):
        if family.name == "vllm:prefix_cache_hits":
            hits = sum(s.value for s in family.samples if s.name.endswith("_total"))
        elif family.name == "vllm:prefix_cache_queries":
            queries = sum(s.value for s in family.samples if s.name.endswith("_total"))
        if family.name == "vllm:num_requests_running":
            running = int(sum(s.value for s in family.samples))
        elif family.name == "vllm:num_requests_waiting":
            waiting = int(sum(s.value for s in family.samples))
        elif family.name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc") and not kv_n:
            for s in family.samples:
                kv_total += s.value
                kv_n += 1
    return running, waiting, (kv_total / kv_n if kv_n else -1.0), hits, queries


GAUGES = ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
          "vllm:gpu_cache_usage_perc", "vllm:num_preemptions", "vllm:other_gauge"]
COUNTERS = ["vllm:prefix_cache_hits", "vllm:prefix_cache_queries", "vllm:generation_tokens"]
label_value = st.text(alphabet=st.sampled_from('ab 0}{=,."'), max_size=6).map(
    lambda s: s.replace("\\", "").replace('"', '\\"'))
labels = st.dictionaries(st.sampled_from(["engine", "model_name", "le_x"]), label_value, max_size=2)
values = st.one_of(st.integers(0, 1000).map(float), st.floats(0, 1, allow_nan=False))


def render_labels(lab: dict[str, str]) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in lab.items()) + "}" if lab else ""


@st.composite
def pages(draw) -> str:
    lines = []
    names = draw(st.lists(st.sampled_from(GAUGES + COUNTERS), unique=True, max_size=len(GAUGES + COUNTERS)))
    for name in names:
        counter = name in COUNTERS
        # as prometheus_client writes text format 0.0.4 (vLLM's): a counter's family is named with _total
        family = f"{name}_total" if counter else name
        lines += [f"# HELP {family} some help", f"# TYPE {family} {'counter' if counter else 'gauge'}"]
        engines = draw(st.lists(labels, min_size=1, max_size=3, unique_by=lambda d: tuple(sorted(d.items()))))
        lines += [f"{family}{render_labels(lab)} {draw(values)}" for lab in engines]
        if counter:     # its creation times follow as a gauge family of their own
            lines += [f"# HELP {name}_created some help", f"# TYPE {name}_created gauge"]
            lines += [f"{name}_created{render_labels(lab)} 1.7e+09" for lab in engines]
    return "\n".join(lines) + "\n"


def same(a: tuple, b: tuple) -> bool:
    return a[:2] == b[:2] and all(abs(x - y) <= 1e-9 * max(1.0, abs(y)) for x, y in zip(a[2:], b[2:], strict=False))


@settings(max_examples=300, deadline=None)
@given(pages())
def test_the_scan_agrees_with_the_full_parser(text):
    assert same(parse_engine_metrics(text), reference(text)), text


def test_a_vllm_page_with_histograms():
    text = "\n".join([
        "# HELP vllm:num_requests_running Number of requests in model execution batches.",
        "# TYPE vllm:num_requests_running gauge",
        'vllm:num_requests_running{engine="0",model_name="m"} 3.0',
        'vllm:num_requests_running{engine="1",model_name="m"} 4.0',
        "# TYPE vllm:num_requests_waiting gauge",
        'vllm:num_requests_waiting{engine="0",model_name="m"} 2.0',
        "# TYPE vllm:kv_cache_usage_perc gauge",
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5',
        'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.25',
        "# TYPE vllm:prefix_cache_queries_total counter",
        'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 640.0',
        'vllm:prefix_cache_queries_created{engine="0",model_name="m"} 1.7e+09',
        "# TYPE vllm:prefix_cache_hits_total counter",
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 320.0',
        "# TYPE vllm:time_to_first_token_seconds histogram",
        *[f'vllm:time_to_first_token_seconds_bucket{{engine="0",le="{le}",model_name="m"}} 7.0'
          for le in ("0.001", "0.005", "0.01", "+Inf")],
        'vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 7.0',
        'vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 0.5',
    ]) + "\n"
    assert parse_engine_metrics(text) == (7, 2, 0.375, 320.0, 640.0) == reference(text)


def test_absent_metrics_are_minus_one():
    assert parse_engine_metrics("# nothing here\nprocess_cpu_seconds_total 1.0\n") == (-1, -1, -1.0, -1.0, -1.0)


async def test_the_simulators_page(sim_both):
    async with aiohttp.ClientSession() as http:
        async with http.get(sim_both.url + "/metrics") as r:
            text = await r.text()
    assert "vllm:num_requests_running" in text
    assert same(parse_engine_metrics(text), reference(text))
