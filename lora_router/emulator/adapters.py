"""Which adapters a replica serves (its registry) and which it holds in memory (its slots).

These are two different things in vLLM, and routers meet both:
- the *registry* is the API server's list of names (`/v1/models`), filled by
  `/v1/load_lora_adapter` and emptied by unload or a restart;
- the *slots* are the worker's memory: `--max-loras` GPU slots inside a cache of
  `--max-cpu-loras` adapters, both least-recently-used. A request for an adapter that was
  evicted from the CPU cache re-reads it from its path first (a stall). Unloading a name leaves
  its weights in the slots until LRU pushes them out (an open vLLM bug, reproduced on purpose).

Slots are keyed by the integer id vLLM gives each load, so a name loaded again is new weights.
Pure bookkeeping: reading the files is the caller's job (`adapter_files`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from lora_router.emulator.adapter_files import AdapterSpec


@dataclass(slots=True)
class Adapter:
    """One registered adapter: the name clients use, the path it was loaded from, its id."""

    name: str
    path: str
    lora_id: int
    spec: AdapterSpec


class AdapterRegistry:
    """Registered adapters by name, in load order (the order `/v1/models` lists them)."""

    __slots__ = ("_by_name", "_next_id")

    def __init__(self) -> None:
        self._by_name: dict[str, Adapter] = {}
        self._next_id = 1

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __len__(self) -> int:
        return len(self._by_name)

    def get(self, name: str) -> Adapter | None:
        return self._by_name.get(name)

    def all(self) -> list[Adapter]:
        return list(self._by_name.values())

    def add(self, name: str, path: str, spec: AdapterSpec) -> Adapter:
        adapter = Adapter(name=name, path=path, lora_id=self._next_id, spec=spec)
        self._next_id += 1
        self._by_name[name] = adapter
        return adapter

    def replace(self, name: str, path: str, spec: AdapterSpec) -> Adapter:
        """`load_inplace`: same name and id, new weights."""
        current = self._by_name[name]
        current.path = path
        current.spec = spec
        return current

    def remove(self, name: str) -> Adapter | None:
        return self._by_name.pop(name, None)


class AdapterSlots:
    """GPU slots inside a CPU cache, both LRU by adapter id."""

    __slots__ = ("_cpu", "_gpu", "cpu_capacity", "disk_reads", "evictions", "gpu_capacity")

    def __init__(self, gpu_capacity: int, cpu_capacity: int) -> None:
        self.gpu_capacity = gpu_capacity
        self.cpu_capacity = cpu_capacity
        self._gpu: OrderedDict[int, None] = OrderedDict()
        self._cpu: OrderedDict[int, None] = OrderedDict()
        self.disk_reads = 0  # adapters re-read from their path because they had been evicted
        self.evictions = 0  # adapters pushed out of the CPU cache

    @property
    def on_gpu(self) -> list[int]:
        return list(self._gpu)

    @property
    def in_memory(self) -> list[int]:
        return list(self._cpu)

    def load(self, lora_id: int) -> None:
        """A successful `/v1/load_lora_adapter` puts the weights in the CPU cache."""
        self._touch_cpu(lora_id, set())

    def forget(self, lora_id: int) -> None:
        """Drop stale weights (an in-place reload must be read again)."""
        self._gpu.pop(lora_id, None)
        self._cpu.pop(lora_id, None)

    def needs_read(self, lora_id: int) -> bool:
        """Whether activating `lora_id` has to read it from disk first."""
        return lora_id not in self._cpu

    def activate(self, lora_id: int, running: Iterable[int]) -> None:
        """Put `lora_id` in a GPU slot for a scheduled request.

        The scheduler never runs more than `gpu_capacity` adapters at once, so a slot held by
        no running request always exists when one must be freed.
        """
        busy = set(running)
        if self.needs_read(lora_id):
            self.disk_reads += 1
        self._touch_cpu(lora_id, busy)
        if lora_id in self._gpu:
            self._gpu.move_to_end(lora_id)
            return
        while len(self._gpu) >= self.gpu_capacity:
            victim = next((i for i in self._gpu if i not in busy), None)
            if victim is None:
                break
            del self._gpu[victim]
        self._gpu[lora_id] = None

    def _touch_cpu(self, lora_id: int, busy: set[int]) -> None:
        if lora_id in self._cpu:
            self._cpu.move_to_end(lora_id)
            return
        self._cpu[lora_id] = None
        while len(self._cpu) > self.cpu_capacity:
            # The least recently used adapter that no running request needs.
            victim = next((i for i in self._cpu if i not in busy and i != lora_id), None)
            if victim is None:
                break
            del self._cpu[victim]
            self._gpu.pop(victim, None)  # weights leave the GPU with the CPU copy
            self.evictions += 1
