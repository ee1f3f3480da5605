#!/usr/bin/env python3
"""One large .txt corpus for measuring `deltastack tokenize` / `train --data DIR` (docs/cpu_engine.md, "A 10 GB corpus").

Usage: scripts/make_big_corpus.py COPIES OUT.txt   (8966 copies: 10,001,096,089 bytes)

Each copy of data/tiny_shakespeare.txt comes after its own header paragraph "Copy N of tiny Shakespeare, variation H."
(H = N * 2654435761 mod 2**32, in hex) and ends with a blank line, so copies never merge into one document.
"""
import os
import sys

src_path = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'data', 'tiny_shakespeare.txt')
src = open(src_path, 'rb').read().rstrip(b'\n') + b'\n\n'
n = int(sys.argv[1])
with open(sys.argv[2], 'wb', buffering=64 << 20) as f:
    for i in range(n):
        f.write(b'Copy %d of tiny Shakespeare, variation %x.\n\n' % (i, (i * 2654435761) & 0xffffffff))
        f.write(src)
