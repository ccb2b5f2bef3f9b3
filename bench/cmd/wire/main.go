package main

// Command wire measures what a selected entry costs on the wire: it runs
// Ok-Topk (core's code, P ranks in one process over transport.NewInProc,
// as bench/cmd/scale does) on the recorded scale inputs with each value
// format, reads every sparse frame a rank sends, and reports the bytes per
// entry — the coded index and the value, a block's scale included, the
// frame's own 8 bytes (count, first index) too; not the 96-byte header —
// beside the entropy bound:
//
//   - indices: a frame of m entries whose first and last index are f and l
//     holds one of C(l−f, m−1) sets once its first index is known, so no
//     code of the set takes fewer than log₂ C(l−f, m−1) bits on average
//     over sets spread at random (the first index is left out of the
//     bound and counted in the bytes);
//   - values: 32 bits a float32 value (taken as incompressible); for 8-bit
//     and 4-bit values the empirical entropy of the codes over every frame
//     (zeroth order: no code can beat it on codes drawn independently from
//     that histogram), the scales left out of the bound.
//
// Frames are parsed here from their layout (core/indexcode.go,
// core/int8values.go, core/int4values.go), not through core's decoder, so
// the layout the documentation gives is checked against what core sends.
//
//	wire -grads build/scale/grads -p 8,64 -md results/wire_bytes.md
//
// Each run is 4 calls on one tensor (the residuals carry over; call 0 is
// Ok-Topk's exact call with its repartition, calls 1–3 reuse its
// thresholds), density 1%, τ = 64, τ′ = 32: results/scale.md's runs.

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"flag"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/oktopk/oktopk/core"
	"github.com/oktopk/oktopk/transport"
)

// tally is what the sparse frames of one run held.
type tally struct {
	frames, entries    int
	indexBytes, values int     // payload bytes: the index section, the values (scales included)
	indexBound         float64 // bits: Σ log₂ C(l−f, m−1)
	codes              map[int]int
}

// recorder passes everything through and tallies the sparse frames sent.
type recorder struct {
	transport.Transport
	mu *sync.Mutex
	t  *tally
}

func (r recorder) Send(ctx context.Context, peer int, tag transport.Tag, dtype transport.Dtype, count uint64, payload []byte) error {
	switch dtype {
	case transport.DtypeSparseF32, transport.DtypeSparseI8, transport.DtypeSparseI4:
		if count > 0 {
			r.mu.Lock()
			err := r.t.add(dtype, int(count), payload)
			r.mu.Unlock()
			if err != nil {
				return err
			}
		}
	}
	return r.Transport.Send(ctx, peer, tag, dtype, count, payload)
}

// add parses one frame: count, first index, blocks of 32 gaps (a width
// byte, then the gaps less one packed at that width), then the values.
func (t *tally) add(dtype transport.Dtype, m int, b []byte) error {
	if len(b) < 8 || int(binary.LittleEndian.Uint32(b)) != m {
		return fmt.Errorf("frame of %d entries: bad count section", m)
	}
	at, first, last := 8, uint64(binary.LittleEndian.Uint32(b[4:])), uint64(binary.LittleEndian.Uint32(b[4:]))
	for start := 1; start < m; start += 32 {
		gaps := min(32, m-start)
		width := int(b[at])
		at++
		for i := range gaps {
			var g uint64
			for j := range width {
				bit := i*width + j
				g |= uint64(b[at+bit/8]>>(bit%8)&1) << j
			}
			last += g + 1
		}
		at += (gaps*width + 7) / 8
	}
	t.frames++
	t.entries += m
	t.indexBytes += at
	t.values += len(b) - at
	if m > 1 {
		t.indexBound += log2Binomial(float64(last-first), float64(m-1))
	}
	vals := b[at:]
	switch dtype {
	case transport.DtypeSparseI8:
		for start := 0; start < m; start += 32 {
			n := min(32, m-start)
			for _, c := range vals[4 : 4+n] {
				t.codes[int(int8(c))]++
			}
			vals = vals[4+n:]
		}
	case transport.DtypeSparseI4:
		for start := 0; start < m; start += 32 {
			n := min(32, m-start)
			for j := range n {
				t.codes[int(int8(vals[4+j/2]>>(4*(j%2))<<4)>>4)]++
			}
			vals = vals[4+(n+1)/2:]
		}
	}
	if dtype != transport.DtypeSparseF32 && len(vals) != 0 {
		return fmt.Errorf("frame of %d entries: %d bytes left after its values", m, len(vals))
	}
	return nil
}

// log2Binomial is log₂ C(n, k), from the log-gamma function.
func log2Binomial(n, k float64) float64 {
	a, _ := math.Lgamma(n + 1)
	b, _ := math.Lgamma(k + 1)
	c, _ := math.Lgamma(n - k + 1)
	return (a - b - c) / math.Ln2
}

// codeEntropy is the zeroth-order entropy of the codes, in bits a code.
func (t *tally) codeEntropy() float64 {
	total := 0
	for _, c := range t.codes {
		total += c
	}
	var h float64
	for _, c := range t.codes {
		p := float64(c) / float64(total)
		h -= p * math.Log2(p)
	}
	return h
}

type meta struct {
	Model   string `json:"model"`
	Step    int    `json:"step"`
	Batches int    `json:"batches"`
	N       int    `json:"n"`
}

