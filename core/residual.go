package core

// Error feedback (Ok-Topk Algorithm 2, and every sparse baseline): each call
// works on acc = grad + residual; afterwards the residual is acc with exactly
// the entries zeroed that this rank selected AND that made it into the global
// result. Everything else — never selected, or selected but dropped by the
// global selection — waits in the residual for a later call. Values sent in
// reduced precision leave their rounding error there instead of zero. gTopk
// differs (gtopk.go, step 4): partial sums its tree drops on the way up
// belong to no one sender, so every entry a rank sent leaves its residual
// and the rank that dropped a sum takes it into its own.

// Accumulate writes acc = grad + residual and reports how many entries are
// not finite, so the caller can skip the step on every rank before anything
// non-finite reaches the residual or the wire.
func Accumulate(acc, grad, residual []float32) (nonFinite int) {
	acc = acc[:len(grad)]
	residual = residual[:len(grad)]
	for i, g := range grad {
		v := g + residual[i]
		acc[i] = v
		// v-v is 0 for finite v and NaN for NaN and ±Inf.
		if v-v != 0 {
			nonFinite++
		}
	}
	return nonFinite
}

// UpdateResidual sets residual = acc, then, for the entries in both the
// local selection and the global result (both ascending by index), subtracts
// the value this rank sent: zero for float32 values, which are acc itself,
// and the rounding error for values rounded to float16 or bfloat16. A NaN or
// ±Inf in acc becomes 0: the residual never keeps a non-finite value, which
// would otherwise poison every later call (callers skip the step when
// Accumulate counts one, so this is the last line of defence).
func UpdateResidual(residual, acc []float32, local, global Sparse) {
	residual = residual[:len(acc)]
	for i, v := range acc {
		if v-v != 0 { // NaN and ±Inf; v-v is 0 for every finite v
			v = 0
		}
		residual[i] = v
	}
	zeroSent(residual, local, global)
}

// zeroSent zeroes the residual's entries that are in both local and global.
func zeroSent(residual []float32, local, global Sparse) {
	g := 0
	for j, i := range local.Idx {
		for g < len(global.Idx) && global.Idx[g] < i {
			g++
		}
		if g < len(global.Idx) && global.Idx[g] == i {
			v := residual[i] - local.Val[j]
			if v-v != 0 {
				v = 0
			}
			residual[i] = v
		}
	}
}

// foldResidual is UpdateResidual for a call that never stored acc = grad +
// residual (vec.go): it forms acc a last time, in place, to become the
// residual (a NaN or ±Inf becoming 0, as in UpdateResidual), and zeroes grad
// in the same pass, ready for the result (writeAverage). One pass over
// memory does what UpdateResidual and ScatterAverage's clear did in two.
// The sums are bitwise those the selection saw.
func foldResidual(residual, grad []float32, local, global Sparse) {
	residual = residual[:len(grad)]
	i := 0
	for ; i+4 <= len(grad); i += 4 {
		g4, r4 := grad[i:i+4:i+4], residual[i:i+4:i+4]
		v0, v1, v2, v3 := g4[0]+r4[0], g4[1]+r4[1], g4[2]+r4[2], g4[3]+r4[3]
		if v0-v0 != 0 || v1-v1 != 0 || v2-v2 != 0 || v3-v3 != 0 {
			v0, v1, v2, v3 = finiteOr0(v0), finiteOr0(v1), finiteOr0(v2), finiteOr0(v3)
		}
		r4[0], r4[1], r4[2], r4[3] = v0, v1, v2, v3
		g4[0], g4[1], g4[2], g4[3] = 0, 0, 0, 0
	}
	for ; i < len(grad); i++ {
		residual[i] = finiteOr0(grad[i] + residual[i])
		grad[i] = 0
	}
	zeroSent(residual, local, global)
}

// addToResidual adds s's values into the residual at s's indices; a sum
// that overflows to ±Inf becomes 0, as in UpdateResidual.
func addToResidual(residual []float32, s Sparse) {
	for j, i := range s.Idx {
		residual[i] = finiteOr0(residual[i] + s.Val[j])
	}
}

func finiteOr0(v float32) float32 {
	if v-v != 0 { // NaN and ±Inf
		return 0
	}
	return v
}

// ScatterAverage writes the global sparse sum, divided by p, into out as a
// dense vector (zeros elsewhere).
func ScatterAverage(out []float32, global Sparse, p int) {
	clear(out)
	writeAverage(out, global, p)
}

// writeAverage writes the global sparse sum, divided by p, into out's
// entries at its indices (out is zero elsewhere already).
func writeAverage(out []float32, global Sparse, p int) {
	fp := float32(p)
	for j, i := range global.Idx {
		if p == 1 {
			out[i] = global.Val[j]
		} else {
			out[i] = global.Val[j] / fp
		}
	}
}
