package core

import (
	"math"
	"testing"
)

// TestPredictCallIsAutosModel: PredictCall answers with the times Predict
// and Choose give, bitwise, for every algorithm and for Auto.
func TestPredictCallIsAutosModel(t *testing.T) {
	m := LinkModel{Alpha: 300e-6, Beta: 44e-9, Gamma: 0.2e-9}
	cfg := DefaultConfig()
	for _, p := range []int{1, 2, 3, 8, 13, 256} {
		for _, n := range []int{1000, 1 << 22} {
			for _, a := range Algorithms() {
				s, b, ran := m.PredictCall(a, n, p, cfg)
				if a == Auto {
					want, predicted := m.Choose(n, p, cfg)
					if ran != want || duration(s) != predicted {
						t.Errorf("P=%d n=%d auto: ran %v in %v, Choose says %v in %v", p, n, ran, duration(s), want, predicted)
					}
					continue
				}
				if ran != a || duration(s) != m.Predict(a, n, p, cfg) {
					t.Errorf("P=%d n=%d %v: ran %v in %v, Predict says %v", p, n, a, ran, duration(s), m.Predict(a, n, p, cfg))
				}
				if want := predictTerms(a, n, cfg.K(n), p, cfg, false).bytes; b != want {
					t.Errorf("P=%d n=%d %v: %v bytes, terms say %v", p, n, a, b, want)
				}
			}
		}
	}
}

// The model prices a selected entry in the configured value format: TopkA
// sends k pairs to each of P−1 ranks, so its bytes fall by k(P−1) times
// what a value saves (4 − 1.125 bytes for 8-bit values, 4 − 0.625 for
// 4-bit ones, a block's scale shared), and Ok-Topk's by its volume's share;
// the rounds do not change, and on a slow link Auto's prediction falls too.
func TestPredictCallPricesTheValueFormat(t *testing.T) {
	m := LinkModel{Alpha: 300e-6, Beta: 44e-9, Gamma: 0.2e-9}
	n, p := 1<<22, 8
	cfg := DefaultConfig()
	k := float64(cfg.K(n))
	_, b32, _ := m.PredictCall(TopkA, n, p, cfg)
	if pair := b32 / (k * float64(p-1)); math.Abs(pair-5.168) > 0.01 {
		t.Errorf("a float32 pair at density 1%% is priced %.3f bytes, want the coded 5.17", pair)
	}
	auto32, _, _ := m.PredictCall(Auto, n, p, cfg)
	for _, c := range []struct {
		v     ValueType
		saved float64
	}{{ValuesInt8, 4 - 1.125}, {ValuesInt4, 4 - 0.625}, {ValuesFloat16, 2}} {
		cfg.Values = c.v
		_, b, _ := m.PredictCall(TopkA, n, p, cfg)
		if want := b32 - k*float64(p-1)*c.saved; math.Abs(b-want) > 1e-6*b32 {
			t.Errorf("%v values: TopkA priced %.0f bytes, want %.0f", c.v, b, want)
		}
		if s, _, _ := m.PredictCall(Auto, n, p, cfg); s >= auto32 {
			t.Errorf("%v values: Auto predicted %v s, not below float32's %v", c.v, s, auto32)
		}
	}
}
