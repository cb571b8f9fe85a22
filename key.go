package ratelimit

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"hash"
	"strings"
	"sync"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/fleet"
)

// keyHasher turns a resolved identity (an API key, a user id, an IP) into
// the fixed-length token that stands for it in storage keys, so that no raw
// identity is ever stored, logged or sent to Redis.
type keyHasher struct {
	pool sync.Pool // of hash.Hash: HMAC-SHA-256 with the secret, or SHA-256
	// fingerprint stands for the secret in the fleet's records (fleet.go):
	// computed when first needed, a slow derivation.
	fingerprint func() string
}

func newKeyHasher(secret string) *keyHasher {
	kh := new(keyHasher)
	kh.fingerprint = sync.OnceValue(func() string { return fleet.SecretFingerprint(secret) })
	kh.pool.New = func() any {
		if secret == "" {
			return sha256.New()
		}
		return hmac.New(sha256.New, []byte(secret))
	}
	return kh
}

// hashLen is the length in bytes of the hash kept in a key: 128 bits is
// ample against collisions. Written in unpadded base64url (22 characters,
// none of them a brace), a live key costs under 100 bytes of Redis memory.
const hashLen = 16

// sum returns the hash of identity, truncated to hashLen bytes.
func (kh *keyHasher) sum(identity string) (sum [hashLen]byte) {
	h := kh.pool.Get().(hash.Hash)
	h.Reset()
	h.Write([]byte(identity))
	var buf [sha256.Size]byte
	copy(sum[:], h.Sum(buf[:0]))
	kh.pool.Put(h)
	return sum
}

// storageKey is where the policy's bucket for one identity lives:
// <key_prefix><policy>:{<hash>}, the hash in unpadded base64url. The braces
// are a Redis Cluster hash tag, so all the policies of one identity live in
// one slot and one script call can decide them together. Recent keys are
// remembered (keyCache): HMAC-SHA-256 costs more than the rest of a
// decision in process, and a remembered key costs no allocation.
func (p *Policy) storageKey(kh *keyHasher, identity string) string {
	if p.keys == nil { // not provisioned: no cache
		return p.newStorageKey(kh, identity)
	}
	id := p.keys.ids.of(identity)
	s := &p.keys.shards[id[0]%keyCacheShards]
	s.mu.Lock()
	key, ok := s.m[id]
	s.mu.Unlock()
	if ok {
		return key
	}
	key = p.newStorageKey(kh, identity)
	s.mu.Lock()
	if s.m == nil || len(s.m) >= keyCacheSize {
		s.m = make(map[bucketID]string, keyCacheSize/4)
	}
	s.m[id] = key
	s.mu.Unlock()
	return key
}

// newStorageKey computes the storage key of identity.
func (p *Policy) newStorageKey(kh *keyHasher, identity string) string {
	sum := kh.sum(identity)
	var enc [24]byte // base64 of hashLen bytes: 22
	var k strings.Builder
	k.Grow(len(p.keyPrefix) + 2 + base64.RawURLEncoding.EncodedLen(hashLen))
	k.WriteString(p.keyPrefix)
	k.WriteByte('{')
	k.Write(base64.RawURLEncoding.AppendEncode(enc[:0], sum[:]))
	k.WriteByte('}')
	return k.String()
}

// keyCache remembers a policy's recent storage keys by identity. It holds
// at most keyCacheSize identities per shard and is emptied when full, so
// memory stays bounded (about 1 MB per policy) whatever clients send.
// Identities are looked up by a 128-bit id (see bucketID): the cache holds
// no identity.
type keyCache struct {
	shards [keyCacheShards]struct {
		mu sync.Mutex
		m  map[bucketID]string
	}
	ids bucketIDs
}

const (
	keyCacheShards = 16
	keyCacheSize   = 1024
)
