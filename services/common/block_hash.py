"""The prefix-cache block hash, shared by the scheduler (which caches blocks under it) and the
gateway (which predicts, from a prompt's token ids, which blocks a replica has cached).

Both sides must compute bit-identical hashes, so this is the only implementation. Hashes
chain: hash(block k) = sha256(hash(block k-1) || token ids of block k as int32 [|| 0xff ||
extra keys]), starting from NONE_HASH, so equal hashes mean equal whole prefixes. Only full
blocks are hashed. Extra keys (the request's `cache_salt` and its LoRA adapter's name and id: one
adapter's KV never serves another's request, nor the base model's) go into the first block
only: the chain carries them into every later one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

NONE_HASH = b"\x00" * 32


def hash_block_tokens(parent_hash: bytes, token_ids: Sequence[int], extra_keys: bytes = b"") -> bytes:
    """Chained hash of one full block of token ids."""
    h = hashlib.sha256(parent_hash)
    h.update(np.asarray(token_ids, dtype=np.int32).tobytes())
    if extra_keys:
        h.update(b"\xff" + extra_keys)
    return h.digest()


def adapter_key(lora_name: str, lora_int_id: int) -> str:
    """What keys a LoRA adapter's blocks: its name and its id. The id follows the adapter's real
    path (the gateway derives it from both), so a name unloaded and loaded again for other weights
    never meets the old weights' KV."""
    return f"{lora_name}\x00{lora_int_id}"


def salt_keys(cache_salt: str | None, lora_key: str | None = None) -> bytes:
    """The extra keys of a request's first block. The adapter's key (`adapter_key`) follows a
    byte that UTF-8 text never contains (0xfe), so no salt can pose as an adapter."""
    keys = cache_salt.encode() if cache_salt else b""
    return keys + b"\xfe" + lora_key.encode() if lora_key else keys


def extend_hashes(hashes: list[bytes], token_ids: Sequence[int], block_size: int, cache_salt: str | None = None,
                  lora_key: str | None = None) -> list[bytes]:
    """Append to `hashes` (the hashes of the first len(hashes) blocks of `token_ids`) the hashes of
    every further full block; returns `hashes`. Incremental, so a running request hashes each
    block once."""
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    extra = salt_keys(cache_salt, lora_key)
    for k in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[k - 1] if k > 0 else NONE_HASH
        hashes.append(hash_block_tokens(parent, token_ids[k * block_size:(k + 1) * block_size],
                                        extra if k == 0 else b""))
    return hashes


def block_hashes(token_ids: Sequence[int], block_size: int, cache_salt: str | None = None,
                 lora_key: str | None = None) -> list[bytes]:
    """The chained hashes of every full block of `token_ids`."""
    return extend_hashes([], token_ids, block_size, cache_salt, lora_key)
