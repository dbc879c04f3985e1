"""llama.cpp with its weights mapped from the file (its default) or read into memory, with and
without glibc's huge-page tunable (docs/results/hugepages.md).

Usage (the llama.cpp environment of benchmarks/anchors/setup_llama_cpp.sh):
    for mmap in 1 0; do for t in "" glibc.malloc.hugetlb=1; do
        GLIBC_TUNABLES=$t .venv-bench/bin/python benchmarks/llama_cpp_pages.py GGUF $mmap
    done; done

Prints the memory on huge pages after loading and three greedy 96-token generations' tok/s
(prefill included) on one prompt.
"""

from __future__ import annotations

import os
import sys
import time

import llama_cpp


def main() -> None:
    path, mmap = sys.argv[1], sys.argv[2] == "1"
    llm = llama_cpp.Llama(model_path=path, n_ctx=512, n_threads=2, n_threads_batch=2,
                          verbose=False, use_mmap=mmap)
    tokens = llm.tokenize(b"Write a short story about a robot learning to paint.")

    def rate() -> float:
        llm.reset()
        t0, n = time.perf_counter(), 0
        for _ in llm.generate(tokens, temp=0.0):
            n += 1
            if n >= 96:
                break
        return round(n / (time.perf_counter() - t0), 1)

    rate()
    memory = {line.split(":")[0]: int(line.split()[1]) >> 10
              for line in open("/proc/self/smaps_rollup")
              if line.startswith(("Rss", "AnonHugePages", "FilePmdMapped"))}
    print(f"mmap={mmap} GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES') or '-'} "
          f"memory MiB {memory} tok/s {[rate() for _ in range(3)]}")


if __name__ == "__main__":
    main()
