package main

// Faults in one call: a rank that never makes it, a rank whose call differs
// in one field (a mismatch), a rank that refuses it, and a non-finite
// gradient on one rank. The checks are the ones faults.go describes.

import (
	"fmt"
	"math"
	"slices"
	"strings"

	"github.com/oktopk/oktopk/core"
)

// neverArrives: every rank but v makes a call; they must fail within the
// timeout + 10%, naming v.
func (st *jobState) neverArrives(res *faultResult) bool {
	v, _, specs := st.victimCall(res)
	st.record(specs, false)
	st.runFaultyCall(res, specs, without(st.all(), v), func(r int, b *batchResult) {
		if f := expectFailure(res, r, b, []string{"timeout", "remote"}, v); f != nil {
			res.detected(f.Took())
		}
	})
	return false
}

// mismatch: rank v's call differs in one field. Every rank must fail with a
// mismatch naming the field and rank v, and no rank may return data.
func (st *jobState) mismatch(res *faultResult, field string) bool {
	v, s, specs := st.victimCall(res)
	switch field {
	case "tensor":
		specs[v].Tensor = 1000 + uint64(s.Index)
	case "n":
		// A fresh tensor on every rank: a known tensor that changes size on
		// one rank is refused there (refused-locally), not a mismatch.
		for r := range specs {
			specs[r].Tensor = 2000 + uint64(s.Index)
		}
		specs[v].N += 1 + st.rng.IntN(7)
	case "k":
		d := s.Density * 2
		if d > 1 {
			d = s.Density / 2
		}
		specs[v].Density = d
		if kOf(d, s.N) == kOf(s.Density, s.N) {
			st.h.harnessProblem(fmt.Sprintf("job %d: density %g and %g give the same k", st.plan.id, d, s.Density))
		}
	case "dtype":
		if s.Dtype == "float32" {
			specs[v].Dtype = halfDtypes[st.rng.IntN(2)]
		} else {
			specs[v].Dtype = "float32"
		}
	case "algorithm":
		specs[v].Alg = otherAlgorithm(s.Alg, st.rng.IntN)
		if !takesValueFormats(specs[v].Alg) {
			specs[v].Values = "float32" // else the victim refuses its own settings
		}
	case "values":
		mine, _ := valuesOf(s)
		others := slices.DeleteFunc(slices.Clone(valueFormats), func(f string) bool { return f == mine.String() })
		specs[v].Values = others[st.rng.IntN(len(others))]
	}
	st.record(specs, false)
	st.runFaultyCall(res, specs, st.all(), func(r int, b *batchResult) {
		f := expectFailure(res, r, b, []string{"mismatch"}, v)
		if f == nil {
			return
		}
		res.detected(f.Took())
		if f.Class == "mismatch" && !strings.Contains(f.Err, field+": rank") {
			res.problem(&res.badErr, "rank %d: the mismatch does not name the field %q: %s", r, field, f.Err)
		}
	})
	return false
}

func kOf(density float64, n int) int { return min(n, int(math.Ceil(density*float64(n)))) }

// refused: rank v refuses the call itself (its tensor resized, or an invalid
// density); the others must not wait out their timeout for it: they fail
// with an invalid-argument or mismatch error (or a remote one carrying v's
// invalid argument) naming v.
func (st *jobState) refused(res *faultResult) bool {
	v, s, specs := st.victimCall(res)
	if !isDense(s.Alg) && st.rng.IntN(2) == 0 {
		specs[v].N += 1 + st.rng.IntN(7) // tensor 1 already has s.N elements on v
	} else {
		specs[v].Density = 1.5
	}
	st.record(specs, false)
	st.runFaultyCall(res, specs, st.all(), func(r int, b *batchResult) {
		if r == v {
			expectFailure(res, r, b, []string{"invalid"}, -2)
			return
		}
		// The others learn of the refusal as an invalid call or a mismatch,
		// or from the refusing rank's abort (a remote error that passes on
		// its invalid argument).
		classes := []string{"invalid", "mismatch"}
		if f := b.failed(); f != nil && f.Class == "remote" && strings.Contains(f.Err, core.ErrInvalidArgument.Error()) {
			classes = append(classes, "remote")
		}
		if f := expectFailure(res, r, b, classes, v); f != nil {
			res.detected(f.Took())
		}
	})
	return false
}

// poison: NaN or ±Inf in rank v's gradient. Every rank must do what the
// reference does (sparse algorithms skip the step on every rank with a
// non-finite error, buffer and residual untouched; dense ones sum it), and
// the communicator must stay usable.
func (st *jobState) poison(res *faultResult, kind string) bool {
	v, s, specs := st.victimCall(res)
	specs[v].Poison = kind
	if kind == "inf" && st.rng.IntN(2) == 0 {
		specs[v].Poison = "-inf"
	}
	specs[v].PoisonAt = st.rng.IntN(s.N)
	st.record(specs, true)
	results := st.runBatch([][]CallSpec{specs}, st.all())
	healthy := true
	for _, r := range st.all() {
		b := results[r]
		ok := st.checkBatch(res, r, b, true, 0)
		healthy = healthy && ok
		if f := b.failed(); f != nil {
			res.detected(f.Took())
			if f.Class != "nonfinite" {
				healthy = false
			}
		}
	}
	return healthy && st.verify(res, 1)
}

// otherAlgorithm draws the algorithm a mismatch-algorithm victim calls
// with instead of alg: one whose calls differ on the wire, on a tensor
// whose residual is where it keeps it. The caller-selected call is Ok-Topk
// on the wire (ranks may mix the two forms), and a tensor's residual is
// either the library's or the caller's, so a call of the other form is
// refused by the victim itself (refused-locally's fault), not caught as a
// mismatch: beside the caller-selected form only the dense algorithms,
// which keep no residual, differ; and no other job's victim calls it.
func otherAlgorithm(alg string, intN func(int) int) string {
	others := slices.DeleteFunc(slices.Clone(campaignAlgs), func(a string) bool {
		return a == alg || a == selectedAlg || (alg == selectedAlg && !isDense(a))
	})
	return others[intN(len(others))]
}
