"""Observability: what the router shows of itself, in one place. Reads, never writes.

- `metrics.py`: the counters the request path and the fleet record into (`RequestStats`,
  `Histogram`, `CacheAccount`: plain ints, no lock, nothing formatted per request) and their
  Prometheus rendering at scrape time (`MetricsCollector`, `gauge`, `counter`);
- `status.py`: `/router/status`, the periodic log line, and `RouterState`, what every view
  reads;
- `families.py`: the live `/metrics` families built from that state;
- `accuracy.py`: `routing_accuracy`, the cached tokens predicted against reported, as status
  and as `/metrics` families.

The views read plain attributes of the fleet, the fence, the broadcaster, the health monitor,
the policy and the retry budget; they never change them and never import the proxy (the
request path, a writer). metrics.py imports nothing of the router, so the request path and
the fleet may record into it without a cycle (tests/test_import_graph.py).
"""
