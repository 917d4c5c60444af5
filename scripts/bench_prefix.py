#!/usr/bin/env python
"""Benchmark named prefixes against no prefix, transformers baselines and the gRPC server (the
same as `prefix-service bench`; options: --help; results and how to read them: docs/benchmarks.md).

    python scripts/bench_prefix.py --quick
    python scripts/bench_prefix.py --json bench_out/bench_prefix.json
"""
import sys

from prefix_service.bench.main import main

if __name__ == "__main__":
    sys.exit(main())
