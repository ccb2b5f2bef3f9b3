package transport

// Stall diagnostics: the Diagnostics settings, and the one-line warning a
// receive that waits long logs, naming the ranks that hold the call up.

import (
	"fmt"
	"log"
	"sort"
	"strconv"
	"strings"
	"time"
)

// DefaultStallWarn is how long a receive waits before it logs which ranks
// hold the call up, unless $OKTOPK_STALL_WARN or Diagnostics say otherwise.
const DefaultStallWarn = 10 * time.Second

// Diagnostics configure the stall warning: when a rank has waited StallWarn
// for a message of call seq N, it logs one line naming the ranks that have
// not started call N (each rank's latest started call travels in its
// heartbeats), or, when all have, the peer it waits for.
type Diagnostics struct {
	// StallWarn: 0 means $OKTOPK_STALL_WARN (a Go duration such as "2s", or
	// seconds), else DefaultStallWarn; negative disables the warning.
	StallWarn time.Duration
	// Log receives each line; nil means the standard log package (stderr).
	// The library never installs signal handlers for this.
	Log func(line string)
}

func (d Diagnostics) withDefaults() Diagnostics {
	if d.StallWarn == 0 {
		d.StallWarn = DefaultStallWarn
		if s := strings.TrimSpace(Getenv("OKTOPK_STALL_WARN")); s != "" {
			if v, err := time.ParseDuration(s); err == nil {
				d.StallWarn = v
			} else if f, err := strconv.ParseFloat(s, 64); err == nil {
				d.StallWarn = time.Duration(f * float64(time.Second))
			}
		}
	}
	if d.Log == nil {
		d.Log = func(line string) { log.Print(line) }
	}
	return d
}

// explain says, for a receive of call seq from peer that is taking long,
// which ranks hold it up. m.mu must be held.
func (m *Mailbox) explain(seq uint64, peer int) string {
	var behind []int
	var last []string
	for r, s := range m.started {
		if r != m.rank && s < seq {
			behind = append(behind, r)
			last = append(last, fmt.Sprint(s))
		}
	}
	sort.Ints(behind)
	var s string
	if len(behind) > 0 {
		s = fmt.Sprintf("ranks %v have not started it (last started seq=%s)", behind, strings.Join(last, ", "))
	} else {
		s = fmt.Sprintf("every rank has started it; waiting for rank %d", peer)
	}
	// A stopped or cut-off rank sends no heartbeats: name every such rank,
	// not only the one waited for, which may itself be waiting on it.
	if m.silence != nil {
		for r := range m.started {
			if d := m.silence(r); r != m.rank && d > 0 {
				s += fmt.Sprintf("; rank %d silent for %.1fs", r, d.Seconds())
			}
		}
	}
	return s
}

// warnStall logs the stall line once per call.
func (m *Mailbox) warnStall(peer int, tag Tag, waited time.Duration) {
	m.mu.Lock()
	if m.warned == tag.Seq {
		m.mu.Unlock()
		return
	}
	m.warned = tag.Seq
	line := fmt.Sprintf("oktopk: rank %d waiting %.1fs in %s seq=%d: %s",
		m.rank, waited.Seconds(), tag.Op, tag.Seq, m.explain(tag.Seq, peer))
	m.mu.Unlock()
	m.diag.Log(line)
}

// NoteStarted records that rank has started call seq (from its heartbeat or
// one of its data frames).
func (m *Mailbox) NoteStarted(rank int, seq uint64) {
	m.mu.Lock()
	if seq > m.started[rank] {
		m.started[rank] = seq
	}
	m.mu.Unlock()
}

// StartedSeq is the latest call this rank has started, for its heartbeats.
func (m *Mailbox) StartedSeq() uint64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.started[m.rank]
}
