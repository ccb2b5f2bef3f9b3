package main

// Where a job's ranks run: in network namespaces on a bridge (the layout
// bench/cluster.sh makes for `make bench`: one namespace and veth per rank,
// addresses from 198.18.0.0/15, set aside for benchmarks), so that a rank's
// link can be taken down or slowed; or, where namespaces cannot be made
// (not root, no `ip netns`), on 127.0.0.1 without link faults. A further
// namespace holds the attacker of the flood faults, a stranger on the same
// network. Everything is named okc<pid>-*, so concurrent campaigns never
// touch each other's, and namespaces of campaigns whose process is gone are
// removed first.

import (
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"

	"github.com/oktopk/oktopk/tests/internal/ports"
)

type cluster struct {
	netns  bool
	why    string // why there are no namespaces
	prefix string
	maxP   int
}

const attackerSlot = 200 // the attacker's address is 198.18.1.200

func sysRun(name string, args ...string) error {
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s %s: %v: %s", name, strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return nil
}

// newCluster makes the namespaces for up to maxP ranks when want allows
// ("on": fail without them, "auto": fall back to loopback, "off").
func newCluster(maxP int, want string) (*cluster, error) {
	c := &cluster{prefix: fmt.Sprintf("okc%d", os.Getpid()), maxP: maxP}
	if want == "off" {
		c.why = "switched off (-netns off)"
		return c, nil
	}
	err := c.setup()
	if err == nil {
		c.netns = true
		return c, nil
	}
	c.teardown()
	if want == "on" {
		return nil, err
	}
	c.why = err.Error()
	return c, nil
}

func (c *cluster) ns(slot int) string { return fmt.Sprintf("%s-r%d", c.prefix, slot) }
func (c *cluster) veth(slot int) string {
	return fmt.Sprintf("%sh%d", c.prefix, slot)
}

func (c *cluster) setup() error {
	if os.Geteuid() != 0 {
		return fmt.Errorf("not root")
	}
	if _, err := exec.LookPath("ip"); err != nil {
		return fmt.Errorf("no ip command: %w", err)
	}
	removeStale()
	if err := sysRun("ip", "link", "add", c.prefix+"br", "type", "bridge"); err != nil {
		return err
	}
	if err := sysRun("ip", "link", "set", c.prefix+"br", "up"); err != nil {
		return err
	}
	slots := []int{attackerSlot}
	for r := 0; r < c.maxP; r++ {
		slots = append(slots, r)
	}
	for _, s := range slots {
		ns := c.ns(s)
		steps := [][]string{
			{"ip", "netns", "add", ns},
			{"ip", "link", "add", c.veth(s), "type", "veth", "peer", "name", "eth0", "netns", ns},
			{"ip", "link", "set", c.veth(s), "master", c.prefix + "br", "up"},
			{"ip", "netns", "exec", ns, "ip", "addr", "add", c.addrOf(s) + "/24", "dev", "eth0"},
			{"ip", "netns", "exec", ns, "ip", "link", "set", "eth0", "up"},
			{"ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"},
		}
		for _, st := range steps {
			if err := sysRun(st[0], st[1:]...); err != nil {
				return err
			}
		}
	}
	return nil
}

// removeStale deletes the namespaces and bridges of campaigns whose process
// is gone.
func removeStale() {
	out, _ := exec.Command("ip", "netns", "list").Output()
	for _, line := range strings.Split(string(out), "\n") {
		f := strings.Fields(line)
		if len(f) == 0 || !strings.HasPrefix(f[0], "okc") {
			continue
		}
		pidText, _, ok := strings.Cut(strings.TrimPrefix(f[0], "okc"), "-")
		pid, err := strconv.Atoi(pidText)
		if !ok || err != nil || processAlive(pid) {
			continue
		}
		killNamespacePids(f[0])
		sysRun("ip", "netns", "del", f[0])
		sysRun("ip", "link", "del", "okc"+pidText+"br")
	}
}

func processAlive(pid int) bool {
	_, err := os.Stat(fmt.Sprintf("/proc/%d", pid))
	return err == nil
}

func killNamespacePids(ns string) {
	out, _ := exec.Command("ip", "netns", "pids", ns).Output()
	for _, f := range strings.Fields(string(out)) {
		if pid, err := strconv.Atoi(f); err == nil {
			if p, err := os.FindProcess(pid); err == nil {
				p.Kill()
			}
		}
	}
}

func (c *cluster) teardown() {
	slots := []int{attackerSlot}
	for r := 0; r < c.maxP; r++ {
		slots = append(slots, r)
	}
	for _, s := range slots {
		killNamespacePids(c.ns(s))
		sysRun("ip", "netns", "del", c.ns(s))
	}
	sysRun("ip", "link", "del", c.prefix+"br")
}

func (c *cluster) close() {
	if c.netns {
		c.teardown()
	}
}

func (c *cluster) addrOf(slot int) string { return fmt.Sprintf("198.18.1.%d", slot+1) }

// masterAddr is rank 0's address, where it serves the rendezvous.
func (c *cluster) masterAddr() string {
	if c.netns {
		return c.addrOf(0)
	}
	return "127.0.0.1"
}

// command runs bin as rank r's process: inside its namespace, or here.
// `ip netns exec` execs the program itself, so the process is the rank and
// signals sent to it reach the rank.
func (c *cluster) command(r int, bin string, args ...string) *exec.Cmd {
	if !c.netns {
		return exec.Command(bin, args...)
	}
	return exec.Command("ip", append([]string{"netns", "exec", c.ns(r), bin}, args...)...)
}

// attackerCommand runs bin in the attacker's namespace (or here).
func (c *cluster) attackerCommand(bin string, args ...string) *exec.Cmd {
	return c.command(attackerSlot, bin, args...)
}

// ifname is what ranks bind: the namespace's veth, or loopback.
func (c *cluster) ifname() string {
	if c.netns {
		return "eth0"
	}
	return ""
}

// linkDown takes rank r's cable out: the host side of its veth goes down,
// so the rank's TCP connections stay open but nothing passes.
func (c *cluster) linkDown(r int) error { return sysRun("ip", "link", "set", c.veth(r), "down") }
func (c *cluster) linkUp(r int) error   { return sysRun("ip", "link", "set", c.veth(r), "up") }

// slow limits rank r's outgoing traffic with a token bucket.
func (c *cluster) slow(r int, rate string) error {
	return sysRun("ip", "netns", "exec", c.ns(r), "tc", "qdisc", "replace", "dev", "eth0", "root",
		"tbf", "rate", rate, "burst", "64kbit", "latency", "200ms")
}

func (c *cluster) unslow(r int) error {
	return sysRun("ip", "netns", "exec", c.ns(r), "tc", "qdisc", "del", "dev", "eth0", "root")
}

// freePortPair picks a port whose successor is free too (rank 0 serves the
// rendezvous on MASTER_PORT+1), below the kernel's ephemeral range. In
// namespaces every job's ports are fresh anyway; on loopback the pair is
// probed.
func (c *cluster) freePortPair(next *int) int {
	low := ports.EphemeralLow()
	for try := 0; try < 200; try++ {
		*next += 2
		if *next+1 >= low {
			*next = 10000
		}
		port := *next
		if c.netns || ports.PairFree(port) {
			return port
		}
	}
	return *next
}
