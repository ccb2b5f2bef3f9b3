package transport

// Tests of launcher detection: Slurm host list expansion, and each
// launcher's variables read, with errors naming launcher and variable.

import (
	"errors"
	"reflect"
	"strings"
	"testing"
)

func TestExpandHostlist(t *testing.T) {
	cases := []struct {
		list string
		want []string
	}{
		{"node01", []string{"node01"}},
		{"node[01-04,07]", []string{"node01", "node02", "node03", "node04", "node07"}},
		{"a[1-2],b3", []string{"a1", "a2", "b3"}},
		{"a[1-2],b[3-4]", []string{"a1", "a2", "b3", "b4"}},
		{"n[9-11]", []string{"n9", "n10", "n11"}},
		{"n[001-003]", []string{"n001", "n002", "n003"}},
		{"n[8-10]x", []string{"n8x", "n9x", "n10x"}},
		{"rack[1-2]-n[1-2]", []string{"rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"}},
		{"[1-2]", []string{"1", "2"}},
		{"h-1.example.org,h-2.example.org", []string{"h-1.example.org", "h-2.example.org"}},
		{"n[5]", []string{"n5"}},
		{"n[3,1]", []string{"n3", "n1"}}, // Slurm keeps the order written
	}
	for _, c := range cases {
		got, err := expandHostlist(c.list)
		if err != nil || !reflect.DeepEqual(got, c.want) {
			t.Errorf("expandHostlist(%q) = %q, %v; want %q", c.list, got, err, c.want)
		}
		first, err := firstHost(c.list)
		if err != nil || first != c.want[0] {
			t.Errorf("firstHost(%q) = %q, %v; want %q", c.list, first, err, c.want[0])
		}
	}
}

func TestHostlistErrorsNameTheCause(t *testing.T) {
	cases := []struct{ list, want string }{
		{"", "empty host name"},
		{"a,,b", "empty host name"},
		{"a,", "empty host name"},
		{"node[1-2", "never closed"},
		{"node1]", "without '['"},
		{"node[4-2]", "runs backwards"},
		{"node[x]", "not a number"},
		{"node[]", "not a number"},
		{"node[1-]", "not a number"},
		{"node[[1]]", "nested"},
		{"node 1", "whitespace"},
		{"node[1-1234567890123456789]", "not a number"},
	}
	for _, c := range cases {
		if _, err := expandHostlist(c.list); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("expandHostlist(%q) error %v, want one containing %q", c.list, err, c.want)
		}
		if _, err := firstHost(c.list); err == nil {
			t.Errorf("firstHost(%q) accepted a malformed list", c.list)
		}
	}
}

func TestHostlistExpansionIsBoundedButFirstHostIsNot(t *testing.T) {
	for _, list := range []string{"n[0-999999999999]", "a[1-2000]b[1-2000]"} {
		if _, err := expandHostlist(list); err == nil || !strings.Contains(err.Error(), "more than") {
			t.Errorf("expandHostlist(%q) error %v, want the host bound", list, err)
		}
	}
	if first, err := firstHost("n[000000-999999999999],m1"); err != nil || first != "n000000" {
		t.Errorf("firstHost = %q, %v; want n000000", first, err)
	}
}

func envOf(m map[string]string) func(string) string {
	return func(k string) string { return m[k] }
}

