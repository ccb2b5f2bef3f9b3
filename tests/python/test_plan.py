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


def test_ring_gets_the_whole_network_link_and_the_others_a_share():
    c = plan.Cluster(64, 8, plan.Link(3e9, 1e-5), plan.Link(1e11, 1e-6), 1e-12, 0.1, 1.0)
    assert plan.call_link(c, "dense_ring") == (1e-5, 1 / 3e9)
    assert plan.call_link(c, "oktopk") == (1e-5, 8 / 3e9)


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
    (GOOD[:6] + ["--link", "fast"] + GOOD[8:], "bad bandwidth"),
    (GOOD + ["--overlap", "2"], "[0, 1]"),
    (GOOD + ["--optimizer", "lion"], "--optimizer"),
    (GOOD[:4] + ["--ranks-per-node", "512"] + GOOD[6:], "exceeds --ranks"),
    (GOOD + ["--latency", "soon"], "bad duration"),
])
def test_bad_arguments_exit_2_with_a_message(args, says, capsys):
    # In this process (main() as `python -m oktopk.plan` runs it; the case
    # below runs the command itself): an interpreter start with torch is
    # most of a subprocess case's time.
    with pytest.raises(SystemExit) as exited:
        plan.main(args)
    err = capsys.readouterr().err
    assert exited.value.code == 2, err
    assert says in err and "usage: python -m oktopk.plan" in err


def test_the_command_exits_2_with_a_message_on_a_bad_argument():
    p = run_plan("--ranks", "8", "--link", "25gbit")
    assert p.returncode == 2, p.stdout + p.stderr
    assert "--params" in p.stderr and "usage: python -m oktopk.plan" in p.stderr


def test_prints_every_method_and_the_hooks_choice(tmp_path):
    p = run_plan(*GOOD, "--optimizer", "adamw", "--map", str(tmp_path / "map.png"))
    assert p.returncode == 0, p.stderr
    for m in plan.METHODS:
        assert f"\n{m} " in p.stdout
    assert "oktopk_hook's defaults: " in p.stdout and "DeMo" in p.stdout
    assert (tmp_path / "map.csv").exists()
    rows = list(csv.DictReader(open(tmp_path / "map.csv")))
    assert len(rows) == len(plan.MAP_RANKS) * len(plan.MAP_RATES_GBIT)
