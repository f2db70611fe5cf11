#!/usr/bin/env python3
"""Checks that every PromQL expression the repository ships parses and returns data.

Used by .ci/check-observability.sh; stdlib only apart from PyYAML.

  check_queries.py static
      Without Prometheus. alerts_test.yml has a firing and a silent case for
      every alert. Dashboards: unique uids and panel ids, a description
      on every panel, the provisioned datasource uid on every panel and
      target, every $variable defined, multi-value variables only inside
      =~/!~ matchers, a unit on every graph. Then every dashboard expression
      (variables substituted) goes through `promtool check rules` as a
      recording rule, so a PromQL syntax error fails before anything starts.
      docker-compose.yml must mount prometheus/ and grafana/ where these
      files expect them.

  check_queries.py render-config --target HOST:PORT --self HOST:PORT --out FILE
      Writes a copy of prometheus/prometheus.yml for a local run: job
      `tributary` scrapes HOST:PORT, every interval is 1s, rule_files points
      at the repository's alerts.yml, and the target gets the namespace/pod
      labels that Kubernetes service discovery would add (so the
      prometheus-adapter queries can be checked).

  check_queries.py live --prom URL --since UNIX_TS [--deadline SECONDS]
      Against a Prometheus that has scraped a gateway under traffic: every
      dashboard target and variable, every recording rule (its expression and
      its recorded series), every alert (the whole expression, and each side
      of its comparisons, which must have data), every prometheus-adapter
      rule (templates rendered), and the health of every rule group. An
      expression passes when it parses and some series has a non-NaN sample
      between --since and now. Failing expressions are retried until
      --deadline, because some signals (an opened circuit, a retry) need the
      traffic to have run for a while. With --metrics-file, every metric the
      queries name must also be present in that scrape of /metrics.

Every check prints one line, PASS or FAIL; the exit status is 1 if any failed.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
DASHBOARDS = ROOT / "grafana" / "dashboards"
DATASOURCES = ROOT / "grafana" / "provisioning" / "datasources"
DASHBOARD_PROVIDERS = ROOT / "grafana" / "provisioning" / "dashboards"
PROM_CONFIG = ROOT / "prometheus" / "prometheus.yml"
RULES = ROOT / "prometheus" / "alerts.yml"
ADAPTER_DIR = ROOT / "k8s" / "prometheus-adapter"
COMPOSE = ROOT / "docker-compose.yml"

# Values for Grafana's built-in variables when a query is run outside Grafana.
BUILTIN_VARS = {
    "__rate_interval": "1m",
    "__interval": "15s",
    "__range": "5m",
    "__range_s": "300",
    "__range_ms": "300000",
    "__interval_ms": "15000",
}
# Labels that Kubernetes service discovery would attach to the gateway target;
# render-config adds them and the adapter templates select on them.
LOCAL_NAMESPACE = "tributary"
LOCAL_POD = "tributary-obs-check"

VAR_RE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)\]\]")
# `label="$var"`: a multi-value variable expands to a|b, which only a regex matcher accepts.
EQ_VAR_RE = re.compile(r'(\w+)\s*(?<![!=~])=(?!~)\s*"[^"]*\$')


class Report:
    def __init__(self) -> None:
        self.passed = 0
        self.failed = 0

    def ok(self, what: str, detail: str = "") -> None:
        self.passed += 1
        print(f"PASS  {what}" + (f"  ({detail})" if detail else ""), flush=True)

    def fail(self, what: str, detail: str = "") -> None:
        self.failed += 1
        print(f"FAIL  {what}" + (f"  ({detail})" if detail else ""), flush=True)

    def check(self, cond: bool, what: str, detail: str = "") -> bool:
        (self.ok if cond else self.fail)(what, detail)
        return cond

    def summary(self, name: str) -> int:
        print(f"{name}: {self.passed} passed, {self.failed} failed", flush=True)
        return 1 if self.failed else 0


# ---------------------------------------------------------------------------
# Loading the repository's queries
# ---------------------------------------------------------------------------
@dataclass
class Query:
    source: str  # human-readable origin, printed on every line
    expr: str
    instant: bool = False
    # For a label_values() variable: the label whose values must exist.
    label: str | None = None
    # Labels some result series must carry: those the expression aggregates
    # `by` (le excepted, histogram_quantile consumes it) and those the panel
    # legend names. A metric without such a label would still give data, but
    # one anonymous line where the panel promises one per value.
    required: frozenset[str] = frozenset()


BY_RE = re.compile(r"\bby\s*\(([^)]*)\)")
LEGEND_RE = re.compile(r"\{\{\s*(\w+)\s*\}\}")


def required_labels(expr: str, legend: str = "") -> frozenset[str]:
    labels = {l.strip() for m in BY_RE.finditer(expr) for l in m.group(1).split(",") if l.strip()}
    labels.update(LEGEND_RE.findall(legend or ""))
    return frozenset(labels - {"le"})


def load_yaml_all(path: Path) -> list:
    with path.open() as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def walk_panels(panels):
    for panel in panels or []:
        yield panel
        if panel.get("type") == "row":
            yield from walk_panels(panel.get("panels"))


def dashboards() -> list[tuple[Path, dict]]:
    files = sorted(DASHBOARDS.glob("*.json"))
    return [(f, json.loads(f.read_text())) for f in files]


def variable_values(dash: dict) -> dict[str, str]:
    """The value each dashboard variable takes in checks: its 'All' regex."""
    values = dict(BUILTIN_VARS)
    for var in dash.get("templating", {}).get("list", []):
        name = var["name"]
        kind = var.get("type")
        if kind == "query" and var.get("includeAll"):
            values[name] = var.get("allValue") or ".*"
        elif kind == "constant":
            values[name] = str(var.get("query", ""))
        elif kind in ("custom", "interval") and var.get("options"):
            values[name] = str(var["options"][0]["value"])
        else:
            # Unknown or without an 'All' value: leave it undefined so that
            # any use of it fails loudly instead of being guessed.
            continue
    return values


def substitute(expr: str, values: dict[str, str]) -> tuple[str, list[str]]:
    missing: list[str] = []

    def repl(m: re.Match) -> str:
        name = m.group(1) or m.group(2) or m.group(3)
        if m.group(3):
            missing.append(f"[[{name}]] (deprecated syntax)")
            return m.group(0)
        if name not in values:
            missing.append(name)
            return m.group(0)
        return values[name]

    return VAR_RE.sub(repl, expr), missing


LABEL_VALUES_RE = re.compile(r"^\s*label_values\(\s*(?:(.*),\s*)?(\w+)\s*\)\s*$", re.S)


def dashboard_queries(report: Report | None = None) -> list[Query]:
    out: list[Query] = []
    for path, dash in dashboards():
        values = variable_values(dash)
        for var in dash.get("templating", {}).get("list", []):
            if var.get("type") != "query":
                continue
            q = var.get("query")
            text = q.get("query") if isinstance(q, dict) else q
            m = LABEL_VALUES_RE.match(text or "")
            where = f"{path.name} variable ${var['name']}"
            if not m:
                if report:
                    report.fail(where, f"unsupported variable query {text!r}")
                continue
            selector, label = m.group(1) or "{__name__=~\".+\"}", m.group(2)
            expr, missing = substitute(selector, values)
            if missing and report:
                report.fail(where, f"undefined variables {missing}")
                continue
            out.append(Query(where, f"count by ({label}) ({expr})", instant=True, label=label))
        for panel in walk_panels(dash.get("panels")):
            if panel.get("type") == "row":
                continue
            for target in panel.get("targets", []):
                where = f"{path.name} panel {panel.get('id')} {panel.get('title')!r} {target.get('refId')}"
                expr, missing = substitute(target.get("expr", ""), values)
                if missing:
                    if report:
                        report.fail(where, f"undefined variables {missing}")
                    continue
                out.append(Query(where, expr, instant=bool(target.get("instant")) and not target.get("range"),
                                 required=required_labels(expr, target.get("legendFormat", ""))))
    return out


def rule_groups() -> list[dict]:
    return yaml.safe_load(RULES.read_text())["groups"]


def split_top_level(expr: str) -> tuple[list[str], list[str]]:
    """Splits an expression at its top-level set operators, then each operand at
    its top-level comparison. Returns (operands, comparison sides).

    Only parentheses, brackets, braces and string literals are understood, which
    is enough for rule expressions: `a > 0.5 and b < 3` gives the sides a, b
    (numeric literals are dropped), and `x` with no comparison gives x itself.
    """

    def scan(text: str, ops: list[str], words: bool):
        depth, i, parts, start, quote = 0, 0, [], 0, None
        while i < len(text):
            c = text[i]
            if quote:
                if c == "\\":
                    i += 2
                    continue
                if c == quote:
                    quote = None
                i += 1
                continue
            if c in "\"'`":
                quote = c
            elif c in "([{":
                depth += 1
            elif c in ")]}":
                depth -= 1
            elif depth == 0:
                for op in ops:
                    if not text.startswith(op, i):
                        continue
                    if words:
                        before = text[i - 1] if i else " "
                        after = text[i + len(op)] if i + len(op) < len(text) else " "
                        if before.isalnum() or before == "_" or after.isalnum() or after == "_":
                            continue
                    parts.append((text[start:i], op))
                    i += len(op)
                    start = i
                    break
                else:
                    i += 1
                    continue
                continue
            i += 1
        parts.append((text[start:], None))
        return parts

    operands = [p for p, _ in scan(expr, ["unless", "and", "or"], True)]
    sides: list[str] = []
    for operand in operands:
        pieces = [p for p, _ in scan(operand, ["==", "!=", ">=", "<=", ">", "<"], False)]
        for piece in pieces:
            piece = re.sub(r"^\s*bool\b", "", piece)
            piece = re.sub(r"^\s*(on|ignoring)\s*\([^)]*\)", "", piece)
            piece = re.sub(r"^\s*(group_left|group_right)\s*(\([^)]*\))?", "", piece)
            piece = piece.strip()
            if not piece:
                continue
            try:
                float(piece)
                continue  # a threshold, nothing to look up
            except ValueError:
                sides.append(piece)
    return operands, sides


def rule_queries() -> list[Query]:
    out: list[Query] = []
    for group in rule_groups():
        for rule in group["rules"]:
            expr = rule["expr"].strip()
            if "record" in rule:
                name = rule["record"]
                out.append(Query(f"alerts.yml record {name} (expr)", expr, required=required_labels(expr)))
                out.append(Query(f"alerts.yml record {name} (recorded series)", name, required=required_labels(expr)))
            else:
                name = rule["alert"]
                _, sides = split_top_level(expr)
                if not sides:
                    raise SystemExit(f"alert {name}: found nothing to evaluate in {expr!r}")
                # Labels the annotations print ({{ $labels.instance }}) must exist too.
                templated = set(re.findall(r"\$labels\.(\w+)", json.dumps(rule.get("annotations", {}))))
                for i, side in enumerate(sides):
                    out.append(Query(f"alerts.yml alert {name} signal {i + 1}/{len(sides)}", side,
                                     required=required_labels(side) | templated))
    return out


def alert_exprs() -> list[tuple[str, str]]:
    return [
        (rule["alert"], rule["expr"].strip())
        for group in rule_groups()
        for rule in group["rules"]
        if "alert" in rule
    ]


# ---------------------------------------------------------------------------
# prometheus-adapter rules
# ---------------------------------------------------------------------------
def adapter_rule_sets(report: Report) -> list[tuple[str, str, list[dict]]]:
    """Finds adapter configs in k8s/prometheus-adapter: a bare config
    ({rules, externalRules, resourceRules}), a ConfigMap carrying one as a
    string, or Helm values ({rules: {custom, external}})."""
    found: list[tuple[str, str, list[dict]]] = []

    def from_config(where: str, cfg) -> None:
        if not isinstance(cfg, dict):
            return
        rules = cfg.get("rules")
        if isinstance(rules, list):
            found.append((where, "custom", rules))
        elif isinstance(rules, dict):  # Helm chart values
            for kind in ("custom", "external"):
                if isinstance(rules.get(kind), list):
                    found.append((where, kind, rules[kind]))
        if isinstance(cfg.get("externalRules"), list):
            found.append((where, "external", cfg["externalRules"]))

    if not ADAPTER_DIR.is_dir():
        report.fail("prometheus-adapter rules", f"{ADAPTER_DIR.relative_to(ROOT)} does not exist")
        return found
    for path in sorted(p for p in ADAPTER_DIR.rglob("*") if p.suffix in (".yaml", ".yml")):
        rel = str(path.relative_to(ROOT))
        try:
            docs = load_yaml_all(path)
        except yaml.YAMLError as err:
            report.fail(f"{rel} parses as YAML", str(err))
            continue
        for doc in docs:
            if not isinstance(doc, dict):
                continue
            if doc.get("kind") == "ConfigMap":
                for key, value in (doc.get("data") or {}).items():
                    try:
                        from_config(f"{rel} ConfigMap {doc['metadata']['name']}/{key}", yaml.safe_load(value))
                    except yaml.YAMLError as err:
                        report.fail(f"{rel} {key} parses as YAML", str(err))
            else:
                from_config(rel, doc)
    if not any(rules for _, _, rules in found):
        report.fail("prometheus-adapter rules", f"no adapter rules found under {ADAPTER_DIR.relative_to(ROOT)}")
    return found


# Names of the service's own metrics inside an expression (not recording-rule names,
# which contain colons).
METRIC_NAME_RE = re.compile(r"(?<![\w:])((?:tributary|http_server|process)_\w+)(?![\w:])")
SERIES_NAME_RE = re.compile(r"^\s*([a-zA-Z_:][a-zA-Z0-9_:]*)")


def render_adapter_rule(kind: str, rule: dict) -> tuple[str, str]:
    """Returns (seriesQuery, metricsQuery) with the adapter's Go templates
    rendered the way the adapter would for one pod in LOCAL_NAMESPACE."""
    series_query = rule["seriesQuery"]
    m = SERIES_NAME_RE.match(series_query)
    if m:
        series = m.group(1)
    else:
        nm = re.search(r'__name__\s*=~?\s*"([^"]+)"', series_query)
        if not nm:
            raise ValueError(f"cannot tell the series name from seriesQuery {series_query!r}")
        series = nm.group(1)
    resources = rule.get("resources") or {}
    label_for: dict[str, str] = {}
    for label, res in (resources.get("overrides") or {}).items():
        resource = res["resource"].lower()
        label_for[resource[:-1] if resource.endswith("s") else resource] = label
    template = resources.get("template")
    for resource in ("namespace", "pod"):
        if resource not in label_for and template:
            label_for[resource] = template.replace("<<.Resource>>", resource).replace("<<.Group>>", "")
    ns_label = label_for.get("namespace", "namespace")
    pod_label = label_for.get("pod", "pod")
    if kind == "external":
        matchers = f'{ns_label}="{LOCAL_NAMESPACE}"'
        group_by = ns_label
    else:
        matchers = f'{ns_label}="{LOCAL_NAMESPACE}",{pod_label}=~"{LOCAL_POD}"'
        group_by = pod_label
    query = rule["metricsQuery"]
    rendered = (
        query.replace("<<.Series>>", series)
        .replace("<<.LabelMatchers>>", matchers)
        .replace("<<.GroupBy>>", group_by)
    )
    rendered = re.sub(r"<<\s*\.Series\s*>>", series, rendered)
    rendered = re.sub(r"<<\s*\.LabelMatchers\s*>>", matchers, rendered)
    rendered = re.sub(r"<<\s*\.GroupBy\s*>>", group_by, rendered)
    if "<<" in rendered:
        raise ValueError(f"unrendered template left in {rendered!r}")
    return series_query, rendered


# ---------------------------------------------------------------------------
# static
# ---------------------------------------------------------------------------
def provisioned_datasource_uids() -> set[str]:
    uids = set()
    for f in DATASOURCES.glob("*.y*ml"):
        for ds in yaml.safe_load(f.read_text()).get("datasources", []):
            uids.add(ds["uid"])
    return uids


def cmd_static(_args) -> int:
    report = Report()
    ds_uids = provisioned_datasource_uids()
    report.check(bool(ds_uids), "grafana datasource provisioning defines a uid", ", ".join(sorted(ds_uids)))

    seen_uids: dict[str, str] = {}
    all_dash = dashboards()
    report.check(len(all_dash) >= 5, "grafana/dashboards holds the five dashboards", f"{len(all_dash)} files")
    for path, dash in all_dash:
        name = path.name
        uid = dash.get("uid")
        report.check(bool(uid) and uid not in seen_uids, f"{name} has a unique uid", str(uid))
        seen_uids[uid] = name
        ids = [p.get("id") for p in walk_panels(dash.get("panels"))]
        report.check(len(ids) == len(set(ids)) and None not in ids, f"{name} panel ids are unique", f"{len(ids)} panels")
        defined = set(variable_values(dash))
        problems: list[str] = []
        cells: set[tuple[int, int]] = set()
        for panel in walk_panels(dash.get("panels")):
            pid = f"panel {panel.get('id')} {panel.get('title')!r}"
            pos = panel.get("gridPos") or {}
            if not pos or pos.get("x", 0) + pos.get("w", 0) > 24:
                problems.append(f"{pid}: gridPos missing or wider than 24 columns")
            for dx in range(pos.get("w", 0)):
                for dy in range(pos.get("h", 0)):
                    cell = (pos["x"] + dx, pos["y"] + dy)
                    if cell in cells:
                        problems.append(f"{pid}: overlaps another panel at {cell}")
                        break
                    cells.add(cell)
                else:
                    continue
                break
            if panel.get("type") == "row":
                continue
            if not (panel.get("description") or "").strip():
                problems.append(f"{pid}: no description")
            if (panel.get("datasource") or {}).get("uid") not in ds_uids:
                problems.append(f"{pid}: datasource uid {panel.get('datasource')} is not provisioned")
            if panel.get("type") in ("timeseries", "stat") and not panel["fieldConfig"]["defaults"].get("unit"):
                problems.append(f"{pid}: no unit")
            targets = panel.get("targets") or []
            if not targets:
                problems.append(f"{pid}: no targets")
            for t in targets:
                if (t.get("datasource") or {}).get("uid") not in ds_uids:
                    problems.append(f"{pid} {t.get('refId')}: datasource is not the provisioned one")
                expr = t.get("expr") or ""
                if not expr.strip():
                    problems.append(f"{pid} {t.get('refId')}: empty expr")
                _, missing = substitute(expr, {k: "" for k in defined})
                if missing:
                    problems.append(f"{pid} {t.get('refId')}: undefined variables {missing}")
                if EQ_VAR_RE.search(expr):
                    problems.append(f"{pid} {t.get('refId')}: a variable inside an = matcher (multi-value needs =~)")
        report.check(not problems, f"{name} panels: description, datasource, unit, variables, layout", "; ".join(problems))

    # Every dashboard expression through promtool's PromQL parser.
    queries = dashboard_queries(report)
    rules = {"groups": [{"name": "dashboard-exprs", "rules": [
        {"record": f"dashboard_expr_{i}", "expr": q.expr} for i, q in enumerate(queries)
    ]}]}
    with tempfile.TemporaryDirectory(prefix="check-queries.") as tmp:
        path = Path(tmp) / "dashboard-exprs.yml"
        path.write_text(yaml.safe_dump(rules))
        res = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True)
    report.check(res.returncode == 0, f"promtool parses all {len(queries)} dashboard expressions",
                 (res.stdout + res.stderr).strip().replace("\n", " | ") if res.returncode else "")

    # Every alert has a unit test that fires it and one that does not.
    tests = yaml.safe_load((ROOT / "prometheus" / "alerts_test.yml").read_text())
    firing, silent = set(), set()
    for t in tests.get("tests", []):
        for a in t.get("alert_rule_test", []):
            (firing if a.get("exp_alerts") else silent).add(a["alertname"])
    for name, _ in alert_exprs():
        report.check(name in firing and name in silent,
                     f"alerts_test.yml has a firing and a silent case for {name}",
                     "" if name in firing and name in silent else
                     f"firing case: {name in firing}, silent case: {name in silent}")

    # The compose file must mount the files where the configs expect them.
    if COMPOSE.exists():
        compose = yaml.safe_load(COMPOSE.read_text())
        services = compose.get("services", {})

        def mounts(service: str) -> dict[str, str]:
            out = {}
            for v in services.get(service, {}).get("volumes", []):
                if isinstance(v, str) and v.startswith("./"):
                    src, dst = v.split(":")[:2]
                    out[src.rstrip("/")] = dst.rstrip("/")
            return out

        prom = mounts("prometheus")
        report.check(prom.get("./prometheus/prometheus.yml") == "/etc/prometheus/prometheus.yml"
                     and prom.get("./prometheus/alerts.yml") == "/etc/prometheus/alerts.yml",
                     "docker-compose mounts prometheus.yml and alerts.yml side by side in /etc/prometheus", str(prom))
        graf = mounts("grafana")
        provider_paths = [
            p["options"]["path"]
            for f in DASHBOARD_PROVIDERS.glob("*.y*ml")
            for p in yaml.safe_load(f.read_text()).get("providers", [])
        ]
        report.check(graf.get("./grafana/provisioning") == "/etc/grafana/provisioning",
                     "docker-compose mounts grafana/provisioning at /etc/grafana/provisioning", str(graf))
        report.check(graf.get("./grafana/dashboards") in provider_paths,
                     "docker-compose mounts grafana/dashboards where the dashboard provider reads",
                     f"mounted at {graf.get('./grafana/dashboards')}, provider reads {provider_paths}")
    else:
        report.fail("docker-compose.yml exists")
    return report.summary("static")


# ---------------------------------------------------------------------------
# render-config
# ---------------------------------------------------------------------------
def cmd_render_config(args) -> int:
    cfg = yaml.safe_load(PROM_CONFIG.read_text())
    cfg.setdefault("global", {})
    cfg["global"].update({"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"})
    cfg["rule_files"] = [str(RULES)]
    jobs = {j["job_name"]: j for j in cfg.get("scrape_configs", [])}
    if "tributary" not in jobs:
        print("prometheus.yml has no job named tributary", file=sys.stderr)
        return 1
    for job in jobs.values():
        job.pop("scrape_interval", None)
        job.pop("scrape_timeout", None)
    labels = {"namespace": LOCAL_NAMESPACE, "pod": LOCAL_POD}
    jobs["tributary"]["static_configs"] = [{"targets": [args.target], "labels": labels}]
    jobs["tributary"].pop("kubernetes_sd_configs", None)
    if "prometheus" in jobs:
        jobs["prometheus"]["static_configs"] = [{"targets": [args.self]}]
    Path(args.out).write_text(yaml.safe_dump(cfg, sort_keys=False))
    print(f"wrote {args.out}: job tributary -> {args.target}, intervals 1s, rules {RULES}")
    return 0


# ---------------------------------------------------------------------------
# live
# ---------------------------------------------------------------------------
class Prometheus:
    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")

    def _post(self, path: str, params: dict) -> tuple[int, dict]:
        data = urllib.parse.urlencode(params).encode()
        req = urllib.request.Request(self.url + path, data=data)
        try:
            with urllib.request.urlopen(req, timeout=20) as resp:
                return resp.status, json.load(resp)
        except urllib.error.HTTPError as err:
            body = err.read().decode(errors="replace")
            try:
                return err.code, json.loads(body)
            except ValueError:
                return err.code, {"status": "error", "error": body}

    def get(self, path: str) -> dict:
        with urllib.request.urlopen(self.url + path, timeout=20) as resp:
            return json.load(resp)

    def evaluate(self, q: Query, since: float) -> tuple[bool, str]:
        """Returns (passed, detail)."""
        now = time.time()
        if q.instant:
            status, body = self._post("/api/v1/query", {"query": q.expr, "time": f"{now:.3f}"})
        else:
            step = max(1, int((now - since) / 250) + 1)
            status, body = self._post(
                "/api/v1/query_range",
                {"query": q.expr, "start": f"{since:.3f}", "end": f"{now:.3f}", "step": f"{step}s"},
            )
        if status != 200 or body.get("status") != "success":
            return False, f"HTTP {status} {body.get('errorType', '')}: {body.get('error', '')}"
        result = body["data"]["result"]
        kind = body["data"]["resultType"]
        if not result:
            return False, "empty result"

        def finite(v: str) -> bool:
            return not math.isnan(float(v))

        if kind == "matrix":
            with_data = [s for s in result if any(finite(v) for _, v in s["values"])]
        elif kind == "vector":
            with_data = [s for s in result if finite(s["value"][1])]
        else:  # scalar
            with_data = [result] if finite(result[1]) else []
        if not with_data:
            return False, f"{len(result)} series, all NaN"
        if q.label and not all(q.label in s["metric"] for s in with_data):
            return False, f"series without label {q.label}"
        labels = sorted({k for s in with_data for k in s["metric"]})
        missing = sorted(q.required - set(labels))
        if missing:
            return False, f"{len(with_data)} series, none with label(s) {', '.join(missing)} (got [{', '.join(labels)}])"
        return True, f"{len(with_data)} series" + (f" [{', '.join(labels)}]" if labels else "")


# What the check's traffic must have made happen, so that every panel shows
# the gateway really counting it (a counter registered at zero and never
# incremented would still give a non-empty panel). The gateway process is new
# for each run, so a counter above zero was incremented by this run; gauges
# are looked at over the whole run (WINDOW is filled in).
EXERCISED = [
    ("2xx, 4xx and 5xx API responses",
     'count(sum by (status_class) (tributary_http_requests_total{status_class=~"2xx|4xx|5xx", http_route!~"/metrics|/healthz|/readyz"}) > 0) == 3'),
    ("404 from an unknown route", 'sum(http_server_request_duration_seconds_count{http_response_status_code="404"}) > 0'),
    ("400 from invalid input", 'sum(http_server_request_duration_seconds_count{http_response_status_code="400"}) > 0'),
    ("201 from a POST /api/v1/orders", 'sum(http_server_request_duration_seconds_count{http_request_method="POST", http_response_status_code="201"}) > 0'),
    ("admission shed requests (503)", "sum(tributary_admission_rejections_total) > 0"),
    ("admission waits were measured", "sum(tributary_admission_wait_seconds_count) > 0"),
    ("rate limiting answered 429", 'sum(http_server_request_duration_seconds_count{http_response_status_code="429"}) > 0'),
    ("rate-limit rejections were counted", "sum(tributary_ratelimit_rejections_total) > 0"),
    ("Redis fallbacks were counted", "sum(tributary_ratelimit_redis_fallbacks_total) > 0"),
    ("downstream calls succeeded", 'sum(tributary_downstream_requests_total{outcome="ok"}) > 0'),
    ("downstream calls failed with an error", 'sum(tributary_downstream_requests_total{outcome="error"}) > 0'),
    ("downstream calls timed out", 'sum(tributary_downstream_requests_total{outcome="timeout"}) > 0'),
    ("calls failed fast on an open circuit", 'sum(tributary_downstream_requests_total{outcome="circuit_open"}) > 0'),
    ("a circuit was open", "max(max_over_time(tributary_downstream_circuit_state[WINDOW])) == 2"),
    ("downstream calls were retried", "sum(tributary_downstream_retries_total) > 0"),
    ("downstream calls were in flight", "max(max_over_time(tributary_downstream_in_flight[WINDOW])) > 0"),
    ("dashboard responses were degraded", "sum(tributary_fanout_degraded_total) > 0"),
    ("critical-path parts were counted", "sum(tributary_fanout_critical_path_total) > 0"),
    ("gateway overhead was measured", "sum(tributary_fanout_gateway_overhead_seconds_count) > 0"),
    ("database queries ran (3 statements or more)",
     "count(sum by (statement) (tributary_db_query_duration_seconds_count) > 0) >= 3"),
    ("pool connections were in use", 'max(max_over_time(tributary_db_pool_connections{state="in_use"}[WINDOW])) > 0'),
    ("connection acquires waited", "sum(tributary_db_pool_acquire_wait_seconds_count) > 0"),
    ("connection acquires timed out", "sum(tributary_db_pool_acquire_timeouts_total) > 0"),
    ("pool connections were opened", "sum(tributary_db_pool_connect_duration_seconds_count) > 0"),
    ("requests were in flight", "max(max_over_time(http_server_active_requests[WINDOW])) > 0"),
    ("workers were busy", "max(max_over_time(tributary_runtime_worker_busy_ratio[WINDOW])) > 0"),
    ("long polls were detected", "sum(tributary_runtime_long_polls_total) > 0"),
    ("scheduling lag was measured", "sum(tributary_runtime_scheduling_lag_seconds_count) > 0"),
]


def cmd_live(args) -> int:
    report = Report()
    prom = Prometheus(args.prom)
    since = args.since

    up = Query('target up: up{job="tributary"} == 1', 'up{job="tributary"} == 1', instant=True)
    passed, detail = prom.evaluate(up, since)
    report.check(passed, up.source, detail)

    queries = dashboard_queries(report) + rule_queries()
    window = f"{int(time.time() - since + args.deadline + 60)}s"
    queries += [Query(f"traffic exercised: {what}", expr.replace("WINDOW", window), instant=True)
                for what, expr in EXERCISED]
    # Whole alert expressions: they must parse (HTTP 200); firing is not required.
    parse_only = []
    for name, expr in alert_exprs():
        status, body = prom._post("/api/v1/query", {"query": expr})
        parse_only.append((name, status == 200 and body.get("status") == "success", body.get("error", "")))
    for name, ok, err in parse_only:
        report.check(ok, f"alerts.yml alert {name} (whole expression parses)", err)

    for where, kind, rules in adapter_rule_sets(report):
        for i, rule in enumerate(rules):
            label = f"{where} {kind} rule {i + 1}"
            name = (rule.get("name") or {}).get("as") or (rule.get("name") or {}).get("matches") or rule.get("seriesQuery")
            try:
                series_query, rendered = render_adapter_rule(kind, rule)
            except (KeyError, ValueError) as err:
                report.fail(f"{label} renders", str(err))
                continue
            queries.append(Query(f"{label} {name} seriesQuery", series_query))
            queries.append(Query(f"{label} {name} metricsQuery: {rendered}", rendered,
                                 required=required_labels(rendered)))

    # Evaluate; retry the failures until the deadline (signals that need time).
    deadline = time.time() + args.deadline
    results: dict[int, tuple[bool, str]] = {}
    pending = list(range(len(queries)))
    while True:
        still = []
        for i in pending:
            results[i] = prom.evaluate(queries[i], since)
            if not results[i][0]:
                still.append(i)
        pending = still
        if not pending or time.time() >= deadline:
            break
        print(f"....  {len(pending)} expressions without data yet, retrying "
              f"({int(deadline - time.time())}s left)", flush=True)
        time.sleep(3)
    for i, q in enumerate(queries):
        passed, detail = results[i]
        report.check(passed, q.source, detail if passed else f"{detail}; expr: {q.expr}")

    # Rule health as Prometheus itself evaluates them.
    groups = prom.get("/api/v1/rules")["data"]["groups"]
    rule_count = 0
    for g in groups:
        for r in g["rules"]:
            rule_count += 1
            name = r.get("name")
            report.check(r.get("health") == "ok", f"rule {g['name']}/{name} evaluates without error",
                         f"health={r.get('health')} {r.get('lastError', '')}".strip())
    expected = sum(len(g["rules"]) for g in rule_groups())
    report.check(rule_count == expected, "Prometheus loaded every rule of alerts.yml", f"{rule_count} of {expected}")

    # Every metric the queries name must be in the live scrape, so that a
    # missing or renamed metric is reported by its name.
    if args.metrics_file:
        scraped = set()
        for line in Path(args.metrics_file).read_text().splitlines():
            if line and not line.startswith("#"):
                scraped.add(re.split(r"[{\s]", line, maxsplit=1)[0])
        recorded = {r["record"] for g in rule_groups() for r in g["rules"] if "record" in r}
        named = set()
        for q in queries:
            named.update(METRIC_NAME_RE.findall(q.expr))
        for name in sorted(named - recorded):
            report.check(name in scraped, f"metric {name} is in the live /metrics scrape")

    # For information: what would page right now under the test traffic.
    alerts = prom.get("/api/v1/alerts")["data"]["alerts"]
    for a in alerts:
        print(f"info  alert {a['labels'].get('alertname')} is {a['state']} {dict(a['labels'])}")
    return report.summary("live")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("static")
    rc = sub.add_parser("render-config")
    rc.add_argument("--target", required=True)
    rc.add_argument("--self", required=True)
    rc.add_argument("--out", required=True)
    live = sub.add_parser("live")
    live.add_argument("--prom", required=True)
    live.add_argument("--since", required=True, type=float)
    live.add_argument("--deadline", type=float, default=60)
    live.add_argument("--metrics-file", help="a scrape of /metrics; every metric the queries name must be in it")
    args = parser.parse_args()
    return {"static": cmd_static, "render-config": cmd_render_config, "live": cmd_live}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
