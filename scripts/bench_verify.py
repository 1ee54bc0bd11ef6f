"""Verifier timing benchmark; see specblock.evaluate.bench_verify for what it measures."""

from specblock.evaluate.bench_verify import main

if __name__ == "__main__":
    main()
