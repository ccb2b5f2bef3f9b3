package main

// The campaign's report, in markdown: the table of fault kinds, the
// coverage of algorithms and dtypes, and every failure in full.

import (
	"fmt"
	"strings"
	"time"
)

type row struct {
	count, hangs, crashes, wrong, badErr, stateChanged, overRSS int
	detect                                                      time.Duration
	hasDetect                                                   bool
	rss                                                         uint64
}

func (r *row) add(f *faultResult) {
	r.count++
	r.hangs += f.hangs
	r.crashes += f.crashes
	r.wrong += f.wrong
	r.badErr += f.badErr
	r.stateChanged += f.stateChanged
	r.overRSS += f.overRSS
	if f.hasDetect && (!r.hasDetect || f.detect > r.detect) {
		r.detect, r.hasDetect = f.detect, true
	}
	r.rss = max(r.rss, f.rss)
}

func (r *row) cells(name string) string {
	det := "–"
	if r.hasDetect {
		det = fmt.Sprintf("%.2f s", r.detect.Seconds())
	}
	rss := "–"
	if r.rss > 0 {
		rss = mib(r.rss)
	}
	return fmt.Sprintf("| %s | %d | %d | %d | %d | %d | %d | %d | %s | %s |\n", name, r.count, r.hangs, r.crashes,
		r.wrong, r.badErr, r.stateChanged, r.overRSS, det, rss)
}

func (h *harness) report() string {
	var b strings.Builder
	cfg := h.cfg
	where := "in network namespaces (one per rank, on a bridge; the attacker in its own)"
	if !h.cluster.netns {
		where = "on 127.0.0.1 (no network namespaces: " + h.cluster.why + ")"
	}
	fmt.Fprintf(&b, "# Fault campaign\n\n")
	fmt.Fprintf(&b, "Seed %d, %d faults injected in %s; ranks %s; call timeout %v, join timeout %v, RSS bound during floods %s; %d:%02d min.\n",
		cfg.seed, len(h.results), plural(h.jobsRun(), "job"), where, cfg.timeout, cfg.initTimeout, mib(cfg.rssBound),
		int(time.Since(h.began).Minutes()), int(time.Since(h.began).Seconds())%60)
	curveJobs := map[int]bool{}
	for _, f := range h.results {
		if f.plan.curve {
			curveJobs[f.plan.id] = true
		}
	}
	fmt.Fprintf(&b, "%d of the jobs with CURVE encryption on (OKTOPK_CURVE=1).\n", len(curveJobs))
	fmt.Fprintf(&b, "%d successful calls compared bit for bit with the fault-free reference (buffer and tensor state); %d failed calls checked for an untouched buffer and state.\n",
		h.okChecked, h.failChecked)
	fmt.Fprintf(&b, "Replay: `make chaos CHAOS_SEED=%d CHAOS_FAULTS=%d`; one job: `build/chaos run -seed %d -faults %d -job N`.\n\n",
		cfg.seed, cfg.faults, cfg.seed, cfg.faults)

	b.WriteString("| fault | count | hangs | crashes | wrong results | bad errors | state changed | over RSS bound | max detection | max RSS |\n")
	b.WriteString("|---|---|---|---|---|---|---|---|---|---|\n")
	var total row
	var skipped []string
	for _, k := range kinds {
		var r row
		for _, f := range h.results {
			if f.kind == k.name {
				r.add(f)
				total.add(f)
			}
		}
		if r.count == 0 {
			if k.netns && !h.cluster.netns {
				skipped = append(skipped, k.name)
			}
			continue
		}
		b.WriteString(r.cells(k.name))
	}
	b.WriteString(total.cells("**total**"))
	if len(skipped) > 0 {
		fmt.Fprintf(&b, "\nSKIPPED (no network namespaces: %s): %s.\n", h.cluster.why, strings.Join(skipped, ", "))
	}
	b.WriteString("\nMax detection: from the fault to the last rank's failing return (for a mismatch, a refusal, a missing rank or NaN: the failing call's duration; for joining: its failure). Max RSS: the largest resident set of any rank while the fault was in play.\n")

	// Coverage.
	dtypes := []string{"float32", "float16", "bfloat16"}
	b.WriteString("\nFaults per algorithm and dtype:\n\n| algorithm | " + strings.Join(dtypes, " | ") + " |\n|---|---|---|---|\n")
	for _, a := range campaignAlgs {
		fmt.Fprintf(&b, "| %s |", a)
		for _, d := range dtypes {
			n := 0
			for _, f := range h.results {
				if f.plan.alg == a && f.plan.dtype == d {
					n++
				}
			}
			fmt.Fprintf(&b, " %d |", n)
		}
		b.WriteString("\n")
	}

	// The legend comes before the failures, so that a log's tail, often
	// all a CI run shows, holds them.
	b.WriteString("\n## Fault kinds\n\n")
	for _, k := range kinds {
		fmt.Fprintf(&b, "- %s: %s.\n", k.name, k.what)
	}

	// Failures.
	var failures []string
	for _, f := range h.results {
		for _, p := range f.problems {
			victim := ""
			if f.victim >= 0 {
				victim = fmt.Sprintf(" on rank %d", f.victim)
			}
			failures = append(failures, fmt.Sprintf("- job %d [%s] %s%s: %s", f.plan.id, f.plan, f.kind, victim, oneLine(p)))
		}
	}
	if len(failures) == 0 && len(h.problems) == 0 {
		b.WriteString("\nNo failures.\n")
	}
	if len(failures) > 0 {
		fmt.Fprintf(&b, "\n## Failures (%d)\n\n%s\n", len(failures), strings.Join(failures, "\n"))
		if cfg.logs != "" {
			fmt.Fprintf(&b, "\nEvery rank's standard error of a failing job is in %s.\n", cfg.logs)
		}
	}
	if len(h.problems) > 0 {
		fmt.Fprintf(&b, "\n## Harness problems (%d)\n\n- %s\n", len(h.problems), strings.Join(h.problems, "\n- "))
	}
	return b.String()
}

func (h *harness) jobsRun() int {
	seen := map[int]bool{}
	for _, f := range h.results {
		seen[f.plan.id] = true
	}
	return len(seen)
}

func plural(n int, what string) string {
	if n == 1 {
		return "1 " + what
	}
	return fmt.Sprintf("%d %ss", n, what)
}

func oneLine(s string) string {
	s = strings.ReplaceAll(s, "\n", " ⏎ ")
	if len(s) > 600 {
		s = s[:600] + "…"
	}
	return s
}
