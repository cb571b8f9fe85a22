package ratelimit

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/fleet"
	"github.com/redis/go-redis/v9"
)

// fleetMember is a store whose instances form a fleet: each records its
// policies for the others to compare (fleet.go), and the admin API lists
// them (admin_fleet.go). Implemented by redisStore.
type fleetMember interface {
	// join registers a provisioned handler, announced to the fleet once
	// its config runs; part unregisters it when it is cleaned up.
	join(h *Handler)
	part(h *Handler)
	// fleetRecord is what this instance announces of the policies of hs.
	fleetRecord(hs []*Handler) fleet.Record
	// readFleets reads the live instances and their fleets, for a listing;
	// liveRecords the records of those of the store's database (db), for
	// a comparison.
	readFleets(ctx context.Context) (fleetStore, error)
	liveRecords(ctx context.Context) (db int, records []fleet.Record, err error)
	// fleetView is what this instance knows of its fleet: stores that
	// share one (on one connection) read the same fleets, which a listing
	// shows once.
	fleetView() *fleetView
}

// GET /rate_limit/fleet: the live instances on each Redis of the loaded
// config, as they announce themselves (fleet.go), grouped in fleets by
// database and key_prefix, with the policies each fleet's instances
// enforce differently. Read from Redis when asked, not from what this
// instance last saw; the other databases of a single Redis too, when its
// user may SELECT them.

// fleetAnswer is what /rate_limit/fleet answers.
type fleetAnswer struct {
	// Instance is this instance's id.
	Instance string       `json:"instance"`
	Stores   []fleetStore `json:"stores"`
}

// fleetStore is one Redis: its live instances and their fleets.
type fleetStore struct {
	Store     string          `json:"store"`
	Instances []fleetInstance `json:"instances"`
	Fleets    []fleet.Fleet   `json:"fleets"`
	// OtherDatabases says why databases other than the config's were not
	// all read, when they were not.
	OtherDatabases string `json:"other_databases,omitempty"`
}

// fleetInstance is a live instance's record, read from the database
// given, with the seconds until it expires unless written again.
type fleetInstance struct {
	fleet.Record
	ExpiresIn float64 `json:"expires_in_seconds"`
	Self      bool    `json:"self,omitempty"`
}

// maxListedDBs bounds the databases of one Redis that fleet reads.
const maxListedDBs = 64

func (adminAPI) fleet(w http.ResponseWriter, r *http.Request) error {
	if r.Method != http.MethodGet {
		return apiError(http.StatusMethodNotAllowed, "fleet takes GET")
	}
	answer := fleetAnswer{Instance: instanceID}
	var seen []*fleetView
	for _, h := range budgets.handlers() {
		fm, ok := h.store.(fleetMember)
		if !ok || slices.Contains(seen, fm.fleetView()) {
			continue
		}
		seen = append(seen, fm.fleetView())
		st, err := fm.readFleets(r.Context())
		if err != nil {
			return storeAPIError(err)
		}
		answer.Stores = append(answer.Stores, st)
	}
	if len(answer.Stores) == 0 {
		return apiError(http.StatusNotFound, "the loaded config has no rate_limit handler with a redis block: without Redis, instances share nothing")
	}
	w.Header().Set("Content-Type", "application/json")
	return json.NewEncoder(w).Encode(answer)
}

// readFleets reads the live instances of the connection's database and,
// on a single Redis, of its other databases, on a client of its own: an
// operator's listing may take longer than the decisions' timeout, and
// SELECT changes a connection's database, which must not go back to the
// decisions' pool.
func (c *redisStore) readFleets(ctx context.Context) (fleetStore, error) {
	st := fleetStore{Store: "Redis " + c.name}
	client := c.listingClient()
	defer client.Close()
	now, live, err := fleetCall(ctx, client, "", "", nil, true)
	if err != nil {
		return st, err
	}
	st.Instances = liveInstances(c.db, now, live)
	if single, ok := client.(*redis.Client); ok { // a Redis Cluster has one database
		others, note := readOtherDatabases(ctx, single, c.db)
		st.Instances, st.OtherDatabases = append(st.Instances, others...), note
	}
	var records []fleet.Record
	for _, in := range st.Instances {
		records = append(records, in.Record)
	}
	st.Fleets = fleet.Fleets(records)
	return st, nil
}

