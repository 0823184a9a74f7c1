"""The Grafana dashboard (`docs/grafana/lora-router.json`) queries only what the router exports:
every metric named in its PromQL is checked against a scrape of a live router that has served
completions, broadcast a load and a sync, and scraped its replicas twice."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import aiohttp
from emulated_fleet import StartEmulators, StartRouter, synced_traffic
from helpers import Adapter, call
from prometheus_client.parser import text_string_to_metric_families

DASHBOARD = Path(__file__).parents[2] / "docs" / "grafana" / "lora-router.json"

# PromQL words that look like metric names but are not.
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool"}
_KEYWORDS |= {"and", "or", "unless", "inf", "nan"}


def expressions(dashboard: dict[str, Any]) -> list[str]:
    out = []
    for panel in dashboard["panels"]:
        for inner in [panel, *panel.get("panels", [])]:
            out.extend(t["expr"] for t in inner.get("targets", []))
    return out


def metric_names(expr: str) -> set[str]:
    """The metric names an expression selects (label matchers, ranges, groupings and strings
    removed; a name followed by `(` is a function)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = set()
    for match in re.finditer(r"(?<![\w.])[A-Za-z_:][A-Za-z0-9_:]*", text):
        rest = text[match.end() :].lstrip()
        if rest.startswith("(") or match.group() in _KEYWORDS:
            continue
        names.add(match.group())
    return names


def test_the_name_extraction_sees_through_promql() -> None:
    expr = (
        'histogram_quantile(0.95, sum by (le, replica) (rate(a_bucket{route="/x", b=~"c(d)"}[5m])))'
        " / on (replica) group_left b_total offset 5m and bool c"
    )
    assert metric_names(expr) == {"a_bucket", "b_total", "c"}


def test_the_dashboard_is_a_grafana_dashboard_on_router_metrics_only() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["title"] == "lora-router" and dashboard["schemaVersion"] >= 30
    exprs = expressions(dashboard)
    assert len(exprs) >= 20
    for expr in exprs:
        names = metric_names(expr)
        assert names, f"no metric in {expr!r}"
        assert all(n.startswith("lora_router_") for n in names), expr


async def test_every_metric_the_dashboard_queries_is_exported(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession, adapter: Adapter
) -> None:
    emus = await emulators(2)
    rt = await router(emus)
    await synced_traffic(client, rt, "v1", adapter("v1"))
    code, body, _ = await call(client, "GET", rt.url + "/metrics")
    assert code == 200
    exported = {
        s.name for family in text_string_to_metric_families(body.decode()) for s in family.samples
    }

    queried = set().union(*map(metric_names, expressions(json.loads(DASHBOARD.read_text()))))

    assert queried - exported == set()
