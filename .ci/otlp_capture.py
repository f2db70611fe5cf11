"""What a real OpenTelemetry collector received from the gateway, written down and then checked.

Two roles in one file, so that what is recorded and what is asserted cannot drift apart:

* Loaded by rotel as a Python processor (`rotel-agent start --otlp-with-trace-processor FILE
  --otlp-with-metrics-processor FILE`), `process_spans` and `process_metrics` append one JSON line
  per batch to the file named by OTLP_CAPTURE: the resource's attributes, and each span (name,
  kind, ids) or metric (name, unit, type). rotel has no file exporter; its debug log would have to
  be parsed back from the collector's text format, and at full verbosity it prints every data
  point. After OTLP_CAPTURE_MAX_ITEMS spans or metrics only the counts are written, so a long
  run under load stays small.
* Run as a script (`python3 .ci/otlp_capture.py traces|metrics CAPTURE ...`), it polls the file
  until what the check expects is there or the deadline passes, and prints what it found either
  way. Exit status 0: found; 1: not found by the deadline.

The processor must never raise: an exception in it would cost the collector the batch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

CAPTURE = os.environ.get("OTLP_CAPTURE", "otlp-capture.jsonl")
MAX_ITEMS = int(os.environ.get("OTLP_CAPTURE_MAX_ITEMS", "5000"))
_written = {"traces": 0, "metrics": 0}

SPAN_KINDS = {0: "unspecified", 1: "internal", 2: "server", 3: "client", 4: "producer", 5: "consumer"}


def _value(any_value) -> object:
    """An AnyValue as a plain Python value (strings, numbers, booleans; others as their repr)."""
    try:
        v = any_value.value
        return v if isinstance(v, (str, int, float, bool)) else str(v)
    except Exception:  # noqa: BLE001 - the processor never raises
        return None


def _resource(obj) -> dict:
    try:
        return {kv.key: _value(kv.value) for kv in obj.resource.attributes}
    except Exception:  # noqa: BLE001
        return {}


def _metric_type(metric) -> str:
    """histogram, sum, gauge, ... as far as the SDK's objects tell it."""
    data = getattr(metric, "data", None)
    if data is None:
        return "none"
    name = type(data).__name__.lower()
    for kind in ("exponentialhistogram", "histogram", "sum", "gauge", "summary"):
        if kind in name:
            return kind
    return name


def _append(signal: str, record: dict, items: list) -> None:
    n = len(items)
    if _written[signal] < MAX_ITEMS:
        record["items"] = items
    _written[signal] += n
    record["signal"] = signal
    record["count"] = n
    with open(CAPTURE, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def process_spans(resource_spans) -> None:
    try:
        items = [
            {
                "name": s.name,
                "kind": SPAN_KINDS.get(int(s.kind), str(s.kind)),
                "trace_id": bytes(s.trace_id).hex(),
                "span_id": bytes(s.span_id).hex(),
                "parent_span_id": bytes(s.parent_span_id).hex(),
            }
            for ss in resource_spans.scope_spans
            for s in ss.spans
        ]
        _append("traces", {"resource": _resource(resource_spans)}, items)
    except Exception as e:  # noqa: BLE001
        _append("traces", {"error": repr(e)}, [])


def process_metrics(resource_metrics) -> None:
    try:
        items = [
            {"name": m.name, "unit": m.unit, "type": _metric_type(m)}
            for sm in resource_metrics.scope_metrics
            for m in sm.metrics
        ]
        _append("metrics", {"resource": _resource(resource_metrics)}, items)
    except Exception as e:  # noqa: BLE001
        _append("metrics", {"error": repr(e)}, [])


# ---- the checker ---------------------------------------------------------------------------------


def _records(path: str, signal: str) -> list[dict]:
    out = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    r = json.loads(line)
                except ValueError:
                    continue  # a line being written
                if r.get("signal") == signal:
                    out.append(r)
    except FileNotFoundError:
        pass
    return out


def _resource_ok(records: list[dict], args) -> tuple[list[dict], str]:
    """The records whose resource has the service name and every expected attribute."""
    want = dict(kv.split("=", 1) for kv in args.attribute)
    want["service.name"] = args.service
    ok = [r for r in records if all(str(r.get("resource", {}).get(k)) == v for k, v in want.items())]
    seen = sorted({json.dumps(r.get("resource", {}), sort_keys=True) for r in records})[:3]
    return ok, f"resources seen: {'; '.join(seen) or 'none'}"


def check_traces(args) -> tuple[bool, str]:
    records = _records(args.capture, "traces")
    ok, seen = _resource_ok(records, args)
    spans = [s for r in ok for s in r.get("items", [])]
    servers = {(s["trace_id"], s["span_id"]): s for s in spans if s["kind"] == "server"}
    routed = [s for s in servers.values() if s["name"].startswith(args.server_span_prefix)]
    children = [
        s
        for s in spans
        if s["kind"] == "client"
        and s["name"].startswith(args.client_span_prefix)
        and (s["trace_id"], s["parent_span_id"]) in servers
    ]
    total = sum(r.get("count", 0) for r in records)
    detail = (
        f"{len(records)} batches, {total} spans; with the expected resource: {len(spans)} spans, "
        f"{len(servers)} server spans, {len(routed)} named '{args.server_span_prefix}...', "
        f"{len(children)} client spans named '{args.client_span_prefix}...' whose parent is a server span of their trace"
    )
    if routed:
        detail += f"; e.g. {routed[0]['name']!r}"
    if children:
        detail += f", child {children[0]['name']!r}"
    return bool(routed and children), f"{detail}\n{seen}"


def check_metrics(args) -> tuple[bool, str]:
    records = _records(args.capture, "metrics")
    ok, seen = _resource_ok(records, args)
    metrics = {}
    for r in ok:
        for m in r.get("items", []):
            metrics.setdefault(m["name"], m)
    missing = []
    for spec in args.metric:
        name, _, rest = spec.partition(":")
        unit, _, kind = rest.partition(":")
        m = metrics.get(name)
        if m is None or (unit and m["unit"] != unit) or (kind and m["type"] != kind):
            missing.append(f"{spec} (got {m})")
    detail = (
        f"{len(records)} batches; {len(metrics)} distinct metrics with the expected resource"
        + (f", e.g. {', '.join(sorted(metrics)[:6])}" if metrics else "")
    )
    if missing:
        detail += f"; missing or different: {'; '.join(missing)}"
    return bool(metrics) and not missing, f"{detail}\n{seen}"


def main() -> int:
    ap = argparse.ArgumentParser(description="Check what otlp_capture.py recorded.")
    ap.add_argument("signal", choices=["traces", "metrics"])
    ap.add_argument("capture")
    ap.add_argument("--service", required=True, help="the expected resource service.name")
    ap.add_argument("--attribute", action="append", default=[], help="another resource attribute, k=v")
    ap.add_argument("--server-span-prefix", default="GET /api/v1/dashboard/")
    ap.add_argument("--client-span-prefix", default="GET /", help="a downstream call's span (not a query's)")
    ap.add_argument(
        "--metric", action="append", default=[], help="NAME[:UNIT[:TYPE]] that must have arrived"
    )
    ap.add_argument("--deadline", type=float, default=30, help="seconds to poll for it")
    args = ap.parse_args()
    check = check_traces if args.signal == "traces" else check_metrics
    end = time.monotonic() + args.deadline
    while True:
        ok, detail = check(args)
        if ok or time.monotonic() >= end:
            break
        time.sleep(0.5)
    print(detail)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
