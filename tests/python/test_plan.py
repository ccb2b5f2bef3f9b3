"""oktopk.plan: the step model's checked-in predictions stay what the model
computes, and the command line refuses bad arguments as argparse does."""

import csv
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import model_check  # noqa: E402
from oktopk import _lib, plan  # noqa: E402

TABLE = os.path.join(ROOT, "results", "model_check.csv")


def test_checked_in_predictions_are_the_models():
    """Every row of results/model_check.csv: the model recomputed from the
    row's inputs gives its predicted_ms (to the table's 0.01 ms), and its
    measured_ms is still what results/ holds."""
    rows = list(csv.DictReader(open(TABLE)))
    assert len(rows) > 200
    measured = {(r["source"], r["model"], r["P"], r["n"], r["link"], r["method"], r["density"]): r["measured_ms"]
                for r in model_check.table()}
    for r in rows:
        assert model_check.predict(r) == pytest.approx(float(r["predicted_ms"]), abs=0.006), r
        key = (r["source"], r["model"], r["P"], r["n"], r["link"], r["method"], r["density"])
        assert key in measured and measured[key] == r["measured_ms"], r


def test_a_call_is_the_librarys_prediction():
    """plan.predict_call on one node is oktopk_predict_call on the intra link."""
    link = plan.Link(12.5e9, 2e-6)
    c = plan.Cluster(8, 8, plan.Link(1e9, 1e-5), link, 1e-12, 0.1, 1.0)
    for alg in ("dense_ring", "oktopk", "gtopk"):
        assert plan.predict_call(c, alg, 1 << 22)[:2] == _lib.predict_call(2e-6, 1 / 12.5e9, 1e-12, alg, 1 << 22, 8)[:2]


def test_values_price_the_coded_frame():
    """--values prices a sparse call's selected values in that format: the
    library's model at 1% (a pair is its coded index, 9.34 bits, and its
    value, a block's scale shared: 5.17 bytes with float32 values, 2.29
    with int8, 1.79 with int4), the schedule's rounds alike; an algorithm
    that sends float32 only is priced as float32."""
    link = plan.Link(12.5e9, 2e-6)
    c = plan.Cluster(8, 8, plan.Link(1e9, 1e-5), link, 1e-12, 0.1, 1.0)
    n = 1 << 22
    sent = {v: plan.predict_call(c, "topka", n, values=v)[1] for v in ("float32", "int8", "int4")}
    pair = sent["float32"] / (7 * 41944)  # TopkA: k pairs to each of P - 1 ranks
    assert pair == pytest.approx(5.17, abs=0.01)
    assert sent["float32"] - sent["int8"] == pytest.approx(7 * 41944 * (4 - 1.125))
    assert sent["float32"] - sent["int4"] == pytest.approx(7 * 41944 * (4 - 0.625))
    ok32, ok4 = plan.predict_call(c, "oktopk", n)[1], plan.predict_call(c, "oktopk", n, values="int4")[1]
    assert ok4 < 0.5 * ok32
    assert plan.predict_call(c, "gtopk", n, values="int4") == plan.predict_call(c, "gtopk", n)
    with pytest.raises(ValueError):
        plan.predict_call(c, "oktopk", n, values="int2")


def test_ring_gets_the_whole_network_link_and_the_others_a_share():
    c = plan.Cluster(64, 8, plan.Link(3e9, 1e-5), plan.Link(1e11, 1e-6), 1e-12, 0.1, 1.0)
    assert plan.call_link(c, "dense_ring") == (1e-5, 1 / 3e9)
    assert plan.call_link(c, "oktopk") == (1e-5, 8 / 3e9)


def cluster(compute=0.3, overlap=1.0, gamma=1e-12, host=0.0, shared=False):
    lk = plan.Link(1e9, 1e-5)
    return plan.Cluster(16, 1, lk, lk, gamma, compute, overlap, host, shared)


def test_a_call_splits_into_the_links_share_and_the_devices():
    """link + device is the library's prediction with the host's time per
    byte added to the link's, and the device's share is the passes (the
    prediction on a link of no latency and no time per byte) plus the
    host's time per byte sent."""
    c = cluster(host=2e-10)
    for alg in ("dense_ring", "oktopk", "topka"):
        call = plan.call_parts(c, alg, 1 << 22)
        seconds, sent, _ = _lib.predict_call(1e-5, 1e-9 + 2e-10, 1e-12, alg, 1 << 22, 16)
        passes, _, _ = _lib.predict_call(0.0, 0.0, 1e-12, alg, 1 << 22, 16)
        assert call.link + call.device == pytest.approx(seconds, rel=1e-12)
        assert call.device == pytest.approx(passes + 2e-10 * sent, rel=1e-12)
        assert call.bytes == sent and call.link > 0


