package ratelimit

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"hash"
	"hash/maphash"
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
	kh.cache.seed = maphash.MakeSeed()
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

// sum returns the hash of identity, in unpadded base64url.
func (kh *keyHasher) sum(identity string) string {
	h := kh.pool.Get().(hash.Hash)
	h.Reset()
	h.Write([]byte(identity))
	var buf [sha256.Size]byte
	sum := h.Sum(buf[:0])
	kh.pool.Put(h)
	return base64.RawURLEncoding.EncodeToString(sum[:hashLen])
}

// storageKey is where the policy's bucket for one identity lives:
// <key_prefix><policy>:{<hash>}. The braces are a Redis Cluster hash tag, so
// all the policies of one identity live in one slot and one script call can
// decide them together.
func (p *Policy) storageKey(kh *keyHasher, identity string) string {
	return p.keyPrefix + "{" + kh.sumCached(identity) + "}"
}

// hashCache remembers recent identities' hashes: HMAC-SHA-256 costs more
// than the rest of a decision in process. It holds at most hashCacheSize
// identities per shard and is emptied when full, so memory stays bounded
// whatever clients send. (It is memory only: identities never leave it.)
type hashCache struct {
	shards [hashCacheShards]struct {
		mu sync.Mutex
		m  map[string]string
	}
	seed maphash.Seed
}

const (
	hashCacheShards = 16
	hashCacheSize   = 4096
)

// sumCached is sum through the cache.
func (kh *keyHasher) sumCached(identity string) string {
	s := &kh.cache.shards[maphash.String(kh.cache.seed, identity)%hashCacheShards]
	s.mu.Lock()
	h, ok := s.m[identity]
	s.mu.Unlock()
	if ok {
		return h
	}
	h = kh.sum(identity)
	if len(identity) <= 256 { // a huge identity is not worth keeping
		s.mu.Lock()
		if s.m == nil || len(s.m) >= hashCacheSize {
			s.m = make(map[string]string, hashCacheSize/4)
		}
		s.m[identity] = h
		s.mu.Unlock()
	}
	return h
}
