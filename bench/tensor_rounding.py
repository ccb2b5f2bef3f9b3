"""Runs a training script with the 4-bit path rounding as tensor
operations (as on a GPU, and on the CPU before the library's one-pass
rounding, ``oktopk_quantize_blocks``), for an A/B of the two on the same
script:

    python bench/tensor_rounding.py SCRIPT [ITS ARGUMENTS]
"""

import os
import runpy
import sys

import oktopk.quantized


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    oktopk.quantized._library_rounds = lambda *settings: False
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))  # as `python SCRIPT` puts it first
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
