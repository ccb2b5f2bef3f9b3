"""One rank of the wheel test, run by torchrun from a fresh virtualenv with
the system libzmq hidden: three DDP steps (a dense warm-up, then two) through oktopk's hook, then prints
where oktopk, its library, libzmq and torch came from, and whether every
rank holds the same parameters."""

import os
import sys

import torch
import torch.distributed as dist
from ddp_steps import train_and_compare  # copied beside this script by test_wheel.py

import oktopk
from oktopk import OkTopkState, oktopk_hook

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.set_num_threads(1)
state = OkTopkState(density=0.1, algorithm="oktopk", timeout=60.0)  # steps 0-1 are the dense warm-up, then sparse
same = train_and_compare(rank, state, oktopk_hook, steps=3, width=16)
with open("/proc/self/maps") as f:
    zmq = sorted({line.split()[-1] for line in f if "libzmq" in line})
# One write of the whole line (well under PIPE_BUF), so that the two ranks'
# lines, sharing torchrun's stdout, never interleave (print writes the text
# and the newline separately).
line = (f"RANK {rank} oktopk={oktopk.__file__} library={oktopk.library_path()} torch={torch.__file__} "
        f"libzmq={','.join(zmq)} communicator={state._reducer.comm is not None} identical={same}\n")
os.write(sys.stdout.fileno(), line.encode())
state.close()
dist.destroy_process_group()
sys.exit(0 if same else 1)
