package ratelimit

import (
	"sync"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/topk"
)

// The identities each policy denied most on this instance (topk.Sketch),
// for the admin API's top.

// topByPolicy keeps each policy name's sketch for the process, so that
// what was counted survives config reloads. Its size is the number of
// policy names in configs.
var topByPolicy sync.Map // name -> *topk.Sketch

func topOf(name string) *topk.Sketch {
	if t, ok := topByPolicy.Load(name); ok {
		return t.(*topk.Sketch)
	}
	t, _ := topByPolicy.LoadOrStore(name, topk.New())
	return t.(*topk.Sketch)
}

// topIDs tells identities' buckets apart in the sketches.
var topIDs = newBucketIDs()
