package transport

// How a rank started by a launcher learns its place in the job from the
// environment (InitFromEnv), in four steps:
//  1. Which launcher: the first of these whose rank variable is set.
//     torchrun (or a script that sets them): RANK, WORLD_SIZE, LOCAL_RANK.
//     Open MPI's mpirun: OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE,
//     OMPI_COMM_WORLD_LOCAL_RANK. MPICH's Hydra (and other PMI launchers):
//     PMI_RANK, PMI_SIZE, MPI_LOCALRANKID. Slurm's srun: SLURM_PROCID,
//     SLURM_NTASKS, SLURM_LOCALID. The order matters where launchers nest:
//     torchrun under srun numbers ranks in RANK while SLURM_PROCID numbers
//     the nodes, and mpirun inside a Slurm allocation inherits the batch
//     step's SLURM_* variables.
//  2. Rank and size from that launcher's variables, checked (0 ≤ rank <
//     size).
//  3. The rendezvous host: MASTER_ADDR when set; else, under Slurm, the
//     first host of the step's node list (SLURM_STEP_NODELIST, else
//     SLURM_JOB_NODELIST, else SLURM_NODELIST), where task 0 runs; else
//     127.0.0.1 when the launcher says every rank is on this host (its
//     local size equals the size); else an error saying to set MASTER_ADDR.
//  4. The rendezvous port: OKTOPK_RENDEZVOUS_PORT; else MASTER_PORT + 1
//     (torchrun's own store holds MASTER_PORT); else under Slurm
//     20000 + SLURM_JOB_ID mod 9000, so that jobs sharing a node differ;
//     else DefaultRendezvousPort. All of these lie below the kernel's usual
//     ephemeral range (32768 and up), where an outgoing connection's source
//     port could already hold the port.
// Every error names the launcher and the variables it read.

import (
	"fmt"
	"strconv"
	"strings"
)

// DefaultRendezvousPort is rank 0's rendezvous port when neither
// OKTOPK_RENDEZVOUS_PORT nor MASTER_PORT is set and the launcher is not
// Slurm: torchrun's default MASTER_PORT (29500) plus one.
const DefaultRendezvousPort = 29501

// launcher names the environment variables one launcher sets.
type launcher struct {
	name                             string
	rank, size, localRank, localSize string // localSize "" when the launcher sets none
}

