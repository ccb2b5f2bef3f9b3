"""The step-time model (oktopk.plan) at the paper's scale: Li & Hoefler
(PPoPP'22) trained on Piz Daint, one P100 per node over Cray Aries, at 32
to 256 ranks. Prints results/plan.md's table "Against the paper": each
method's step (ms) and its step over Ok-Topk's.

    PYTHONPATH=plugins/pytorch python bench/paper_scale.py

The cluster and the models are assumptions, not the paper's figures (see
results/plan.md): 10 GB/s and 2 µs between nodes, one rank per node,
selection at the P100's 732 GB/s, overlap 0 (the reference code reduces
after backward), and the compute per step below.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "plugins", "pytorch"))

from oktopk import plan  # noqa: E402

LINK = plan.Link(10e9, 2e-6)
SELECT_BYTES_PER_SECOND = 732e9
# (name, parameters, density, compute seconds per step)
MODELS = (("VGG-16 (CIFAR-10)", 14.7e6, 0.02, 0.060), ("LSTM (AN4)", 27e6, 0.02, 0.120), ("BERT", 133e6, 0.01, 0.300))
RANKS = (32, 64, 128, 256)
METHODS = (("dense", "dense"), ("Ok-Topk", "oktopk"), ("TopkA", "topka"), ("TopkDSA", "topkdsa"), ("gTopk", "gtopk"),
           ("Gaussiank", "gaussiank"))


def main():
    names = [name for name, _ in METHODS]
    print("| model | P | " + " | ".join(names) + " | dense ÷ Ok-Topk | "
          + " | ".join(f"{name} ÷" for name in names[2:]) + " |")
    print("|---" * (2 + len(names) + len(names) - 1) + "|")
    for model, n, density, compute in MODELS:
        for ranks in RANKS:
            cluster = plan.Cluster(ranks, 1, LINK, LINK, 1 / SELECT_BYTES_PER_SECOND, compute, 0.0)
            ms = {m: plan.step(cluster, m, n, density=density).seconds * 1e3 for _, m in METHODS}
            ratios = [ms["dense"] / ms["oktopk"]] + [ms[m] / ms["oktopk"] for _, m in METHODS[2:]]
            print(f"| {model} | {ranks} | " + " | ".join(f"{ms[m]:.0f}" for _, m in METHODS) + " | "
                  + " | ".join(f"{x:.2f}" for x in ratios) + " |")


if __name__ == "__main__":
    main()
