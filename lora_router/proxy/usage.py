"""Cache accounting: the cached prompt tokens the policy expected of a replica, against those
the replica says it reused (vLLM's `usage.prompt_tokens_details.cached_tokens`).

Rules:
- *Counted*: a routed completion of one token-id prompt (its token count is exact) that a
  replica answered 200, on the attempt that answered; recorded per replica and lineage
  (observe/metrics.py `CacheAccount`). Text, chat and batch prompts are not counted. An answer
  whose client left before its end counts only if its report had passed: the openai SDK
  closes a stream at its `[DONE]`, before the chunked terminator.
- *Predicted*: what the policy's decision leaves cached (`Decision.prompt - Decision.tokens`:
  a sibling all of it, a continuation the earlier prompt, a new family nothing), as vLLM counts
  it: whole blocks only, and never the prompt's last token, which vLLM recomputes for its
  logits (`predicted_cached_tokens`).
- *Reported*: the last `"cached_tokens":N` in the last `TAIL_BYTES` of the answer's last read,
  else of the two reads before it, and across their boundaries: vLLM writes `usage` at the end
  of a completion, before two or three null fields, and ends a stream in three writes (its
  usage frame, `[DONE]`, the chunked terminator), each of which may be a read of its own
  (docs/design/routing.md). None when it is not there or null: a
  replica without `--enable-prompt-tokens-details`, a stream without
  `stream_options.include_usage`. A literal key inside a JSON string has escaped quotes, so it
  cannot match.
- *Zero copy*: nothing is parsed while the answer streams (http/upstream.py keeps a reference
  to the last three reads); the end searches at most 3 x `TAIL_BYTES` of them, once.

Never: raises on what a replica sends (what does not read is unreported); allocates per
streamed read.
"""

from __future__ import annotations

import re
from typing import Final

_KEY: Final = b'"cached_tokens":'
_NUMBER: Final = re.compile(rb"\d{1,15}")
# Bytes searched at the end of each of the last three reads (the search costs per byte: a
# 40 KB stream read searched whole cost 20 % of the SSE path's instructions).
TAIL_BYTES: Final = 512
# Bytes of each read around their boundary searched for a key cut in two.
_REACH: Final = 64


def predicted_cached_tokens(prompt: int, to_compute: int, block_size: int) -> int:
    """What vLLM would report cached for a prompt of `prompt` tokens (at least 1) of which
    the policy expects `to_compute` (0 to `prompt`) to be computed."""
    cached = prompt - 1 if to_compute == 0 else prompt - to_compute
    return cached - cached % block_size


def reported_cached_tokens(*reads: bytes) -> int | None:
    """vLLM's `cached_tokens` in an answer whose last reads were `reads`, the last first (b""
    for none), or None if it did not report them."""
    after = b""  # the first _REACH bytes of what follows `read` (the reads after it, joined)
    for read in reads:
        if not read:
            return None  # no read before it
        if after:  # first: a key or number cut by the boundary, across reads shorter than it
            data = read[-_REACH:] + after
            at = data.rfind(_KEY)
            if at >= 0:
                break
        data = read
        at = read.rfind(_KEY, len(read) - TAIL_BYTES)
        if at >= 0:
            break
        after = (read[:_REACH] + after)[:_REACH]
    else:
        return None
    found = _NUMBER.match(data, at + len(_KEY))
    return int(found.group()) if found else None  # not a number: null, or cut short
