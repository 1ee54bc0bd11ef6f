"""Decoding time split and target forward timing; see specblock.evaluate.bench_decode for what it measures."""

from specblock.evaluate.bench_decode import main

if __name__ == "__main__":
    main()
