"""Just enough of the Prometheus text format to turn two scrapes of /metrics into run deltas.

Histogram quantiles are estimated like PromQL's ``histogram_quantile``: linear interpolation
inside the bucket that holds the rank, so they are only as fine as the buckets (the gateway's
request histogram starts at 1 ms, which is exactly the resolution the "< 1 ms" targets need).
"""

from __future__ import annotations

import math
import re

SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)")
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')

Labels = tuple[tuple[str, str], ...]

# Families the lab reports; everything else in /metrics is ignored.
HISTOGRAMS = {
    "http_server_request_duration_seconds": "http_response_status_code",
    "tributary_db_pool_acquire_wait_seconds": None,
    "tributary_admission_wait_seconds": None,
    "tributary_downstream_request_duration_seconds": "downstream",
    "tributary_db_query_duration_seconds": "statement",
    "tributary_fanout_gateway_overhead_seconds": None,
    "tributary_runtime_scheduling_lag_seconds": None,
}
COUNTERS = [
    "tributary_http_requests_total",
    "tributary_admission_rejections_total",
    # Cuts of the adaptive limit by cause (core / db_pool / both), in builds that count them.
    "tributary_admission_limit_decreases_total",
    # Core-only cuts undone because the queue did not shorten, in builds that count them.
    "tributary_admission_limit_cuts_undone_total",
    "tributary_ratelimit_rejections_total",
    "tributary_downstream_requests_total",
    "tributary_db_pool_acquire_timeouts_total",
    "tributary_fanout_degraded_total",
    "tributary_runtime_long_polls_total",
    "tributary_runtime_polls_total",
    # Present only in builds that count breaker transitions (the overload curve reads to="open").
    "tributary_downstream_circuit_transitions_total",
    # The downstream caches (docs/caching.md), per downstream: hit ratio = hits / lookups.
    "tributary_cache_hits_total",
    "tributary_cache_misses_total",
    "tributary_cache_coalesced_total",
    "tributary_cache_stale_served_total",
]
GAUGES = [
    "process_resident_memory_bytes",
    "tributary_db_pool_max_connections",
    "tributary_admission_limit",
    "tributary_runtime_workers",
    "tributary_runtime_blocking_threads",
]


def parse(text: str | None) -> dict[tuple[str, Labels], float]:
    samples: dict[tuple[str, Labels], float] = {}
    for line in (text or "").splitlines():
        if not line or line.startswith("#"):
            continue
        match = SAMPLE.match(line)
        if not match:
            continue
        name, _, raw_labels, value = match.groups()
        labels = tuple(sorted(LABEL.findall(raw_labels or "")))
        try:
            samples[(name, labels)] = float(value)
        except ValueError:
            continue
    return samples


def _delta(before: dict, after: dict, key) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """histogram_quantile over cumulative (upper bound, count) pairs sorted by bound."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    total = buckets[-1][1]
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound  # beyond the last finite bucket: report its bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return None


def quantile_bucket(q: float, buckets: list[tuple[float, float]]) -> tuple[float, float] | None:
    """The (lower, upper] bucket bounds that hold the q-quantile: all a histogram really knows."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower = 0.0
    for bound, count in buckets:
        if count >= rank:
            return (lower, bound)
        lower = bound
    return None


def histogram_deltas(before: dict, after: dict, family: str, group_by: str | None) -> dict:
    groups: dict[str, dict] = {}
    for (name, labels), _ in after.items():
        if name != f"{family}_bucket":
            continue
        label_map = dict(labels)
        group = label_map.get(group_by, "all") if group_by else "all"
        le = float(label_map["le"]) if label_map.get("le") not in (None, "+Inf") else math.inf
        entry = groups.setdefault(group, {"buckets": {}, "count": 0.0, "sum": 0.0, "series": set()})
        entry["buckets"][le] = entry["buckets"].get(le, 0.0) + _delta(before, after, (name, labels))
        series = tuple(kv for kv in labels if kv[0] != "le")
        if series not in entry["series"]:
            entry["series"].add(series)
            entry["count"] += _delta(before, after, (f"{family}_count", series))
            entry["sum"] += _delta(before, after, (f"{family}_sum", series))
    result = {}
    for group, entry in sorted(groups.items()):
        buckets = sorted(entry["buckets"].items())
        count = entry["count"]
        if count <= 0:
            continue
        le_1ms = entry["buckets"].get(0.001)  # only when the histogram has a 1 ms bucket

        def ms(value):
            return None if value is None else round(value * 1000, 3)

        result[group] = {
            "count": int(count),
            "mean_ms": ms(entry["sum"] / count),
            "p50_ms": ms(quantile(0.5, buckets)),
            "p99_ms": ms(quantile(0.99, buckets)),
            "p999_ms": ms(quantile(0.999, buckets)),
            "p50_bucket_ms": bucket_ms(quantile_bucket(0.5, buckets)),
            "p99_bucket_ms": bucket_ms(quantile_bucket(0.99, buckets)),
            "fraction_le_1ms": round(le_1ms / count, 4) if le_1ms is not None else None,
            # Observations above 1 s: slower than the gateway's default request deadline.
            "count_gt_1s": int(count - entry["buckets"][1.0]) if 1.0 in entry["buckets"] else None,
            "buckets": {("+Inf" if math.isinf(b) else f"{b:g}"): int(c) for b, c in buckets},
        }
    return result


