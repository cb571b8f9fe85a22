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
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/calendar"
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

// BenchmarkBytesPerIdentity: what one identity costs Redis, per policy
// kind, and for how long: used_memory (INFO memory) before and after
// 20,000 identities each make one admitted request, divided by 20,000
// (the key, its value, its expiry and the keyspace's share). A rate
// bucket lives until it is full again (burst × interval at most); a
// concurrency slot's key while a lease is held and a lease after; a quota's
// count until its period ends: a month for /month, whatever the identity.
//
//	go test -run '^$' -bench BenchmarkBytesPerIdentity -benchtime 1x .
func BenchmarkBytesPerIdentity(b *testing.B) {
	ctx := context.Background()
	srv := testredis.Start(b)
	client := redis.NewClient(&redis.Options{Addr: srv.Addr})
	b.Cleanup(func() { client.Close() })
	month := &quotaSpec{periods: calendar.New(calendar.Month, time.UTC), name: "monthly"}
	kinds := []struct {
		name   string
		format int
		req    func(key string) bucketRequest
	}{
		{"rate_v1", formatV1, func(key string) bucketRequest {
			return bucketRequest{key: key, limit: limit{interval: 600_000, burst: 100}, op: opTake, cost: 1}
		}},
		{"rate_v2", formatV2, func(key string) bucketRequest {
			return bucketRequest{key: key, limit: limit{interval: 600_000, burst: 100}, op: opTake, cost: 1}
		}},
		{"concurrent", formatV2, func(key string) bucketRequest {
			return bucketRequest{key: key, limit: limit{interval: 30_000_000, burst: 3}, op: opAcquire, lease: leaseIDs(), events: "rl:events"}
		}},
		{"quota_month", formatV2, func(key string) bucketRequest {
			return quotaRequest(key, 1_000_000, month, opTake, 1)
		}},
	}
	const identities = 20_000
	kh := newKeyHasher("secret")
	for _, k := range kinds {
		b.Run(k.name, func(b *testing.B) {
			for range b.N {
				if err := client.FlushAll(ctx).Err(); err != nil {
					b.Fatal(err)
				}
				before := usedMemory(b, client)
				p := &Policy{Name: k.name, keyPrefix: "rl:"}
				for i := 0; i < identities; i += 100 {
					var reqs [][]bucketRequest
					for j := i; j < i+100; j++ {
						reqs = append(reqs, []bucketRequest{k.req(p.storageKey(kh, "identity-"+strconv.Itoa(j)))})
					}
					if _, err := evalScriptFormat(ctx, client, decideLua, k.format, reqs...); err != nil {
						b.Fatal(err)
					}
				}
				if n := client.DBSize(ctx).Val(); n != identities {
					b.Fatalf("%d keys for %d identities", n, identities)
				}
				b.ReportMetric(float64(usedMemory(b, client)-before)/identities, "bytes/identity")
			}
		})
	}
}

// usedMemory is Redis's used_memory, in bytes.
func usedMemory(b *testing.B, client *redis.Client) int64 {
	info, err := client.Info(context.Background(), "memory").Result()
	if err != nil {
		b.Fatal(err)
	}
	for line := range strings.SplitSeq(info, "\r\n") {
		if v, ok := strings.CutPrefix(line, "used_memory:"); ok {
			n, _ := strconv.ParseInt(v, 10, 64)
			return n
		}
	}
	b.Fatal("no used_memory in INFO memory")
	return 0
}
