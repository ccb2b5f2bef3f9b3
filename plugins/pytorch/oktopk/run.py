"""``python -m oktopk.run`` (or ``oktopk-run``): torchrun, with oktopk's
hook on every ``DistributedDataParallel`` the script builds. The script is
not changed: not one line.

    python -m oktopk.run --nproc-per-node 4 train.py --epochs 3
    python -m oktopk.run --oktopk-density 0.02 --nnodes 2 --nproc-per-node 8 \\
        --rdzv-backend c10d --rdzv-endpoint head:29400 train.py

Every torchrun argument means what it means to torchrun (elastic restarts,
``--nnodes MIN:MAX``, ``-m module``). Settings of ``OkTopkState`` come
from ``--oktopk-<name> VALUE`` flags before torchrun's (``--oktopk-density
0.02``, ``--oktopk-dense-compression quantized``) or from ``OKTOPK_<NAME>``
variables; each rank runs the script through ``oktopk.autohook``, which
says what it switched on. Under mpirun or srun run ``python -m
oktopk.autohook train.py`` as the launcher's program instead.
"""

import os
import sys

from .autohook import PREFIX, settings_from_env

FLAG = "--oktopk-"


def split_flags(argv):
    """(OKTOPK_* variables from the leading --oktopk-<name> flags, the rest
    of argv for torchrun). The flags come first, before torchrun's own:
    torchrun's options take values, and everything after the script is the
    script's."""
    env, i = {}, 0
    while i < len(argv) and argv[i].startswith(FLAG):
        name, eq, value = argv[i][len(FLAG):].partition("=")
        if not eq:
            if i + 1 >= len(argv):
                raise ValueError(f"{argv[i]} needs a value")
            i += 1
            value = argv[i]
        env[PREFIX + name.replace("-", "_").upper()] = value
        i += 1
    return env, argv[i:]


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        env, rest = split_flags(argv)
        os.environ.update(env)  # the ranks torchrun starts inherit them
        settings_from_env()  # refused here, once, rather than in every rank
    except ValueError as e:
        print(f"python -m oktopk.run: error: {e}", file=sys.stderr)
        return 2
    from torch.distributed.run import get_args_parser, run

    args = get_args_parser().parse_args(rest)
    if args.no_python:
        print("python -m oktopk.run: error: --no-python runs a program that is not Python: there is no DDP to hook",
              file=sys.stderr)
        return 2
    script = ["-m", args.training_script] if args.module else [args.training_script]
    if args.run_path:  # torchrun runs the file in its own process: give it autohook's
        from . import autohook

        args.training_script = autohook.__file__
    else:
        args.training_script, args.module = "oktopk.autohook", True
    args.training_script_args = script + list(args.training_script_args)
    if args.max_restarts > 0:
        # torchrun's agent keeps one store across its restarts, and by
        # default the ranks' process group shares it: a restarted rank can
        # read the keys of the attempt before (a peer's old address), and
        # gloo's or NCCL's setup then fails or hangs (pytorch/pytorch#135712,
        # #167288). Each attempt on a store of its own, unless the user chose.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    run(args)
    return 0


def entry():
    """The ``oktopk-run`` command."""
    sys.exit(main())


if __name__ == "__main__":
    entry()
