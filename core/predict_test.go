package core

import "testing"

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
