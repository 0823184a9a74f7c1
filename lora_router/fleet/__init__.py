"""The fleet: the replicas behind the router, their service state, and the control plane.

Two questions, one file each:

- *Which code may change a replica's state?* `lifecycle.py`. Each replica has one `Lifecycle`
  (joining → replaying → serving ⇄ ejected / backing-off, draining → gone) whose methods are
  the only transitions; everything else reports events to it.
- *Which code talks HTTP to a replica?* `client.py` for every control request (health checks,
  discovery, replays, broadcasts, `/metrics` scrapes, `--check`); the routed path's bytes go
  through `lora_router/http/upstream.py`, the data plane's own pools.

The rest, by what each part knows:

- `fleet.py`: membership, the pause intent (`Fleet.pause`), and `routable`, the data plane's
  one question; reads lifecycle states, does no I/O;
- `replica.py`: one replica as the router sees it (its lifecycle, breaker, adapters, load);
- `breaker.py`: the per-replica circuit breaker of the routed path (traffic only, never state);
- `fence.py`: the version fence (which adapter names are live), pure, with its own refusals;
- `broadcast.py`: the broadcaster (one operation at a time: all-or-nothing loads, unloads,
  pause/resume/reset) and the `/health` and `/v1/models` fan-ins;
- `replica_loads.py`: the per-replica half of loads and unloads (mount-lag retries, a copy
  already there), under broadcasts and replays;
- `replay.py`: discovery at start and the replay that brings a replica to the fleet's state;
- `health.py`: active checks and passive reports, which decide when to report an event;
- `telemetry.py`: the replicas' own `/metrics`, read-only;
- `failure.py`: why a replica failed, named once (cause and fix), pure: what the log,
  `last_error`, `/health`, `top` and `--check` say;
- `refusals.py`: the fleet's refusals as values (none in service, a replica's refusal passed
  on, a load timed out), which proxy/answers.py renders: the fleet speaks no HTTP;
- `readiness.py`: whether a replica can take part in a weight sync (LoRA, dev mode, runtime
  loading), one notion for the router's standing warnings and `--check`; pure;
- `leftovers.py`: the adapters a reused replica still holds, judged by name (which collide with
  the trainer's loads), and the `--unload-stale` glob that clears them; pure;
- `report.py`: one replica's `/metrics` scrape, kept on its `Replica`;
- `kv_events.py`: with `--policy kv`, one ZMQ subscription per replica to its KV-cache events,
  feeding the KV index (routing/kv_index.py); it only listens, and asks `/kv_event_sources`
  through `client.py`; `kv_wire.py` decodes those events and states the caps on them.
"""
