"""The PyTorch plugin's fault campaign: `make chaos-torch` (the full one),
`make chaos-torch-smoke` (a slice that `make test` runs).

tests/cmd/chaos (`make chaos`) injects faults into the library's calls;
this one injects them into the plugin's own paths, with real
torch.distributed gloo process groups over real rank processes (CPU, 2-3
ranks, tiny models): the DDP hook's measured choice (native, sparse, and
under AdamW bf16, fp16 or quantized), its named algorithms, FSDP2
(oktopk.fsdp) and oktopk.optim.DeMo. The faults:

- sigkill / sigstop: one rank killed or stopped at a random point of a
  chosen step; the others must raise a named error within the timeouts.
- nan / inf: one rank's gradient poisoned at a chosen step (warm-up,
  probe, switch, quantized, ...); every rank must see it, skip the step
  and keep every residual as it was; the ranks end bitwise equal.
- mismatch-*: one rank holds another value of a setting the plugin
  compares (or resumed from another step); every rank must raise, naming
  it, within seconds (the process group's own timeout is long, so it
  cannot be what ends the job).
- corrupt-byte / corrupt-field / corrupt-file: a checkpoint of the
  plugin's with a bit flipped, a field edited, or a byte of the saved file
  flipped; loading it must be refused (the checksum), the live state left
  as it was.
- resume-<step kind>: a checkpoint saved at a warm-up, probe, decision,
  confirmation, switch or steady step, loaded into a fresh model,
  optimizer and state; the continued run must equal the uninterrupted one
  bitwise (paths, parameters, residuals).
- elastic-*: examples/pytorch/elastic.py under torchrun's elastic agent
  (``--max-restarts``, through oktopk.run or torch.distributed.run), one
  rank SIGKILLed mid-step, two at once, or one lost again after the
  restart; the agent restarts the group, every rank resumes from the
  newest checkpoint every rank saved, and the run must end with the
  parameters of the same run uninterrupted, bit for bit.
- continue-*: examples/pytorch/continue.py with on_rank_loss="continue",
  each rank a process of its own; one rank killed or stopped in a sparse
  step, or two at once; the survivors must go on without it, bitwise
  alike, and a stopped rank woken afterwards must fail, naming why.

Every job has a hard wall-clock bound. Seeded and replayable:

    campaign.py --seed 7 --faults 200 --out results/chaos_torch.md
    campaign.py --seed 7 --faults 200 --job 12 -v     # one job again
    campaign.py --smoke                                 # make test's slice

Exits 1 on any hang, crash, silent divergence, unnamed error, changed
state or harness error.
"""

import argparse
import json
import os
import queue
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))

from conftest import free_port  # noqa: E402  (ports below the ephemeral range, as every test picks them)

ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
WORKER = os.path.join(HERE, "worker.py")

PLUGIN_TIMEOUT = 2.0  # OkTopkState(timeout=), DeMo(timeout=): seconds a library call waits for a peer
PG_TIMEOUT = 3.0  # the job's gloo process group: the warm-up and native steps' collectives
MISMATCH_PG_TIMEOUT = 60.0  # long: a mismatch must be named by the plugin, not ended by gloo
HANG_AFTER_FAULT = 15.0  # a rank that has not returned this long after a kill or stop hangs
MAX_DELAY = 0.02  # a kill or stop lands up to this long after the victim starts its step
AFTER_FAULT_STEPS = 40  # steps a kill's or stop's job runs past the step it lands in
MISMATCH_BOUND = 5.0  # seconds within which a mismatch must fail every rank

# Faults drawn per kind (weights) when the plan is made.
JOB_WEIGHTS = {
    "sigkill": 14,
    "sigstop": 8,
    "nan": 11,
    "inf": 7,
    "mismatch-setting": 27,  # at least one job per SETTINGS entry in a 200-fault plan (the test of the plan checks every name)
    "mismatch-demo": 7,  # every DEMO_SETTINGS name in a 200-fault plan
    "mismatch-resume": 4,
    "corrupt": 5,  # each job: several corruptions (corrupt-byte, -field, -file)
    "resume": 7,  # each job: several cuts (resume-<step kind>)
    "elastic": 26,  # each job: a restart or two of a whole torchrun group (elastic-*): about a fifth of the faults
    "continue": 12,  # each job: a rank (or two) lost under on_rank_loss="continue", the survivors going on (continue-*)
}

# The row order of the report.
KIND_ORDER = ["sigkill", "sigstop", "nan", "inf", "mismatch-setting", "mismatch-demo", "mismatch-resume", "corrupt-byte", "corrupt-field",
              "corrupt-file", "resume-warm-up", "resume-probe", "resume-decision", "resume-confirmation", "resume-switch", "resume-steady",
              "elastic-kill", "elastic-two-at-once", "elastic-kill-again", "continue-kill", "continue-stop", "continue-two-at-once",
              "continue-rejoin", "continue-lost-twice", "continue-claim-live"]

KIND_TEXT = {
    "sigkill": "SIGKILL of one rank 0-20 ms after it starts a chosen step (it waits there for the campaign's go, so the signal "
               "lands inside the run; a step takes a few ms, so it may land a few steps on); the others must raise a named error "
               "(OkTopkError, or gloo's RuntimeError on a dense step) within the timeouts.",
    "sigstop": "SIGSTOP of one rank likewise (killed when the job ends); the others must raise a named timeout (DeMo stopped "
               "before its first step: OkTopkError within its own timeout, not the process group's error).",
    "nan": "NaN in one rank's gradient at a chosen step (a hook on the hidden activation's gradient; DeMo: in .grad); "
           "every rank must see a non-finite step, skip it, and keep its residuals, thresholds, quantized residuals and velocities bitwise.",
    "inf": "+Inf or -Inf likewise.",
    "mismatch-setting": "one rank's OkTopkState (DDP hook or FSDP2) holds another value of a setting the ranks compare "
                        "(agreement_settings), or another optimizer family; every rank must raise OkTopkError naming it.",
    "mismatch-demo": "one rank's DeMo holds another topk, chunk, momentum_decay, weight_decay or lr from the start, or one rank "
                     "changes its lr or weight decay (param_groups) at a later step; every rank must raise OkTopkError naming it "
                     "at that step.",
    "mismatch-resume": "one rank resumes from a checkpoint of another step than the others', or starts fresh while they resume.",
    "corrupt-byte": "one bit of a tensor or blob of the plugin's checkpoint flipped in memory; loading it into a fresh state and "
                    "into the live one must raise ValueError naming the checksum and change neither (DeMo: at times on one rank "
                    "only, while the others load their intact checkpoints, which every rank must then refuse alike).",
    "corrupt-field": "one field of the plugin's checkpoint edited (iter, rank, density, the choice's decision, a group, the checksum "
                     "itself, or the checksum dropped), likewise.",
    "corrupt-file": "one byte of a tensor or blob flipped in the file torch.save wrote, then torch.load; likewise.",
    "resume-warm-up": "a checkpoint saved in the dense warm-up, loaded into a fresh model, optimizer and state in the same ranks; "
                      "the continued run must equal the uninterrupted one bitwise (every step's path, parameters, residuals).",
    "resume-probe": "likewise, saved inside a probe of the path not chosen (or before the first decision).",
    "resume-decision": "likewise, saved just before a decision of the measured choice.",
    "resume-confirmation": "likewise, saved while a switch awaits its confirmation.",
    "resume-switch": "likewise, saved just before a step that switches path (sparse to native folds the residuals; native to "
                     "sparse makes a new communicator; quantized to native folds the quantized residuals).",
    "resume-steady": "likewise, saved on a chosen path between decisions (named algorithms, DeMo: any step after the warm-up).",
    "elastic-kill": "examples/pytorch/elastic.py (Ok-Topk named, a checkpoint of every rank every 3 or 4 steps) under torchrun's "
                    "elastic agent, through oktopk.run or torch.distributed.run; one rank SIGKILLs itself after its forward in a "
                    "chosen step; the agent restarts the group, which resumes from the newest checkpoint every rank saved and must "
                    "end with the uninterrupted run's parameters, bit for bit, on every rank (a restart that never came is a hang, "
                    "a failed launch a crash).",
    "elastic-two-at-once": "likewise, two ranks of three killed in the same step.",
    "continue-kill": "examples/pytorch/continue.py (Ok-Topk named, on_rank_loss=\"continue\"), each rank a process of its own over "
                     "env://; a rank other than rank 0 (the store's host) SIGKILLs itself after its forward in a sparse step; the "
                     "survivors must void that step, go on without it, and end with the same parameters bit for bit, the loss "
                     "recorded alike on each.",
    "continue-stop": "likewise with SIGSTOP: the survivors go on after the timeout; woken once they are done, the stopped rank "
                     "must fail with an OkTopkError and write no record.",
    "continue-two-at-once": "likewise, two ranks of four killed in the same step (the survivors wait out the timeout for them).",
    "continue-rejoin": "a continue-kill whose lost rank comes back (a new process, --join) once it is gone: the group must admit it "
                       "two steps after it asks, hand it the model, the optimizer and the step, and every rank, the joiner "
                       "included, must end with the same parameters bit for bit (the kill and the join count as two faults).",
    "continue-lost-twice": "two ranks of four lost a few steps apart, each in a step of its own: the group shrinks twice, every "
                           "survivor recording both losses alike, and ends with two ranks, bitwise alike.",
    "continue-claim-live": "a new process asks to join as a rank that is not lost: it must be refused (an OkTopkError naming "
                           "why), and the group goes on untouched.",
    "elastic-kill-again": "likewise, a rank killed again in the restarted attempt (two restarts): counted as two faults.",
}

# The settings agreement_settings compares, each with two values a rank can
# hold (the others hold the first), and the algorithm the state needs for
# them.
SETTINGS = [
    ("density", [0.1, 0.05], {}),
    ("algorithm", [None, "oktopk"], {}),
    ("algorithm", ["oktopk", "topka"], {}),
    ("algorithm", ["auto", "gaussiank"], {}),
    ("warmup_iters", [2, 3], {}),
    ("warmup_compression", [None, "quantized"], {"warmup_iters": 4}),
    ("tau", [64, 8], {"algorithm": "oktopk"}),
    ("tau_prime", [32, 4], {"algorithm": "oktopk"}),
    ("dense_compression", ["bf16", "quantized"], {}),
    ("dense_compression", ["quantized", None], {}),
    ("dense_compression", ["bf16", "fp16"], {}),
    ("sparse", [True, False], {}),
    ("sparse_after", [0, 6], {}),
    ("value_dtype", ["float32", "bfloat16"], {}),
    ("value_dtype", ["float16", "float32"], {"algorithm": "oktopk"}),
    ("value_dtype", ["int8", "int4"], {"algorithm": "oktopk"}),
    ("stochastic_rounding", [False, True], {"value_dtype": "float16"}),
    ("density_schedule", [None, [0.5, 4]], {"algorithm": "oktopk"}),
    ("measure_xi_every", [None, 2], {"algorithm": "oktopk"}),
    ("adaptive", [None, [0.01, 0.2]], {"algorithm": "oktopk"}),
    ("sparse_margin", [0.1, 0.25], {}),
    ("recheck_every", [200, 8], {}),
    ("device_path", [None, True], {}),
    ("momentum_correction", [True, False], {}),
    ("momentum_masking", [False, "waited"], {}),
    ("optimizer_family", ["sgdm", "adamw"], {}),
]
DEMO_SETTINGS = [("topk", [32, 8]), ("chunk", [64, 16]), ("momentum_decay", [0.999, 0.99]), ("weight_decay", [0.0, 0.1]),
                 ("lr", [0.01, 0.02])]
