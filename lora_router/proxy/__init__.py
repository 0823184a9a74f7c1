"""The proxy: a client's request from its route to its answer.

- `dispatch.py`: the route table's use (routes.py, which config.py reads too, stays beside
  config), the control and admin handlers;
- `routed.py`: the routed completion, one `RoutedRequest` through admit, key, pick, send and
  settle in the request's Task, its stages explicit;
- `forward.py`: a request sent to one replica (its head, the count of the replica's work);
- `retry.py`: the data plane's retry rule and budget;
- `answers.py`: every rendering of a domain outcome (the fleet's, the fence's) as vLLM's answer;
- `body.py`: a completion's body, read and validated once;
- `usage.py`: the cached tokens a decision predicted, and those the answer says vLLM reused.

The proxy imports the fleet and routing; neither imports the proxy (tests/test_import_graph.py).
"""
