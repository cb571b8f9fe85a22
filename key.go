package ratelimit

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"hash"
	"sync"
)

// keyHasher turns a resolved identity (an API key, a user id, an IP) into
// the fixed-length token that stands for it in storage keys, so that no raw
// identity is ever stored, logged or sent to Redis.
type keyHasher struct {
	pool  sync.Pool // of hash.Hash: HMAC-SHA-256 with the secret, or SHA-256
	cache hashCache
}

func newKeyHasher(secret string) *keyHasher {
	kh := new(keyHasher)
	kh.cache.ids = newBucketIDs()
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
// one slot and one script call can decide them together.
func (p *Policy) storageKey(kh *keyHasher, identity string) string {
	sum := kh.sumCached(identity)
	b := make([]byte, 0, len(p.keyPrefix)+2+base64.RawURLEncoding.EncodedLen(hashLen))
	b = append(b, p.keyPrefix...)
	b = append(b, '{')
	b = base64.RawURLEncoding.AppendEncode(b, sum[:])
	return string(append(b, '}'))
}

// hashCache remembers recent identities' hashes: HMAC-SHA-256 costs more
// than the rest of a decision in process. It holds at most hashCacheSize
// identities per shard and is emptied when full, so memory stays bounded
// whatever clients send. Identities are looked up by a 128-bit id (see
// bucketID), so the cache holds neither the identities nor any pointer.
type hashCache struct {
	shards [hashCacheShards]struct {
		mu sync.Mutex
		m  map[bucketID][hashLen]byte
	}
	ids bucketIDs
}

const (
	hashCacheShards = 16
	hashCacheSize   = 4096
)

// sumCached is sum through the cache.
func (kh *keyHasher) sumCached(identity string) [hashLen]byte {
	id := kh.cache.ids.of(identity)
	s := &kh.cache.shards[id[0]%hashCacheShards]
	s.mu.Lock()
	h, ok := s.m[id]
	s.mu.Unlock()
	if ok {
		return h
	}
	h = kh.sum(identity)
	s.mu.Lock()
	if s.m == nil || len(s.m) >= hashCacheSize {
		s.m = make(map[bucketID][hashLen]byte, hashCacheSize/4)
	}
	s.m[id] = h
	s.mu.Unlock()
	return h
}