def bucket_ms(bounds: tuple[float, float] | None) -> list | None:
    if bounds is None:
        return None
    return [round(b * 1000, 3) if not math.isinf(b) else None for b in bounds]


def counter_deltas(before: dict, after: dict, family: str) -> dict[str, int]:
    result = {}
    for (name, labels), _ in after.items():
        if name != family:
            continue
        key = ",".join(f"{k}={v}" for k, v in labels) or "all"
        delta = _delta(before, after, (name, labels))
        if delta:
            result[key] = int(delta)
    return result


def gauges(after: dict, family: str) -> dict[str, float]:
    return {(",".join(f"{k}={v}" for k, v in labels) or "value"): value
            for (name, labels), value in after.items() if name == family}


def run_metrics(before_text: str | None, after_text: str | None) -> dict:
    """Deltas over the run of the families the lab reports (absent families are omitted)."""
    before, after = parse(before_text), parse(after_text)
    result: dict = {"scraped": bool(after)}
    for family, group_by in HISTOGRAMS.items():
        deltas = histogram_deltas(before, after, family, group_by)
        if deltas:
            result[family] = deltas
    for family in COUNTERS:
        deltas = counter_deltas(before, after, family)
        if deltas:
            result[family] = deltas
    for family in GAUGES:
        values = gauges(after, family)
        if values:
            result[family] = values
    return result


# Gauges sampled during a run: (family, label filter) -> name in the run JSON.
SAMPLED_GAUGES = {
    ("tributary_db_pool_connections", ("state", "in_use")): "pool_in_use",
    ("tributary_db_pool_connections", ("state", "idle")): "pool_idle",
    ("tributary_db_pool_waiters", None): "pool_waiters",
    ("tributary_db_pool_queue_standing", None): "pool_queue_standing",
    ("http_server_active_requests", None): "active_requests",
    ("tributary_admission_permits_in_use", None): "admission_permits_in_use",
    ("process_resident_memory_bytes", None): "rss_bytes",
    ("process_open_fds", None): "open_fds",
    ("tributary_admission_limit", ("group", "dashboard")): "admission_limit_dashboard",
    ("tributary_admission_permits_in_use", ("group", "dashboard")): "admission_in_use_dashboard",
    ("tributary_admission_shedding", None): "admission_shedding",
    ("tributary_admission_queue_standing", ("group", "dashboard")): "admission_queue_standing_dashboard",
}
# Circuit-breaker state (0 closed, 1 half-open, 2 open), sampled as the number of downstreams
# whose breaker is open / not closed at the sample.
CIRCUIT_STATE = "tributary_downstream_circuit_state"


def sample_gauges(text: str | None) -> dict[str, float]:
    """One sample of the gauges above (summed over label sets that pass the filter)."""
    values: dict[str, float] = {}
    for (name, labels), value in parse(text).items():
        for (family, label_filter), key in SAMPLED_GAUGES.items():
            if name == family and (label_filter is None or label_filter in labels):
                values[key] = values.get(key, 0.0) + value
        if name == CIRCUIT_STATE:
            values["circuits_open"] = values.get("circuits_open", 0.0) + (value >= 2)
            values["circuits_not_closed"] = values.get("circuits_not_closed", 0.0) + (value >= 1)
    return values


def summarise_gauges(samples: list[dict[str, float]]) -> dict:
    keys = sorted({k for s in samples for k in s} - {"t"})
    result: dict = {"samples": len(samples)}
    for key in keys:
        series = [s[key] for s in samples if key in s]
        result[key] = {"mean": round(sum(series) / len(series), 3), "max": max(series)}
    return result