// liveRecords reads the records of the live instances of the connection's
// database, on a client of its own, as readFleets does.
func (c *redisStore) liveRecords(ctx context.Context) (db int, records []fleet.Record, err error) {
	client := c.listingClient()
	defer client.Close()
	now, live, err := fleetCall(ctx, client, "", "", nil, true)
	if err != nil {
		return c.db, nil, err
	}
	for _, in := range liveInstances(c.db, now, live) {
		records = append(records, in.Record)
	}
	return c.db, records, nil
}

// listingTimeout bounds each read of a listing.
const listingTimeout = 2 * time.Second

// listingClient is a client of one connection to the connection's Redis
// (each node's, for a Cluster), whose reads may take listingTimeout.
func (c *redisStore) listingClient() redis.UniversalClient {
	switch cl := c.client.(type) {
	case *redis.ClusterClient:
		opt := *cl.Options()
		opt.PoolSize, opt.MinIdleConns, opt.MaxIdleConns = 1, 0, 1
		opt.ReadTimeout, opt.WriteTimeout = listingTimeout, listingTimeout
		return redis.NewClusterClient(&opt)
	case *redis.Client: // a single Redis, or a master found through Sentinel
		opt := *cl.Options()
		opt.PoolSize, opt.MinIdleConns, opt.MaxIdleConns = 1, 0, 1
		opt.ReadTimeout, opt.WriteTimeout = listingTimeout, listingTimeout
		return redis.NewClient(&opt)
	}
	return nil
}

// readOtherDatabases reads the fleets of a single Redis's databases other
// than own, until one is out of range; note says why not all were read.
func readOtherDatabases(ctx context.Context, cl *redis.Client, own int) (out []fleetInstance, note string) {
	conn := cl.Conn()
	defer conn.Close()
	for db := 0; db < maxListedDBs; db++ {
		if db == own {
			continue
		}
		var res *redis.Cmd
		_, err := conn.Pipelined(ctx, func(p redis.Pipeliner) error {
			p.Select(ctx, db)
			res = p.Eval(ctx, fleetLua, []string{fleetIndexKey, fleetRecordsKey}, "", "", "", fleetTTL.Milliseconds(), "1")
			return nil
		})
		switch {
		case err != nil && strings.Contains(err.Error(), "out of range"):
			return out, ""
		case err != nil && strings.HasPrefix(err.Error(), "NOPERM"):
			return out, "databases other than " + fmt.Sprint(own) + " not read: the Redis user may not SELECT them (" + err.Error() + ")"
		case err != nil:
			return out, fmt.Sprintf("databases from %d on not read: %v", db, err)
		}
		vals, err := res.Slice()
		if err != nil {
			return out, fmt.Sprintf("database %d not read: %v", db, err)
		}
		now, live, err := parseFleetReply(vals, true)
		if err != nil {
			return out, fmt.Sprintf("database %d not read: %v", db, err)
		}
		out = append(out, liveInstances(db, now, live)...)
	}
	return out, fmt.Sprintf("databases from %d on not read", maxListedDBs)
}

// liveInstances decodes the records read from database db; those that do
// not decode are left out.
func liveInstances(db int, now int64, live []fleetEntry) []fleetInstance {
	var out []fleetInstance
	for _, e := range live {
		r, err := fleet.Decode([]byte(e.record))
		if err != nil || r.ID != e.id {
			continue
		}
		r.DB = db // where it was read: what it shares
		out = append(out, fleetInstance{Record: r, ExpiresIn: float64(e.expiry-now) / 1000, Self: e.id == instanceID})
	}
	return out
}
