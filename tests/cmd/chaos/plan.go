package main

// The campaign's plan, drawn from the seed alone: how many faults of each
// kind, grouped into jobs, each job with its algorithm, dtype, value format,
// size and world size. Faults that end a job (a dead or stopped rank, a mismatch, …)
// close one job each; the others (NaN, floods, a slowed link, …) ride along
// in those jobs, several in sequence on the same processes, so that many
// faults cost few process starts.

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"sort"
	"time"
)

type kind struct {
	name       string
	fatal      bool // the job ends with it
	init       bool // injected while the ranks join: a job of its own
	netns      bool // needs network namespaces
	sparseOnly bool // meaningless for dense allreduce (no tensor id, no k)
	valuesOnly bool // needs an algorithm that takes 16- and 8-bit values
	flood      bool // a stranger's traffic: RSS is held to the bound
	weight     int
	what       string
}

var kinds = []kind{
	{name: "sigkill", fatal: true, weight: 3, what: "SIGKILL of one rank at a random point of a call"},
	{name: "sigstop", fatal: true, weight: 2, what: "SIGSTOP of one rank at a random point of a call"},
	{name: "link-down", fatal: true, netns: true, weight: 2, what: "one rank's link down (ip link set … down) for 0.1 s to 1.5× the call timeout, then up"},
	{name: "link-slow", netns: true, weight: 2, what: "one rank's link slowed (tc tbf) for several calls"},
	{name: "never-arrives-call", fatal: true, weight: 2, what: "one rank never makes a call the others make"},
	{name: "never-arrives-init", init: true, weight: 1, what: "one rank never starts: the others are joining"},
	{name: "wrong-token-rank", init: true, weight: 1, what: "one rank joins with another job token"},
	{name: "mismatch-tensor", fatal: true, sparseOnly: true, weight: 1, what: "one rank calls with another tensor id"},
	{name: "mismatch-n", fatal: true, weight: 1, what: "one rank calls with another n"},
	{name: "mismatch-k", fatal: true, sparseOnly: true, weight: 1, what: "one rank calls with another density (another k)"},
	{name: "mismatch-dtype", fatal: true, weight: 1, what: "one rank calls with float32 where the others pass a half dtype, or the reverse"},
	{name: "mismatch-algorithm", fatal: true, weight: 1, what: "one rank calls with another algorithm"},
	{name: "mismatch-values", fatal: true, sparseOnly: true, valuesOnly: true, weight: 1, what: "one rank sends its values in another format (float32, float16, bfloat16, int8, int4)"},
	{name: "refused-locally", fatal: true, weight: 2, what: "one rank refuses the call itself (its tensor resized, or an invalid density)"},
	{name: "nan", weight: 2, what: "NaN in one rank's gradient"},
	{name: "inf", weight: 2, what: "±Inf in one rank's gradient"},
	{name: "flood-random-bytes", flood: true, weight: 2, what: "random bytes on a rank's inbox or the rendezvous port"},
	{name: "flood-empty-frames", flood: true, weight: 2, what: "empty ZeroMQ frames and empty store messages"},
	{name: "flood-huge-announce", flood: true, weight: 2, what: "frames announcing huge sizes, partly sent and held open"},
	{name: "flood-idle-conns", flood: true, weight: 2, what: "hundreds of idle connections held open"},
	{name: "wrong-token-frames", flood: true, weight: 2, what: "well-formed hello, heartbeat and data frames and store requests with another token"},
}

func kindByName(name string) kind {
	for _, k := range kinds {
		if k.name == name {
			return k
		}
	}
	panic("unknown fault kind " + name)
}

// The algorithms of the campaign (core/algorithm.go's names): the two dense
// allreduces, Ok-Topk, Ok-Topk through the caller-selected call (the GPU
// path's: selectedAlg) and the sparse baselines it is compared with.
var (
	campaignAlgs = []string{"dense_ring", "dense_rabenseifner", "oktopk", selectedAlg, "topka", "topkdsa", "gtopk", "gaussiank"}
	halfDtypes   = []string{"float16", "bfloat16"}
	// valueFormats are the formats sparse values travel in (core.ValueType's
	// names), drawn for the jobs whose algorithm takes them.
	valueFormats = []string{"float32", "float16", "bfloat16", "int8", "int4"}
)

func isDense(alg string) bool { return alg == "dense_ring" || alg == "dense_rabenseifner" }

// takesValueFormats says whether alg sends its values in any of
// valueFormats (the others send float32 only).
func takesValueFormats(alg string) bool {
	return alg == "oktopk" || alg == selectedAlg || alg == "topka" || alg == "gaussiank"
}

type jobPlan struct {
	id       int
	p        int
	alg      string
	dtype    string
	values   string // the format sparse values travel in
	n        int
	density  float64
	tau      int
	tauPrime int
	timeout  time.Duration
	curve    bool     // OKTOPK_CURVE=1 on every rank (where libzmq has CURVE)
	faults   []string // in order; a fatal or init one is last
}

func (jp *jobPlan) String() string {
	s := fmt.Sprintf("%s %s P=%d n=%d density=%g tau=%d tau'=%d", jp.alg, jp.dtype, jp.p, jp.n, jp.density, jp.tau, jp.tauPrime)
	if jp.values != "float32" {
		s += " values=" + jp.values
	}
	if jp.curve {
		s += " CURVE"
	}
	return s
}