# The DeMo settings a param group holds, which a rank can change between
# steps (a scheduler, a hand edit): drawn as changed after the first step
# too.
DEMO_GROUP_SETTINGS = ("lr", "weight_decay")
# The named algorithms the runs use; the dense ones only where a checkpoint
# is the subject (resume): their states hold no library tensor state, and
# state_dict() then raises (results/chaos_torch.md, findings).
NAMED = ["oktopk", "auto", "topka", "gaussiank", "gtopk", "topkdsa"]
NAMED_WITH_DENSE = NAMED + ["dense_ring"]
# What the resume jobs run, in turn: the DDP hook's measured choice (twice
# as often: its steps are what a resume must get right), FSDP2's, a named
# algorithm, DeMo.
RESUMED = ["ddp", "ddp", "fsdp", "named", "demo"]


# -- the plan ----------------------------------------------------------------

def ddp_cfg(rng, front="ddp", schedule=None, optimizer=None, choice=None, named=NAMED):
    """A DDP (or FSDP2) config: the measured choice or a named algorithm."""
    if choice is None:
        choice = rng.random() < 0.7
    state = {"density": 0.05, "timeout": PLUGIN_TIMEOUT}
    if choice:
        optimizer = optimizer or rng.choice(["sgdm", "sgdm", "sgd", "adamw", "adamw"])
        state["recheck_every"] = 8
        if optimizer == "adamw":
            state["dense_compression"] = rng.choice(["quantized", "bf16", "fp16"])
        if schedule is None:
            schedule = rng.choice(["sparse-then-native", "native-then-candidate", "none"])
        if optimizer != "adamw" and rng.random() < 0.2:
            # No sparse step: the 4-bit path is the candidate under SGD too.
            state["sparse"] = False
        elif optimizer != "adamw":
            # The early steps (the 4-bit path in sparse's place, then sparse
            # joins, the schedule starting over) within the job, or none:
            # the default's 100 would outlast it.
            state["sparse_after"] = 6 if rng.random() < 0.25 else 0
        if optimizer != "adamw" and rng.random() < 0.25:
            # A warm-up in bfloat16, native, then 4 bits (DDP's first step, its second, the rest):
            # its residuals join the first sparse step.
            state["warmup_iters"], state["warmup_compression"] = 4, "quantized"
        if front == "ddp" and optimizer == "sgdm" and rng.random() < 0.3:
            # Momentum factor masking: the library marks and lists the
            # residual's zeros after each sparse call (residual_zeros); the
            # default masks over its first 100 sparse steps, this one over
            # its first 3, then stops within the job.
            state["momentum_masking"] = rng.choice(["waited", ["waited", 3]])
    else:
        optimizer = optimizer or rng.choice(["sgd", "sgdm"])
        state["algorithm"] = rng.choice(named)
        state["tau"], state["tau_prime"] = 2, 3
        if state["algorithm"] in ("oktopk", "topka", "gaussiank", "auto") and rng.random() < 0.4:
            state["value_dtype"] = rng.choice(["bfloat16", "float16", "int8", "int4"])
        schedule = "none"
    return {"front": front, "optimizer": optimizer, "model": rng.choice(["small", "deep"]) if front == "ddp" else "small", "state": state,
            "schedule": schedule}


def demo_cfg(rng):
    return {"front": "demo", "model": "small", "schedule": "none",
            "state": {"lr": 0.01, "weight_decay": 0.1, "topk": rng.choice([8, 16, 32]), "chunk": rng.choice([16, 64]),
                      "timeout": PLUGIN_TIMEOUT}}


def any_cfg(rng, schedule=None):
    r = rng.random()
    if r < 0.6:
        return ddp_cfg(rng, schedule=schedule)
    if r < 0.8:
        return ddp_cfg(rng, front="fsdp", schedule=schedule)
    return demo_cfg(rng)


def describe(cfg):
    """A config in a few words, for the report."""
    s = cfg.get("state", {})
    if cfg["front"] == "demo":
        return "DeMo"
    if cfg["front"] == "elastic":
        return f"torchrun elastic, DDP {s['algorithm']} at {s['density']:g}"
    if cfg["front"] == "continue":
        return f"on_rank_loss=continue, DDP {s['algorithm']} at {s['density']:g}"
    head = "FSDP2" if cfg["front"] == "fsdp" else "DDP"
    if "algorithm" in s:
        return f"{head} {s['algorithm']}" + (f" {s['value_dtype']}" if "value_dtype" in s else "")
    if cfg.get("optimizer") == "adamw":
        return f"{head} choice, AdamW ({s.get('dense_compression')})"
    warm = ", no sparse (4 bits)" if s.get("sparse") is False else ""
    warm += ", 4-bit warm-up" if s.get("warmup_compression") else ""
    warm += f", 4-bit early steps ({s['sparse_after']})" if s.get("sparse_after") else ""
    warm += ", masking" if s.get("momentum_masking") else ""
    return f"{head} choice, {'SGD+momentum' if cfg.get('optimizer') == 'sgdm' else 'SGD'}{warm}"


def schedule_steps(cfg):
    """Steps that take a run through its schedule's decisions."""
    warm = cfg.get("state", {}).get("warmup_iters", 2) if cfg["front"] != "demo" else 0
    return warm + {"sparse-then-native": 38, "native-then-candidate": 26}.get(cfg.get("schedule"), 14)


class Cycle:
    """The items of a list in a seeded order, over and over: every setting
    is drawn before any is drawn twice."""

    def __init__(self, items, rng):
        self.items, self.rng, self.left = list(items), rng, []

    def next(self):
        if not self.left:
            self.left = list(self.items)
            self.rng.shuffle(self.left)
        return self.left.pop()


def make_job(kind, rng, world, cycles=None):
    if cycles is None:
        cycles = {"setting": Cycle(SETTINGS, rng), "demo": Cycle(DEMO_SETTINGS, rng), "resume": Cycle(RESUMED, rng)}
    job = {"kind": kind, "world": world, "pg_timeout": PG_TIMEOUT}
    if kind in ("sigkill", "sigstop"):
        cfg = any_cfg(rng, schedule=rng.choice(["none", "none", "sparse-then-native"]))
        steps = schedule_steps(cfg) if cfg["schedule"] != "none" else 16
        warm = 0 if cfg["front"] == "demo" else 2
        # The step the fault lands in: anywhere from the warm-up's first
        # (DDP rebuilds its buckets there) to three before the end; the
        # first sparse step (the communicator's setup) often.
        at = rng.choice([warm, warm, rng.randrange(0, steps - 3), rng.randrange(warm, steps - 3)])
        if cfg["front"] == "demo" and kind == "sigstop" and rng.random() < 0.5:
            at = 0  # stopped before DeMo's first step: its agreement must honour DeMo's timeout
        # Steps enough after the fault's that the run cannot end before
        # the signal lands (a step takes a few ms); the survivors stop at
        # their first failing step anyway.
        job.update(type="fault_run", cfg=cfg, steps=at + AFTER_FAULT_STEPS, progress=True, faults=[kind],
                   fault={"signal": kind, "victim": rng.randrange(world), "step": at, "delay": round(rng.uniform(0, MAX_DELAY), 4)})
    elif kind in ("nan", "inf"):
        cfg = any_cfg(rng, schedule=rng.choice(["sparse-then-native", "native-then-candidate", "none"]))
        warm = 0 if cfg["front"] == "demo" else cfg["state"].get("warmup_iters", 2)
        steps = schedule_steps(cfg)
        # Where it lands: the warm-up, the first sparse step, a probe, the
        # schedule's switches (sparse to native at s 20, native to the
        # candidate at s 16 or 32), or any step.
        interesting = [0, 1, 2, warm, warm + 1, warm + 4, warm + 20, warm + 16, warm + 32, rng.randrange(steps)]
        step = min(rng.choice(interesting), steps - 3)
        value = "nan" if kind == "nan" else rng.choice(["inf", "-inf"])
        job.update(type="fault_run", cfg=cfg, steps=min(steps, step + 4), inject={"rank": rng.randrange(world), "step": step, "value": value},
                   faults=[kind])
    elif kind == "elastic":
        job.update(elastic_job(rng, world))
    elif kind == "continue":
        job.update(continue_job(rng, world))
    elif kind == "mismatch-setting":
        name, values, needs = cycles["setting"].next()
        front = "fsdp" if rng.random() < 0.25 else "ddp"
        if name == "momentum_masking":
            front = "ddp"  # FSDP2 refuses masking
        cfg = ddp_cfg(rng, front=front, choice=True, schedule="none", optimizer="sgdm")
        cfg["state"].pop("recheck_every", None)
        if name != "sparse":
            # sparse=False refuses a named algorithm and dense_compression
            # None, which other settings' values or needs bring in.
            cfg["state"].pop("sparse", None)
        cfg["state"].update(needs)
        if name in ("value_dtype", "stochastic_rounding", "momentum_correction", "momentum_masking"):
            # Masking needs float32 values and the correction; a rank that
            # holds it with either refused would fail alone, not mismatch.
            cfg["state"].pop("momentum_masking", None)
        if name == "optimizer_family":
            cfg["state"]["dense_compression"] = "bf16"
        if name in ("value_dtype",) and values[0] == "float32" and "algorithm" not in needs:
            pass  # the measured choice's sparse path is "auto", which takes 16-bit values
        victim = rng.randrange(world)
        per_rank = [values[1] if r == victim else values[0] for r in range(world)]
        job.update(type="mismatch", cfg=cfg, setting=name, values=per_rank, steps=3, pg_timeout=MISMATCH_PG_TIMEOUT, faults=[kind])
    elif kind == "mismatch-demo":
        name, values = cycles["demo"].next()
        cfg = demo_cfg(rng)
        victim = rng.randrange(world)
        job.update(type="mismatch", cfg=cfg, setting=name, values=[values[1] if r == victim else values[0] for r in range(world)], steps=3,
                   pg_timeout=MISMATCH_PG_TIMEOUT, faults=[kind])
        if name in DEMO_GROUP_SETTINGS and rng.random() < 0.5:
            job.update(change_at=rng.randrange(1, 4))
            job["steps"] = job["change_at"] + 2
    elif kind == "mismatch-resume":
        cfg = any_cfg(rng, schedule="none")
        if cfg["front"] == "demo":
            cfg = ddp_cfg(rng, schedule="none")
        a, b = sorted(rng.sample(range(1, 7), 2))
        victim = rng.randrange(world)
        fresh = rng.random() < 0.3
        other = None if fresh else b
        job.update(type="mismatch", cfg=cfg, setting="resume-fresh" if fresh else "resume-step",
                   values=[other if r == victim else a for r in range(world)], save_steps=[a, b], steps=3, pg_timeout=MISMATCH_PG_TIMEOUT,
                   faults=[kind])
    elif kind == "corrupt":
        # A checkpoint that holds residuals (library states, quantized
        # residuals, velocities): the candidate path chosen (steps 4-19
        # after the warm-up of sparse-then-native), or a sparse algorithm.
        cfg = any_cfg(rng, schedule="sparse-then-native")
        if cfg.get("state", {}).get("dense_compression") in ("bf16", "fp16"):
            cfg["state"]["dense_compression"] = "quantized"  # 16 bits keep no residual: nothing to flip
        if cfg.get("state", {}).get("algorithm") in ("dense_ring", "dense_rabenseifner"):
            cfg["state"]["algorithm"] = "oktopk"
        hows = [rng.choice(["byte", "byte", "field", "field", "file"]) for _ in range(rng.randrange(3, 6))]
        corruptions = [{"how": h} for h in hows]
        for c in corruptions:
            if c["how"] == "field" and rng.random() < 0.15:
                c["field"] = "checksum-dropped"
            if cfg["front"] == "demo" and rng.random() < 0.5:
                c["victim"] = rng.randrange(world)  # DeMo's loads are agreed: one rank's corrupt checkpoint fails every rank
        job.update(type="corrupt", cfg=cfg, steps=rng.randrange(7, 14), corruptions=corruptions, seed=rng.randrange(10**6),
                   faults=["corrupt-" + h for h in hows])
    elif kind == "resume":
        what = cycles["resume"].next()
        if what == "ddp":
            cfg = ddp_cfg(rng, choice=True, schedule=rng.choice(["sparse-then-native", "native-then-candidate"]))
        elif what == "fsdp":
            cfg = ddp_cfg(rng, front="fsdp", choice=True, schedule=rng.choice(["sparse-then-native", "native-then-candidate"]))
        elif what == "named":
            cfg = ddp_cfg(rng, choice=False, named=NAMED_WITH_DENSE)
        else:
            cfg = demo_cfg(rng)
        steps = schedule_steps(cfg)
        warm = 0 if cfg["front"] == "demo" else 2
        # The step after the warm-up (s) each checkpoint is taken before: for
        # the measured choice one in the warm-up, one before a switch of
        # path (sparse-then-native: to native at s 20 and 36, folding the
        # residuals, to sparse at 32; native-then-candidate: to native at
        # 4, to the candidate at 16) and one before a probe, decision or
        # confirmation step; else any three.
        if cfg["schedule"] == "sparse-then-native":
            strata = [[-1, 0], [20, 32, 36], [1, 2, 4, 5, 7, 8, 21, 24, 25, 27, 28, 33]]
        elif cfg["schedule"] == "native-then-candidate":
            strata = [[-1, 0], [4, 16], [2, 5, 8, 9, 12, 17, 20, 21, 23, 24]]
        else:
            strata = None
        if strata:
            cuts = sorted(warm + rng.choice(points) for points in strata)
        else:
            cuts = sorted(rng.sample(range(1, steps - 1), 3))
        # Two ranks: at three, a float sum over the ranks depends on where a
        # value sits in its bucket, and a resumed process's first step runs
        # in DDP's provisional layout, so plain DDP does not resume bitwise
        # either (results/chaos_torch.md).
        job.update(type="resume", world=2, cfg=cfg, steps=steps, cuts=cuts, faults=["resume"] * len(cuts))
    else:
        raise ValueError(kind)
    return job