func load(dir, name string) ([][]float32, meta, error) {
	var m meta
	b, err := os.ReadFile(filepath.Join(dir, name+".json"))
	if err != nil {
		return nil, m, err
	}
	if err := json.Unmarshal(b, &m); err != nil {
		return nil, m, err
	}
	raw, err := os.ReadFile(filepath.Join(dir, name+".f32"))
	if err != nil {
		return nil, m, err
	}
	if len(raw) != 4*m.Batches*m.N {
		return nil, m, fmt.Errorf("%s.f32: %d bytes for %d batches of %d", name, len(raw), m.Batches, m.N)
	}
	var batches [][]float32
	for j := range m.Batches {
		g := make([]float32, m.N)
		for i := range g {
			g[i] = math.Float32frombits(binary.LittleEndian.Uint32(raw[4*(j*m.N+i):]))
		}
		batches = append(batches, g)
	}
	return batches, m, nil
}

// run is calls calls of Ok-Topk at P ranks on the batches (rank r's
// gradient at call c is batch (r + c) mod B, as in bench/cmd/scale).
func run(batches [][]float32, p, calls int, cfg core.Config) (*tally, error) {
	t := &tally{codes: map[int]int{}}
	var mu sync.Mutex
	ts := transport.NewInProc(p)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	errs := make([]error, p)
	var wg sync.WaitGroup
	for r := range p {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c := core.NewCommunicator(recorder{ts[r], &mu, t})
			n := len(batches[0])
			g := make([]float32, n)
			for call := range calls {
				copy(g, batches[(r+call)%len(batches)])
				if _, err := c.SparseAllreduce(ctx, 1, g, cfg); err != nil {
					errs[r] = err
					cancel()
					return
				}
			}
		}()
	}
	wg.Wait()
	for _, tr := range ts {
		tr.Close()
	}
	for _, err := range errs {
		if err != nil {
			return nil, err
		}
	}
	return t, nil
}

func main() {
	grads := flag.String("grads", "build/scale/grads", "folder of recorded gradients (bench/scale_record.py)")
	inputsFlag := flag.String("inputs", "", "recorded names, comma-separated (default: every one in -grads)")
	psFlag := flag.String("p", "8,64", "rank counts")
	valuesFlag := flag.String("values", "float32,int8,int4", "value formats")
	density := flag.Float64("density", 0.01, "k = ceil(density·n)")
	calls := flag.Int("calls", 4, "calls per run")
	mdPath := flag.String("md", "", "markdown table (else stdout)")
	flag.Parse()

	names := strings.Split(*inputsFlag, ",")
	if *inputsFlag == "" {
		matches, _ := filepath.Glob(filepath.Join(*grads, "*.json"))
		names = names[:0]
		for _, m := range matches {
			names = append(names, strings.TrimSuffix(filepath.Base(m), ".json"))
		}
		sort.Strings(names)
	}
	var ps []int
	for _, s := range strings.Split(*psFlag, ",") {
		p, err := strconv.Atoi(s)
		check(err)
		ps = append(ps, p)
	}
	var values []core.ValueType
	for _, s := range strings.Split(*valuesFlag, ",") {
		v, err := core.ParseValueType(s)
		check(err)
		values = append(values, v)
	}
	var out strings.Builder
	fmt.Fprintf(&out, "| input | P | values | entries | bytes/entry | index bytes | value bytes | bound bits/entry (index + values) | bound bytes/entry |\n")
	fmt.Fprintf(&out, "|---|---|---|---|---|---|---|---|---|\n")
	type key struct {
		p int
		v core.ValueType
	}
	sums := map[key]*[2]float64{} // bytes, entries over the inputs
	for _, name := range names {
		batches, m, err := load(*grads, name)
		check(err)
		for _, p := range ps {
			for _, v := range values {
				cfg := core.Config{Algorithm: core.OkTopk, Density: *density, Tau: 64, TauPrime: 32, Values: v}
				start := time.Now()
				t, err := run(batches, p, *calls, cfg)
				check(err)
				e := float64(t.entries)
				valueBound := 32.0
				if v != core.ValuesFloat32 {
					valueBound = t.codeEntropy()
				}
				idxBound := t.indexBound / e
				bytes := float64(t.indexBytes+t.values) / e
				fmt.Fprintf(&out, "| %s (%s, step %d) | %d | %v | %d | %.3f | %.3f | %.3f | %.2f + %.2f | %.3f |\n",
					name, m.Model, m.Step, p, v, t.entries, bytes, float64(t.indexBytes)/e, float64(t.values)/e,
					idxBound, valueBound, (idxBound+valueBound)/8)
				s := sums[key{p, v}]
				if s == nil {
					s = &[2]float64{}
					sums[key{p, v}] = s
				}
				s[0] += float64(t.indexBytes + t.values)
				s[1] += e
				fmt.Fprintf(os.Stderr, "%s P=%d %v: %d frames, %d entries, %.3f bytes an entry (%.1f s)\n",
					name, p, v, t.frames, t.entries, bytes, time.Since(start).Seconds())
			}
		}
	}
	fmt.Fprintf(&out, "\nOver every input (bytes / entries):\n\n| P | values | bytes/entry |\n|---|---|---|\n")
	for _, p := range ps {
		for _, v := range values {
			s := sums[key{p, v}]
			fmt.Fprintf(&out, "| %d | %v | %.3f |\n", p, v, s[0]/s[1])
		}
	}
	if *mdPath != "" {
		check(os.WriteFile(*mdPath, []byte(out.String()), 0o644))
		return
	}
	fmt.Print(out.String())
}

func check(err error) {
	if err != nil {
		fmt.Fprintln(os.Stderr, "wire:", err)
		os.Exit(1)
	}
}