@pytest.mark.parametrize("shared", [False, True])
def test_without_overlap_the_step_is_compute_and_every_call(shared):
    c = cluster(overlap=0.0, shared=shared)
    for m in plan.METHODS:
        s = plan.step(c, m, 3e7)
        assert s.seconds == pytest.approx(c.compute_seconds + s.communication, rel=1e-12), m


@pytest.mark.parametrize("shared", [False, True])
def test_one_bucket_hides_nothing_and_later_buckets_hide_under_backward(shared):
    """A call starts when backward has handed its bucket over: a model of
    one bucket exposes its whole call; with several, only what runs past
    backward's end (here the last bucket's call, as the link keeps up).
    On shared cores the calls' passes are paid in full and only the
    link's time hides."""
    c = cluster(compute=10.0, shared=shared)
    one = plan.step(c, "dense", 1e6)
    assert one.seconds == pytest.approx(c.compute_seconds + one.communication, rel=1e-12)
    n = 4 * (plan.DDP_BUCKET_BYTES // 4)  # four full buckets
    calls, hides = plan.calls(c, "dense", n)
    assert hides and len(calls) == 4 and all(x.device > 0 for x in calls)
    s = plan.step(c, "dense", n)
    paid = sum(x.device for x in calls) + calls[-1].link if shared else calls[-1].link + calls[-1].device
    assert s.seconds == pytest.approx(c.compute_seconds + paid, rel=1e-12)


def test_exposed_link_is_what_runs_past_the_window():
    assert plan.exposed_link([1.0], [5], 3.0) == 1.0  # handed over at the end
    assert plan.exposed_link([1.0, 1.0], [1, 1], 4.0) == 1.0  # the first hides whole
    assert plan.exposed_link([3.0, 1.0], [1, 1], 4.0) == 2.0  # the second waits for the first: 2 + 3 + 1 - 4
    assert plan.exposed_link([1.0, 1.0], [1, 1], 0.0) == 2.0


def test_demo_exchanges_after_backward():
    c = cluster(compute=10.0)
    s = plan.step(c, "demo", 3e7)
    assert s.seconds == pytest.approx(c.compute_seconds + s.communication, rel=1e-12)


def test_momentum_correction_costs_its_passes_on_sparse_steps_only():
    c = cluster()
    n = 3e7
    for m in ("oktopk", "topka", "auto"):
        extra = plan.step(c, m, n, momentum_correction=True).seconds - plan.step(c, m, n).seconds
        assert extra == pytest.approx(plan.CORRECTION_PASSES * 4 * n * 1e-12, rel=1e-9), m
    for m in ("dense", "bf16", "quantized", "powersgd", "demo"):
        assert plan.step(c, m, n, momentum_correction=True) == plan.step(c, m, n), m


@pytest.mark.parametrize("shared,where", [(True, "library"), (False, "tensors")])
def test_the_quantized_path_pays_its_passes_beside_the_rings(shared, where):
    n = 3e7
    bucket_passes, chunk_passes = plan.QUANTIZED_PASSES[where]
    extra = (bucket_passes + chunk_passes / 16) * 4 * n * 1e-12
    device = [sum(c.device for c in plan.calls(cluster(gamma=g, shared=shared), m, n)[0]) for m in ("quantized", "dense") for g in (1e-12, 0.0)]
    assert device[0] - device[1] == pytest.approx(device[2] - device[3] + extra, rel=1e-9)
    if shared:  # on the host's cores nothing hides the passes: the step pays them all
        quantized = [plan.step(cluster(gamma=g, shared=True), "quantized", n).seconds for g in (1e-12, 0.0)]
        ring = [plan.step(cluster(gamma=g, shared=True), "dense", n).seconds for g in (1e-12, 0.0)]
        assert quantized[0] - quantized[1] == pytest.approx(ring[0] - ring[1] + extra, rel=1e-9)


@pytest.mark.parametrize("text,rate", [("25gbit", 25e9 / 8), ("600GB/s", 600e9), ("200mbit", 25e6),
                                       ("100Gbit/s", 12.5e9), ("1.5e9", 1.5e9)])
def test_rates(text, rate):
    assert plan.parse_rate(text) == pytest.approx(rate)


def run_plan(*args):
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "plugins", "pytorch"))
    return subprocess.run([sys.executable, "-m", "oktopk.plan", *args], capture_output=True, text=True, env=env,
                          timeout=120)


GOOD = ["--params", "1.3e9", "--ranks", "256", "--ranks-per-node", "8", "--link", "25gbit", "--intra", "600GB/s"]


