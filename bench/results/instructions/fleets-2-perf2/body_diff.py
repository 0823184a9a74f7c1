"""read_completion of two trees on the same bodies: the same Completion or the same error.

    python body_diff.py OLD_TREE   # against the lora_router this interpreter imports

30,000 random prompts (flat id lists, ids replaced by floats, signs, literals, strings, nested
lists and objects, every JSON whitespace, empty lists) and the atoms alone, each read under
ten `max_prompt_tokens` limits.
"""

from __future__ import annotations

import importlib.util
import random
import sys
from types import ModuleType

import lora_router.proxy.body as new
from lora_router.http.errors import HTTPError

ATOMS = ["0", "1", "7", "4294967295", "4294967296", "18446744073709551616", "-1", "1.5", "1e3"]
ATOMS += ["1E3", "true", "false", "null", '"a"', '"1"', '"n"', "[]", "[1]", "[1, 2]", "{}"]
ATOMS += ['{"a": 1}', '"\\u00e9"', '"[1]"', "123456789012"]
SPACES = ["", " ", "\t", "\n", "\r\n", "  "]
LIMITS = (1, 2, 3, 4, 5, 10, 19, 20, 21, 100_000)


def load(tree: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location("old_body", f"{tree}/lora_router/proxy/body.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["old_body"] = module  # msgspec resolves the Struct's annotations through it
    spec.loader.exec_module(module)
    return module


def array(rng: random.Random) -> str:
    k = rng.choice([0, 1, 2, 3, 5, 20])
    if rng.random() < 0.5:
        items = [str(rng.randrange(0, 200_000)) for _ in range(k)]
        if items and rng.random() < 0.5:
            items[rng.randrange(len(items))] = rng.choice(ATOMS)
    else:
        items = [rng.choice(ATOMS) for _ in range(k)]
    inner = ",".join(rng.choice(SPACES) + i + rng.choice(SPACES) for i in items)
    return "[" + rng.choice(SPACES) + inner + rng.choice(SPACES) + "]"


def outcome(module: ModuleType, body: bytes, limit: int) -> tuple[object, ...]:
    try:
        c = module.read_completion(body, chat=False, max_prompt_tokens=limit)
    except HTTPError as e:
        return ("error", e.status, str(e))
    ids = c.token_ids()
    return (c.model, c.raw_tokens, None if ids is None else list(ids), c.text, c.stream)


def main() -> None:
    old = load(sys.argv[1])
    rng = random.Random(1)
    prompts = [*ATOMS, '"text"', "[ ]", "[\n]", "[[1,2],[3]]", '["a","b"]']
    prompts += [array(rng) for _ in range(30_000)]
    n = 0
    for prompt in prompts:
        body = ('{"model": "m", "prompt": ' + prompt + ', "stream": false}').encode()
        for limit in LIMITS:
            a, b = outcome(old, body, limit), outcome(new, body, limit)
            assert a == b, (body, a, b)
            n += 1
    print(f"the same on {n} bodies x limits")


if __name__ == "__main__":
    main()
