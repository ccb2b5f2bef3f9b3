"""The default path: the framework's own dense allreduce or the sparse one,
chosen from the measured time of a training step.

A sparse step sends about 1% of the gradient but costs selection passes and
makes less progress than a dense one; on a fast link (NCCL on NVLink, or
loopback) the framework's allreduce is faster, on a slow one sparse wins by
far. No cost model of one call sees what the user waits for: backward, the
reduction overlapped with it, and the optimizer competing for the same cores
and memory bandwidth. So the front ends time whole steps and choose.

The schedule, in steps after the dense warm-up (``s`` = 0, 1, ...):

1. Explore: ``PROBE_STEPS`` steps sparse. If the front end timed its last
   warm-up step (native) and the sparse probe's steps took at most
   ``CLEAR_WIN`` of it, a clear win, no step noise explains that (a slow
   link): sparse is chosen at once (and confirmed as in 3), sparing a
   native probe whose steps there take seconds and, on the way to a
   compressed dense path, send float32. Otherwise ``PROBE_STEPS`` steps
   native.
2. Decide (at the first bucket of the next step): every rank times each
   step from its first bucket to the next step's first bucket (its whole
   reduction, the optimizer and the next forward; the first step of each
   run of one path is left out, since it pays the switch). Its medians per
   path are agreed across the ranks by a max, so every rank decides from the
   same figures, the slowest rank's. Sparse is chosen only if it saves
   ``margin`` (default 10%) of the native step: a dense step is exact, a
   sparse one leaves most of the gradient waiting in the residual.
3. Confirm a switch: a probe's few steps can be lucky where steps are
   noisy (ranks sharing cores), so a decision for sparse, or one that
   leaves the chosen path, holds only if the new path's own next
   ``MEASURE_STEPS`` steps still meet the rule against the figure it beat;
   otherwise the old path returns at once, with no probe.
4. Run the choice for ``recheck_every`` steps, then probe the other path for
   ``PROBE_STEPS`` steps and decide again from those and the chosen path's
   latest ``MEASURE_STEPS`` steps (links and loads change), confirming a
   switch as in 3. A recheck that keeps the choice doubles the period
   before the next one, up to ``MAX_BACKOFF`` times ``recheck_every``
   (TCP's retransmission timer backs off the same way); a switch starts it
   over, and a clear win (1.) starts one doubling in, as if a recheck had
   already kept it. Each probe of native sends float32 where the
   compressed path sends a few bits (under Adam about 0.14 of the bytes):
   with a fixed period a long run would send about 0.158 of plain DDP's
   bytes instead of 0.141, and a 400-step run chosen on a clear win would
   spend 4 of its steps on the first recheck's float32. Exploration costs
   ``PROBE_STEPS`` steps a probe: by default 4 in the 204 steps after a
   decision (2%), 4 in 404 (1%) after a clear win, 4 in 1,604 (0.25%) once
   the period has reached its longest; and a switch that is not confirmed
   its ``MEASURE_STEPS``.

An Adam-family optimizer stepping the parameters (``oktopk.optimizers``)
takes sparse out of the choice: the ranks agree on whether any of them saw
one before the first sparse probe (step 0) and at every decision and
confirmation. Seen at step 0, the schedule above runs with the front
end's compressed dense path in sparse's place (DDP and FSDP2, their
``dense_compression``): ``QUANTIZED``, every value every step in a few
bits with error feedback (``oktopk.quantized``), or ``BF16``, the process
group's allreduce in bfloat16 (half the bytes, a value's 8-bit mantissa
rounded as in torch's ``bf16_compress_hook``); neither sends a coordinate's
gradient in bursts as top-k does. Seen later (no warm-up step: the
optimizer had not stepped yet), or where the front end offers no such path
(Horovod, or ``dense_compression=None``), every step from then on is
native, with no more probes.

Under other optimizers (SGD) the early steps go the same way: for the
first ``sparse_after`` steps (``DEFAULT_SPARSE_AFTER``) the compressed
dense path stands in sparse's place, and at ``s = sparse_after`` sparse
joins, the schedule above starting over from there (its sparse probe
compared with native's latest agreed figure). Why: top-k's error feedback
delivers most of a coordinate's gradient some steps late, and early in
training that delay costs the most: at 1% a 100-step MLP ended 3.5 points
below plain DDP, and VGG-16 left its first plateau about 90 steps later
(results/sgd.md, results/frameworks.md). Every value every step in 4 bits
holds dense's accuracy there; the run then goes sparse, where top-k's
bytes (about a seventh of the 4-bit path's) matter over its length. Where
the front end has no compressed dense path (Horovod, or
``dense_compression=None``) sparse is measured from the first step.

The path of every step is a function of ``s`` and of agreed decisions only,
so every rank takes the same path whatever its own clock says; the decision
state is checkpointed, and a resumed run continues it.
"""

