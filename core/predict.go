package core

// PredictCall is Auto's cost model (auto.go) answering for one call outside
// a communicator: what a call of alg would take on a link of m, and the
// bytes one rank sends on its critical path. A planner that composes calls
// into a training step (the PyTorch plugin's oktopk.plan) reads it through
// the C ABI, so that the step model and Auto's choice come from the same
// terms and cannot disagree.

// PredictCall is the model's time in seconds for one call of alg on a dense
// gradient of n elements with cfg's density and periods over p ranks, the
// bytes one rank sends on the call's critical path (the same for every rank
// in the symmetric algorithms; gTopk's root, which sends the most, in its
// tree), and the algorithm that would run: alg itself, or Auto's choice
// for Auto (a dense allreduce when predicted within denseMargin of the
// fastest sparse one).
func (m LinkModel) PredictCall(alg Algorithm, n, p int, cfg Config) (seconds, bytes float64, ran Algorithm) {
	ran = alg
	if alg == Auto {
		ran = m.choose(n, p, cfg, false).alg
	}
	t := predictTerms(ran, n, cfg.K(n), p, cfg, false)
	return m.seconds(t, n), t.bytes, ran
}
