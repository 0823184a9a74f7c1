"""HTTP/1.1 on both sides of the router, with no knowledge of routes or replicas' roles.

- `server.py`: one `ClientConnection` per client (httptools): parse, enforce the limits, answer its
  requests in order in one Task, write answers with back-pressure;
- `request.py`: a parsed `Request`, the `Limits` a connection reads, the `ResponseSink` an
  answer streams into, the `ConnectionCount` of a listener;
- `framing.py`, `target.py`, `headers.py`: the rules of a request's framing (smuggling), its
  path (one canonical form) and its headers (hop-by-hop out, the replica's token in);
- `upstream.py`: keep-alive pools to one replica, the answer streamed byte for byte, the one
  re-send on a stale pooled connection; `exchange.py`: one exchange's state and its errors;
- `cork.py`: the writes of one pass of the event loop leave together;
- `timer.py`: one lazily re-armed timer per connection; `auth.py`: the client's API key;
  `errors.py`: vLLM's error shape.

http/ imports only itself and config.py: nothing of proxy/, fleet/ or routing/
(tests/test_import_graph.py).
"""