func TestDetectLaunchReadsEachLauncher(t *testing.T) {
	cases := []struct {
		name      string
		env       map[string]string
		launcher  string
		rank      int
		size      int
		localRank int
		host      string
		port      int
	}{
		{"torchrun", map[string]string{"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"},
			"torchrun-style", 3, 4, 1, "10.0.0.1", 29501},
		{"rank and size by hand, default port", map[string]string{"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h"},
			"torchrun-style", 0, 2, -1, "h", DefaultRendezvousPort},
		{"Open MPI on one host", map[string]string{"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4",
			"OMPI_COMM_WORLD_LOCAL_RANK": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"},
			"Open MPI", 2, 4, 2, "127.0.0.1", DefaultRendezvousPort},
		{"Open MPI across hosts", map[string]string{"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8",
			"OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "MASTER_ADDR": "node01", "OKTOPK_RENDEZVOUS_PORT": "23456"},
			"Open MPI", 5, 8, 1, "node01", 23456},
		{"MPICH Hydra", map[string]string{"PMI_RANK": "1", "PMI_SIZE": "3", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "3", "MASTER_PORT": "12000"},
			"MPICH/PMI", 1, 3, 1, "127.0.0.1", 12001},
		{"PMI without local variables", map[string]string{"PMI_RANK": "0", "PMI_SIZE": "2", "MASTER_ADDR": "10.1.1.1"},
			"MPICH/PMI", 0, 2, -1, "10.1.1.1", DefaultRendezvousPort},
		{"srun", map[string]string{"SLURM_PROCID": "6", "SLURM_NTASKS": "8", "SLURM_LOCALID": "2", "SLURM_JOB_ID": "123456",
			"SLURM_STEP_NODELIST": "node[03-04,07]", "SLURM_JOB_NODELIST": "node[01-08]"},
			"Slurm", 6, 8, 2, "node03", 20000 + 123456%9000},
		{"srun, job node list only", map[string]string{"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "gpu-a[1-2],cpu7", "SLURM_JOB_ID": "9"},
			"Slurm", 0, 2, -1, "gpu-a1", 20009},
		{"srun with MASTER_ADDR and MASTER_PORT", map[string]string{"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_STEP_NODELIST": "n[1-2]",
			"MASTER_ADDR": "n2", "MASTER_PORT": "15000", "SLURM_JOB_ID": "9"},
			"Slurm", 1, 2, -1, "n2", 15001},
		// Nested launchers: the inner one's numbering wins.
		{"torchrun under srun", map[string]string{"RANK": "5", "WORLD_SIZE": "8", "MASTER_ADDR": "n1", "MASTER_PORT": "29500",
			"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_STEP_NODELIST": "n[1-2]"},
			"torchrun-style", 5, 8, -1, "n1", 29501},
		{"mpirun inside a Slurm allocation", map[string]string{"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
			"OMPI_COMM_WORLD_LOCAL_SIZE": "4", "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_NODELIST": "n9"},
			"Open MPI", 3, 4, -1, "127.0.0.1", DefaultRendezvousPort},
	}
	for _, c := range cases {
		l, err := detectLaunch(envOf(c.env))
		if err != nil {
			t.Errorf("%s: %v", c.name, err)
			continue
		}
		if l.launcher.name != c.launcher || l.rank != c.rank || l.size != c.size || l.localRank != c.localRank || l.host != c.host || l.port != c.port {
			t.Errorf("%s: got %s %d/%d local %d at %s:%d; want %s %d/%d local %d at %s:%d", c.name,
				l.launcher.name, l.rank, l.size, l.localRank, l.host, l.port, c.launcher, c.rank, c.size, c.localRank, c.host, c.port)
		}
		if desc := l.String(); !strings.Contains(desc, c.launcher) || !strings.Contains(desc, l.launcher.rank) {
			t.Errorf("%s: description %q does not name the launcher and its rank variable", c.name, desc)
		}
	}
}

func TestDetectLaunchErrorsNameTheLauncherAndVariable(t *testing.T) {
	cases := []struct {
		name string
		env  map[string]string
		want []string
	}{
		{"nothing set", map[string]string{"MASTER_ADDR": "h"}, []string{"no launcher's variables", "RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"}},
		{"torchrun without MASTER_ADDR", map[string]string{"RANK": "0", "WORLD_SIZE": "2"}, []string{"torchrun-style launch", "MASTER_ADDR is not set"}},
		{"torchrun with a bad size", map[string]string{"RANK": "0", "WORLD_SIZE": "two", "MASTER_ADDR": "h"}, []string{"torchrun-style launch", `WORLD_SIZE="two" is not an integer`}},
		{"Open MPI without size", map[string]string{"OMPI_COMM_WORLD_RANK": "1"}, []string{"Open MPI launch", "OMPI_COMM_WORLD_SIZE is not set"}},
		{"Open MPI rank out of range", map[string]string{"OMPI_COMM_WORLD_RANK": "4", "OMPI_COMM_WORLD_SIZE": "4"}, []string{"Open MPI launch", "OMPI_COMM_WORLD_RANK=4 is not a rank of OMPI_COMM_WORLD_SIZE=4"}},
		{"Open MPI across hosts without MASTER_ADDR", map[string]string{"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"},
			[]string{"Open MPI launch", "MASTER_ADDR is not set", "mpirun -x MASTER_ADDR", "MPI_Bcast"}},
		{"PMI bad local rank", map[string]string{"PMI_RANK": "1", "PMI_SIZE": "4", "MPI_LOCALRANKID": "x"}, []string{"MPICH/PMI launch", `MPI_LOCALRANKID="x"`}},
		{"Slurm without node list", map[string]string{"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, []string{"Slurm launch", "MASTER_ADDR is not set", "SLURM_STEP_NODELIST"}},
		{"Slurm with a malformed node list", map[string]string{"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_NODELIST": "n[1-"}, []string{"Slurm launch", "SLURM_STEP_NODELIST", "never closed"}},
		{"port out of range", map[string]string{"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_STEP_NODELIST": "n1", "MASTER_PORT": "65535"}, []string{"Slurm launch", "MASTER_PORT=65535", "outside 1..65535"}},
		{"bad rendezvous port", map[string]string{"PMI_RANK": "0", "PMI_SIZE": "1", "MASTER_ADDR": "h", "OKTOPK_RENDEZVOUS_PORT": "http"}, []string{"MPICH/PMI launch", `OKTOPK_RENDEZVOUS_PORT="http"`}},
	}
	for _, c := range cases {
		_, err := detectLaunch(envOf(c.env))
		if err == nil {
			t.Errorf("%s: accepted", c.name)
			continue
		}
		if !errors.Is(err, ErrRendezvous) {
			t.Errorf("%s: %v does not wrap ErrRendezvous", c.name, err)
		}
		for _, w := range c.want {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("%s: %q does not contain %q", c.name, err, w)
			}
		}
	}
}