import os
import statistics
import time

from .paths import DENSE_COMPRESSIONS, NATIVE, SPARSE
from .paths import PATHS as _WAYS

# The ways to reduce, by name (oktopk.paths): the two sides of the choice,
# native (the process group's allreduce, residual folded in first) and
# sparse (the library's sparse allreduce), and the dense ways that take
# sparse's place under an Adam-family optimizer (dense_compression).
PATHS = tuple(_WAYS)
BF16 = _WAYS["bf16"].name  # the process group's allreduce of bfloat16 values, the default there
QUANTIZED = _WAYS["quantized"].name  # oktopk.quantized: a few bits per value, error feedback

PROBE_STEPS = 4  # steps of a probe of the path not chosen
# A clear win: the candidate's probe at most this share of the one timed
# warm-up step, so that it still saves the margin were that step 1.5 times
# its usual time (the slowest of 20 measured ran 1.39 times their median;
# results/text.md, "A clear win at 60%").
CLEAR_WIN = 0.6
MEASURE_STEPS = 12  # steps of a confirmation, and of the chosen path's figure at a recheck
DEFAULT_MARGIN = 0.10
DEFAULT_RECHECK_EVERY = 200
MAX_BACKOFF = 8  # the longest period between probes, in recheck_every's
DEFAULT_SPARSE_AFTER = 100  # the early steps, after the warm-up, in which sparse waits (StepChoice's sparse_after)


def check_choice(margin, recheck_every):
    """The choice's settings, checked; ValueError naming the bad one."""
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0.0 <= margin < 1.0:
        raise ValueError(f"sparse_margin must be a number in [0, 1), got {margin!r}")
    if isinstance(recheck_every, bool) or not isinstance(recheck_every, int) or recheck_every < 2 * PROBE_STEPS:
        raise ValueError(f"recheck_every must be an integer >= {2 * PROBE_STEPS}, got {recheck_every!r}")
    return float(margin), int(recheck_every)


def check_sparse_after(sparse_after):
    """The early steps' length, checked; ValueError naming it."""
    if isinstance(sparse_after, bool) or not isinstance(sparse_after, int) or sparse_after < 0:
        raise ValueError(f"sparse_after must be an integer >= 0, got {sparse_after!r}")
    return int(sparse_after)


def check_dense_compression(dense_compression, name="dense_compression"):
    """A front end's compressed dense path (in sparse's place under an
    Adam-family optimizer, or the warm-up's), checked; ValueError naming
    the choices."""
    if dense_compression is not None and dense_compression not in DENSE_COMPRESSIONS:
        choices = ", ".join(repr(n) for n in DENSE_COMPRESSIONS)
        raise ValueError(f"{name} must be one of {choices} or None, got {dense_compression!r}")
    return dense_compression


def debug_enabled():
    return os.environ.get("OKTOPK_DEBUG_AUTO") == "1"


