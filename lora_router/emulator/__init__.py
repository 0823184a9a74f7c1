"""The vLLM emulator: a faithful stand-in for `vllm serve --enable-lora` replicas, no GPU needed.

Tests, benchmarks and demos of lora-router run against it. It answers every route of the
contract (`shared/docs/vllm-contract.md` §2) with vLLM's statuses, bodies, headers and SSE
framing, for vLLM 0.32 (the default), 0.27, 0.33 or 0.34 (`config.SUPPORTED_VERSIONS` says how
they differ), and simulates what routing changes: a prefix cache, LoRA slots, a batch scheduler
and a capacity model of continuous batching. Faults can be switched on to test fault tolerance.

Layout, one concept per module:
- `config`: `EmulatorConfig`, the settings (the `vllm serve` flags that matter, plus timing);
- `faults`: `Faults`, the failure switches (flags, attributes, `POST /emulator/faults`);
- `tokens`: tokenizer, chat template and deterministic generation (pure);
- `prefix_cache`: chained block hashes and the LRU block cache (pure);
- `kv_events`: vLLM's KV-cache events over ZMQ (`--kv-events-config`), from that cache;
- `adapter_files`: reading and writing adapter directories (`write_adapter`);
- `adapters`: the adapter registry and the GPU/CPU slots (pure);
- `scheduler`: admission into the running batch (`max_num_seqs`, `max_loras`);
- `batching`: the capacity model: how an engine step is filled and how long it takes (pure);
- `engine`: `Engine`, the state a replica holds, running its batch step by step (`emu.state`);
- `replies`: HTTP answers shaped as vLLM shapes them, server-independent;
- `completions`: parsing generation requests and rendering their answers (pure);
- `control`: every non-generation route, shared by both servers;
- `metrics`: the Prometheus exposition;
- `serving`, `app`: the aiohttp server (generation, streaming, dispatch);
- `fast`: the raw-protocol server with pre-rendered answers, for benchmarks;
- `server`: `Emulator` and `start_emulator` (start, crash, restart, stop);
- `cli`: the `lora-router-emulator` command.

In-process use:

    emu = await start_emulator(EmulatorConfig(port=0, vllm_version="0.27"))
    emu.url, emu.state.adapters, emu.requests, emu.faults.dead = True
    await emu.restart(); await emu.crash(); await emu.stop()
"""

from lora_router.emulator.adapter_files import write_adapter
from lora_router.emulator.config import EmulatorConfig
from lora_router.emulator.engine import Engine
from lora_router.emulator.faults import Faults
from lora_router.emulator.server import Emulator, start_emulator

__all__ = ["Emulator", "EmulatorConfig", "Engine", "Faults", "start_emulator", "write_adapter"]