var launchers = []launcher{
	{"torchrun-style", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"},
	{"Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"},
	{"MPICH/PMI", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"},
	{"Slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", ""},
}

var slurmNodeLists = []string{"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"}

// launchEnv is what a rank learned from its launcher.
type launchEnv struct {
	launcher   launcher
	rank, size int
	localRank  int    // -1 when the launcher does not say
	host       string // rendezvous host: rank 0 serves there
	hostFrom   string // where host came from, for messages
	port       int
	portFrom   string
	token      string // OKTOPK_JOB_TOKEN
}

// String describes the launch for error messages: which launcher, which
// variables, and where the rendezvous address came from.
func (l launchEnv) String() string {
	s := fmt.Sprintf("%s launch: rank %d of %d from %s and %s", l.launcher.name, l.rank, l.size, l.launcher.rank, l.launcher.size)
	if l.localRank >= 0 {
		s += fmt.Sprintf(", local rank %d", l.localRank)
	}
	return s + fmt.Sprintf("; rendezvous %s:%d (host from %s, port from %s)", l.host, l.port, l.hostFrom, l.portFrom)
}

// detectLaunch reads the launcher's variables through getenv (so that the
// caller decides which environment is read).
func detectLaunch(getenv func(string) string) (launchEnv, error) {
	var l launchEnv
	found := false
	for _, c := range launchers {
		if strings.TrimSpace(getenv(c.rank)) != "" {
			l.launcher, found = c, true
			break
		}
	}
	if !found {
		return l, fmt.Errorf("%w: no launcher's variables in the environment: set RANK and WORLD_SIZE "+
			"(and MASTER_ADDR, MASTER_PORT) as torchrun does, or start the ranks with mpirun "+
			"(OMPI_COMM_WORLD_RANK, PMI_RANK) or srun (SLURM_PROCID)", ErrRendezvous)
	}
	c := l.launcher
	fail := func(format string, args ...any) error {
		return fmt.Errorf("%w: %s launch: %s", ErrRendezvous, c.name, fmt.Sprintf(format, args...))
	}
	integer := func(name string) (int, error) {
		v := strings.TrimSpace(getenv(name))
		if v == "" {
			return 0, fail("%s is not set", name)
		}
		n, err := strconv.Atoi(v)
		if err != nil {
			return 0, fail("%s=%q is not an integer", name, v)
		}
		return n, nil
	}
	var err error
	if l.rank, err = integer(c.rank); err != nil {
		return l, err
	}
	if l.size, err = integer(c.size); err != nil {
		return l, err
	}
	if l.size < 1 || l.rank < 0 || l.rank >= l.size {
		return l, fail("%s=%d is not a rank of %s=%d", c.rank, l.rank, c.size, l.size)
	}
	l.localRank = -1
	if strings.TrimSpace(getenv(c.localRank)) != "" {
		if l.localRank, err = integer(c.localRank); err != nil {
			return l, err
		}
	}

	switch addr := strings.TrimSpace(getenv("MASTER_ADDR")); {
	case addr != "":
		l.host, l.hostFrom = addr, "MASTER_ADDR"
	case c.name == "Slurm":
		for _, name := range slurmNodeLists {
			list := strings.TrimSpace(getenv(name))
			if list == "" {
				continue
			}
			first, err := firstHost(list)
			if err != nil {
				return l, fail("%s: %v", name, err)
			}
			l.host, l.hostFrom = first, "the first host of "+name
			break
		}
		if l.host == "" {
			return l, fail("MASTER_ADDR is not set and neither is any of %s", strings.Join(slurmNodeLists, ", "))
		}
	default:
		if c.localSize != "" && strings.TrimSpace(getenv(c.localSize)) != "" {
			local, err := integer(c.localSize)
			if err != nil {
				return l, err
			}
			if local == l.size {
				l.host, l.hostFrom = "127.0.0.1", fmt.Sprintf("%s=%s=%d (every rank on this host)", c.localSize, c.size, local)
				break
			}
		}
		if l.host == "" {
			hint := "set MASTER_ADDR to rank 0's host on every rank"
			if c.name != "torchrun-style" {
				hint += " (mpirun -x MASTER_ADDR=<host>), or pass a unique id from oktopk_get_unique_id with MPI_Bcast"
			}
			return l, fail("MASTER_ADDR is not set and the launcher does not say where rank 0 runs: %s", hint)
		}
	}

	port := func(name string, plus int) error {
		p, err := integer(name)
		if err != nil {
			return err
		}
		if p+plus < 1 || p+plus > 65535 {
			return fail("%s=%d gives rendezvous port %d, outside 1..65535", name, p, p+plus)
		}
		l.port = p + plus
		return nil
	}
	// A malformed MASTER_PORT is a launch gone wrong even where
	// OKTOPK_RENDEZVOUS_PORT overrides it: say so rather than carry on.
	if strings.TrimSpace(getenv("MASTER_PORT")) != "" {
		if _, err := integer("MASTER_PORT"); err != nil {
			return l, err
		}
	}
	switch {
	case strings.TrimSpace(getenv("OKTOPK_RENDEZVOUS_PORT")) != "":
		l.portFrom = "OKTOPK_RENDEZVOUS_PORT"
		err = port("OKTOPK_RENDEZVOUS_PORT", 0)
	case strings.TrimSpace(getenv("MASTER_PORT")) != "":
		l.portFrom = "MASTER_PORT+1"
		err = port("MASTER_PORT", 1)
	case c.name == "Slurm" && strings.TrimSpace(getenv("SLURM_JOB_ID")) != "":
		job, jerr := integer("SLURM_JOB_ID")
		if jerr != nil {
			return l, jerr
		}
		l.port, l.portFrom = 20000+job%9000, "20000 + SLURM_JOB_ID mod 9000"
	default:
		l.port, l.portFrom = DefaultRendezvousPort, "the default"
	}
	if err != nil {
		return l, err
	}
	l.token = getenv("OKTOPK_JOB_TOKEN")
	return l, nil
}

// maxHostlist bounds how many names expandHostlist produces, so that a
// malformed or hostile list (node[0-999999999]) cannot exhaust memory.
const maxHostlist = 1 << 20

// hostPattern is one comma-separated item of a Slurm hostlist: literal text
// and bracketed ranges in turn, as in rack[1-2]-node[01-04,07].
type hostPattern []hostPart

type hostPart struct {
	literal string
	ranges  []numRange // nil for a literal part
}

type numRange struct {
	lo, hi uint64
	width  int // zero padding: the digits of the low bound as written
}

// parseHostlist parses Slurm's hostlist syntax: items separated by commas
// outside brackets; each item is text with any number of bracket groups;
// a group holds numbers and lo-hi ranges separated by commas, zero-padded
// to the width of each range's low bound (node[01-10] → node01 … node10).
func parseHostlist(s string) ([]hostPattern, error) {
	var items []hostPattern
	var cur hostPattern
	var text strings.Builder
	flush := func() {
		if text.Len() > 0 {
			cur = append(cur, hostPart{literal: text.String()})
			text.Reset()
		}
	}
	for i := 0; i < len(s); i++ {
		switch ch := s[i]; ch {
		case ',':
			flush()
			if len(cur) == 0 {
				return nil, fmt.Errorf("hostlist %q: empty host name at byte %d", s, i)
			}
			items = append(items, cur)
			cur = nil
		case '[':
			end := strings.IndexByte(s[i:], ']')
			if end < 0 {
				return nil, fmt.Errorf("hostlist %q: '[' at byte %d is never closed", s, i)
			}
			body := s[i+1 : i+end]
			if strings.ContainsAny(body, "[") {
				return nil, fmt.Errorf("hostlist %q: nested '[' at byte %d", s, i)
			}
			ranges, err := parseRanges(body)
			if err != nil {
				return nil, fmt.Errorf("hostlist %q: [%s]: %w", s, body, err)
			}
			flush()
			cur = append(cur, hostPart{ranges: ranges})
			i += end
		case ']':
			return nil, fmt.Errorf("hostlist %q: ']' at byte %d without '['", s, i)
		case ' ', '\t', '\n':
			return nil, fmt.Errorf("hostlist %q: whitespace at byte %d", s, i)
		default:
			text.WriteByte(ch)
		}
	}
	flush()
	if len(cur) == 0 {
		return nil, fmt.Errorf("hostlist %q: empty host name at its end", s)
	}
	return append(items, cur), nil
}

func parseRanges(body string) ([]numRange, error) {
	var out []numRange
	for _, r := range strings.Split(body, ",") {
		lo, hi, isRange := strings.Cut(r, "-")
		if !isRange {
			hi = lo
		}
		a, err := parseNumber(lo)
		if err != nil {
			return nil, err
		}
		b, err := parseNumber(hi)
		if err != nil {
			return nil, err
		}
		if b < a {
			return nil, fmt.Errorf("range %q runs backwards", r)
		}
		out = append(out, numRange{lo: a, hi: b, width: len(lo)})
	}
	return out, nil
}

func parseNumber(s string) (uint64, error) {
	if s == "" || len(s) > 18 || strings.Trim(s, "0123456789") != "" {
		return 0, fmt.Errorf("%q is not a number of at most 18 digits", s)
	}
	return strconv.ParseUint(s, 10, 64)
}

func (r numRange) format(n uint64) string {
	return fmt.Sprintf("%0*d", r.width, n)
}

// first is the pattern's first host name.
func (p hostPattern) first() string {
	var b strings.Builder
	for _, part := range p {
		if part.ranges == nil {
			b.WriteString(part.literal)
		} else {
			b.WriteString(part.ranges[0].format(part.ranges[0].lo))
		}
	}
	return b.String()
}

// firstHost is the first host of a Slurm hostlist, found without expanding
// the list (a job's list may name thousands of nodes).
func firstHost(list string) (string, error) {
	items, err := parseHostlist(list)
	if err != nil {
		return "", err
	}
	return items[0].first(), nil
}

// expandHostlist lists every host of a Slurm hostlist in Slurm's order (the
// leftmost bracket group varies slowest), at most maxHostlist of them.
func expandHostlist(list string) ([]string, error) {
	items, err := parseHostlist(list)
	if err != nil {
		return nil, err
	}
	var out []string
	for _, item := range items {
		names := []string{""}
		for _, part := range item {
			if part.ranges == nil {
				for i := range names {
					names[i] += part.literal
				}
				continue
			}
			var count uint64
			for _, r := range part.ranges {
				count += r.hi - r.lo + 1
				if count > maxHostlist {
					break
				}
			}
			// Checked in this order the product stays below 2^41: no overflow.
			if count > maxHostlist || uint64(len(out))+uint64(len(names))*count > maxHostlist {
				return nil, fmt.Errorf("hostlist %q: more than %d hosts", list, maxHostlist)
			}
			next := make([]string, 0, len(names)*int(count))
			for _, prefix := range names {
				for _, r := range part.ranges {
					for n := r.lo; ; n++ {
						next = append(next, prefix+r.format(n))
						if n == r.hi {
							break
						}
					}
				}
			}
			names = next
		}
		out = append(out, names...)
	}
	return out, nil
}
