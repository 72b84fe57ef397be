#!/usr/bin/env python3
"""Test vectors for vLLM's sha256_cbor prefix-cache block hashes, computed with the reference CBOR
library (pip install cbor2), independently of headroom's Rust code (workload/src/vllm_hash.rs):

    NONE_HASH = sha256(cbor(seed))            seed = PYTHONHASHSEED, else "vllm-none-hash" (vLLM >= 0.29)
    h_i       = sha256(cbor((h_i-1 or NONE_HASH, tuple(tokens of block i), extra_keys or None)))
    event int = last 8 bytes of h_i, big-endian (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1, the default)
    cbor(x)   = cbor2.dumps(x, canonical=True)

Prints one line per case: name, then the event integers of blocks [0..16) and [16..32). The Rust
test `vllm_hash::tests::independent_test_vectors` holds the same numbers.
"""
import hashlib

import cbor2


def h(x):
    return hashlib.sha256(cbor2.dumps(x, canonical=True)).digest()


def chain(seed, first_extra):
    parent, out = h(seed), []
    for i, tokens in enumerate([range(16), range(16, 32)]):
        parent = h((parent, tuple(tokens), first_extra if i == 0 else None))
        out.append(int.from_bytes(parent[-8:], "big"))
    return out


for name, seed, extra in [
    ("seed 0", "0", None),
    ("seed unset (vLLM >= 0.29)", "vllm-none-hash", None),
    ("seed 0, cache_salt, vLLM 0.10.2-0.30", "0", ("salt",)),
    ("seed 0, cache_salt, vLLM >= 0.31", "0", (("cache_salt", "salt"),)),
]:
    print(name, *chain(seed, extra))