ELASTIC_STEPS = 12


def elastic_job(rng, world):
    """An elastic-* job: which ranks examples/pytorch/elastic.py kills in
    which step of which attempt, and what the run must then show."""
    variant = rng.choice(["kill", "kill", "two", "again"])
    if variant == "two":
        world = 3
    save_every = rng.choice([3, 4])
    victims = rng.sample(range(world), 2 if variant == "two" else 1)
    at = rng.randrange(ELASTIC_STEPS)
    kills = [(at, victims, 0)]
    if variant == "again":
        start = at // save_every * save_every  # where the restarted attempt begins
        kills.append((rng.randrange(start, ELASTIC_STEPS), [rng.randrange(world)], 1))
    last = kills[-1][0] // save_every * save_every
    name = {"kill": "elastic-kill", "two": "elastic-two-at-once", "again": "elastic-kill-again"}[variant]
    return {"type": "elastic", "world": world, "cfg": {"front": "elastic", "state": {"density": rng.choice([0.01, 0.05]),
                                                                                     "algorithm": "oktopk"}},
            "save_every": save_every, "kills": kills, "launcher": rng.choice(["oktopk.run", "torch.distributed.run"]),
            "restarts": len(kills), "resumed": last or None, "faults": [name] * (1 if variant == "kill" else 2)}


CONTINUE_STEPS = 14


def continue_job(rng, world):
    """A continue-* job: which ranks examples/pytorch/continue.py loses in
    which step, and how."""
    variant = rng.choice(["kill", "kill", "stop", "two", "rejoin", "twice", "claim"])
    world = 4 if variant in ("two", "twice") else 3
    victims = [] if variant == "claim" else sorted(rng.sample(range(1, world), 2 if variant in ("two", "twice") else 1))  # rank 0 hosts the store
    at = rng.randrange(3, CONTINUE_STEPS - 6)  # after the warm-up and the first sparse step (the communicator's setup)
    job = {"type": "continue", "world": world, "cfg": {"front": "continue", "state": {"density": rng.choice([0.01, 0.05]),
                                                                                      "algorithm": "oktopk"}},
           "victims": victims, "at": at, "stop": variant == "stop", "rejoin": variant == "rejoin"}
    if variant == "twice":
        # The second loss in a step of its own, a few steps on: the engine's
        # step is then one behind the script's (the first void step does not
        # count).
        later = at + rng.randrange(2, 5)
        job.update(kills=[(at, [victims[0]]), (later, [victims[1]])], losses=[(at, [victims[0]]), (later - 1, [victims[1]])],
                   faults=["continue-lost-twice"] * 2)
    elif variant == "claim":
        job.update(kills=[], losses=[], claim=rng.randrange(1, world), faults=["continue-claim-live"])
    else:
        name = {"kill": "continue-kill", "stop": "continue-stop", "two": "continue-two-at-once", "rejoin": "continue-kill"}[variant]
        job.update(kills=[(at, victims)], losses=[(at, victims)],
                   faults=[name] * len(victims) + (["continue-rejoin"] if variant == "rejoin" else []))
    return job


def plan(seed, faults, kinds=None):
    """The campaign's jobs, drawn from ``seed`` until they inject at least
    ``faults`` faults: every kind once first, then by JOB_WEIGHTS."""
    rng = random.Random(seed)
    names = [k for k in JOB_WEIGHTS if kinds is None or k in kinds or any(f.startswith(k) for f in kinds)]
    if not names:
        raise SystemExit(f"no job kind matches {kinds}")
    jobs, total = [], 0
    queue_ = list(names)
    cycles = {"setting": Cycle(SETTINGS, random.Random(seed + 1)), "demo": Cycle(DEMO_SETTINGS, random.Random(seed + 2)),
              "resume": Cycle(RESUMED, random.Random(seed + 3))}
    while total < faults:
        kind = queue_.pop(0) if queue_ else rng.choices(names, weights=[JOB_WEIGHTS[k] for k in names])[0]
        world = rng.choice([2, 2, 3])
        job = make_job(kind, rng, world, cycles)
        job["id"] = len(jobs)
        jobs.append(job)
        total += len(job["faults"])
    return jobs


def smoke_plan(seed):
    """make test's slice: every kind of fault, on 2 ranks (a kill on 3), in configurations
    chosen to be quick, the victims and delays drawn from ``seed``. It
    leaves out what results/chaos_torch.md lists as the plugin's open
    findings (a resume from the warm-up under a clear win or AdamW, a NaN
    in one of several groups, a NaN at the first sparse step, a dense
    named algorithm's checkpoint), so that it stays green until they are
    fixed; the full campaign counts them."""
    rng = random.Random(seed)
    T = PLUGIN_TIMEOUT

    def ddp(optimizer="sgdm", **state):
        return {"front": "ddp", "optimizer": optimizer, "model": "small", "state": {"density": 0.05, "timeout": T, **state}, "schedule": "none"}

    demo = {"front": "demo", "model": "small", "schedule": "none", "state": {"lr": 0.01, "weight_decay": 0.1, "topk": 8, "chunk": 16, "timeout": T}}
    fsdp = {"front": "fsdp", "optimizer": "sgd", "model": "small", "state": {"density": 0.05, "timeout": T}, "schedule": "none"}

    def fault(kind, cfg, step):
        return {"kind": kind, "type": "fault_run", "cfg": cfg, "steps": step + AFTER_FAULT_STEPS, "progress": True, "faults": [kind],
                "fault": {"signal": kind, "victim": rng.randrange(2), "step": step, "delay": round(rng.uniform(0, MAX_DELAY), 4)}}

    def mismatch(kind, cfg, name, values):
        victim = rng.randrange(2)
        per_rank = [values[1] if r == victim else values[0] for r in range(2)]
        return {"kind": kind, "type": "mismatch", "cfg": cfg, "setting": name, "values": per_rank,
                "steps": 3, "pg_timeout": MISMATCH_PG_TIMEOUT, "faults": [kind]}

    quantized = dict(ddp("adamw", recheck_every=8, dense_compression="quantized"), schedule="sparse-then-native")
    choice = dict(ddp("sgd", recheck_every=8), schedule="native-then-candidate")
    victim = random.Random(seed + 5).choice([1, 2])  # the continue job's victim (its own draw: the others' stay as they were)
    jobs = [
        fault("sigkill", ddp(recheck_every=8), 3),  # the sparse probe
        fault("sigstop", ddp(algorithm="oktopk"), 5),
        {"kind": "nan", "type": "fault_run", "cfg": quantized, "steps": 25, "faults": ["nan"],
         "inject": {"rank": rng.randrange(2), "step": 22, "value": "nan"}},  # quantized to native: the fold given back
        {"kind": "inf", "type": "fault_run", "cfg": demo, "steps": 7, "faults": ["inf"],
         "inject": {"rank": rng.randrange(2), "step": 4, "value": rng.choice(["inf", "-inf"])}},
        mismatch("mismatch-setting", ddp(), "dense_compression", ["bf16", "quantized"]),
        mismatch("mismatch-setting", fsdp, "warmup_iters", [2, 3]),
        mismatch("mismatch-demo", demo, "topk", [32, 8]),
        dict(mismatch("mismatch-resume", ddp(algorithm="oktopk"), "resume-step", [None, None]), values=[3, 5][:: rng.choice([1, -1])],
             save_steps=[3, 5]),
        {"kind": "corrupt", "type": "corrupt", "cfg": dict(ddp(recheck_every=8), schedule="sparse-then-native"), "steps": 9,
         "seed": rng.randrange(10**6), "faults": ["corrupt-byte", "corrupt-field", "corrupt-file", "corrupt-field"],
         "corruptions": [{"how": "byte"}, {"how": "field"}, {"how": "file"}, {"how": "field", "field": "checksum-dropped"}]},
        {"kind": "corrupt", "type": "corrupt", "cfg": demo, "steps": 5, "seed": rng.randrange(10**6),
         "corruptions": [{"how": "file"}, {"how": "byte", "victim": rng.randrange(2)}], "faults": ["corrupt-file", "corrupt-byte"]},
        dict(mismatch("mismatch-demo", demo, "lr", [0.01, 0.02]), change_at=2, steps=4),
        fault("sigstop", demo, 0),  # before DeMo's first step
        # Warm-up (no clear win to lose), the native probe, the switch to
        # the candidate's probe (a new communicator).
        {"kind": "resume", "type": "resume", "cfg": choice, "steps": 24, "cuts": [1, 7, 18], "faults": ["resume"] * 3},
        # Three ranks, FSDP2: killed at the first sparse step, where the
        # communicator is set up through the store.
        dict(fault("sigkill", dict(fsdp, optimizer="sgdm"), 2), world=3, fault={"signal": "sigkill", "victim": rng.randrange(3), "step": 2,
                                                                                  "delay": round(rng.uniform(0, 0.01), 4)}),
        # torchrun's agent restarts the group after a kill in a sparse step.
        {"kind": "elastic", "type": "elastic", "world": 2, "cfg": {"front": "elastic", "state": {"density": 0.05, "algorithm": "oktopk"}},
         "save_every": 3, "kills": [(7, [rng.randrange(2)], 0)], "launcher": "oktopk.run", "restarts": 1, "resumed": 6,
         "faults": ["elastic-kill"]},
        # on_rank_loss="continue": a rank of three killed in a sparse step,
        # the survivors going on without it.
        {"kind": "continue", "type": "continue", "world": 3, "cfg": {"front": "continue", "state": {"density": 0.05, "algorithm": "oktopk"}},
         "victims": [victim], "at": 6, "stop": False, "kills": [(6, [victim])], "losses": [(6, [victim])], "faults": ["continue-kill"]},
    ]
    for n, job in enumerate(jobs):
        job["id"] = n
        job.setdefault("world", 2)
        job.setdefault("pg_timeout", PG_TIMEOUT)
    return jobs


