"""The settings of one emulated vLLM replica.

`EmulatorConfig` mirrors the `vllm serve` flags and environment switches that change what a
router sees (`--max-loras`, `--max-lora-rank`, `--api-key`, `VLLM_SERVER_DEV_MODE`, ...), plus the
emulator's own knobs: the timing model, the vLLM version whose quirks to reproduce, and the
faults to start with. It is built once (by `cli.py` or a test) and passed down; nothing in the
emulator reads the environment.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field

from lora_router.emulator.batching import StepCosts
from lora_router.emulator.faults import Faults
from lora_router.emulator.kv_events import KVEventsConfig

# The release lines emulated, oldest first. 0.32 is the default: the line the docs and the
# real-vLLM tier (tests/vllm) were checked against, its behaviour read from a running 0.32
# server and its code. 0.27 is the reference HF Jobs recipe's pin. 0.33 is kept apart, not as
# a name for 0.32, because it differs from it where the router can tell (read from 0.33.0's
# code, not seen running): it answers new requests 503 while paused in abort or wait mode,
# where 0.32 queues them as 0.27 does, and its streams send `: keep-alive` every 15 s by
# default, where 0.32 sends none unless `--sse-keep-alive-interval` is given.
# 0.34 (read from its released code, not seen running) leaves `usage.prompt_tokens_details` out
# when it has nothing to report, where 0.32 and 0.33 send `null`.
SUPPORTED_VERSIONS = ("0.27", "0.32", "0.33", "0.34")
# Measured step costs (batching.py; docs/design/capacity-model.md says how they were measured):
# `tiny-cpu` is vLLM 0.32's CPU build serving the real-vLLM tier's tiny model
# (lora_router/testbed/tiny_model.py) with one OpenMP thread, as tests/vllm starts it.
PROFILES: dict[str, StepCosts] = {
    "tiny-cpu": StepCosts(
        prefill_s_per_token=18e-6, decode_s_per_token=3.2e-3, decode_s_per_seq=0.065e-3
    ),
}
# What `/version` reports for each emulated release line.
RELEASE_OF_VERSION = {"0.27": "0.27.1", "0.32": "0.32.0", "0.33": "0.33.0", "0.34": "0.34.0"}


@dataclass(slots=True)
class EmulatorConfig:
    """Every setting of an emulated replica.

    Defaults are vLLM's own, except `max_loras=6`, the reference deployment's setting.
    """

    # Listening
    host: str = "127.0.0.1"
    port: int = 0  # 0: the OS picks a free port (read it back from `Emulator.port`)
    ssl: ssl.SSLContext | None = None  # serve https with this context
    api_key: str | None = None  # like `--api-key`: guards /v1/* only

    # The served model (`vllm serve MODEL --max-model-len N`)
    model: str = "Qwen/Qwen2.5-Math-1.5B"
    max_model_len: int = 4096
    vllm_version: str = "0.32"

    # LoRA (`--enable-lora --max-lora-rank R --max-loras K --max-cpu-loras C`)
    enable_lora: bool = True
    runtime_lora_updating: bool = True  # VLLM_ALLOW_RUNTIME_LORA_UPDATING=1
    dev_mode: bool = True  # VLLM_SERVER_DEV_MODE=1: /pause, /resume, /server_info ...
    # --enable-scale-out (0.32 on): /inference/v1/abort_requests works (else it answers 403).
    enable_scale_out: bool = False
    # --enable-prompt-tokens-details: `usage.prompt_tokens_details.cached_tokens` (else null).
    prompt_tokens_details: bool = True
    # Keep every request received in `Emulator.requests` (tests read it); a standalone
    # process has no reader, and its list would only grow.
    record_requests: bool = True
    max_lora_rank: int = 16
    max_loras: int = 6
    max_cpu_loras: int | None = None  # None: same as max_loras, as vLLM defaults it

    # Engine model: continuous batching (batching.py says how a step is filled and timed)
    block_size: int = 16
    cache_blocks: int = 8192  # prefix-cache capacity in blocks (LRU beyond it)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192  # tokens one engine step computes at most
    prefill_s_per_token: float = 0.0  # per *uncached* prompt token
    decode_s_per_token: float = 0.0  # a step that decodes one sequence
    decode_s_per_seq: float = 0.0  # added to a step by each further decoding sequence
    speed: float = 1.0  # this replica's relative speed: every step cost is divided by it
    adapter_load_s: float = 0.0  # re-reading an evicted adapter from its path
    mean_output_tokens: int = 64  # mean natural length before the EOS token
    seed: int = 0  # makes unseeded requests and fault draws reproducible across runs

    # HTTP behaviour
    # `--sse-keep-alive-interval` (0.32 on). None: the line's default, 15 s on 0.33, off on
    # 0.32 and 0.27; 0: off. 0.27 has no keep-alive at all.
    sse_keepalive_s: float | None = None
    fast: bool = False  # pre-rendered answers on a raw asyncio protocol (benchmarks)
    # `--kv-events-config '<json>'` (0.32 on): publish KV-cache events over ZMQ (kv_events.py).
    kv_events_config: KVEventsConfig | None = None

    # Faults in force at start; `Emulator.faults` is this same object, mutable at run time.
    faults: Faults = field(default_factory=Faults)

    def __post_init__(self) -> None:
        if self.vllm_version not in SUPPORTED_VERSIONS:
            raise ValueError(
                f"vllm_version must be one of {', '.join(SUPPORTED_VERSIONS)}, "
                f"not {self.vllm_version!r}"
            )
        if self.block_size < 1 or self.cache_blocks < 0 or self.max_num_seqs < 1:
            raise ValueError("block_size and max_num_seqs must be >= 1, cache_blocks >= 0")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        _ = self.step_costs  # building it checks the costs and the speed
        if self.max_loras < 1:
            raise ValueError("max_loras must be >= 1")
        if self.kv_events_config is not None and not self.since("0.32"):
            raise ValueError("--kv-events-config is emulated from vLLM 0.32 on")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            # vLLM refuses this combination at start-up too.
            raise ValueError("max_cpu_loras must be >= max_loras")

    def since(self, version: str) -> bool:
        """Whether the emulated line is `version` or newer (a behaviour that line brought)."""
        return SUPPORTED_VERSIONS.index(self.vllm_version) >= SUPPORTED_VERSIONS.index(version)

    @property
    def step_costs(self) -> StepCosts:
        """The capacity model's constants (batching.py)."""
        return StepCosts(
            self.prefill_s_per_token, self.decode_s_per_token, self.decode_s_per_seq, self.speed
        )

    @property
    def cpu_loras(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras

    @property
    def release(self) -> str:
        return RELEASE_OF_VERSION[self.vllm_version]

    @property
    def keepalive_interval(self) -> float | None:
        """Seconds between SSE `: keep-alive` comments on an idle stream, or None for never."""
        if not self.since("0.32"):
            return None
        if self.sse_keepalive_s is None:
            return 15.0 if self.since("0.33") else None
        return self.sse_keepalive_s if self.sse_keepalive_s > 0 else None
