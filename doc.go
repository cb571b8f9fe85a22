// Package ratelimit is a Caddy HTTP handler that enforces rate limits shared
// by every Caddy instance of a deployment: token buckets kept in Redis and
// decided by one atomic Lua script, so that four instances allowing
// "100 per minute" allow 100 per minute together, not 400.
//
// # Glossary
//
// One word, one meaning, in Go and in lua/decide.lua alike:
//
//   - policy: a named limit of the config. Its kind (kind.go) is a value
//     set once when the config is checked: rate, concurrent, quota or shed.
//   - identity: what a policy's key template resolves to for a request (an
//     API key, a user id, an address). It is never stored or logged: the
//     storage key is its keyed hash (key.go).
//   - bucket: one identity's state under one policy, in the store, under
//     its storage key.
//   - rate: N tokens per duration (rate.n per rate.per), refilled
//     continuously; burst: what a bucket holds when full.
//   - quota: N per calendar period (a day, a month, in a timezone); a
//     period is only ever a quota's calendar span.
//   - cost: the tokens a request takes. A reservation is a cost taken
//     before the response and settled after it (charge_if, settle, cost
//     openai): given back, or charged further as debt.
//   - store: where buckets live and are decided atomically (store.go): this
//     process's memory or Redis. What only some stores can do is asked for
//     by capability, never by naming a store.
//   - decision: the store's one answer for a request's buckets, all or
//     nothing; a verdict is its answer per policy.
//   - admission: one request's decision and all it holds until it returns
//     (admission.go): a part per policy it matched (the policy, its bucket
//     request, its verdict, the identity), the outcome, and its held places
//     and slots, given back in one place (giveBack).
//   - slot: a place for one request in flight (concurrent, shed {
//     concurrent }). In Redis a slot is a lease, renewed while its request
//     runs and reclaimed when its instance vanishes; its release frees it.
//     A hash slot is Redis Cluster's, and only that.
//   - turn: the time ahead that `wait` reserves for a request; held: a
//     request waiting for its turn or for a slot, among the max_held a
//     policy may hold.
//   - after: the work an admitted request leaves for after its response (a
//     charge, a settle, a slot's release; charge.go, finish.go), done
//     before the client sees the response's end.
//   - delta: the tokens an adjustment charges (> 0) or gives back (< 0),
//     opAdjust in Go and ADJUST in the script.
//   - override, plan, grant, reset: an operator's or a plan's change to one
//     identity's limit or bucket (plan.go, override*.go, admin*.go); events:
//     the pub/sub channel that announces them to the fleet.
//   - shed: turning requests away to protect the service, not a caller's
//     budget (shed_policy.go); a class is a priority level, its share the
//     part of the capacity it may use.
//   - fleet: the instances that share one Redis database and key prefix
//     (fleet.go).
//   - hot key: a rate policy's key one instance decides often (past its
//     hot_keys a second): it decides the key's requests from blocks, with
//     no call each (hotkeys.go, hotkeys_store.go, internal/hotkey).
//   - block: a hot key's tokens taken ahead in one decision (debited in
//     Redis first) and spent here on the bucket's schedule; what is unspent
//     goes back when the key cools, at reload and at shutdown.
//
// # Where things are
//
// The request path reads top to bottom in serve.go (ServeHTTP: match, the
// decision, deny or report, hold, serve watched); the decision (the shed
// step, then the store's) is made in admission.go; what it tells is set in
// report.go; what a request holds (slots, held places) is in slots.go; the
// response is watched in charge.go and finished in finish.go. The store
// contract is store.go, its implementations store_memory.go and
// store_redis.go (the Redis store is its connection, whose concurrency
// slots are kept by lease_book.go), and the script's wire format wire.go
// beside lua/decide.lua, whose Go mirror is bucket.go (decideBuckets). Pieces that know nothing of this
// package's vocabulary live under internal/ (breaker, calendar, clientaddr,
// hotkey, llm, pace, shed, topk, fleet, suggest), which never imports the
// root.
package ratelimit