# -- sessions of rank processes ----------------------------------------------

class Session:
    """``world`` rank processes (worker.py) in one gloo process group,
    reading jobs from their stdin."""

    counter = 0

    def __init__(self, world, python, logdir, workdir):
        Session.counter += 1
        self.id = Session.counter
        self.world = world
        self.events = queue.Queue()
        self.procs, self.logs = [], []
        self.ready = set()
        self.dead = False
        self.used = 0
        port = free_port()
        env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "plugins", "pytorch") + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        env.pop("OKTOPK_DEBUG_AUTO", None)
        for r in range(world):
            log = os.path.join(logdir, f"session{self.id}-rank{r}.log")
            self.logs.append(log)
            with open(log, "w") as err:
                p = subprocess.Popen([python, WORKER, "--rank", str(r), "--world", str(world), "--port", str(port), "--workdir", workdir],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env=env, cwd=ROOT, text=True,
                                     start_new_session=True)
            self.procs.append(p)
            threading.Thread(target=self._read, args=(r, p), daemon=True).start()

    def _read(self, rank, p):
        for line in p.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            msg["rank"] = rank
            self.events.put(msg)
        self.events.put({"ev": "eof", "rank": rank})

    def wait_ready(self, timeout):
        deadline = time.monotonic() + timeout
        while len(self.ready) < self.world:
            try:
                msg = self.events.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                return False
            if msg["ev"] == "ready":
                self.ready.add(msg["rank"])
            elif msg["ev"] == "eof":
                return False
            if time.monotonic() > deadline:
                return False
        return True

    def send(self, job):
        line = json.dumps(job) + "\n"
        for p in self.procs:
            try:
                p.stdin.write(line)
                p.stdin.flush()
            except (BrokenPipeError, OSError):
                pass
        self.used += 1

    def kill(self):
        self.dead = True
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.kill(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def exit_codes(self):
        return [p.poll() for p in self.procs]


class Sessions:
    """The current session per world size, and a spare one started ahead
    for the jobs that end theirs (a killed or stopped rank)."""

    def __init__(self, python, logdir, workdir):
        self.python, self.logdir, self.workdir = python, logdir, workdir
        self.current, self.spare = {}, {}

    def get(self, world):
        s = self.current.get(world)
        if s is not None and not s.dead:
            return s
        s = self.spare.pop(world, None) or Session(world, self.python, self.logdir, self.workdir)
        self.current[world] = s
        return s

    def prewarm(self, world):
        if world not in self.spare:
            self.spare[world] = Session(world, self.python, self.logdir, self.workdir)

    def retire(self, world):
        s = self.current.pop(world, None)
        if s is not None:
            s.kill()

    def close(self):
        for s in list(self.current.values()) + list(self.spare.values()):
            s.kill()


# -- running a job -----------------------------------------------------------

def job_bound(job):
    """The job's hard wall-clock bound (seconds), its sleeps included."""
    steps = job.get("steps", 10)
    if job["type"] == "resume":
        steps = steps + sum(steps - c for c in job["cuts"])
    if job["type"] == "corrupt":
        steps += 6 + 3 * len(job["corruptions"])
    return 40.0 + 0.5 * steps + (8 * 0.3 * (1 + len(job.get("cuts", []))) if job["cfg"].get("schedule") != "none" else 0)


def run_job(sessions, job, verbose=False, next_job=None):
    """Run one job on a session; returns (results by rank, exit codes,
    fault time or None, timing, hung ranks). ``next_job``: the one after
    it, whose session is started meanwhile when this job ends its own."""
    if job["type"] == "elastic":
        return run_elastic(job, sessions.workdir, verbose)
    if job["type"] == "continue":
        return run_continue(job, sessions.workdir, verbose)
    world = job["world"]
    destructive = job["kind"] in ("sigkill", "sigstop")
    session = sessions.get(world)
    if destructive and next_job is not None and next_job["kind"] in ("sigkill", "sigstop"):
        sessions.prewarm(next_job["world"])  # its ranks import torch while this job runs
    started = time.monotonic()
    if not session.wait_ready(120):
        codes = session.exit_codes()
        sessions.retire(world)
        return {"harness": f"session {session.id} did not start (exit codes {codes}); logs {session.logs}"}
    setup_seconds = time.monotonic() - started
    payload = dict(job, last=destructive)
    session.send(payload)
    t0 = time.monotonic()
    deadline = t0 + job_bound(job)
    results, fault_time, hung, eof = {}, None, [], set()
    fault = job.get("fault")
    victim = fault["victim"] if fault else None
    while len(results) + len(eof - set(results)) < world:
        if fault_time is not None and victim is not None:
            # Only the survivors report; the victim is dead or stopped.
            if all(r in results or r in eof for r in range(world) if r != victim):
                break
            deadline = min(deadline, fault_time + HANG_AFTER_FAULT)
        try:
            msg = session.events.get(timeout=max(0.01, min(0.2, deadline - time.monotonic())))
        except queue.Empty:
            msg = None
        if msg is not None:
            ev, r = msg["ev"], msg["rank"]
            if ev == "done":
                results[r] = msg["result"]
            elif ev == "eof":
                eof.add(r)
            elif ev == "step" and fault is not None and r == victim and fault_time is None and msg["step"] == fault["step"]:
                # The victim waits at the start of the step for this go.
                try:
                    session.procs[victim].stdin.write("go\n")
                    session.procs[victim].stdin.flush()
                except (BrokenPipeError, OSError):
                    pass
                time.sleep(fault["delay"])
                sig = signal.SIGKILL if fault["signal"] == "sigkill" else signal.SIGSTOP
                try:
                    os.kill(session.procs[victim].pid, sig)
                    fault_time = time.monotonic()
                except ProcessLookupError:
                    pass
        if time.monotonic() > deadline:
            hung = [r for r in range(world) if r not in results and r not in eof and r != (victim if fault_time is not None else None)]
            break
    elapsed = time.monotonic() - t0
    codes = [p.poll() for p in session.procs]
    if destructive or hung or any(r in eof for r in range(world)):
        sessions.retire(world)
    else:
        # Reuse the session only if every rank ended the job alike (all
        # succeeded, or all failed at the same step): the ranks then made
        # the same communicators, whose store keys are numbered per
        # process.
        ends = {json.dumps([(res.get("error") or {}).get("step"), bool(res.get("error")), bool(res.get("harness_error"))])
                for res in results.values()}
        if len(ends) > 1 or any(res.get("harness_error") for res in results.values()):
            sessions.retire(world)
    if verbose:
        print(f"  job {job['id']} {job['kind']}: {elapsed:.1f} s (+{setup_seconds:.1f} s session start), session {session.id}", flush=True)
    return {"results": results, "codes": codes, "fault_time": fault_time, "elapsed": elapsed, "hung": hung, "eof": sorted(eof),
            "victim": victim if fault_time is not None else None, "logs": session.logs, "fault_landed": fault_time is not None}


ELASTIC_SCRIPT = os.path.join(ROOT, "examples", "pytorch", "elastic.py")
ELASTIC_BOUND = 240.0  # seconds for a whole elastic job, every attempt
_uninterrupted = {}  # (world, density) -> each rank's record of the uninterrupted run


def elastic_run(job, base, kills, restarts, launcher):
    """examples/pytorch/elastic.py under ``launcher`` (torchrun's agent) in
    folder ``base``: (the completed process or None on the bound, each
    rank's record, seconds)."""
    ckpt, out = os.path.join(base, "ckpt"), os.path.join(base, "out")
    os.makedirs(out)
    s = job["cfg"]["state"]
    cmd = [sys.executable, "-m", launcher, "--nnodes", "1", "--nproc-per-node", str(job["world"]), "--max-restarts", str(restarts),
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", os.path.basename(base),
           ELASTIC_SCRIPT, "--ckpt", ckpt, "--out", out, "--steps", str(ELASTIC_STEPS), "--save-every", str(job["save_every"]),
           "--algorithm", s["algorithm"], "--density", str(s["density"])]
    for step, ranks, attempt in kills:
        cmd += ["--kill", f"{step}:{','.join(map(str, ranks))}:{attempt}"]
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "plugins", "pytorch"), OMP_NUM_THREADS="1",
               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")  # a store per attempt, as docs/failures.md asks under torchrun
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=ELASTIC_BOUND, env=env, start_new_session=True)
    except subprocess.TimeoutExpired:
        proc = None
    ranks = {}
    for f in os.listdir(out):
        with open(os.path.join(out, f)) as fh:
            ranks[int(f[4:-5])] = json.load(fh)
    return proc, ranks, time.monotonic() - t0


def run_elastic(job, workdir, verbose=False):
    """An elastic-* job: the uninterrupted run of its size and density
    (once per campaign), then the run with its kills."""
    key = (job["world"], job["cfg"]["state"]["density"])
    if key not in _uninterrupted:
        proc, ranks, _ = elastic_run(job, tempfile.mkdtemp(dir=workdir, prefix="whole-"), [], 0, "torch.distributed.run")
        if proc is None or proc.returncode != 0 or sorted(ranks) != list(range(job["world"])):
            said = "timed out" if proc is None else proc.stderr[-1500:]
            return {"harness": f"the uninterrupted elastic run of {key} failed: {said}"}
        _uninterrupted[key] = ranks
    proc, ranks, elapsed = elastic_run(job, tempfile.mkdtemp(dir=workdir, prefix=f"job{job['id']}-"), job["kills"], job["restarts"],
                                       job["launcher"])
    if verbose:
        print(f"  job {job['id']} {job['kind']}: {elapsed:.1f} s", flush=True)
    return {"elastic": True, "proc": proc, "ranks": ranks, "whole": _uninterrupted[key], "elapsed": elapsed, "logs": []}


