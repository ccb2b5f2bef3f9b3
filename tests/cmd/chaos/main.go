package main

// Command chaos is oktopk's fault campaign: a seeded run of real rank
// processes (in network namespaces when it can make them) into which it
// injects hundreds of faults — killed, stopped and missing ranks, links
// taken down and slowed, mismatched and locally refused calls, NaN and Inf,
// strangers' floods and wrong job tokens — over every algorithm, both a
// float32 and a half-precision dtype, and, for the algorithms that take
// them, every format values travel in (float32, float16, bfloat16, int8, int4),
// and checks each: no hang past the
// timeout + 10%, no crash, every successful call bitwise equal to a
// fault-free reference, every error naming its cause and the faulty rank,
// failed calls leaving the caller's buffer and the tensor's state as they
// were, and bounded memory under floods. It prints a markdown table of fault
// kinds and writes it to -out. See `make chaos` and `make chaos-smoke`.
//
//	chaos run [-faults 500] [-seed 1] [-out FILE] [-logs DIR] [-timeout 2s]
//	          [-init-timeout 3s] [-flood-time 1.2s] [-rss-mb 160]
//	          [-netns auto|on|off] [-kinds k1,k2…] [-job N] [-v]
//
// The same binary is the campaign's rank program (`chaos rank`, see
// rank.go) and its attacker (`chaos flood`, see flood.go).

import (
	"flag"
	"fmt"
	"os"
	"slices"
	"strings"
	"time"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: chaos run|rank|flood [flags]")
		os.Exit(2)
	}
	switch os.Args[1] {
	case "rank":
		os.Exit(rankMain(os.Args[2:]))
	case "flood":
		os.Exit(floodMain(os.Args[2:]))
	case "run":
		os.Exit(runMain(os.Args[2:]))
	}
	fmt.Fprintf(os.Stderr, "chaos: unknown command %q (run, rank or flood)\n", os.Args[1])
	os.Exit(2)
}

func runMain(args []string) int {
	fs := flag.NewFlagSet("run", flag.ContinueOnError)
	faults := fs.Int("faults", 500, "faults to inject")
	seed := fs.Uint64("seed", 1, "seed of the plan and of every fault")
	out := fs.String("out", "", "write the markdown report here too")
	logs := fs.String("logs", "", "save every rank's standard error of failing jobs here")
	timeout := fs.Duration("timeout", 2*time.Second, "timeout of every call")
	initTimeout := fs.Duration("init-timeout", 3*time.Second, "timeout of joining")
	floodTime := fs.Duration("flood-time", 1200*time.Millisecond, "how long each flood lasts")
	rssMB := fs.Uint64("rss-mb", 160, "bound on a rank's RSS during floods, MiB")
	rssKillMB := fs.Uint64("rss-kill-mb", 1024, "a rank past this RSS is killed (it counts as over the bound): the machine's safety net, MiB")
	netns := fs.String("netns", "auto", "network namespaces: on, off, or auto (use them when they can be made)")
	job := fs.Int("job", -1, "run only this job of the plan (replay)")
	verbose := fs.Bool("v", false, "log what every rank returned for every fault")
	only := fs.String("kinds", "", "comma-separated fault kinds to inject (default: every kind)")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if *netns != "on" && *netns != "off" && *netns != "auto" {
		fmt.Fprintln(os.Stderr, "chaos: -netns is on, off or auto")
		return 2
	}
	var kindList []string
	if *only != "" {
		for _, k := range strings.Split(*only, ",") {
			if !slices.ContainsFunc(kinds, func(x kind) bool { return x.name == k }) {
				fmt.Fprintf(os.Stderr, "chaos: unknown fault kind %q\n", k)
				return 2
			}
			kindList = append(kindList, k)
		}
	}
	return runCampaign(config{kinds: kindList, faults: *faults, seed: *seed, out: *out, logs: *logs, timeout: *timeout,
		initTimeout: *initTimeout, floodTime: *floodTime, rssBound: *rssMB << 20, rssKill: *rssKillMB << 20, netns: *netns, job: *job, maxP: 4, verbose: *verbose})
}
