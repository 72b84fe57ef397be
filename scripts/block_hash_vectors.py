#!/usr/bin/env python3
"""Test vectors for headroom's block hash chain (workload/src/blocks.rs), computed independently of
the Rust code with the `xxhash` package (pip install xxhash):

    h_0 = xxh3_64(le64(root) ‖ le32(tokens of block 0) ‖ extra, seed),  root = xxh3_64(b"headroom-root", seed)
    h_i = xxh3_64(le64(h_i−1) ‖ le32(tokens of block i), seed)

Prints (seed, extra, h_0, h_1) for blocks [0..16) and [16..32); the Rust test
`blocks::tests::independent_test_vectors` holds the same numbers.
"""
import struct

import xxhash


def block(parent, tokens, extra, seed):
    start = parent if parent is not None else xxhash.xxh3_64_intdigest(b"headroom-root", seed=seed)
    data = struct.pack("<Q", start) + b"".join(struct.pack("<I", t) for t in tokens)
    if parent is None:
        data += extra
    return xxhash.xxh3_64_intdigest(data, seed=seed)


for seed, extra in [(0, b""), (42, b""), (0, b"salt")]:
    h0 = block(None, range(16), extra, seed)
    h1 = block(h0, range(16, 32), extra, seed)
    print(seed, extra.decode(), h0, h1)