def judge_elastic(job, run):
    """Each of an elastic job's faults: a hang (no end within the bound), a
    crash (the launcher failed, or a rank wrote no record), or a silent
    divergence (another attempt count or resumed step than the kills
    imply, or parameters that are not the uninterrupted run's)."""
    proc, ranks, notes = run["proc"], run["ranks"], []
    o = {"hang": proc is None, "crash": 0, "silent": 0}
    if proc is not None and proc.returncode != 0:
        o["crash"] = 1
        notes.append(f"the launcher exited {proc.returncode}: {proc.stderr[-800:]}")
    elif proc is not None:
        missing = sorted(set(range(job["world"])) - set(ranks))
        if missing:
            o["crash"] = 1
            notes.append(f"ranks {missing} wrote no record")
    for r, res in sorted(ranks.items()):
        want = {"attempt": job["restarts"], "resumed": job["resumed"], "params": run["whole"][r]["params"]}
        got = {k: res.get(k) for k in want}
        if got != want or not res.get("bytes_sent"):
            o["silent"] = 1
            notes.append(f"rank {r}: " + ", ".join(f"{k} {got[k]!r} (wanted {want[k]!r})" for k in want if got[k] != want[k])
                         + ("" if res.get("bytes_sent") else ", no bytes sent"))
    return [outcome(k, hang=int(o["hang"]), crash=o["crash"], silent=o["silent"], notes=list(notes), detection=None)
            for k in job["faults"]], [("elastic seconds", round(run["elapsed"], 1))]


CONTINUE_SCRIPT = os.path.join(ROOT, "examples", "pytorch", "continue.py")
CONTINUE_BOUND = 120.0  # seconds for every survivor of a continue job to end
SLOW_STEPS, SLOW_SLEEP = 40, 0.1  # a claim job's run: long enough for the claimant to start and be refused
# A rejoin job's run goes on until the lost rank's new process has joined
# (its start, `import torch`, takes seconds on a loaded machine), then
# REJOIN_AFTER steps on every rank; REJOIN_STEPS at most.
REJOIN_STEPS, REJOIN_AFTER = 300, 10
CONTINUE_WAKE_BOUND = 30.0  # seconds for a woken stopped rank to fail


