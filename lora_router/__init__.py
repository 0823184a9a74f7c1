"""lora-router: make N vLLM replicas, retrained live through LoRA adapters, look like one server.

Three kinds of route (see docs/architecture.md):
- routed: completions go to one replica chosen by prefix affinity (`routing/`);
- broadcast: adapter loads/unloads and pause/resume go to every replica behind a version
  fence (`fleet/`: each replica's one state in `fleet/lifecycle.py`, every control request in
  `fleet/client.py`);
- read-only: health, server info and the model list are answered for the fleet as a whole.
The bytes of every proxied response flow through `http/` untouched.
"""

__version__ = "0.1.0"
