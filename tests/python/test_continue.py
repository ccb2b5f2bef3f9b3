"""on_rank_loss="continue": a rank killed or stopped mid-run, and the
survivors going on without it, with no restart (examples/pytorch/continue.py,
each rank a process of its own over env://, as a launcher that keeps the
survivors runs them)."""

import json
import os
import signal
import subprocess
import sys

import pytest

from conftest import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
SCRIPT = os.path.join(ROOT, "examples", "pytorch", "continue.py")


def start_ranks(world, out, *args):
    out.mkdir(parents=True)
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "plugins", "pytorch"), OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), WORLD_SIZE=str(world))
    # A session each: a stopped rank whose siblings exit is not sent
    # SIGHUP as an orphaned process group's member would be.
    procs = [subprocess.Popen([sys.executable, SCRIPT, "--out", str(out), *map(str, args)], env=dict(env, RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
             for r in range(world)]
    for p in procs:
        p.env_port = port
    return procs


def procs_port(procs):
    """The job's store port (MASTER_PORT of ``start_ranks``' processes)."""
    return int(procs[0].env_port)


def summaries(out):
    return {int(f[4:-5]): json.load(open(out / f)) for f in os.listdir(out)}


def check_survivors(ranks, survivors, lost, step, steps):
    """Every survivor ends with the same parameters, bit for bit; the loss
    is recorded alike on each, their new numbers in the original order; the
    void step changed no parameter and is not counted."""
    assert sorted(ranks) == survivors
    first = ranks[survivors[0]]
    for number, r in enumerate(survivors):
        s = ranks[r]
        assert s["params"] == first["params"], f"rank {r}'s parameters differ from rank {survivors[0]}'s"
        assert s["digests"] == first["digests"], f"rank {r} and rank {survivors[0]} parted at some step"
        assert s["size"] == len(survivors)
        assert len(s["rank_losses"]) == 1, s["rank_losses"]
        loss = s["rank_losses"][0]
        assert (loss["step"], loss["lost"], loss["survivors"], loss["rank"]) == (step, lost, len(survivors), number), loss
        assert loss["residual_mass_lost"] > 0, loss  # the lost rank held a residual after the sparse steps before
        assert s["iter"] == steps - 1, "the void step counted"
        assert s["bytes_sent"] > 0
    digests = first["digests"]
    assert digests[step] == digests[step - 1], "the void step's optimizer step changed the parameters"
    assert digests[step + 1] != digests[step], "no step after the loss"


def test_a_killed_rank_the_survivors_go_on_without_it_bitwise_alike(tmp_path):
    # Rank 2 of 4 SIGKILLs itself in step 8 (the sparse steps began at 2):
    # the survivors void step 8, agree at step 9's start, renumber 0, 1, 3
    # as 0, 1, 2, and train to the end over 3 ranks.
    out = tmp_path / "out"
    procs = start_ranks(4, out, "--steps", 20, "--kill-at", 8, "--kill-rank", 2, "--timeout", 10)
    results = [p.communicate(timeout=180) for p in procs]
    assert procs[2].returncode == -signal.SIGKILL
    for r in (0, 1, 3):
        assert procs[r].returncode == 0, results[r][1][-3000:]
    assert "rank 2 lost in step 8" in results[0][1], results[0][1][-2000:]
    check_survivors(summaries(out), [0, 1, 3], [2], 8, 20)


def test_a_stopped_rank_is_left_behind_and_refused_when_it_wakes(tmp_path):
    # Rank 1 of 3 SIGSTOPs itself in step 5: the survivors time out on it
    # (3 s), void step 5 and go on as 2 ranks. Woken after they finished,
    # it finds its peers gone and fails with an error; it never trains on
    # alone.
    out = tmp_path / "out"
    procs = start_ranks(3, out, "--steps", 12, "--kill-at", 5, "--kill-rank", 1, "--stop", "--timeout", 3)
    results = {r: procs[r].communicate(timeout=180) for r in (0, 2)}
    for r in (0, 2):
        assert procs[r].returncode == 0, results[r][1][-3000:]
    check_survivors(summaries(out), [0, 2], [1], 5, 12)
    os.kill(procs[1].pid, signal.SIGCONT)
    stdout, stderr = procs[1].communicate(timeout=60)
    assert procs[1].returncode not in (0, None), stderr[-3000:]
    assert "OkTopkError" in stderr, stderr[-3000:]
    assert not (out / "rank1.json").exists()


def test_continue_is_refused_where_it_cannot_go_on():
    from oktopk import Engine, OkTopkState, ProcessGroupCollectives, Settings

    with pytest.raises(ValueError, match="needs a named algorithm"):
        OkTopkState(on_rank_loss="continue")
    with pytest.raises(ValueError, match="on_rank_loss must be one of"):
        OkTopkState(algorithm="oktopk", on_rank_loss="resume")
    with pytest.raises(ValueError, match="Horovod"):
        Engine(Settings(algorithm="oktopk").with_flat(on_rank_loss="continue"), None, ProcessGroupCollectives(None))
    with pytest.raises(ValueError, match="FSDP2"):
        OkTopkState(algorithm="oktopk", on_rank_loss="continue").attach_shards(None, False)


def join_rank(out, port, world, rank, *args):
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "plugins", "pytorch"), OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank))
    return subprocess.Popen([sys.executable, SCRIPT, "--out", str(out), "--join", *map(str, args)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def test_a_rank_that_comes_back_joins_and_every_rank_ends_bitwise_alike(tmp_path):
    # Rank 2 of 4 is killed in step 6; once it is gone a new process comes
    # back as rank 2 (--join). The group's rank 0 sees its request at a
    # step boundary and admits it two steps later; it is handed the model,
    # the optimizer and the step, and from then on every step averages
    # over 4 ranks again. Every rank's parameters after every step from
    # the join on are the same, bit for bit, the joiner's included.
    # The run ends 12 steps after the join (--after-join), and until then
    # goes on (to 600 steps at most): the joiner's start (its `import
    # torch`, seconds on a loaded machine) must find rank 0, which hosts
    # the job's store, still running; a fixed 60 steps once ended first.
    out, after = tmp_path / "out", 12
    common = ("--steps", 600, "--after-join", after, "--step-sleep", 0.1, "--timeout", 10)
    procs = start_ranks(4, out, "--kill-at", 6, "--kill-rank", 2, *common)
    assert procs[2].wait(timeout=120) == -signal.SIGKILL
    joiner = join_rank(out, procs_port(procs), 4, 2, *common)
    results = {r: procs[r].communicate(timeout=180) for r in (0, 1, 3)}
    joined = joiner.communicate(timeout=120)
    for r in (0, 1, 3):
        assert procs[r].returncode == 0, results[r][1][-3000:]
    assert joiner.returncode == 0, joined[1][-3000:]
    ranks = summaries(out)
    assert sorted(ranks) == [0, 1, 2, 3]
    assert len({s["params"] for s in ranks.values()}) == 1, "the ranks' parameters differ after the join"
    member = ranks[0]
    (join,) = member["rank_joins"]
    assert join["joined"] == [2] and join["size"] == 4 and join["step"] - join["asked_by"] == 2, join
    for r in (0, 1, 3):
        assert ranks[r]["rank_joins"] == [dict(join, rank=r)], ranks[r]["rank_joins"]
        assert ranks[r]["size"] == 4
    mine = ranks[2]
    assert mine["rank_joins"][0]["step"] == join["step"] and mine["size"] == 4 and mine["bytes_sent"] > 0
    assert len(mine["digests"]) == after, "the joiner did not end with the group"
    first = len(member["digests"]) - after  # the script step it joined at
    assert mine["digests"] == member["digests"][first:], "the joiner's parameters part from the others' at some step"
    assert "rank 2 joined at step" in results[0][1]


def test_a_process_that_claims_a_live_rank_is_refused_and_the_group_goes_on(tmp_path):
    out = tmp_path / "out"
    procs = start_ranks(3, out, "--steps", 40, "--step-sleep", 0.1, "--timeout", 10)
    joiner = join_rank(tmp_path, procs_port(procs), 3, 1, "--steps", 40, "--timeout", 10)
    _, err = joiner.communicate(timeout=120)
    assert joiner.returncode not in (0, None)
    assert "join refused: rank 1 is not a lost rank of this job" in err, err[-3000:]
    results = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], results[0][1][-3000:]
    ranks = summaries(out)
    assert len({s["params"] for s in ranks.values()}) == 1
    assert all(s["rank_joins"] == [] and s["size"] == 3 for s in ranks.values())


def survivors_of(world, store):
    """ContinuingCollectives of a group of ``world`` ranks that met in
    ``store`` (an in-process store), as after their first sparse step."""
    from oktopk.survivors import ContinuingCollectives

    group = []
    for origin in range(world):
        c = ContinuingCollectives(None)
        c._incarnation, c._origin, c._world, c._members, c._job = "test", origin, world, list(range(world)), store
        group.append(c)
    return group


def shrink_all(ranks, steps, timeout=5.0):
    """Each of ``ranks`` (ContinuingCollectives) shrinking at once, at its
    step; their results or errors."""
    import threading

    out = [None] * len(ranks)

    def run(k):
        try:
            out[k] = ranks[k].shrink(steps[k], 1.0, timeout)
        except Exception as e:  # noqa: BLE001 - the test reads it
            out[k] = e

    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(ranks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_survivors_at_different_steps_all_refuse_to_go_on():
    # A rank lost in the last message of a step: one survivor finished the
    # step another voided, so they stand a step apart. Every survivor must
    # raise (MISMATCH), naming the steps, rather than train on states that
    # differ.
    import torch.distributed as dist

    from oktopk import OkTopkError, _lib

    group = survivors_of(4, dist.HashStore())
    out = shrink_all(group[:3], [7, 7, 8])  # rank 3 lost
    for e in out:
        assert isinstance(e, OkTopkError) and e.code == _lib.MISMATCH, e
        assert "different steps" in str(e) and "rank 2: step 8" in str(e)


def test_a_survivor_that_comes_after_the_agreement_closed_is_left_out():
    import torch.distributed as dist

    from oktopk import OkTopkError

    store = dist.HashStore()
    group = survivors_of(4, store)
    out = shrink_all(group[:3], [5, 5, 5])
    for origin, loss in enumerate(out):
        assert loss == {"lost": [3], "survivors": 3, "rank": origin, "residual_mass_lost": 1.0}, loss
    late = shrink_all([group[3]], [5], timeout=1.0)[0]
    assert isinstance(late, OkTopkError) and "after it closed" in str(late), late
    assert [c.members for c in group[:3]] == [[0, 1, 2]] * 3