def run_continue(job, workdir, verbose=False):
    """A continue-* job: every rank a process of its own (env://), the
    victims lost in step ``at``; a stopped victim is woken once the
    survivors are done."""
    out = tempfile.mkdtemp(dir=workdir, prefix=f"job{job['id']}-")
    s, world = job["cfg"]["state"], job["world"]
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "plugins", "pytorch"), OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), WORLD_SIZE=str(world))
    slow = job.get("rejoin") or "claim" in job
    steps = REJOIN_STEPS if job.get("rejoin") else SLOW_STEPS if slow else CONTINUE_STEPS
    common = [sys.executable, CONTINUE_SCRIPT, "--out", out, "--steps", str(steps), "--density", str(s["density"]),
              "--timeout", str(PLUGIN_TIMEOUT)] + (["--step-sleep", str(SLOW_SLEEP)] if slow else [])
    if job.get("rejoin"):
        common += ["--after-join", str(REJOIN_AFTER)]
    cmd = list(common)
    for at, ranks in job["kills"]:
        cmd += ["--kill", f"{at}:{','.join(map(str, ranks))}"]
    if job["stop"]:
        cmd.append("--stop")
    t0 = time.monotonic()
    procs = {r: subprocess.Popen(cmd, env=dict(env, RANK=str(r)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 start_new_session=True) for r in range(world)}
    ended, hung = {}, []
    if "claim" in job:
        claimant = subprocess.Popen(common + ["--join"], env=dict(env, RANK=str(job["claim"])), stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            ended["claimant"] = (claimant.wait(timeout=CONTINUE_BOUND), *claimant.communicate())
        except subprocess.TimeoutExpired:
            claimant.kill()
            claimant.wait()
            hung.append("claimant")
    if job.get("rejoin"):
        (victim,) = job["victims"]
        try:
            procs[victim].wait(timeout=CONTINUE_BOUND)
            ended[victim] = (procs[victim].returncode, *procs[victim].communicate())
            procs[victim] = subprocess.Popen(common + ["--join"], env=dict(env, RANK=str(victim)), stdout=subprocess.PIPE,
                                             stderr=subprocess.PIPE, text=True, start_new_session=True)
            del ended[victim]
        except subprocess.TimeoutExpired:
            hung.append(victim)
    for r in sorted(procs):
        if r in job["victims"] and job["stop"]:
            continue
        try:
            ended[r] = (procs[r].wait(timeout=max(1.0, CONTINUE_BOUND - (time.monotonic() - t0))), *procs[r].communicate())
        except subprocess.TimeoutExpired:
            hung.append(r)
    elapsed = time.monotonic() - t0
    for r in job["victims"] if job["stop"] else []:
        os.kill(procs[r].pid, signal.SIGCONT)
        try:
            ended[r] = (procs[r].wait(timeout=CONTINUE_WAKE_BOUND), *procs[r].communicate())
        except subprocess.TimeoutExpired:
            hung.append(r)
    for r in hung:
        procs[r].kill()
        procs[r].wait()
    ranks = {}
    for f in os.listdir(out):
        with open(os.path.join(out, f)) as fh:
            ranks[int(f[4:-5])] = json.load(fh)
    if verbose:
        print(f"  job {job['id']} {job['kind']}: {elapsed:.1f} s", flush=True)
    return {"continue": True, "ended": ended, "hung": hung, "ranks": ranks, "elapsed": elapsed, "logs": []}


def judge_continue(job, run):
    """Each of a continue job's faults: a hang (a survivor, or a woken
    stopped rank, past its bound), a crash (a survivor failed or wrote no
    record), a silent divergence (survivors' parameters differ, the loss
    recorded otherwise than it happened, or a lost rank that trained on
    alone), or an unnamed error (a woken rank's failure that is not an
    OkTopkError)."""
    if job.get("rejoin"):
        return judge_rejoin(job, run)
    victims, world = job["victims"], job["world"]
    survivors = [r for r in range(world) if r not in victims]
    o = {"hang": bool(run["hung"]), "crash": 0, "silent": 0, "unnamed": 0}
    notes = [f"ranks {run['hung']} did not end within the bound"] if run["hung"] else []
    for r in survivors:
        code, _, err = run["ended"].get(r, (None, "", ""))
        if code not in (0, None) or (code == 0 and r not in run["ranks"]):
            o["crash"] = 1
            notes.append(f"survivor {r} exited {code}: {err[-800:]}")
    records = [run["ranks"][r] for r in survivors if r in run["ranks"]]
    steps = SLOW_STEPS if "claim" in job else CONTINUE_STEPS
    want = [(step, lost) for step, lost in job["losses"]]
    for r in survivors:
        rec = run["ranks"].get(r)
        if rec is None:
            continue
        losses = rec.get("rank_losses") or []
        got = [(loss["step"], loss["lost"]) for loss in losses]
        if (got != want or (losses and losses[-1].get("rank") != survivors.index(r)) or rec["iter"] != steps - len(want)
                or rec.get("rank_joins")):
            o["silent"] = 1
            notes.append(f"survivor {r}: losses {got!r}, joins {rec.get('rank_joins')!r}, iter {rec.get('iter')} (wanted {want}, "
                         f"iter {steps - len(want)})")
    if "claim" in job:
        code, _, err = run["ended"].get("claimant", (None, "", ""))
        if code == 0:
            o["silent"] = 1
            notes.append("the process that claimed a live rank was admitted")
        elif code is not None and "join refused" not in err:
            o["unnamed"] = 1
            notes.append(f"the claimant exited {code} without naming the refusal: {err[-800:]}")
    if len({rec["params"] for rec in records}) > 1:
        o["silent"] = 1
        notes.append("the survivors' parameters differ")
    for r in victims:
        if r in run["ranks"]:
            o["silent"] = 1
            notes.append(f"lost rank {r} wrote a record: it trained on")
        if job["stop"] and r in run["ended"]:
            code, _, err = run["ended"][r]
            if code == 0:
                o["silent"] = 1
            elif "OkTopkError" not in err:
                o["unnamed"] = 1
                notes.append(f"woken rank {r} exited {code} without an OkTopkError: {err[-800:]}")
    return [outcome(k, hang=int(o["hang"]), crash=o["crash"], silent=o["silent"], unnamed=o["unnamed"], notes=list(notes), detection=None)
            for k in job["faults"]], [("continue seconds", round(run["elapsed"], 1))]


def judge_rejoin(job, run):
    """A continue-rejoin job: every rank, the joiner included, ended (no
    hang), wrote its record (no crash), with the same parameters, the loss
    and the join recorded alike on the members, the join two steps after
    it was asked for, and the joiner's parameters the members' from its
    first step on (no silent divergence)."""
    (victim,), world = job["victims"], job["world"]
    o = {"hang": bool(run["hung"]), "crash": 0, "silent": 0}
    notes = [f"ranks {run['hung']} did not end within the bound"] if run["hung"] else []
    for r in range(world):
        code, _, err = run["ended"].get(r, (None, "", ""))
        if code not in (0, None) or (code == 0 and r not in run["ranks"]):
            o["crash"] = 1
            notes.append(f"rank {r}{' (the joiner)' if r == victim else ''} exited {code}: {err[-800:]}")
    records = run["ranks"]
    if len({rec["params"] for rec in records.values()}) > 1:
        o["silent"] = 1
        notes.append("the ranks' parameters differ after the join")
    members = [r for r in records if r != victim]
    for r in members:
        rec = records[r]
        losses, joins = rec.get("rank_losses") or [], rec.get("rank_joins") or []
        if ([(l["step"], l["lost"]) for l in losses] != [(job["at"], [victim])] or len(joins) != 1 or joins[0]["joined"] != [victim]
                or joins[0]["step"] - joins[0]["asked_by"] != 2 or rec["size"] != world):
            o["silent"] = 1
            notes.append(f"rank {r}: losses {losses!r}, joins {joins!r}, size {rec.get('size')}")
    if victim in records and members:
        mine, theirs = records[victim]["digests"], records[members[0]]["digests"]
        if mine != theirs[len(theirs) - len(mine):]:
            o["silent"] = 1
            notes.append("the joiner's parameters part from the members' at some step")
    return [outcome(k, hang=int(o["hang"]), crash=o["crash"], silent=o["silent"], notes=list(notes), detection=None)
            for k in job["faults"]], [("continue seconds", round(run["elapsed"], 1))]


# -- judging a job -----------------------------------------------------------

FAULT_WORDS = {
    "sigkill": re.compile(r"peer|closed|reset|crash|dead|died|timed? ?out|timeout|broken pipe|connection|remote|store", re.I),
    "sigstop": re.compile(r"timed? ?out|timeout|within .* s", re.I),
}


def named_type(err):
    """Whether an error is of a type the plugin promises (OkTopkError,
    ValueError, RuntimeError and its torch subclasses)."""
    mro = set(err.get("mro", []))
    return bool(mro & {"OkTopkError", "ValueError", "RuntimeError"})


def mass_error(*masses):
    """The error of a state_dict() that raised while its mass was taken."""
    return next((m["error"] for m in masses if isinstance(m, dict) and "error" in m), None)


def mass_moved(before, after, front):
    """How ``after`` lost or changed what ``before`` held (see the worker's
    mass_of): each group's library state and quantized residuals bitwise,
    a new quantized group all zero, no group dropped from those a native
    step folds, the velocities bitwise; DeMo: momentum and library state."""
    if front == "demo":
        return [k for k in ("momentum", "library_state") if before.get(k) != after.get(k)]
    moved = []
    for g, d in before["tensors"].items():
        if after["tensors"].get(g) != d:
            moved.append(f"library state of group {g}")
    for g, (d, _) in before["quantized"].items():
        if g not in after["quantized"] or after["quantized"][g][0] != d:
            moved.append(f"quantized residuals of group {g}")
    for g, (_, zero) in after["quantized"].items():
        if g not in before["quantized"] and not zero:
            moved.append(f"new quantized group {g} not zero")
    dropped = set(before["residual_groups"]) - set(after["residual_groups"])
    if dropped:
        moved.append(f"groups {sorted(dropped)} no longer folded")
    if before["momentum"] != after["momentum"]:
        moved.append("velocities")
    return moved


def outcome(kind, **kw):
    o = {"kind": kind, "hang": 0, "crash": 0, "silent": 0, "unnamed": 0, "changed": 0, "detection": None, "notes": []}
    o.update(kw)
    return o


def judge(job, run):
    """The job's faults, each an outcome: hang, crash, silent divergence,
    unnamed error, state changed, detection seconds, and notes."""
    if "harness" in run:
        return [outcome(k, harness=run["harness"]) for k in job["faults"]], []
    if run.get("elastic"):
        return judge_elastic(job, run)
    if run.get("continue"):
        return judge_continue(job, run)
    results, world = run["results"], job["world"]
    harness = [f"rank {r}: {res['harness_error']}" for r, res in results.items() if res.get("harness_error")]
    if harness:
        return [outcome(k, harness="; ".join(harness)) for k in job["faults"]], []
    kind = job["kind"]
    base = {"hang": len(run["hung"]) > 0}
    crashed = [r for r in run["eof"] if r not in results and r != run.get("victim")]
    notes = []
    if run["hung"]:
        notes.append(f"ranks {run['hung']} still running after the bound")
    if crashed:
        notes.append(f"ranks {crashed} died without reporting (exit codes {run['codes']})")
    extra = []  # (label, value) for the report's breakdowns
    if kind in ("sigkill", "sigstop"):
        o = outcome(kind, hang=int(base["hang"]), crash=len(crashed), notes=notes)
        if not run["fault_landed"]:
            o["harness"] = "the fault was never injected (the victim finished before its step?)"
            return [o], extra
        if job["fault"]["victim"] in results:
            o["harness"] = "the fault landed after the victim's run had ended: nothing was left to notice it"
            return [o], extra
        worst = 0.0
        words = FAULT_WORDS[kind]
        for r, res in results.items():
            if r == run["victim"]:
                continue
            err = res.get("error")
            if err is None:
                o["silent"] = 1
                o["notes"].append(f"rank {r} finished every step without noticing the {kind}")
                continue
            if not named_type(err) or not words.search(err["msg"]):
                o["unnamed"] = 1
                o["notes"].append(f"rank {r}: {err['msg'][:300]}")
            elif job["cfg"]["front"] == "demo" and err["step"] == 0 and "OkTopkError" not in err["mro"]:
                # DeMo's first step makes no collective of DDP's: its own agreement must name the lost rank.
                o["unnamed"] = 1
                o["notes"].append(f"rank {r}: DeMo's first step ended by the process group, not by DeMo's timeout: {err['msg'][:300]}")
            seconds = err["t"] - run["fault_time"]
            if seconds < -0.05:
                o["unnamed"] = 1
                o["notes"].append(f"rank {r} failed {-seconds:.2f} s before the fault: {err['msg'][:300]}")
            worst = max(worst, seconds)
            before, after = res.get("before_failure"), res.get("after_failure")
            if res.get("after_failure_error"):
                o["notes"].append(f"rank {r}: state_dict() after the failure raised {res['after_failure_error']}")
            elif before and after and mass_error(before["mass"], after["mass"]):
                o["info"] = f"rank {r}: state_dict() raised: {mass_error(before['mass'], after['mass'])}"
            elif before and after:
                # What the plugin promises after a failed step: nothing
                # moved on the rank where it failed (DeMo: its momentum and
                # parameters; the hook and FSDP2: every group's library
                # state, 4-bit residuals and folds, and the velocities: what
                # the step's completed calls took is given back).
                moved = mass_moved(before["mass"], after["mass"], job["cfg"]["front"])
                promised = list(moved)
                if before["params"] != after["params"]:
                    promised.append("parameters")
                if promised:
                    o["changed"] = 1
                    o["notes"].append(f"rank {r}: {', '.join(promised)} changed by the failed step {err['step']} ({res.get('failing_path')})")
                others = [m for m in moved if m not in promised]
                if others:
                    o["info"] = f"rank {r}: after the failed step {err['step']} ({res.get('failing_path')}): {', '.join(others)}"
        o["detection"] = worst
        landed = [res.get("failing_path") for r, res in results.items() if r != run["victim"] and res.get("error")]
        extra.append(("landed", f"{kind} in {landed[0] if landed else '?'}"))
        return [o], extra
    if kind in ("nan", "inf"):
        o = outcome(kind, hang=int(base["hang"]), crash=len(crashed), notes=notes)
        inj = job["inject"]
        b = inj["step"]
        paths = set()
        seen = []
        for r, res in results.items():
            if res.get("error"):
                o["unnamed"] = 1
                o["notes"].append(f"rank {r} raised at step {res['error']['step']}: {res['error']['msg'][:300]}")
                continue
            finite = {int(k): v for k, v in res["finite"].items()}
            seen.append(finite.get(b))
            paths.add(res["paths"].get(str(b), "?"))
            if any(not finite[g] for g in finite if g > b):
                o["silent"] = 1
                o["notes"].append(f"rank {r}: non-finite gradients after the step (steps {[g for g in finite if g > b and not finite[g]]})")
            error = mass_error(res.get("mass_before"), res.get("mass_after"))
            if error:
                o["unnamed"] = 1
                o["notes"].append(f"rank {r}: state_dict() raised around the skipped step {b}: {error}")
                continue
            moved = mass_moved(res["mass_before"], res["mass_after"], job["cfg"]["front"])
            if moved:
                o["changed"] = 1
                o["notes"].append(f"rank {r}: {', '.join(moved)} changed by the skipped step {b}")
            o["detection"] = max(o["detection"] or 0.0, res.get("inject_seconds", 0.0))
        if any(s is not False for s in seen) and len(seen) == world:
            o["silent"] = 1
            o["notes"].append(f"the poisoned step {b} was finite on some rank: {seen}")
        digests = {res.get("params") for res in results.values() if not res.get("error")}
        if len(digests) > 1:
            o["silent"] = 1
            o["notes"].append("the ranks ended with different parameters")
        extra.append(("landed", f"{kind} in {sorted(paths)[0] if len(paths) == 1 else '/'.join(sorted(paths))}"))
        return [o], extra
    if job["type"] == "mismatch":
        o = outcome(kind, hang=int(base["hang"]), crash=len(crashed), notes=notes)
        name = job["setting"]
        want = "iter" if name.startswith("resume") else name
        if name == "optimizer_family":
            want = "optimizer_family"
        worst = 0.0
        for r, res in results.items():
            err = res.get("error")
            if err is None:
                o["silent"] = 1
                o["notes"].append(f"rank {r} ran every step with {name} {job['values'][r]!r} against {job['values']}")
                continue
            named = "OkTopkError" in err["msg"] or "OkTopkError" in err.get("mro", [])
            if not named or "settings differ across ranks" not in err["msg"] or want not in err["msg"]:
                o["unnamed"] = 1
                o["notes"].append(f"rank {r}: {err['msg'][:400]}")
            if job.get("change_at") is not None and err.get("step") != job["change_at"]:
                o["unnamed"] = 1
                o["notes"].append(f"rank {r}: the change at step {job['change_at']} was named at step {err.get('step')}")
            worst = max(worst, err["seconds"])
        if worst > MISMATCH_BOUND:
            o["notes"].append(f"detected after {worst:.1f} s, over the {MISMATCH_BOUND} s bound")
            o["hang"] = 1
        o["detection"] = worst
        later = f" changed at step {job['change_at']}" if job.get("change_at") is not None else ""
        extra.append(("setting", f"{'FSDP2' if job['cfg']['front'] == 'fsdp' else 'DeMo' if job['cfg']['front'] == 'demo' else 'DDP'}: {name}{later}"))
        return [o], extra
    if job["type"] == "corrupt":
        outs = []
        for i, fk in enumerate(job["faults"]):
            o = outcome(fk, hang=int(base["hang"]), crash=len(crashed), notes=list(notes))
            worst = 0.0
            for r, res in results.items():
                if i >= len(res.get("faults", [])):
                    continue
                entry = res["faults"][i]
                for target in ("fresh", "live"):
                    err = entry[target]
                    if err is None:
                        o["silent"] = 1
                        o["notes"].append(f"rank {r}: the {target} state loaded the checkpoint with its {entry['what']}")
                        continue
                    msg = err["msg"]
                    if "ValueError" not in err["mro"] or not ("fails its checksum" in msg or "not a DeMo checkpoint" in msg):
                        o["unnamed"] = 1
                        o["notes"].append(f"rank {r} ({target}, {entry['what']}): {msg[:300]}")
                    worst = max(worst, err["seconds"])
                    if entry[target + "_changed"]:
                        o["changed"] = 1
                        o["notes"].append(f"rank {r}: the refused load changed the {target} state ({entry['what']})")
            o["detection"] = worst
            outs.append(o)
        for r, res in results.items():
            if res.get("intact_loads") is not True:
                outs[0]["unnamed"] = 1
                outs[0]["notes"].append(f"rank {r}: the intact checkpoint did not load: {res.get('intact_loads')}")
        if len({res.get("params") for res in results.values()}) > 1:
            outs[0]["silent"] = 1
            outs[0]["notes"].append("the ranks ended with different parameters after the refused loads")
        if len(results) < world:
            for o in outs:
                o["hang"] = max(o["hang"], int(bool(run["hung"])))
        return outs, extra
    if job["type"] == "resume":
        outs = []
        any_res = next(iter(results.values()), None)
        failed = [(r, res["error"]) for r, res in results.items() if res.get("checkpoint_failed")]
        if failed:
            r, err = failed[0]
            for cut in job["cuts"]:
                o = outcome("resume-" + ("warm-up" if cut <= any_res.get("warmup", 0) else "steady"), hang=int(base["hang"]), crash=len(crashed),
                            notes=notes + [f"rank {r}: state_dict() raised after step {err['step'] - 1}, so no checkpoint: {err['msg'][:300]}"])
                o["unnamed"] = 1
                outs.append(o)
                extra.append(("resumed", f"{describe(job['cfg'])}: {o['kind']}"))
            return outs, extra
        for cut in job["cuts"]:
            label = resume_label(job, any_res, cut) if any_res else "resume-?"
            # Resumed before "auto" (named, or the measured choice's sparse
            # path) made its first library call, the run measures the link
            # itself, as a fresh run does, and its algorithms follow that
            # measurement: neither it nor a second uninterrupted run is the
            # first one bitwise (docs/pytorch-details.md). Where it chose other
            # algorithms, it must still take the same paths and end alike on
            # every rank; where it chose the same, it is compared bitwise.
            before_auto = bool(any_res) and job["cfg"]["front"] in ("ddp", "fsdp") and \
                job["cfg"].get("state", {}).get("algorithm") in (None, "auto") and \
                not any(a for g, a in any_res["whole"].get("algorithms", {}).items() if int(g) < cut)
            o = outcome(label, hang=int(base["hang"]), crash=len(crashed), notes=list(notes))
            if any_res:
                paths = any_res["whole"]["paths"]
                o["at"] = (paths.get(str(cut - 1)), paths.get(str(cut)))  # the paths of the steps before and after the cut
            for r, res in results.items():
                entry = res["resumed"].get(str(cut))
                whole = res["whole"]
                if entry is None:
                    o["notes"].append(f"rank {r}: not run (an earlier cut failed)")
                    o["unnamed"] = max(o["unnamed"], 0)
                    continue
                if entry.get("error"):
                    o["unnamed"] = 1
                    o["notes"].append(f"rank {r} resumed at {cut} raised at step {entry['error']['step']}: {entry['error']['msg'][:300]}")
                    continue
                differ = []
                tail = {g: p for g, p in whole["paths"].items() if int(g) >= cut}
                if entry["paths"] != tail:
                    first = min((int(g) for g in tail if entry["paths"].get(g) != tail[g]), default=None)
                    differ.append(f"paths from step {first} ({entry['paths'].get(str(first))} for {tail.get(str(first))})")
                algos = {g: a for g, a in whole.get("algorithms", {}).items() if int(g) > cut}  # the first resumed step: new counters
                theirs = {g: a for g, a in entry.get("algorithms", {}).items() if int(g) > cut}
                remeasured = before_auto and not differ and algos != theirs
                if remeasured:
                    o["notes"].append(f"rank {r} resumed at step {cut}, before auto's first call: other algorithms "
                                      f"(compared across the ranks, not with the uninterrupted run)")
                elif not differ and algos != theirs:
                    first = min(int(g) for g in set(algos) | set(theirs) if algos.get(g) != theirs.get(g))
                    differ.append(f"library algorithms from step {first} ({theirs.get(str(first))} for {algos.get(str(first))})")
                if entry["params"] != whole["params"] and not remeasured:
                    differ.append("parameters")
                if whole["mass"] != entry["mass"] and not remeasured:
                    differ.append("residuals")
                if differ:
                    o["silent"] = 1
                    o["notes"].append(f"rank {r} resumed at step {cut}: {', '.join(differ)} differ from the uninterrupted run's")
            resumed = [res["resumed"][str(cut)] for res in results.values() if res["resumed"].get(str(cut), {}).get("params")]
            if before_auto and len({entry["params"] for entry in resumed}) > 1:  # (equal to the whole run's where not remeasured)
                o["silent"] = 1
                o["notes"].append(f"resumed at step {cut}, before auto's first call: the ranks ended with different parameters")
            outs.append(o)
            extra.append(("resumed", f"{describe(job['cfg'])}: {label}" + (" (before auto's first call)" if before_auto else "")))
        return outs, extra
    raise ValueError(kind)


def resume_label(job, res, cut):
    """What kind of step the first resumed step (``cut``) is, from the
    uninterrupted run's paths and the choice saved at the cut."""
    warm = res.get("warmup", 0)
    if cut <= warm and job["cfg"]["front"] != "demo":
        return "resume-warm-up"
    paths = res["whole"]["paths"]
    choice = res.get("choice_at", {}).get(str(cut))
    here, before = paths.get(str(cut)), paths.get(str(cut - 1))
    if choice is None:
        return "resume-steady"
    s = cut - warm
    if before is not None and here != before and before != "warm-up":
        return "resume-switch"
    if choice["confirm_at"] is not None and s <= choice["confirm_at"]:
        return "resume-confirmation"
    due = choice["chosen"] is None and s in (4, 8) or choice["decided_at"] is not None and s == choice["decided_at"] + 8 + 4
    if due:
        return "resume-decision"
    if choice["chosen"] is None or here != choice["chosen"]:
        return "resume-probe"
    return "resume-steady"


# -- the plugin's findings -------------------------------------------------
#
# Failures the campaign found in the plugin, by the signature of their
# notes; tests/chaos_torch/repro.py reproduces each alone.

FINDINGS = [
    ("warmup-adam", "A run under AdamW resumed from a checkpoint saved at the end of the warm-up probes sparse, not bf16 or quantized: "
                    "the ranks agree on the optimizer family at the first step after the warm-up, and the resumed process has not seen "
                    "its optimizer step by then; from the next decision on every step is native. The resumed run's paths and "
                    "parameters differ from the uninterrupted run's."),
    ("warmup-timing", "The measured choice resumed from a checkpoint saved in the warm-up loses the last warm-up step's time (taken "
                      "at the first bucket of the step after it, and a resumed process does not time its own first step), so where "
                      "the sparse probe wins clearly (a slow link) the resumed run probes native for 4 steps instead of choosing "
                      "sparse at once: other paths, other parameters."),
    ("nan-one-group", "A NaN or Inf in one group's gradient (one DDP bucket of several; one FSDP2 module of several) skips that group "
                      "on every rank, and the script skips the optimizer step, but the other groups were reduced: their library "
                      "residuals and thresholds, quantized residuals and velocities advanced on a step that did not happen, and what "
                      "they sent is lost (docs: the velocity and residual stay as they were)."),
    ("switch-fold", "A run resumed from a checkpoint saved just before a step that switches from sparse to native (DDP hook or "
                    "FSDP2) does not fold the residuals into that native step: the fold needs the communicator, which a resumed "
                    "process makes only at its first sparse step, so the residuals wait (until the next sparse probe, recheck_every "
                    "steps later, or for good once only native steps remain): other parameters, other residuals, same paths."),
    ("auto-remeasure", "With algorithm='auto' the library chooses each call's algorithm from a link measurement that each "
                       "communicator makes at its first call and the checkpoint does not carry: a resumed run measures again and, where "
                       "two candidates' predicted times are close (here tiny buckets: dense_ring against topka, the 5% rule), chooses "
                       "others, so it is not the uninterrupted run bitwise. Timing-dependent: replay the job (it failed 3 times of 3 "
                       "at some cut), not repro.py. The measured choice's sparse path is 'auto' too."),
    ("no-state", "state_dict() raises OkTopkError ('tensor ... has no state yet') with a named dense algorithm (every step after "
                 "the warm-up) and after a NaN or Inf at the first sparse step (until the next sparse step): no checkpoint there."),
]


def classify(o, job):
    """The finding a failed outcome is an instance of, or None."""
    text = " ".join(o["notes"])
    if "has no state yet" in text:
        return "no-state"
    if o["kind"] in ("nan", "inf") and o["changed"] and not o["silent"] and not o["unnamed"]:
        return "nan-one-group"
    if o["kind"].startswith("resume") and o["silent"] and not o["unnamed"]:
        if re.search(r"paths from step \d+ \(sparse for (bf16|quantized)\)", text) and job["cfg"].get("optimizer") == "adamw":
            return "warmup-adam"
        if o["kind"] == "resume-warm-up" and re.search(r"\(native for (sparse|bf16|quantized)\)", text) and \
                job["cfg"].get("schedule") == "sparse-then-native":
            return "warmup-timing"
        if "paths from" not in text and o.get("at") == ("sparse", "native"):
            return "switch-fold"
        if "paths from" not in text and "library algorithms from step" in text:
            return "auto-remeasure"
    return None


# -- the report --------------------------------------------------------------

def failed(o):
    return bool(o["hang"] or o["crash"] or o["silent"] or o["unnamed"] or o["changed"] or o.get("harness"))


def fmt_seconds(v):
    return "–" if v is None else f"{v:.2f} s"


def report(args, jobs, outcomes, extras, wall, failures, failed_jobs, python):
    rows = defaultdict(lambda: {"count": 0, "hang": 0, "crash": 0, "silent": 0, "unnamed": 0, "changed": 0, "detection": None})
    for o in outcomes:
        row = rows[o["kind"]]
        row["count"] += 1
        for k in ("hang", "crash", "silent", "unnamed", "changed"):
            row[k] += 1 if o[k] else 0
        if o["detection"] is not None:
            row["detection"] = max(row["detection"] or 0.0, o["detection"])
    total = {"count": 0, "hang": 0, "crash": 0, "silent": 0, "unnamed": 0, "changed": 0, "detection": None}
    for row in rows.values():
        for k in ("count", "hang", "crash", "silent", "unnamed", "changed"):
            total[k] += row[k]
        if row["detection"] is not None:
            total["detection"] = max(total["detection"] or 0.0, row["detection"])
    lines = ["# PyTorch plugin fault campaign", ""]
    worlds = Counter(j["world"] for j in jobs)
    lines.append(f"Seed {args.seed}, {len(outcomes)} faults injected in {len(jobs)} jobs "
                 f"({', '.join(f'{n} of {w} ranks' for w, n in sorted(worlds.items()))}), real gloo process groups over real rank processes "
                 f"(CPU, tiny models); plugin timeout {PLUGIN_TIMEOUT:g} s, the jobs' gloo timeout {PG_TIMEOUT:g} s "
                 f"({MISMATCH_PG_TIMEOUT:g} s for the mismatches, which the plugin must name within {MISMATCH_BOUND:g} s), "
                 f"a hang is a rank not returned {HANG_AFTER_FAULT:g} s after a kill or stop or past the job's bound; "
                 f"{wall // 60:.0f}:{wall % 60:02.0f} min.")
    lines.append(f"Fronts: the DDP hook (the measured choice under SGD, SGD with momentum and AdamW with bf16, fp16 or quantized, and named "
                 f"algorithms), FSDP2 (oktopk.fsdp) and oktopk.optim.DeMo; elastic restarts of whole torchrun groups; on_rank_loss=\"continue\" runs going on without a lost rank.")
    if args.smoke:
        made = f"make chaos-torch-smoke CHAOS_TORCH_SEED={args.seed}"
        one = f"tests/chaos_torch/campaign.py --smoke --seed {args.seed} --job N -v"
    else:
        out = f" CHAOS_TORCH_OUT={os.path.relpath(os.path.abspath(args.out), ROOT)}" if args.out else ""
        made = f"make chaos-torch CHAOS_TORCH_SEED={args.seed} CHAOS_TORCH_FAULTS={args.faults}{out}"
        one = f"make chaos-torch CHAOS_TORCH_SEED={args.seed} CHAOS_TORCH_FAULTS={args.faults} CHAOS_TORCH_FLAGS='--job N -v'"
    if args.custom or args.kinds or args.job:
        made = f"tests/chaos_torch/campaign.py {' '.join(sys.argv[1:])}"
    lines.append(f"Made by `{made}` (seeded: the same command replays it); one job again: `{one}`.")
    lines += ["", "| fault | count | hangs | crashes | silent divergences | unnamed errors | state changed | max detection |",
              "|---|---|---|---|---|---|---|---|"]
    kinds = [k for k in KIND_ORDER if k in rows] + sorted(k for k in rows if k not in KIND_ORDER)
    for k in kinds:
        r = rows[k]
        lines.append(f"| {k} | {r['count']} | {r['hang']} | {r['crash']} | {r['silent']} | {r['unnamed']} | {r['changed']} | "
                     f"{fmt_seconds(r['detection'])} |")
    t = total
    lines.append(f"| **total** | {t['count']} | {t['hang']} | {t['crash']} | {t['silent']} | {t['unnamed']} | {t['changed']} | "
                 f"{fmt_seconds(t['detection'])} |")
    lines += ["", "Max detection: for a kill or stop, from the signal to the last surviving rank's failing return; for a mismatch, "
                  "the failing step's duration; for a NaN or Inf, the poisoned step's duration; for a corrupted checkpoint, the refused "
                  "load's. Silent divergence: a run that went on where it had to fail (a mismatch or corruption accepted, a dead peer "
                  "not noticed), ranks that ended with different parameters, a poisoned step that was finite on a rank, or a resumed "
                  "run that differs from the uninterrupted one. Unnamed error: an error of another type than OkTopkError, ValueError "
                  "or RuntimeError, or whose message names neither the setting nor the fault, or an error where none was due. State "
                  "changed: residuals, thresholds, quantized residuals or velocities (DeMo: its momentum and parameters) that a skipped, "
                  "failed or refused step changed."]
    by = defaultdict(Counter)
    for label, value in extras:
        by[label][value] += 1
    if by.get("landed"):
        lines += ["", "Where the kills, stops, NaNs and Infs landed (the path of the step they hit; FSDP2 and DeMo included):", "",
                  "| fault in path | count |", "|---|---|"]
        for v, n in sorted(by["landed"].items()):
            lines.append(f"| {v} | {n} |")
    if by.get("setting"):
        lines += ["", "Mismatched settings (one rank holds the other value; every rank must name it):", "", "| front: setting | count |",
                  "|---|---|"]
        for v, n in sorted(by["setting"].items()):
            lines.append(f"| {v} | {n} |")
    if by.get("resumed"):
        lines += ["", "Resumes by configuration and step kind:", "", "| configuration: step kind | count |", "|---|---|"]
        for v, n in sorted(by["resumed"].items()):
            lines.append(f"| {v} | {n} |")
    if by.get("elastic seconds"):
        seconds = sorted(v for v, n in by["elastic seconds"].items() for _ in range(n))
        lines += ["", f"Elastic jobs: {len(seconds)}, each a whole torchrun run with its restarts, {seconds[0]:.1f}-{seconds[-1]:.1f} s "
                      f"(median {seconds[len(seconds) // 2]:.1f} s), against one uninterrupted run per size and density."]
    fronts = Counter(describe(j["cfg"]) for j in jobs)
    lines += ["", "Jobs per configuration:", "", "| configuration | jobs |", "|---|---|"]
    for v, n in sorted(fronts.items()):
        lines.append(f"| {v} | {n} |")
    lines += ["", "## How", "",
              "- Each rank is a process of its own (tests/chaos_torch/worker.py) that imports torch and oktopk once; a session of 2 or "
              "3 of them serves job after job, each job on a gloo process group of its own (`dist.new_group`), and ends when a job "
              "kills or stops one of its ranks (or its ranks ended a job unalike); the campaign starts the next session while the job "
              "before runs. Only the plugin's public API is used.",
              "- The measured choice times whole steps. So that a resumed run meets the same decisions as the uninterrupted one "
              "whatever the machine's load, the loop sleeps after each step by its path (a schedule: 0.3 s against a few ms of work), "
              "which sets where the probes, decisions, confirmations and switches fall; the table of resumes names the step kind "
              "each checkpoint was taken before, from the uninterrupted run's paths and the choice it saved.",
              "- Resumes run on 2 ranks: at 3, a float sum over the ranks depends on where a value sits in its bucket, and a "
              "resumed process's first step runs in DDP's provisional bucket layout, so plain DDP (no hook) does not resume bitwise "
              "at 3 ranks either (measured: a one-bucket model resumed after step 1 or 3 ends with other bits); that is torch's, "
              "not the plugin's.",
              "- A kill's or stop's victim waits at the start of its step for the campaign's go, which then signals it 0-20 ms later.",
              "- An elastic job is a whole run of examples/pytorch/elastic.py under torchrun's elastic agent (c10d rendezvous, a store "
              "per attempt), not a session's: the script kills its own victims after their forward, in the step and attempt the plan "
              "names, and every rank's final parameters are compared with one uninterrupted run of the same size and density. At 3 "
              "ranks too: a resumed attempt's steps are sparse (the checkpoints fall after the 2-step warm-up), and the library's "
              "reductions do not depend on DDP's bucket layout.",
              "", "## Fault kinds", ""]
    for k in kinds:
        if k in KIND_TEXT:
            lines.append(f"- {k}: {KIND_TEXT[k]}")
    lines.append("")
    infos = [f"job {o['job']} ({o['kind']}): {o['info']}" for o in outcomes if o.get("info")]
    if infos:
        lines += [f"Seen, not counted ({len(infos)}): after a failed step the plugin promises a raise, the velocities (DeMo: its "
                  f"momentum and parameters) as they were, and a restart from a checkpoint saved on every rank at the same step "
                  f"(docs/pytorch-details.md, Failures); what else the failed step left changed:", ""]
        lines += [f"- {i}" for i in infos[:40]]
        if len(infos) > 40:
            lines.append(f"- ... and {len(infos) - 40} more")
        lines.append("")
    found = Counter(o.get("finding") for o in outcomes if o.get("finding"))
    unclassified = sum(1 for o in outcomes if failed(o) and not o.get("finding"))
    if found or unclassified:
        lines += ["## Findings", "", "The failures above, by what in the plugin they come from; each reproduces alone with the plugin's "
                  "public API: `PYTHONPATH=plugins/pytorch OMP_NUM_THREADS=1 $(make -s print-py) tests/chaos_torch/repro.py CASE`.", "",
                  "| finding (repro.py CASE) | faults failed | what |", "|---|---|---|"]
        for name, text in FINDINGS:
            if found.get(name):
                lines.append(f"| {name} | {found[name]} | {text} |")
        if unclassified:
            lines.append(f"| (unclassified) | {unclassified} | see the failures below |")
        lines.append("")
    if failures:
        lines.append(f"## Failures ({len(failures)})")
        lines.append("")
        for f in failures:
            lines.append(f"- {f}")
        lines.append("")
    else:
        lines.append("No failures.")
        lines.append("")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--faults", type=int, default=200)
    ap.add_argument("--smoke", action="store_true", help="make test's slice: one job of every kind")
    ap.add_argument("--kinds", default=None, help="comma-separated job kinds (" + ", ".join(JOB_WEIGHTS) + ")")
    ap.add_argument("--job", type=int, action="append", help="run only job N of the plan (repeatable)")
    ap.add_argument("--out", default=None, help="write the report here")
    ap.add_argument("--logs", default=os.path.join(ROOT, "build", "chaos-torch-logs"), help="the failing jobs' rank logs")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--budget", type=float, default=0, help="fail if the campaign takes longer (seconds; 0: no bound)")
    ap.add_argument("--plan", action="store_true", help="print the plan and exit")
    ap.add_argument("--custom", default=None, help="run the jobs of this file (JSON lines, as --plan prints them) instead")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    kinds = args.kinds.split(",") if args.kinds else None
    if args.custom:
        with open(args.custom) as f:
            jobs = [dict(json.loads(line), id=n) for n, line in enumerate(f) if line.strip()]
    else:
        jobs = smoke_plan(args.seed) if args.smoke else plan(args.seed, args.faults, kinds)
    if args.plan:
        for j in jobs:
            print(json.dumps(j))
        return 0
    selected = [j for j in jobs if args.job is None or j["id"] in args.job]
    start = time.monotonic()
    os.makedirs(args.logs, exist_ok=True)
    for old in os.listdir(args.logs):
        if old.startswith("job"):
            shutil.rmtree(os.path.join(args.logs, old), ignore_errors=True)
    scratch = tempfile.mkdtemp(prefix="chaos-torch-")
    session_logs = os.path.join(args.logs, "sessions")
    shutil.rmtree(session_logs, ignore_errors=True)
    os.makedirs(session_logs)
    sessions = Sessions(args.python, session_logs, scratch)
    # The jobs that keep their session first (grouped by world size), then
    # those that end it, each on a session started while the one before ran.
    order = sorted(selected, key=lambda j: (j["kind"] in ("sigkill", "sigstop"), j["world"], j["id"]))
    outcomes, extras, failures, failed_jobs = [], [], [], []
    try:
        for n, job in enumerate(order):
            run = run_job(sessions, job, args.verbose, order[n + 1] if n + 1 < len(order) else None)
            outs, extra = judge(job, run)
            for o in outs:
                o["job"] = job["id"]
                if failed(o):
                    o["finding"] = classify(o, job)
            outcomes += outs
            extras += extra
            bad = [o for o in outs if failed(o)]
            if bad:
                failed_jobs.append(job["id"])
                keep = os.path.join(args.logs, f"job{job['id']}")
                os.makedirs(keep, exist_ok=True)
                for log in run.get("logs", []):
                    if os.path.exists(log):
                        shutil.copy(log, keep)
                for o in bad:
                    what = [k for k in ("hang", "crash", "silent", "unnamed", "changed") if o[k]]
                    if o.get("harness"):
                        what.append("harness: " + o["harness"])
                    tag = f" [finding {o['finding']}]" if o.get("finding") else ""
                    failures.append(f"job {job['id']} ({o['kind']}, {describe(job['cfg'])}, {job['world']} ranks){tag}: "
                                    f"{', '.join(what)}: {'; '.join(o['notes'])[:1200]} (rank logs: {os.path.relpath(keep, ROOT)})")
                print(("  FAILED: " if args.verbose else f"job {job['id']:3d} {job['kind']:16s} FAILED: ") + failures[-1], flush=True)
            elif not args.verbose:
                print(f"job {job['id']:3d} {job['kind']:16s} {len(outs)} fault(s) ok  ({run.get('elapsed', 0):.1f} s)", flush=True)
    finally:
        sessions.close()
        shutil.rmtree(scratch, ignore_errors=True)
    wall = time.monotonic() - start
    if args.budget and wall > args.budget:
        failures.append(f"the campaign took {wall:.0f} s, over its budget of {args.budget:.0f} s")
    text = report(args, selected, outcomes, extras, wall, failures, failed_jobs, args.python)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