class StepChoice:
    """Which path each step after the warm-up takes, and the measurements
    behind it. The front end sets ``agree(values)``: its max-allreduce of
    a list of floats over its ranks (-1.0 stands for "not measured").
    ``clock`` returns seconds (tests give each rank a noisy one)."""

    def __init__(self, margin=DEFAULT_MARGIN, recheck_every=DEFAULT_RECHECK_EVERY, adam_candidate=None, sparse=True, sparse_after=0):
        self.margin, self.recheck_every = check_choice(margin, recheck_every)
        self.adam_candidate = check_dense_compression(adam_candidate)  # the front end's path in sparse's place under Adam, or None
        if not sparse and self.adam_candidate is None:
            raise ValueError("sparse=False needs a compressed dense path to measure against native")
        # The early steps: the compressed dense path in sparse's place until
        # step sparse_after (0: none; only where sparse is measured and the
        # front end has such a path).
        self.sparse_after = check_sparse_after(sparse_after) if sparse and self.adam_candidate is not None else 0
        self.agree = None
        self.log = None  # the front end's logger of decisions (rank 0 with OKTOPK_DEBUG_AUTO=1)
        self.clock = time.perf_counter
        # The front end's view of this rank's optimizer: a function returning
        # the name of an Adam-family optimizer that steps the parameters, or
        # None (oktopk.optimizers).
        self.adam_seen = lambda: None
        # The Adam-family optimizer the ranks agreed on: every step dense.
        self.kept_dense_for = None
        # The path measured against native: SPARSE; adam_candidate or None
        # (native only) once an Adam-family optimizer is agreed on.
        # sparse=False: the compressed dense path under every optimizer.
        self.candidate = SPARSE if sparse and not self.sparse_after else self.adam_candidate
        self.origin = 0  # the step the first decision's schedule counts from: sparse_after once sparse joins
        self.chosen = None  # None until the first decision
        self.decided_at = None  # the step s of the latest decision
        self.period = self.recheck_every  # steps of the chosen path from decided_at to its next probe
        self.max_backoff = MAX_BACKOFF
        self.confirm_at = None  # the step s that confirms the latest decision, a switch, or None
        self.ms = dict.fromkeys(PATHS)  # the agreed ms per step of the latest decision
        self.steps = dict.fromkeys(PATHS, 0)  # steps run on each path
        self.explored = 0  # of them, steps on a path that the decision after them did not keep
        self.decisions = 0
        self.reverted = 0  # switches their own steps did not confirm
        self.reason = "exploring: no decision yet"
        # This rank's own timings: s -> seconds of step s, for recent steps.
        self._seconds = {}
        self._started = None  # (s, clock, timed) at the latest step's first bucket
        self._unfinished = None  # (s, seconds so far) of a loaded checkpoint's step under way, until resume_timing
        # (_started, [s, seconds so far]): the step under way as the first
        # checkpoint since its first bucket saved it. Every checkpoint until
        # the next step's first bucket holds the same, so that two saves
        # between the same steps are equal (and a save right after a load
        # holds what was loaded).
        self._saved_so_far = None

    # -- the schedule --------------------------------------------------------

    @property
    def measure(self):
        """The steps of a confirmation and of the chosen path's figure at a
        recheck: MEASURE_STEPS, fewer when the period between probes is
        shorter than that and a probe."""
        return min(MEASURE_STEPS, self.recheck_every - PROBE_STEPS)

    def due(self, s):
        """Whether step s begins with a decision (or a confirmation)."""
        if self.candidate is None:
            return False
        if self.chosen is None:
            return s - self.origin in (PROBE_STEPS, 2 * PROBE_STEPS)  # after the candidate's probe, after the native one
        if self.confirm_at is not None:
            return s == self.confirm_at
        return s == self.decided_at + self.period + PROBE_STEPS

    def path(self, s):
        """The path of step s, the same on every rank (after any decision
        due at s)."""
        if self.candidate is None:
            return NATIVE
        if self.chosen is None:
            return self.candidate if s - self.origin < PROBE_STEPS else NATIVE
        if s < self.decided_at + self.period:
            return self.chosen
        return self.other(self.chosen)

    def other(self, path):
        return self.candidate if path == NATIVE else NATIVE

    def _windows(self, s):
        """(native steps, candidate steps) whose timings decide at step s:
        the warm-up's last step (s = -1) or the native probe, and the
        candidate's probe; or a probe and the chosen path's latest steps; each run's
        first step left out."""
        if self.chosen is None:
            o = self.origin
            native = range(o - 1, o) if s - o == PROBE_STEPS else range(o + PROBE_STEPS + 1, o + 2 * PROBE_STEPS)
            return native, range(o + 1, o + PROBE_STEPS)
        probe = range(s - PROBE_STEPS + 1, s)
        kept = range(s - PROBE_STEPS - self.measure + 1, s - PROBE_STEPS)
        return (kept, probe) if self.chosen == NATIVE else (probe, kept)

    def _backed_off(self, period):
        """The period after a recheck that kept the choice: doubled, up to
        ``max_backoff`` times ``recheck_every``."""
        return min(2 * period, self.max_backoff * self.recheck_every)

    def _candidate_wins(self, native_ms, candidate_ms):
        return candidate_ms < (1.0 - self.margin) * native_ms

    # -- measuring and deciding ----------------------------------------------

    def time_warmup_step(self):
        """At the first bucket of the last native warm-up step: time it, as
        step -1, until the next step's first bucket (``begin_step`` at the
        first step after the warm-up, else ``end_warmup_step``)."""
        self._started = (-1, self.clock(), True)

    def end_warmup_step(self):
        """At the first bucket of the warm-up step after the timed one (a
        compressed warm-up's, whose steps are not native): the timed step
        ends here, not with the warm-up."""
        if self._started is not None and self._started[0] == -1:
            if self._started[2]:
                self._seconds[-1] = self.clock() - self._started[1]
            self._started = None

    def leave_out(self, seconds):
        """Leave ``seconds`` just spent (the front end's agreement on the
        settings) out of the time of the step under way."""
        if self._started is not None:
            s, started, timed = self._started
            self._started = (s, started + seconds, timed)

    def begin_step(self, s, untimed=False):
        """At the first bucket of step s: time the step before it (when it
        was s - 1), then decide if one is due; returns the path of s. Every
        rank calls it at the same steps. ``untimed``: this step's time says
        nothing of its path (a resumed run's first, in DDP's provisional
        bucket layout)."""
        now = self.clock()
        if self._started is not None and self._started[0] == s:
            # Step s again: it came back void (a NaN skipped it) and does
            # not count. Its decision stands; its time starts anew.
            self._started = (s, now, not untimed)
            return self.path(s)
        if self._started is not None and self._started[0] == s - 1 and self._started[2]:
            self._seconds[s - 1] = now - self._started[1]
        self._started = (s, now, not untimed)
        for old in [k for k in self._seconds if k < s - 2 * (self.measure + PROBE_STEPS)]:
            del self._seconds[old]
        if self.chosen is None and s == 0 and self.kept_dense_for is None:
            self._agree_on_optimizer(s, self.agree([self._adam_flag()])[0])
        if s == self.sparse_after and self.candidate == self.adam_candidate and self.kept_dense_for is None and s > 0:
            self._let_sparse_in(s)
        if self.due(s):
            if self.confirm_at is not None:
                self._confirm(s)
            else:
                self._decide(s)
        path = self.path(s)
        self.steps[path] += 1
        if self.chosen is not None and path != self.chosen:
            self.explored += 1
        return path

    def _let_sparse_in(self, s):
        """At step ``sparse_after``: the early steps are over, and the sparse
        path takes the compressed dense path's place in the choice. The
        schedule starts over from s: a sparse probe, chosen at once on a
        clear win over native's latest agreed figure, else a native probe."""
        self.candidate, self.origin = SPARSE, s
        self.chosen, self.decided_at, self.confirm_at, self.period = None, None, None, self.recheck_every
        self.reason = f"step {s}: the early steps are over; probing sparse"
        if self.log is not None:
            self.log(f"oktopk: step {s} after the warm-up: the early steps (sparse_after={self.sparse_after}) are over: "
                     f"probing sparse against native")

    def _local_median(self, steps):
        seconds = [self._seconds[k] for k in steps if k in self._seconds]
        return statistics.median(seconds) * 1e3 if seconds else -1.0

    def _adam_flag(self):
        return 1.0 if self.adam_seen() is not None else 0.0

    def _agree_on_optimizer(self, s, flag):
        """Given the max over the ranks of the Adam flag, once: if any rank
        saw an Adam-family optimizer, sparse leaves the choice. At step 0,
        before the first probe, the front end's ``adam_candidate`` takes its
        place (returns False: the schedule goes on); otherwise every step
        from s on is native (returns True: the decision is made)."""
        if flag <= 0 or self.kept_dense_for is not None:
            return False
        self.kept_dense_for = self.adam_seen() or "an Adam-family optimizer (on another rank)"
        if s == 0 and self.chosen is None and self.adam_candidate is not None:
            self.candidate = self.adam_candidate
            self.reason = (f"{self.kept_dense_for} steps the parameters: dense on every step, "
                           f"native or {self.candidate} by measured step time (oktopk.optimizers)")
            return False
        if self.chosen is None:
            self.explored += min(s - self.origin, PROBE_STEPS)  # the candidate's probe's steps so far
        elif self.confirm_at is not None and self.chosen == SPARSE:
            self._count_undone_switch(s)
        self.candidate = None
        self.chosen, self.decided_at, self.confirm_at = NATIVE, s, None
        self.decisions += 1
        self.reason = f"{self.kept_dense_for} steps the parameters: native on every step (oktopk.optimizers)"
        self._log(s)
        return True

    def _log(self, s):
        if self.log is not None:
            until = "" if self.candidate is None else f" until step {self.decided_at + self.period}"
            self.log(f"oktopk: step {s} after the warm-up: {self.chosen}{until}: {self.reason}")

    def _decide(self, s):
        candidate = self.candidate
        native, probed = self._windows(s)
        native_ms, candidate_ms, adam = self.agree([self._local_median(native), self._local_median(probed), self._adam_flag()])
        if self._agree_on_optimizer(s, adam):
            return
        if self.chosen is None and s - self.origin == PROBE_STEPS:
            # After the candidate's probe: chosen at once only on a clear win
            # over the timed warm-up step (after the early steps: native's
            # latest agreed figure, the same on every rank); else the native
            # probe.
            if self.origin > 0 and self.ms[NATIVE] is not None:
                native_ms = self.ms[NATIVE]
            if native_ms > 0 and 0 <= candidate_ms <= CLEAR_WIN * native_ms:
                self.ms[NATIVE], self.ms[candidate] = native_ms, candidate_ms
                self.chosen, self.decided_at, self.confirm_at = candidate, s, s + self.measure
                # A win this clear counts as a recheck that kept the
                # choice: the back-off starts one doubling in.
                self.period = self._backed_off(self.recheck_every)
                self.decisions += 1
                self.reason = (f"{candidate} {candidate_ms:.1f} ms/step, at most {CLEAR_WIN:.0%} of the warm-up's native step "
                               f"({native_ms:.1f}): no native probe")
                self._log(s)
            elif self.log is not None:
                self.log(f"oktopk: step {s} after the warm-up: {candidate} probed at {candidate_ms:.1f} ms/step, not at most "
                         f"{CLEAR_WIN:.0%} of the warm-up's native step ({native_ms:.1f}; -1: not timed): probing native")
            return
        # The path a decision for the other must be confirmed against:
        # native before the first decision (preferred on a tie), then the
        # chosen one (measured over its latest steps, not a probe's few).
        incumbent = self.chosen or NATIVE
        if native_ms < 0 or candidate_ms < 0:
            # Not measured (a run resumed inside a probe): keep the choice,
            # probe again after the next period.
            chosen = incumbent
            self.reason = f"a path was not timed (a run resumed inside a probe); keeping {chosen}"
        elif self._candidate_wins(native_ms, candidate_ms):
            chosen = candidate
            self.reason = (f"{candidate} {candidate_ms:.1f} ms/step saves {1 - candidate_ms / native_ms:.0%} of native's "
                           f"{native_ms:.1f} (margin {self.margin:.0%})")
        else:
            chosen = NATIVE
            self.reason = (f"native {native_ms:.1f} ms/step; {candidate} {candidate_ms:.1f} would save "
                           f"{1 - candidate_ms / native_ms:.0%}, less than the margin {self.margin:.0%}")
        if native_ms >= 0 and candidate_ms >= 0:
            self.ms[NATIVE], self.ms[candidate] = native_ms, candidate_ms
        if self.chosen is None:
            # The first probe of the path not chosen was exploration too.
            self.explored += PROBE_STEPS
        # Backing off: a recheck that keeps the choice (a timed one) waits
        # twice as long for the next; a first decision or a switch starts over.
        # A recheck that timed nothing (resumed inside a probe) keeps the period.
        if self.chosen is None or chosen != self.chosen:
            self.period = self.recheck_every
        elif native_ms >= 0 and candidate_ms >= 0:
            self.period = self._backed_off(self.period)
        self.chosen, self.decided_at = chosen, s
        self.confirm_at = s + self.measure if chosen != incumbent else None
        self.decisions += 1
        self._log(s)

    def _count_undone_switch(self, s):
        """Exploration, for a switch undone at step s before its
        confirmation held: its steps since the decision; for the first
        decision, every candidate step so far (the native steps before it
        were not exploration after all)."""
        if self.decisions == 1:
            self.explored = self.steps[self.chosen]
        else:
            self.explored += s - self.decided_at

    def _confirm(self, s):
        """At step s, ``measure`` steps after a switch: keep the new path if
        its own steps still meet the rule against the figure it beat, else go
        back."""
        new, old = self.chosen, self.other(self.chosen)
        steps = range(self.decided_at + 1, s)
        new_ms, adam = self.agree([self._local_median(steps), self._adam_flag()])
        if self._agree_on_optimizer(s, adam):
            return
        self.confirm_at = None
        old_ms = self.ms[old]
        if new_ms < 0 or old_ms is None:
            return  # not timed (a resumed run): the decision stands
        native_ms, candidate_ms = (new_ms, old_ms) if new == NATIVE else (old_ms, new_ms)
        self.ms[new] = new_ms
        if self._candidate_wins(native_ms, candidate_ms) == (new != NATIVE):
            self.reason += f"; confirmed by its next {len(steps)} steps ({new_ms:.1f} ms/step)"
            self._log(s)
            return
        self._count_undone_switch(s)
        self.chosen, self.decided_at, self.period = old, s, self.recheck_every
        self.decisions += 1
        self.reverted += 1
        self.reason = (f"{new} measured {new_ms:.1f} ms/step over its next {len(steps)} steps against {old}'s {old_ms:.1f}, "
                       f"which the margin {self.margin:.0%} does not let it replace: back to {old}")
        self._log(s)

    # -- what the state shows, and checkpoints -------------------------------

    def summary(self):
        """What was chosen and why, as a dict."""
        return {
            "path": self.chosen,
            "candidate": self.candidate,
            **{f"{path}_ms_per_step": self.ms[path] for path in PATHS},
            "steps": dict(self.steps),
            "explored_steps": self.explored,
            "decisions": self.decisions,
            "reverted": self.reverted,
            "reason": self.reason,
            "kept_dense_for": self.kept_dense_for,
        }

    def state_dict(self):
        return {
            "chosen": self.chosen,
            "candidate": self.candidate,
            "decided_at": self.decided_at,
            "confirm_at": self.confirm_at,
            "reverted": self.reverted,
            "ms": dict(self.ms),
            "steps": dict(self.steps),
            "explored": self.explored,
            "decisions": self.decisions,
            "reason": self.reason,
            "margin": self.margin,
            "recheck_every": self.recheck_every,
            "period": self.period,
            "kept_dense_for": self.kept_dense_for,
            "origin": self.origin,
            # This rank's own timings, so that a run resumed inside a probe
            # decides from the same figures (the resumed first step is not
            # timed: its clock started in another process).
            "seconds": dict(self._seconds),
            # The step under way, timed from its first bucket until the next
            # step's: a checkpoint saved between two steps holds the time
            # the one just run has taken so far, which the resumed run
            # completes at its first bucket. The next decision may need
            # that step (the last warm-up step's time decides whether the
            # sparse probe wins clearly).
            "unfinished": self._unfinished_step(),
        }

    def _unfinished_step(self):
        """[s, seconds so far] of the timed step under way, or None."""
        if self._started is None or not self._started[2]:
            return None
        if self._saved_so_far is None or self._saved_so_far[0] is not self._started:
            self._saved_so_far = (self._started, [self._started[0], self.clock() - self._started[1]])
        return list(self._saved_so_far[1])

    def resume_timing(self):
        """At the load of a checkpoint, in the resuming process: the step
        that was under way when it was saved goes on being timed from here,
        from the time it had taken so far; its first bucket of the next step
        ends it, as in the run that saved it. Apart from load_state_dict,
        which reads no clock: the clock is this process's, and a choice may
        be loaded before it is set."""
        if self._unfinished is not None:
            s, seconds = self._unfinished
            self._started, self._unfinished = (s, self.clock() - seconds, True), None
            self._saved_so_far = (self._started, [s, seconds])

    def load_state_dict(self, saved):
        self.margin, self.recheck_every = check_choice(saved["margin"], saved["recheck_every"])
        self.chosen, self.decided_at = saved["chosen"], saved["decided_at"]
        # A checkpoint from before the back-off ran every period at recheck_every.
        self.period = int(saved.get("period", self.recheck_every))
        self.confirm_at, self.reverted = saved["confirm_at"], saved["reverted"]
        self.ms = {**dict.fromkeys(PATHS), **saved["ms"]}
        self.steps = {**dict.fromkeys(PATHS, 0), **saved["steps"]}
        self.explored, self.decisions, self.reason = saved["explored"], saved["decisions"], saved["reason"]
        self.kept_dense_for, self.candidate = saved["kept_dense_for"], saved["candidate"]
        self.origin = int(saved.get("origin", 0))  # a checkpoint from before the early steps counted from 0
        if self.candidate not in (SPARSE, None, self.adam_candidate):
            raise ValueError(f"oktopk: this checkpoint's choice measures the {self.candidate} path, which this front end "
                             f"does not offer (its dense_compression: {self.adam_candidate!r}); pass dense_compression={self.candidate!r} "
                             "to resume it")
        self._seconds, self._started = {int(k): float(v) for k, v in saved["seconds"].items()}, None
        unfinished = saved["unfinished"]
        self._unfinished = None if unfinished is None else (int(unfinished[0]), float(unfinished[1]))
