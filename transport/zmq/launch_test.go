package zmq

// Tests of joining a job from a launcher's environment alone (Open MPI,
// MPICH/PMI, Slurm), and of the error when rank 0 never answers.

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/oktopk/oktopk/transport"
)

func envOf(m map[string]string) func(string) string {
	return func(k string) string { return m[k] }
}

// freeRendezvousPort is a port below the ephemeral range that was free a
// moment ago (a port inside it could be any outgoing connection's).
func freeRendezvousPort(t *testing.T) int {
	t.Helper()
	for p := 21000 + time.Now().Nanosecond()%8000; ; p++ {
		ln, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", p))
		if err == nil {
			ln.Close()
			return p
		}
	}
}

// Three ranks over real sockets join through each launcher's variables
// alone: no RANK, WORLD_SIZE or MASTER_ADDR under mpirun or srun.
func TestInitFromLaunchJoinsUnderEachLauncher(t *testing.T) {
	const size = 3
	launches := map[string]func(rank int) map[string]string{
		"Open MPI": func(rank int) map[string]string {
			return map[string]string{"OMPI_COMM_WORLD_RANK": fmt.Sprint(rank), "OMPI_COMM_WORLD_SIZE": "3",
				"OMPI_COMM_WORLD_LOCAL_RANK": fmt.Sprint(rank), "OMPI_COMM_WORLD_LOCAL_SIZE": "3"}
		},
		"MPICH/PMI": func(rank int) map[string]string {
			return map[string]string{"PMI_RANK": fmt.Sprint(rank), "PMI_SIZE": "3", "MPI_LOCALNRANKS": "3"}
		},
		"Slurm": func(rank int) map[string]string {
			return map[string]string{"SLURM_PROCID": fmt.Sprint(rank), "SLURM_NTASKS": "3", "SLURM_LOCALID": fmt.Sprint(rank),
				"SLURM_STEP_NODELIST": "localhost", "SLURM_JOB_ID": "77"}
		},
	}
	for name, envFor := range launches {
		port := freeRendezvousPort(t)
		envs := make([]map[string]string, size)
		for r := range envs {
			envs[r] = envFor(r)
			envs[r]["OKTOPK_RENDEZVOUS_PORT"] = fmt.Sprint(port)
		}
		zs, errs := joinFromEnvs(envs)
		for r := 0; r < size; r++ {
			if errs[r] != nil {
				t.Errorf("%s: rank %d: %v", name, r, errs[r])
				continue
			}
			if zs[r].Rank() != r || zs[r].Size() != size {
				t.Errorf("%s: rank %d joined as %d of %d", name, r, zs[r].Rank(), zs[r].Size())
			}
			if !strings.HasPrefix(zs[r].Endpoint(), "tcp://127.0.0.1:") {
				t.Errorf("%s: rank %d advertises %s, want loopback for a job on this host", name, r, zs[r].Endpoint())
			}
		}
		for _, z := range zs {
			if z != nil {
				z.Close()
			}
		}
	}
}

func TestInitFromLaunchFailureNamesTheLauncher(t *testing.T) {
	// Rank 1 of an Open MPI job whose rank 0 never serves: the rendezvous
	// times out, and the error says which launcher and address were used,
	// and that rank 0 — the rank that serves that address — never answered.
	port := freeRendezvousPort(t)
	env := map[string]string{"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
		"OKTOPK_RENDEZVOUS_PORT": fmt.Sprint(port)}
	ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	start := time.Now()
	z, err := initFromLaunch(ctx, Options{}, envOf(env))
	if err == nil {
		z.Close()
		t.Fatal("joined a job whose rank 0 never started")
	}
	if time.Since(start) > 5*time.Second {
		t.Errorf("took %v past a 500 ms deadline", time.Since(start))
	}
	if !errors.Is(err, transport.ErrRendezvous) {
		t.Errorf("%v does not wrap ErrRendezvous", err)
	}
	for _, w := range []string{"Open MPI launch", "OMPI_COMM_WORLD_RANK", fmt.Sprintf("127.0.0.1:%d", port), "OKTOPK_RENDEZVOUS_PORT", "rank 0 "} {
		if !strings.Contains(err.Error(), w) {
			t.Errorf("%q does not name %q", err, w)
		}
	}
}

// joinFromEnvs joins one rank per environment at once, each from its own
// launcher variables, and returns every rank's transport or error.
func joinFromEnvs(envs []map[string]string) ([]*Transport, []error) {
	zs := make([]*Transport, len(envs))
	errs := make([]error, len(envs))
	var wg sync.WaitGroup
	for r, env := range envs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			zs[r], errs[r] = initFromLaunch(ctx, Options{}, envOf(env))
		}()
	}
	wg.Wait()
	return zs, errs
}
