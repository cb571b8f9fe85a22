package ratelimit

import (
	"encoding/json"
	"net/http"
	"slices"
	"time"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/fleet"
)

// fleetMember is a store whose instances form a fleet: each records its
// policies for the others to compare, and the admin API lists them.
// Implemented by redisStore. Its fleetView (fleet.go) joins a provisioned
// handler (announced to the fleet once its config runs) and parts it when
// it is cleaned up, says what this instance announces (fleetRecord), and
// reads the live instances and their fleets, for a listing (readFleets),
// or the records of those of its database, for a comparison
// (liveRecords). Stores that share a view (one connection) read the same
// fleets, which a listing shows once.
type fleetMember interface {
	fleetView() *fleetView
}

var _ fleetMember = (*redisStore)(nil)

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
		st, err := fm.fleetView().readFleets(r.Context())
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

// listingTimeout bounds each read of a listing.
const listingTimeout = 2 * time.Second