@pytest.mark.parametrize("args,says", [
    (["--ranks", "8", "--link", "25gbit"], "--params"),
    (GOOD[:2] + ["--ranks", "0"] + GOOD[4:], "positive integer"),
    (GOOD[:2] + ["--ranks", "2.5"] + GOOD[4:], "positive integer"),
    (GOOD[:2] + ["--ranks", "1e12"] + GOOD[4:], "at most 2.147e+09"),
    (GOOD[:6] + ["--link", "fast"] + GOOD[8:], "bad bandwidth"),
    (GOOD[:6] + ["--link", "0gbit"] + GOOD[8:], "must be > 0"),
    (GOOD + ["--overlap", "2"], "[0, 1]"),
    (GOOD + ["--momentum", "-0.5"], "[0, 1]"),
    (GOOD + ["--optimizer", "lion"], "--optimizer"),
    (GOOD[:4] + ["--ranks-per-node", "512"] + GOOD[6:], "exceeds --ranks"),
    (GOOD + ["--latency", "soon"], "bad duration"),
    (GOOD + ["--latency", "1e400"], "must be finite"),
    (["--params", "0.5"] + GOOD[2:], "a whole number of parameters"),
    (["--params", "1e30"] + GOOD[2:], "at most 1e+12"),
    (["--params", "1e18"] + GOOD[2:], "at most 1e+12"),
    (["--params", "nan"] + GOOD[2:], "a whole number of parameters"),
    (["--params", "inf"] + GOOD[2:], "a whole number of parameters"),
    (["--params", "-3"] + GOOD[2:], "a whole number of parameters"),
    (GOOD + ["--density", "0"], "want a density in (0, 1]"),
    (GOOD + ["--density", "1.5"], "want a density in (0, 1]"),
    (GOOD + ["--density", "nan"], "want a density in (0, 1]"),
    (GOOD + ["--compute-ms", "inf"], "positive number"),
    (GOOD + ["--tokens-per-rank", "1e300", "--tflops", "1e-300"], "the step's compute comes to inf s"),
    (GOOD + ["--powersgd-rank", "0"], "positive integer"),
    (GOOD + ["--map", "no/such/dir/map.png"], "no such directory"),
    (GOOD + ["--map", "m.png", "--no-map"], "pass one"),
    (GOOD + ["--frobnicate"], "unrecognized arguments"),
])
def test_bad_arguments_exit_2_with_a_one_line_message_and_write_nothing(args, says, capsys, tmp_path, monkeypatch):
    # In this process (main() as `python -m oktopk.plan` runs it; the case
    # below runs the command itself): an interpreter start with torch is
    # most of a subprocess case's time.
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exited:
        plan.main(args)
    err = capsys.readouterr().err
    assert exited.value.code == 2, err
    assert says in err and err.startswith("python -m oktopk.plan: error: "), err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert os.listdir(tmp_path) == []


def test_the_command_exits_2_with_a_one_line_message_on_a_bad_argument():
    p = run_plan("--params", "1e30", "--ranks", "8", "--link", "25gbit")
    assert p.returncode == 2, p.stdout + p.stderr
    assert p.stderr.count("\n") == 1 and "--params" in p.stderr and "at most 1e+12" in p.stderr, p.stderr


def test_a_trillion_parameters_plans_in_seconds_and_writes_no_file_unasked(tmp_path, monkeypatch, capsys):
    # 150,000 DDP buckets: each size priced once, runs of equal calls
    # placed whole (it took over two minutes when every bucket was priced).
    import time

    monkeypatch.chdir(tmp_path)
    start = time.monotonic()
    assert plan.main(["--params", "1e12", "--ranks", "64", "--link", "100gbit"]) == 0
    assert time.monotonic() - start < 30
    assert "oktopk_hook's defaults" in capsys.readouterr().out
    assert os.listdir(tmp_path) == []


def test_runs_of_equal_calls_expose_what_one_call_at_a_time_would():
    # exposed_link takes a run of equal calls whole: the same as handing
    # them over one by one, the recurrence it replaces.
    import random

    rng = random.Random(7)
    for _ in range(200):
        sizes = [rng.choice([5, 5, 5, 3])] * rng.randint(1, 6) + [rng.randint(1, 9)] * rng.randint(0, 3)
        links = [rng.choice([0.1, 0.5, 2.0]) for _ in sizes]
        links = [links[0] if s == sizes[0] else x for s, x in zip(sizes, links)]
        window = rng.choice([0.0, 1.0, 7.5])
        total, ready, done = sum(sizes), 0.0, 0.0
        for link, size in zip(links, sizes):
            ready += size
            done = max(done, window * ready / total) + link
        assert plan.exposed_link(links, sizes, window) == pytest.approx(max(0.0, done - window), rel=1e-12, abs=1e-12)


def test_prints_every_method_and_the_hooks_choice(tmp_path):
    p = run_plan(*GOOD, "--optimizer", "adamw", "--map", str(tmp_path / "map.png"))
    assert p.returncode == 0, p.stderr
    for m in plan.METHODS:
        assert f"\n{m} " in p.stdout
    assert "oktopk_hook's defaults: " in p.stdout and "DeMo" in p.stdout
    assert (tmp_path / "map.csv").exists()
    rows = list(csv.DictReader(open(tmp_path / "map.csv")))
    assert len(rows) == len(plan.MAP_RANKS) * len(plan.MAP_RATES_GBIT)
