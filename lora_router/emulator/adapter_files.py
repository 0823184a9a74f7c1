"""Reading and writing LoRA adapter directories, as PEFT saves them and vLLM loads them.

vLLM reads `adapter_config.json` (rank `r`, `lora_alpha`, `target_modules`, `use_dora`, `bias`)
and a weights file, `adapter_model.safetensors` or `adapter_model.bin`. The emulator does the same
checks, so a router test that forgets to write the adapter, writes it late (mount lag) or with too
high a rank sees what a real replica would answer. `write_adapter` makes a minimal valid directory
(a real safetensors file holding rank-`r` A and B matrices) for tests and demos.

This is the only module of the emulator that touches the filesystem.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

CONFIG_FILE = "adapter_config.json"
SAFETENSORS_FILE = "adapter_model.safetensors"
BIN_FILE = "adapter_model.bin"
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


class AdapterNotFound(Exception):
    """The directory or its config is missing (vLLM: 404 "No adapter found for <path>")."""


class AdapterInvalid(Exception):
    """The adapter exists but cannot be served (vLLM: 500 "Call to add_lora method failed")."""


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    """What vLLM learns from an adapter directory."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    weights_file: str


def read_adapter(path: str) -> AdapterSpec:
    """Validate the adapter directory at `path` the way vLLM's add_lora does."""
    directory = Path(path).expanduser()
    config_path = directory / CONFIG_FILE
    try:
        raw = config_path.read_text(encoding="utf-8")
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError) as exc:
        raise AdapterNotFound(f"No adapter found for {path}") from exc
    try:
        config = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise AdapterInvalid(f"{config_path} is not valid JSON: {exc.msg}") from exc
    if not isinstance(config, dict):
        raise AdapterInvalid(f"{config_path} must hold a JSON object")
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise AdapterInvalid(f"{config_path} has no valid rank 'r'")
    if config.get("use_dora"):
        raise AdapterInvalid("vLLM does not yet support DoRA.")
    if config.get("bias", "none") != "none":
        raise AdapterInvalid("Adapter bias cannot be used without bias_enabled.")
    targets = config.get("target_modules") or []
    if isinstance(targets, str):
        targets = [targets]
    alpha = config.get("lora_alpha", rank)
    weights = _weights_file(directory)
    return AdapterSpec(
        rank=rank,
        alpha=float(alpha) if isinstance(alpha, int | float) else float(rank),
        target_modules=tuple(str(t) for t in targets),
        weights_file=str(weights),
    )


def _weights_file(directory: Path) -> Path:
    safetensors = directory / SAFETENSORS_FILE
    if safetensors.is_file():
        if _safetensors_tensor_count(safetensors) == 0:
            raise AdapterInvalid(f"{directory} doesn't contain tensors")
        return safetensors
    legacy = directory / BIN_FILE
    if legacy.is_file() and legacy.stat().st_size > 0:
        return legacy
    raise AdapterInvalid(f"{directory} doesn't contain tensors")


def _safetensors_tensor_count(path: Path) -> int:
    """Number of tensors in a safetensors file, read from its header only."""
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) != 8:
            return 0
        (header_len,) = struct.unpack("<Q", head)
        if header_len > 100_000_000:
            raise AdapterInvalid(f"{path} has a corrupt safetensors header")
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise AdapterInvalid(f"{path} has a corrupt safetensors header") from exc
    return sum(1 for key in header if key != "__metadata__")


def write_adapter(
    directory: str | os.PathLike[str],
    rank: int = 1,
    *,
    alpha: int | None = None,
    target_modules: tuple[str, ...] = DEFAULT_TARGETS,
    base_model: str = "Qwen/Qwen2.5-Math-1.5B",
    hidden_size: int = 8,
) -> Path:
    """Write a minimal valid PEFT LoRA adapter into `directory` (created if needed).

    The weights are a real safetensors file with one zero-initialised A/B pair per target
    module of layer 0, shaped for rank `rank`; small, but it passes every check vLLM makes.
    """
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    config = {
        "peft_type": "LORA",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": alpha if alpha is not None else 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": list(target_modules),
        "bias": "none",
        "use_dora": False,
        "task_type": "CAUSAL_LM",
    }
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2), encoding="utf-8")
    (out / SAFETENSORS_FILE).write_bytes(_safetensors_bytes(rank, target_modules, hidden_size))
    return out


def _safetensors_bytes(rank: int, targets: tuple[str, ...], hidden: int) -> bytes:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for module in targets:
        prefix = f"base_model.model.model.layers.0.self_attn.{module}"
        for name, shape in (
            (f"{prefix}.lora_A.weight", [rank, hidden]),
            (f"{prefix}.lora_B.weight", [hidden, rank]),
        ):
            size = shape[0] * shape[1] * 4  # float32
            header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
            offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    encoded += b" " * (-len(encoded) % 8)  # the format pads the header to 8 bytes
    return struct.pack("<Q", len(encoded)) + encoded + bytes(offset)
