"""Where a CPU verify pass's extra cost comes from: the matrix products of one SmolLM2-135M forward
(30 layers: q, k, v, o, gate, up, down; the 49152-wide head) at 1, 2, 4, 8 and 16 rows, one thread,
random fp32 weights of the real shapes, two layouts: torch's F.linear(x, W) (W as [out, in], what
transformers runs) and x @ W^T with W^T stored contiguous ([in, out]). Median and best of --repeats.

    python recipes/bench_linear_rows.py [--repeats 7] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from spec import clock

HIDDEN, VOCAB, LAYERS = 576, 49152, 30
# one layer: q, k, v (3 kv heads x 64), o, gate, up, down, as [out, in]
SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(o, i, generator=gen) * 0.02 for _ in range(LAYERS) for (o, i) in SHAPES]
    weights.append(torch.randn(VOCAB, HIDDEN, generator=gen) * 0.02)
    transposed = [w.t().contiguous() for w in weights]

    def forward(rows: int, layout: str) -> float:
        inputs = {i: torch.randn(rows, i, generator=gen) for i in {w.shape[1] for w in weights}}
        t0 = clock.now(torch.device("cpu"))
        for w, wt in zip(weights, transposed):
            x = inputs[w.shape[1]]
            (x @ wt) if layout == "x @ W^T" else torch.nn.functional.linear(x, w)
        return clock.now(torch.device("cpu")) - t0

    for layout in ("F.linear", "x @ W^T"):
        one = None
        for rows in (1, 2, 4, 8, 16):
            times = [forward(rows, layout) for _ in range(args.repeats)]
            median = statistics.median(times)
            one = one or median
            print(f"{layout:<9} {rows:>2} rows: median {1e3 * median:6.1f} ms, best {1e3 * min(times):6.1f} ms, "
                  f"{median / one:4.2f}x its 1-row median", flush=True)


if __name__ == "__main__":
    main()