// faultCounts splits total over the kinds available, by weight, every kind
// at least once when total allows.
func faultCounts(total int, avail []kind) map[string]int {
	counts := map[string]int{}
	if len(avail) == 0 || total <= 0 {
		return counts
	}
	w := 0
	for _, k := range avail {
		w += k.weight
	}
	left := total
	if total >= len(avail) {
		for _, k := range avail {
			counts[k.name] = 1
		}
		left -= len(avail)
	}
	// Largest remainder over what is left.
	type rem struct {
		name string
		frac float64
	}
	var rems []rem
	given := 0
	for _, k := range avail {
		exact := float64(left) * float64(k.weight) / float64(w)
		counts[k.name] += int(exact)
		given += int(exact)
		rems = append(rems, rem{k.name, exact - float64(int(exact))})
	}
	sort.SliceStable(rems, func(a, b int) bool { return rems[a].frac > rems[b].frac })
	for i := 0; given < left; i++ {
		counts[rems[i%len(rems)].name]++
		given++
	}
	return counts
}

const maxRidersPerJob = 4

// makePlan draws the campaign: total faults of the kinds available (link
// faults need namespaces; only, when given, narrows them), packed into
// jobs, a quarter of them with CURVE on where curve says libzmq has it.
func makePlan(seed uint64, total int, netns, curve bool, maxP int, timeout time.Duration, only ...string) []*jobPlan {
	rng := rand.New(rand.NewPCG(seed, 0x6f6b746f706b))
	var avail []kind
	for _, k := range kinds {
		if (!k.netns || netns) && (len(only) == 0 || slices.Contains(only, k.name)) {
			avail = append(avail, k)
		}
	}
	counts := faultCounts(total, avail)
	var enders, riders []string
	for _, k := range avail {
		for i := 0; i < counts[k.name]; i++ {
			if k.fatal || k.init {
				enders = append(enders, k.name)
			} else {
				riders = append(riders, k.name)
			}
		}
	}
	rng.Shuffle(len(enders), func(a, b int) { enders[a], enders[b] = enders[b], enders[a] })
	rng.Shuffle(len(riders), func(a, b int) { riders[a], riders[b] = riders[b], riders[a] })
	var jobs []*jobPlan
	for _, e := range enders {
		jobs = append(jobs, &jobPlan{faults: []string{e}})
	}
	// Riders go round-robin into the jobs that start (not the init ones),
	// before their ender; jobs of riders alone end with an orderly exit.
	var hosts []*jobPlan
	for _, jp := range jobs {
		if !kindByName(jp.faults[0]).init {
			hosts = append(hosts, jp)
		}
	}
	for len(hosts)*maxRidersPerJob < len(riders) {
		jp := &jobPlan{}
		jobs = append(jobs, jp)
		hosts = append(hosts, jp)
	}
	for i, r := range riders {
		jp := hosts[i%len(hosts)]
		jp.faults = append([]string{r}, jp.faults...)
	}
	rng.Shuffle(len(jobs), func(a, b int) { jobs[a], jobs[b] = jobs[b], jobs[a] })

	// Algorithm and dtype: every combination in turn, dense ones skipped for
	// jobs with a fault that needs a sparse algorithm.
	type combo struct{ alg, dtype string }
	var all, sparse, valued []combo
	for _, a := range campaignAlgs {
		for _, half := range []bool{false, true} {
			dt := "float32"
			if half {
				dt = halfDtypes[rng.IntN(len(halfDtypes))]
			}
			all = append(all, combo{a, dt})
			if !isDense(a) {
				sparse = append(sparse, combo{a, dt})
			}
			if takesValueFormats(a) {
				valued = append(valued, combo{a, dt})
			}
		}
	}
	rng.Shuffle(len(all), func(a, b int) { all[a], all[b] = all[b], all[a] })
	rng.Shuffle(len(sparse), func(a, b int) { sparse[a], sparse[b] = sparse[b], sparse[a] })
	rng.Shuffle(len(valued), func(a, b int) { valued[a], valued[b] = valued[b], valued[a] })
	ai, si, vi := 0, 0, 0
	for id, jp := range jobs {
		jp.id = id
		needSparse, needValues := false, false
		for _, f := range jp.faults {
			needSparse = needSparse || kindByName(f).sparseOnly
			needValues = needValues || kindByName(f).valuesOnly
		}
		var c combo
		switch {
		case needValues:
			c = valued[vi%len(valued)]
			vi++
		case needSparse:
			c = sparse[si%len(sparse)]
			si++
		default:
			c = all[ai%len(all)]
			ai++
		}
		jp.alg, jp.dtype, jp.values = c.alg, c.dtype, "float32"
		if takesValueFormats(jp.alg) {
			jp.values = valueFormats[rng.IntN(len(valueFormats))]
		}
		jp.p = 3 + rng.IntN(maxP-2)
		if isDense(jp.alg) {
			jp.n = 3000 + rng.IntN(60000)
		} else {
			jp.n = 3000 + rng.IntN(120000)
		}
		jp.density = []float64{0.005, 0.01, 0.02, 0.05, 0.1}[rng.IntN(5)]
		jp.tau = 2 + rng.IntN(7)
		jp.tauPrime = 1 + rng.IntN(4)
		jp.timeout = timeout
		jp.curve = curve && rng.IntN(4) == 0
	}
	return jobs
}
