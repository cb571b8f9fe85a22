package testredis

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

// Cluster is a Redis Cluster of real redis-server processes on loopback.
type Cluster struct {
	Masters, Replicas []*Server
}

// Addrs are the seed addresses of every node.
func (c *Cluster) Addrs() []string {
	var a []string
	for _, s := range append(append([]*Server(nil), c.Masters...), c.Replicas...) {
		a = append(a, s.Addr)
	}
	return a
}

// StartCluster starts masters and as many replicas (one per master when
// replicas is true), joins them with `redis-cli --cluster create`, and waits
// (at most 30 s) until every node reports cluster_state:ok.
func StartCluster(t testing.TB, masters int, replicas bool) *Cluster {
	t.Helper()
	cli, err := CLIBinary()
	if err != nil {
		t.Fatalf("%v", err)
	}
	n := masters
	if replicas {
		n *= 2
	}
	var nodes []*Server
	for range n {
		nodes = append(nodes, start(t, "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
			"--cluster-node-timeout", "1000", "--cluster-replica-validity-factor", "0"))
	}
	args := []string{"--cluster", "create"}
	for _, s := range nodes {
		args = append(args, s.Addr)
	}
	if replicas {
		args = append(args, "--cluster-replicas", "1")
	}
	args = append(args, "--cluster-yes")
	if out, err := exec.Command(cli, args...).CombinedOutput(); err != nil {
		t.Fatalf("%s --cluster create: %v\n%s", cli, err, out)
	}
	c := &Cluster{}
	deadline := time.Now().Add(30 * time.Second)
	for _, s := range nodes {
		for {
			info, err := s.Do("CLUSTER", "INFO")
			if err == nil && strings.Contains(info, "cluster_state:ok") {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("cluster node %s not ready within 30s: %v %s", s.Addr, err, info)
			}
			time.Sleep(50 * time.Millisecond)
		}
		role, _ := s.Role()
		if role == "master" {
			c.Masters = append(c.Masters, s)
		} else {
			c.Replicas = append(c.Replicas, s)
		}
	}
	return c
}

// Role is "master", "slave" or "sentinel", from ROLE... read through INFO
// replication, which Do can return as one bulk string.
func (s *Server) Role() (string, error) {
	info, err := s.Do("INFO", "replication")
	if err != nil {
		return "", err
	}
	for _, line := range strings.Split(info, "\r\n") {
		if v, ok := strings.CutPrefix(line, "role:"); ok {
			return v, nil
		}
	}
	return "", fmt.Errorf("no role in %q", info)
}

// CaughtUp says whether replica has received every write master had
// taken when asked: replication is asynchronous, and a test that cuts or
// kills the master counts on what the replica holds.
func CaughtUp(master, replica *Server) (bool, error) {
	sent, err := replicationOffset(master, "master_repl_offset:")
	if err != nil {
		return false, err
	}
	got, err := replicationOffset(replica, "slave_repl_offset:")
	return err == nil && got >= sent, err
}

func replicationOffset(s *Server, field string) (int64, error) {
	info, err := s.Do("INFO", "replication")
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(info, "\r\n") {
		if v, ok := strings.CutPrefix(line, field); ok {
			return strconv.ParseInt(v, 10, 64)
		}
	}
	return 0, fmt.Errorf("no %s in %q", field, info)
}

// Sentinels is a master, a replica and three sentinels watching them
// under the master name "limiter".
type Sentinels struct {
	Master, Replica *Server
	Sentinels       []*Server
	logs            []string // each sentinel's log file
}

// MasterName is what the sentinels call the master.
const MasterName = "limiter"

// Addrs are the sentinels' addresses.
func (sn *Sentinels) Addrs() []string {
	var a []string
	for _, s := range sn.Sentinels {
		a = append(a, s.Addr)
	}
	return a
}

// StartSentinels starts the master, its replica and three sentinels that
// declare the master down after 1 s, and waits (at most 30 s) until the
// sentinels agree on the master and see each other.
func StartSentinels(t testing.TB) *Sentinels {
	t.Helper()
	master := start(t)
	return WatchWithSentinels(t, master, start(t, "--replicaof", "127.0.0.1", strconv.Itoa(master.port())))
}

