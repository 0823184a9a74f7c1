"""The tools: programs built on the router, run from the `lora-router` command (cli.py).

- `check.py`: `lora-router --check`, the preflight of the replicas (fleet/leftovers.py judges
  the adapters a replica lists that the router did not load);
- `demo.py`: `lora-router --demo`, a GRPO-shaped run over emulated replicas (`demo_command.py`
  its command line, `demo_report.py` its closing table);
- `top.py`: `lora-router top`, a live view of a running router read over HTTP;
- `table.py`: the plain-text table check and the demo print;
- `terminal.py`: untrusted names and messages made safe to print (`top`, `--check`).

A tool imports only the public entry points of the package, never its internals (the request
path, the fleet's state, the views' wiring), so each could live in its own repository:

- `lora_router.config`: the typed settings, built from the command line;
- `lora_router.command`: what every command shares (bad flags, `--help`, Ctrl-C);
- `lora_router.runtime`: a running router, started and stopped in-process;
- `lora_router.fleet.client`, `lora_router.fleet.failure`, `lora_router.fleet.leftovers`,
  `lora_router.fleet.readiness`, `lora_router.fleet.discovery` and `lora_router.fleet.aliases`:
  the router's client of one replica, the causes and fixes it names, how it judges the adapters
  left on a reused replica, whether a replica can take part in a weight sync, how it reads its
  membership sources, and when it takes two URLs for one server (so `--check` finds and reads
  the replicas as the router does);
- `lora_router.routing`: the package's exported names (the policies, lineages), pure;
- `lora_router.emulator`: the vLLM stand-in, a program of its own (the demo's replicas).

tests/test_import_graph.py holds the list.
"""
