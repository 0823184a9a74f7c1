"""What tests and benchmarks drive lora-router with, besides the emulator: the one home of code
that tests/ and bench/ share, so that neither imports the other (tests/test_import_graph.py).

- `grpo_trace`: the GRPO workload, the requests TRL 1.16's async rollout worker sends, as a pure
  function of a few parameters (the routing benches replay it; tests/routing/test_trace.py
  checks it);
- `vllm_harness`: real vLLM CPU replicas and the `lora-router` command as processes, started as
  a user starts them, each wait bounded (the real-vLLM tier, tests/vllm, and the real-vLLM
  benches); `replica_logging.json` is the replicas' logging configuration;
- `tiny_model`: the tiny Qwen2 model and rank-1 adapters those replicas serve, built locally;
- `trl_client`: TRL's own client code, driven without a trainer;
- `net`: a free loopback port, for the programs both start.

The router never imports it: it is a client of the router and its replicas, as tools/ is.
`vllm_harness`, `tiny_model` and `trl_client` need the real-vLLM environment
(`tests/vllm/install.sh`) for anything beyond their imports.
"""
