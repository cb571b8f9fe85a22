package ratelimit

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testredis"
)

// secondWaveBase is the build before the second wave, whose script issue
// 26 holds this one's cost to (git history).
const secondWaveBase = "bf47ad3b79ed0fa252ecf581bbd608ea5cacefa3"

// BenchmarkScriptCost: Redis's CPU per request (the process's own time,
// /proc/<pid>/schedstat, which a stall of the shared machine does not
// inflate as it does INFO commandstats' wall clock) for lua/decide.lua and
// for secondWaveBase's script, each on its own redis-server, called in
// turn, 8 takes a call over 10,000 identities as make bench's (b) sends
// them (format v2). The ratio is the median of the rounds' ratios, each
// round 500 calls of each script.
//
//	go test -run '^$' -bench BenchmarkScriptCost -benchtime 20x .
func BenchmarkScriptCost(b *testing.B) {
	old, err := exec.Command("git", "show", secondWaveBase+":lua/decide.lua").Output()
	if err != nil {
		b.Skipf("reading the script of %.7s from git history: %v", secondWaveBase, err)
	}
	ctx := context.Background()
	type side struct {
		client *redis.Client
		pid    int
		sha    string
		keys   []string
		cpu    []float64 // µs per request, per round
	}
	start := func(script, prefix string) *side {
		srv := testredis.Start(b)
		client := redis.NewClient(&redis.Options{Addr: srv.Addr})
		b.Cleanup(func() { client.Close() })
		sha, err := client.ScriptLoad(ctx, script).Result()
		if err != nil {
			b.Fatal(err)
		}
		p, kh := &Policy{keyPrefix: prefix}, newKeyHasher("secret")
		keys := make([]string, 10_000)
		for i := range keys {
			keys[i] = p.storageKey(kh, strconv.Itoa(i))
		}
		return &side{client: client, pid: srv.Pid(), sha: sha, keys: keys}
	}
	before, now := start(string(old), "rl:before:"), start(decideLua, "rl:now:")
	l := limit{interval: 10, burst: 100_000} // (b)'s 100000/1s
	const calls, per = 500, 8
	c := 0
	b.ResetTimer()
	for range b.N {
		cpu0 := []int64{schedMicros(b, before.pid), schedMicros(b, now.pid)}
		for range calls {
			c++
			batch := make([]*pending, per)
			args := []any{"evalsha", before.sha, per}
			for q := range batch {
				i := (c*per + q) * 7919 % len(now.keys)
				batch[q] = &pending{reqs: []bucketRequest{{key: now.keys[i], limit: l, op: opTake, cost: 1}}}
				args = append(args, before.keys[i])
			}
			// The base's ARGV: per request its bucket count, then interval,
			// burst, cost, wait, shadow.
			for range batch {
				args = append(args, 1, l.interval, l.burst, 1, 0, 0)
			}
			if err := before.client.Do(ctx, args...).Err(); err != nil {
				b.Fatal(err)
			}
			args = encodeCall(batch, formatV2)
			args[1] = now.sha
			res, err := now.client.Do(ctx, args...).Int64Slice()
			if err == nil {
				err = decodeReply(res, batch)
			}
			if err != nil {
				b.Fatal(err)
			}
		}
		before.cpu = append(before.cpu, float64(schedMicros(b, before.pid)-cpu0[0])/(calls*per))
		now.cpu = append(now.cpu, float64(schedMicros(b, now.pid)-cpu0[1])/(calls*per))
	}
	b.StopTimer()
	ratios := make([]float64, b.N)
	for i := range ratios {
		ratios[i] = now.cpu[i] / before.cpu[i]
	}
	med := func(v []float64) float64 { v = slices.Clone(v); slices.Sort(v); return v[len(v)/2] }
	b.ReportMetric(med(before.cpu), "redis-cpu-µs/request-"+secondWaveBase[:7])
	b.ReportMetric(med(now.cpu), "redis-cpu-µs/request")
	b.ReportMetric(med(ratios), "ratio")
	b.ReportMetric(slices.Min(ratios), "ratio-min")
	b.ReportMetric(slices.Max(ratios), "ratio-max")
}

// schedMicros is the CPU time a process has run, in µs.
func schedMicros(b *testing.B, pid int) int64 {
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/schedstat", pid))
	if err != nil {
		b.Skipf("no schedstat: %v", err)
	}
	ns, err := strconv.ParseInt(strings.Fields(string(raw))[0], 10, 64)
	if err != nil {
		b.Fatal(err)
	}
	return ns / 1000
}