// WatchWithSentinels starts three sentinels that watch master (and find its
// replica from it), as StartSentinels does.
func WatchWithSentinels(t testing.TB, master, replica *Server) *Sentinels {
	t.Helper()
	return WatchWithSentinelsFor(t, master, replica, 5*time.Second)
}

// WatchWithSentinelsFor is WatchWithSentinels with the sentinels'
// failover-timeout. It is also how long a sentinel lets a replica
// replicate from another address than the master's before it points the
// replica at the master itself (+fix-slave-config): a replica behind a
// Proxy needs longer than its test runs.
func WatchWithSentinelsFor(t testing.TB, master, replica *Server, failoverTimeout time.Duration) *Sentinels {
	t.Helper()
	sn := &Sentinels{Master: master, Replica: replica}
	for range 3 {
		port := FreePort(t)
		dir := t.TempDir()
		conf := filepath.Join(dir, "sentinel.conf")
		logfile := filepath.Join(dir, "sentinel.log")
		sn.logs = append(sn.logs, logfile)
		body := fmt.Sprintf("port %d\nbind 127.0.0.1\ndir %s\nlogfile %s\nsentinel monitor %s 127.0.0.1 %d 2\n"+
			"sentinel down-after-milliseconds %s 1000\nsentinel failover-timeout %s %d\nsentinel parallel-syncs %s 1\n",
			port, dir, logfile, MasterName, sn.Master.port(), MasterName, MasterName, failoverTimeout.Milliseconds(), MasterName)
		if err := os.WriteFile(conf, []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
		s := &Server{Addr: "127.0.0.1:" + strconv.Itoa(port), bin: sn.Master.bin, args: []string{conf, "--sentinel"}}
		t.Cleanup(s.Stop)
		s.start(t)
		sn.Sentinels = append(sn.Sentinels, s)
	}
	// What the sentinels decided, and why, for a test that failed: the
	// cleanups run last-in first-out, so the logs are read before the
	// sentinels are stopped.
	t.Cleanup(func() {
		if !t.Failed() {
			return
		}
		for i, f := range sn.logs {
			b, _ := os.ReadFile(f)
			t.Logf("sentinel %s log:\n%s", sn.Sentinels[i].Addr, b)
		}
	})
	deadline := time.Now().Add(30 * time.Second)
	for _, s := range sn.Sentinels {
		for {
			info, err := s.Do("INFO", "sentinel")
			if err == nil && strings.Contains(info, "status=ok") && strings.Contains(info, "sentinels=3") {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("sentinel %s not ready within 30s: %v %s", s.Addr, err, info)
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	return sn
}

func (s *Server) port() int {
	_, p, _ := strings.Cut(s.Addr, ":")
	n, _ := strconv.Atoi(p)
	return n
}

// StartReplica starts a replica of master and waits (at most 10 s) until
// the master counts it: WAIT 1 on the master answers 1. The master sends
// its data at once (repl-diskless-sync-delay 0) rather than after 5 s.
func StartReplica(t TB, master *Server) *Server {
	t.Helper()
	return StartReplicaVia(t, master, master.Addr)
}

// StartReplicaVia is StartReplica with the replica connecting to master
// through addr (a Proxy to it).
func StartReplicaVia(t TB, master *Server, addr string) *Server {
	t.Helper()
	if _, err := master.Do("CONFIG", "SET", "repl-diskless-sync-delay", "0"); err != nil {
		t.Fatalf("CONFIG SET on %s: %v", master.Addr, err)
	}
	host, port, _ := strings.Cut(addr, ":")
	r := start(t, "--replicaof", host, port)
	deadline := time.Now().Add(10 * time.Second)
	for {
		n, err := master.Do("WAIT", "1", "100")
		if err == nil && n == "1" {
			return r
		}
		if time.Now().After(deadline) {
			info, _ := master.Do("INFO", "replication")
			t.Fatalf("replica %s of %s not acknowledging within 10s: %v %s", r.Addr, master.Addr, err, info)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
